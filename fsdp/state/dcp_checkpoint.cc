#include "fsdp/state/dcp_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "fsdp/base/torch_compat.h"
#include "fsdp/formats/atomic_file.h"
#include "fsdp/formats/files.h"
#include "fsdp/formats/pickle.h"
#include "fsdp/state/internal/durable_files.h"
#include "fsdp/state/internal/model_layout.h"
#include "fsdp/state/internal/optim_state_dict_layout.h"
#include "fsdp/state/internal/state_dict_layout.h"
#include "fsdp/state/internal/torch_file.h"
#include "fsdp/state/optim_state_dict.h"
#include "fsdp/state/state_dict.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using state_internal::message_of;
using state_internal::PyValue;
using state_internal::PyValuePtr;

constexpr char kModel[] = "model";
constexpr char kOptim[] = "optim";
constexpr char kState[] = "state";
constexpr char kParamGroups[] = "param_groups";
constexpr char kStep[] = "step";

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Note [A flat range as chunks]
// FSDP shards a tensor as a contiguous range [begin, end) of its row-major flattening;
// DCP stores chunks that are boxes (offsets and sizes per dimension). A range is tiled by
// at most 2 * ndim - 1 boxes: a partial slab of the first row it touches (recursively,
// in the trailing dimensions), a run of whole rows, and a partial slab of the last row.
// Each box is itself contiguous in the flattening (leading sizes 1, one partial
// dimension, whole trailing dimensions), so a rank's shard is a view per box.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t flat_begin = 0;  // where the box starts in the flattening
};

void boxes_of(const std::vector<int64_t>& shape, size_t dim, int64_t begin, int64_t end,
              std::vector<int64_t> prefix, int64_t base, std::vector<Box>& out) {
  if (begin >= end) return;
  if (dim == shape.size()) {  // a 0-dim tensor: its one element
    out.push_back({prefix, {}, base});
    return;
  }
  const std::vector<int64_t> rest(shape.begin() + dim + 1, shape.end());
  const int64_t row = numel_of(rest);
  auto box = [&](int64_t first_row, int64_t rows) {
    Box b{prefix, std::vector<int64_t>(prefix.size(), 1), base + first_row * row};
    b.offsets.push_back(first_row);
    b.sizes.push_back(rows);
    b.offsets.insert(b.offsets.end(), rest.size(), 0);
    b.sizes.insert(b.sizes.end(), rest.begin(), rest.end());
    out.push_back(std::move(b));
  };
  auto partial = [&](int64_t r, int64_t from, int64_t to) {  // within row r
    std::vector<int64_t> inner = prefix;
    inner.push_back(r);
    boxes_of(shape, dim + 1, from - r * row, to - r * row, inner, base + r * row, out);
  };
  if (begin % row != 0) {
    const int64_t r = begin / row;
    const int64_t head_end = std::min(end, (r + 1) * row);
    partial(r, begin, head_end);
    begin = head_end;
  }
  if (end - begin >= row) {
    box(begin / row, (end - begin) / row);
    begin += (end - begin) / row * row;
  }
  if (begin < end) partial(begin / row, begin, end);
}

// The boxes tiling elements [begin, begin + numel) of a tensor of `shape`.
std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t numel) {
  std::vector<Box> out;
  boxes_of(shape, 0, begin, begin + numel, {}, 0, out);
  return out;
}

// ---- Staging.

std::vector<DcpPathElement> path(std::initializer_list<DcpPathElement> elements) {
  return std::vector<DcpPathElement>(elements);
}

std::string key_of(const std::vector<DcpPathElement>& p) {
  std::string key;
  for (const DcpPathElement& e : p) {
    absl::StrAppend(&key, key.empty() ? "" : ".",
                    std::holds_alternative<std::string>(e) ? std::get<std::string>(e)
                                                           : std::to_string(std::get<int64_t>(e)));
  }
  return key;
}

class Stager {
 public:
  explicit Stager(StagedDcpCheckpoint& staged) : staged_(staged) {}

  // A tensor: its entry, and this rank's chunks when `written`.
  void tensor(std::vector<DcpPathElement> p, const ShardedTensor& t, bool written) {
    DcpEntryMetadata e;
    e.fqn = key_of(p);
    e.path = std::move(p);
    e.dtype = t.local.scalar_type();
    e.size = t.global_shape;
    if (written) {
      const at::Tensor local = t.local.to(at::kCPU).contiguous();
      for (Box& b : boxes_of_range(t.global_shape, t.offset, local.numel())) {
        at::Tensor data = local.narrow(0, b.flat_begin - t.offset, numel_of(b.sizes)).view(b.sizes);
        staged_.chunks.push_back({e.fqn, std::move(b.offsets), data});
      }
    }
    staged_.entries.push_back(std::move(e));
  }
  void value(std::vector<DcpPathElement> p, c10::IValue v) {
    DcpEntryMetadata e;
    e.fqn = key_of(p);
    e.path = std::move(p);
    e.is_tensor = false;
    staged_.values.emplace_back(e.fqn, std::move(v));
    staged_.entries.push_back(std::move(e));
  }

 private:
  StagedDcpCheckpoint& staged_;
};

// An extra entry: a dict with string keys is flattened one entry per leaf, as DCP's
// flatten_state_dict does ("lr_scheduler.last_epoch" with path (lr_scheduler,
// last_epoch)); any other value is one entry.
void stage_extra(Stager& stager, const std::vector<DcpPathElement>& p, const c10::IValue& value) {
  if (!value.isGenericDict()) {
    stager.value(p, value);
    return;
  }
  for (const auto& item : value.toGenericDict()) {
    TORCH_CHECK(item.key().isString(), "stage_dcp_checkpoint: the extra entry '", key_of(p),
                "' is a dict with a key of type ", item.key().tagKind(),
                "; DCP folders take dicts with string keys only");
    std::vector<DcpPathElement> child = p;
    child.emplace_back(item.key().toStringRef());
    stage_extra(stager, child, item.value());
  }
}

// ---- Writing. See Note [A failed save leaves nothing] in checkpoint.cc.

// The records one rank sends rank 0, as a pickle: a list of (fqn, chunk offsets or
// None, chunk sizes, byte offset, length).
std::string records_pickle(const std::vector<DcpStorageInfo>& records,
                           const std::vector<std::vector<int64_t>>& sizes) {
  auto ints = [](const std::vector<int64_t>& v) {
    std::vector<PickleValuePtr> items;
    for (int64_t x : v) items.push_back(PickleValue::integer_value(x));
    return PickleValue::tuple(std::move(items));
  };
  std::vector<PickleValuePtr> list;
  for (size_t i = 0; i < records.size(); ++i) {
    const DcpStorageInfo& r = records[i];
    list.push_back(PickleValue::tuple(
        {PickleValue::str(r.fqn), r.chunk_offsets ? ints(*r.chunk_offsets) : PickleValue::none(),
         ints(sizes[i]), PickleValue::integer_value(r.offset),
         PickleValue::integer_value(r.length)}));
  }
  return write_pickle(*PickleValue::list(std::move(list)));
}

// Rank `rank`'s records back from their pickle, into `md` (chunks and storage).
void add_records(const std::string& bytes, int rank, DcpMetadata& md) {
  const PickleValuePtr list = read_pickle(bytes, PickleHooks(), "the records of rank");
  auto ints = [](const PickleValuePtr& t) {
    std::vector<int64_t> v;
    for (const PickleValuePtr& x : t->items) v.push_back(x->integer);
    return v;
  };
  for (const PickleValuePtr& r : list->items) {
    DcpStorageInfo s;
    s.fqn = r->items[0]->string;
    s.relative_path = dcp_data_file(rank);
    s.offset = r->items[3]->integer;
    s.length = r->items[4]->integer;
    if (r->items[1]->kind != PickleValue::Kind::kNone) {
      s.chunk_offsets = ints(r->items[1]);
      auto entry = std::find_if(md.entries.begin(), md.entries.end(),
                                [&](const DcpEntryMetadata& e) { return e.fqn == s.fqn; });
      TORCH_INTERNAL_ASSERT(entry != md.entries.end(), "a chunk of unknown key ", s.fqn);
      s.index = static_cast<int64_t>(entry->chunks.size());
      entry->chunks.push_back({*s.chunk_offsets, ints(r->items[2])});
    }
    md.storage.push_back(std::move(s));
  }
}

// Exchanges one string per rank (all-gather of sizes, then of the padded bytes as int64).
std::vector<std::string> all_gather_strings(Communicator& comm, const at::TensorOptions& on_device,
                                            const std::string& mine) {
  const int world = comm.world_size();
  at::Tensor sizes = at::empty({world}, on_device);
  comm.all_gather_into_tensor(
      sizes, at::scalar_tensor(static_cast<int64_t>(mine.size()), on_device).reshape({1}));
  const at::Tensor sizes_cpu = sizes.cpu();
  const int64_t* n = sizes_cpu.data_ptr<int64_t>();
  const int64_t longest = *std::max_element(n, n + world);
  at::Tensor padded = at::zeros({longest}, at::kLong);
  for (size_t i = 0; i < mine.size(); ++i) {
    padded.data_ptr<int64_t>()[i] = static_cast<unsigned char>(mine[i]);
  }
  at::Tensor all = at::empty({longest * world}, on_device);
  comm.all_gather_into_tensor(all, padded.to(on_device.device()));
  all = all.cpu();
  std::vector<std::string> out(world);
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0; i < n[r]; ++i)
      out[r].push_back(static_cast<char>(all.data_ptr<int64_t>()[r * longest + i]));
  }
  return out;
}

// This rank's file: its chunks (and, on rank 0, the values), and their records.
std::string rank_file_bytes(const StagedDcpCheckpoint& staged, std::vector<DcpStorageInfo>& records,
                            std::vector<std::vector<int64_t>>& sizes) {
  std::string file;
  auto append = [&](const std::string& fqn, std::optional<std::vector<int64_t>> offsets,
                    std::vector<int64_t> chunk_sizes, const c10::IValue& value) {
    const std::vector<char> bytes = compat::save_torch_archive(value);
    records.push_back({fqn, std::move(offsets), std::nullopt, dcp_data_file(staged.rank),
                       static_cast<int64_t>(file.size()), static_cast<int64_t>(bytes.size())});
    sizes.push_back(std::move(chunk_sizes));
    file.append(bytes.begin(), bytes.end());
  };
  for (const DcpStagedChunk& c : staged.chunks)
    append(c.fqn, c.offsets, c.data.sizes().vec(), c.data);
  if (staged.rank == 0) {
    for (const auto& [fqn, value] : staged.values) append(fqn, std::nullopt, {}, value);
  }
  return file;
}

void write_into(const StagedDcpCheckpoint& staged, const fs::path& partial, const fs::path& target,
                Communicator& comm, const at::TensorOptions& on_device) {
  const int rank = comm.rank();
  std::string error;
  if (rank == 0) {
    try {
      TORCH_CHECK(fs::is_directory(target.parent_path()), "the parent directory '",
                  target.parent_path().string(), "' does not exist");
      fs::remove_all(partial);
      fs::create_directory(partial);
    } catch (const std::exception& e) {
      error = message_of(e);
    }
  }
  std::vector<std::string> outcomes = all_gather_strings(comm, on_device, error);
  TORCH_CHECK(outcomes[0].empty(), "write_dcp_checkpoint: creating '", partial.string(),
              "' failed on rank 0: ", outcomes[0]);

  // Each rank's file, then its records (or its error) to every rank.
  std::vector<DcpStorageInfo> records;
  std::vector<std::vector<int64_t>> sizes;
  std::string mine;
  int64_t bytes = 0;
  try {
    const std::string file = rank_file_bytes(staged, records, sizes);
    bytes = static_cast<int64_t>(file.size());
    write_file_atomically((partial / dcp_data_file(rank)).string(), file);
    mine = "ok" + records_pickle(records, sizes);
  } catch (const std::exception& e) {
    mine = "error" + message_of(e);
  }
  outcomes = all_gather_strings(comm, on_device, mine);
  std::string failed;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (outcomes[r].rfind("ok", 0) != 0) {
      absl::StrAppend(&failed, failed.empty() ? "" : "; ", "rank ", r, ": ", outcomes[r].substr(5));
    }
  }
  if (!failed.empty()) {
    state_internal::remove_partial(partial);
    TORCH_CHECK(false, "write_dcp_checkpoint: writing '", target.string(), "' failed (", failed,
                "); it is unchanged; ", state_internal::space_note(target.parent_path(), bytes));
  }

  error.clear();
  if (rank == 0) {
    try {
      DcpMetadata md;
      md.entries = staged.entries;
      for (int r = 0; r < comm.world_size(); ++r) add_records(outcomes[r].substr(2), r, md);
      write_file_atomically((partial / kDcpMetadataFile).string(), serialize_dcp_metadata(md));
      state_internal::publish(partial, target);
    } catch (const std::exception& e) {
      state_internal::remove_partial(partial);
      error = message_of(e);
    }
  }
  outcomes = all_gather_strings(comm, on_device, error);
  TORCH_CHECK(outcomes[0].empty(), "write_dcp_checkpoint: publishing '", target.string(),
              "' failed on rank 0: ", outcomes[0]);
}

// ---- Loading.

// Reads the folder's entries, each chunk at most once.
class FolderReader {
 public:
  explicit FolderReader(std::string dir) : dir_(std::move(dir)), md_(read_dcp_metadata(dir_)) {
    for (const DcpStorageInfo& s : md_.storage) {
      storage_.try_emplace(std::make_pair(s.fqn, s.chunk_offsets.value_or(std::vector<int64_t>{})),
                           &s);
    }
  }

  const DcpMetadata& metadata() const { return md_; }

  // Elements [begin, begin + numel) of tensor `entry` (flattened) into `out` (1-D,
  // contiguous), reading only the chunks that overlap them.
  void read(const DcpEntryMetadata& entry, int64_t begin, at::Tensor& out) {
    const std::vector<Box> mine = boxes_of_range(entry.size, begin, out.numel());
    int64_t copied = 0;
    for (const DcpChunk& chunk : entry.chunks) {
      std::optional<at::Tensor> data;
      for (const Box& box : mine) {
        std::vector<int64_t> lo, hi;
        bool overlap = true;
        for (size_t d = 0; d < box.sizes.size() && overlap; ++d) {
          lo.push_back(std::max(box.offsets[d], chunk.offsets[d]));
          hi.push_back(std::min(box.offsets[d] + box.sizes[d], chunk.offsets[d] + chunk.sizes[d]));
          overlap = lo[d] < hi[d];
        }
        if (!overlap) continue;
        if (!data) data = chunk_data(entry, chunk);
        at::Tensor dst = out.narrow(0, box.flat_begin - begin, numel_of(box.sizes)).view(box.sizes);
        at::Tensor src = *data;
        for (size_t d = 0; d < lo.size(); ++d) {
          dst = dst.narrow(d, lo[d] - box.offsets[d], hi[d] - lo[d]);
          src = src.narrow(d, lo[d] - chunk.offsets[d], hi[d] - lo[d]);
        }
        dst.copy_(src);
        copied += dst.numel();
      }
    }
    TORCH_CHECK(copied == out.numel(), "'", dir_, "': the chunks of '", entry.fqn, "' cover ",
                copied, " of the ", out.numel(), " elements [", begin, ", ", begin + out.numel(),
                ") this rank needs; the checkpoint is incomplete or damaged");
  }

  // Throws unless the records of `entry`'s chunks lie inside their files and hold at
  // least `numel` elements: called before allocating a tensor whose size comes from the
  // metadata.
  void check_backed(const DcpEntryMetadata& entry, int64_t numel) {
    int64_t stored = 0;
    for (const DcpChunk& chunk : entry.chunks) {
      const DcpStorageInfo* s = find(entry.fqn, chunk.offsets);
      if (s == nullptr) continue;
      const int64_t size = file_size(s->relative_path);
      if (s->offset <= size && s->length <= size - s->offset) {
        stored = s->length > INT64_MAX - stored ? INT64_MAX : stored + s->length;
      }
    }
    const auto item = static_cast<int64_t>(c10::elementSize(entry.dtype));
    TORCH_CHECK(numel <= stored / item, "'", dir_, "': '", entry.fqn, "' has size ",
                state_internal::shape_string(entry.size), " (", numel, " elements of ",
                c10::toString(entry.dtype),
                "), but its chunks' records in the folder's files hold ", stored,
                " bytes; the checkpoint is damaged or was edited");
  }

  // A non-tensor entry.
  c10::IValue value(const DcpEntryMetadata& entry) {
    const DcpStorageInfo* s = find(entry.fqn, std::nullopt);
    TORCH_CHECK(s != nullptr, "'", dir_, "' lists '", entry.fqn, "' but stores no value for it");
    return to_ivalue(parse(*s), entry.fqn);
  }

 private:
  PyValuePtr parse(const DcpStorageInfo& s) {
    const std::string name =
        absl::StrCat(dir_, "/", s.relative_path, " ('", s.fqn, "' at byte ", s.offset, ")");
    return state_internal::read_torch_file(read_dcp_entry(dir_, s), name);
  }
  at::Tensor chunk_data(const DcpEntryMetadata& entry, const DcpChunk& chunk) {
    const DcpStorageInfo* s = find(entry.fqn, chunk.offsets);
    TORCH_CHECK(s != nullptr, "'", dir_, "': no file holds the chunk of '", entry.fqn,
                "' at offsets (", absl::StrJoin(chunk.offsets, ", "), ")");
    const PyValuePtr value = parse(*s);
    TORCH_CHECK(value->kind == PyValue::Kind::kTensor &&
                    value->tensor.sizes().vec() == chunk.sizes &&
                    value->tensor.scalar_type() == entry.dtype,
                "'", dir_, "': the chunk of '", entry.fqn, "' at offsets (",
                absl::StrJoin(chunk.offsets, ", "), ") must be a ", c10::toString(entry.dtype),
                " tensor of shape ", state_internal::shape_string(chunk.sizes), ", found ",
                value->kind == PyValue::Kind::kTensor
                    ? absl::StrCat(c10::toString(value->tensor.scalar_type()), " ",
                                   state_internal::shape_string(value->tensor.sizes()))
                    : std::string(state_internal::kind_name(value->kind)));
    return value->tensor;
  }
  c10::IValue to_ivalue(const PyValuePtr& v, const std::string& fqn) {
    switch (v->kind) {
      case PyValue::Kind::kNone:
        return c10::IValue();
      case PyValue::Kind::kBool:
        return c10::IValue(v->integer != 0);
      case PyValue::Kind::kInt:
        return c10::IValue(v->integer);
      case PyValue::Kind::kFloat:
        return c10::IValue(v->real);
      case PyValue::Kind::kString:
        return c10::IValue(v->string);
      case PyValue::Kind::kTensor:
        return c10::IValue(v->tensor);
      case PyValue::Kind::kTuple:
      case PyValue::Kind::kList: {
        std::vector<c10::IValue> items;
        for (const PyValuePtr& item : v->items) items.push_back(to_ivalue(item, fqn));
        if (v->kind == PyValue::Kind::kTuple) return c10::ivalue::Tuple::create(std::move(items));
        c10::impl::GenericList list(c10::AnyType::get());
        for (c10::IValue& item : items) list.push_back(std::move(item));
        return list;
      }
      default:
        TORCH_CHECK(false, "'", dir_, "': the value of '", fqn, "' is a ",
                    state_internal::kind_name(v->kind),
                    "; fsdp reads numbers, bools, strings, None, tensors, tuples and lists");
    }
  }

  const DcpStorageInfo* find(const std::string& fqn,
                             const std::optional<std::vector<int64_t>>& chunk_offsets) const {
    auto it = storage_.find(std::make_pair(fqn, chunk_offsets.value_or(std::vector<int64_t>{})));
    if (it == storage_.end() || it->second->chunk_offsets.has_value() != chunk_offsets.has_value())
      return nullptr;
    return it->second;
  }
  int64_t file_size(const std::string& relative_path) {
    auto it = file_sizes_.find(relative_path);
    if (it != file_sizes_.end()) return it->second;
    const std::string path = absl::StrCat(dir_, "/", relative_path);
    std::string error;
    int64_t size = 0;
    try {
      size = ReadableFile::open(path, "Distributed Checkpoint data").size();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    TORCH_CHECK(error.empty(), "'", dir_, "' is not a complete Distributed Checkpoint: ", error);
    return file_sizes_[relative_path] = size;
  }

  std::string dir_;
  DcpMetadata md_;
  // (fqn, chunk offsets, or {} for a value) -> its record.
  absl::flat_hash_map<std::pair<std::string, std::vector<int64_t>>, const DcpStorageInfo*> storage_;
  absl::flat_hash_map<std::string, int64_t> file_sizes_;
};

bool is_string(const DcpPathElement& e, const char* s) {
  return std::holds_alternative<std::string>(e) && std::get<std::string>(e) == s;
}

void load_model(FolderReader& reader, const std::string& dir, ShardedStateDict& model_state) {
  static const std::string kWhat = "load_dcp_checkpoint";
  std::vector<std::string> keys;
  absl::flat_hash_map<std::string, const DcpEntryMetadata*> by_fqn;
  for (const DcpEntryMetadata& e : reader.metadata().entries) {
    if (e.path.size() == 2 && is_string(e.path[0], kModel) && e.is_tensor &&
        std::holds_alternative<std::string>(e.path[1])) {
      keys.push_back(std::get<std::string>(e.path[1]));
      by_fqn[keys.back()] = &e;
    }
  }
  state_internal::check_same_keys(model_state.keys(), keys,
                                  kWhat + " ('" + dir + "' holds another model)");
  for (auto& item : model_state) {
    ShardedTensor& piece = item.value();
    const DcpEntryMetadata& e = *by_fqn.at(item.key());
    TORCH_CHECK(e.size == piece.global_shape, kWhat, ": size mismatch for '", item.key(),
                "': the checkpoint has shape ", state_internal::shape_string(e.size),
                ", the model has ", state_internal::shape_string(piece.global_shape));
    TORCH_CHECK(e.dtype == piece.local.scalar_type(), kWhat, ": dtype mismatch for '", item.key(),
                "': the checkpoint has ", c10::toString(e.dtype), ", the model has ",
                c10::toString(piece.local.scalar_type()));
    at::Tensor local = at::empty({piece.local.numel()}, piece.local.options().device(at::kCPU));
    reader.read(e, piece.offset, local);
    piece.local = local;
  }
}

void load_optim(FolderReader& reader, const state_internal::ModelLayout& layout,
                torch::optim::Optimizer& optimizer, const std::string& dir,
                const ShardedStateDict& model_state) {
  ShardedOptimStateDict optim_state;
  std::map<int64_t, OptimParamGroup> groups;
  bool any = false;
  for (const DcpEntryMetadata& e : reader.metadata().entries) {
    if (e.path.empty() || !is_string(e.path[0], kOptim)) continue;
    any = true;
    const bool state = e.path.size() == 4 && is_string(e.path[1], kState) && e.is_tensor &&
                       std::holds_alternative<std::string>(e.path[2]) &&
                       std::holds_alternative<std::string>(e.path[3]);
    const bool group = e.path.size() == 4 && is_string(e.path[1], kParamGroups) &&
                       std::holds_alternative<int64_t>(e.path[2]) &&
                       std::holds_alternative<std::string>(e.path[3]);
    TORCH_CHECK(state || group, "load_dcp_checkpoint: '", dir, "' has optimizer entry '", e.fqn,
                "', which is neither optim.state.<FQN>.<name> nor optim.param_groups.<i>.<option>");
    if (group) {
      OptimParamGroup& g = groups[std::get<int64_t>(e.path[2])];
      const std::string& option = std::get<std::string>(e.path[3]);
      const c10::IValue value = reader.value(e);
      if (option != "params") {
        g.options.emplace_back(option, value);
        continue;
      }
      TORCH_CHECK(value.isList(), "load_dcp_checkpoint: '", e.fqn, "' must be a list of FQNs");
      for (const c10::IValue& fqn : value.toListRef()) {
        TORCH_CHECK(fqn.isString(), "load_dcp_checkpoint: '", e.fqn, "' must be a list of FQNs");
        g.params.push_back(fqn.toStringRef());
      }
      continue;
    }
    const std::string& fqn = std::get<std::string>(e.path[2]);
    const std::string& name = std::get<std::string>(e.path[3]);
    const ShardedTensor* param = model_state.find(fqn);
    TORCH_CHECK(param != nullptr, "load_dcp_checkpoint: '", dir, "' has optimizer state for '", fqn,
                "', which the model does not have");
    // State shaped like its parameter is sharded like it; anything else (step) is whole.
    const bool replicated = e.size != param->global_shape;
    if (replicated) reader.check_backed(e, numel_of(e.size));
    ShardedTensor piece{e.size, replicated ? 0 : param->offset,
                        at::empty({replicated ? numel_of(e.size) : param->local.numel()},
                                  at::TensorOptions().dtype(e.dtype)),
                        replicated};
    reader.read(e, piece.offset, piece.local);
    if (!optim_state.contains(fqn)) optim_state.insert(fqn, ShardedParamOptimState());
    optim_state[fqn].insert(name, std::move(piece));
  }
  TORCH_CHECK(any, "load_dcp_checkpoint: '", dir,
              "' holds no optimizer state (no \"optim\" entries); pass a null optimizer to load "
              "the model only");
  state_internal::load_sharded_optim_state_dict(layout, optimizer, optim_state);
  std::vector<OptimParamGroup> list;
  for (auto& [index, g] : groups) {
    TORCH_CHECK(index == static_cast<int64_t>(list.size()), "load_dcp_checkpoint: '", dir,
                "' lacks param_groups entry ", list.size());
    list.push_back(std::move(g));
  }
  state_internal::load_optim_param_groups(layout, optimizer, list);
}

}  // namespace

StagedDcpCheckpoint stage_dcp_checkpoint(FullyShardedRoot& model,
                                         const torch::optim::Optimizer* optimizer,
                                         const DcpCheckpointOptions& options) {
  // One layout for the whole save (it walks the module tree); checks `model` is idle.
  const state_internal::ModelLayout layout =
      state_internal::model_layout(model, "stage_dcp_checkpoint");
  const ShardedStateDict model_state = state_internal::sharded_state_dict(layout);
  const absl::flat_hash_set<std::string> copies = state_internal::pieces_written_elsewhere(layout);
  StagedDcpCheckpoint staged;
  staged.rank = layout.rank;
  staged.world_size = layout.world_size;
  staged.collective_device = model.device_handle().device();
  Stager stager(staged);
  auto written = [&](const std::string& fqn, const ShardedTensor& t) {
    return t.local.numel() > 0 && !copies.contains(fqn) && (!t.replicated || layout.rank == 0);
  };
  for (const auto& item : model_state) {
    stager.tensor(path({kModel, item.key()}), item.value(), written(item.key(), item.value()));
  }
  if (optimizer != nullptr) {
    for (const auto& param : state_internal::sharded_optim_state_dict(layout, *optimizer)) {
      for (const auto& state : param.value()) {
        ShardedTensor t = state.value();
        // PyTorch keeps Adam's step as a float32 tensor (exact up to 2^24 steps).
        if (state.key() == kStep) t.local = t.local.to(at::kFloat);
        stager.tensor(path({kOptim, kState, param.key(), state.key()}), t, written(param.key(), t));
      }
    }
    const std::vector<OptimParamGroup> groups =
        state_internal::optim_param_groups(layout, *optimizer);
    for (size_t i = 0; i < groups.size(); ++i) {
      const int64_t index = static_cast<int64_t>(i);
      for (const auto& [name, value] : groups[i].options) {
        stager.value(path({kOptim, kParamGroups, index, name}), value);
      }
      stager.value(path({kOptim, kParamGroups, index, "params"}),
                   c10::List<std::string>(groups[i].params));
    }
  }
  for (const auto& [name, value] : options.extras()) {
    TORCH_CHECK(name != kModel && name != kOptim,
                "stage_dcp_checkpoint: an extra entry may not be "
                "named '",
                name, "' (the model's and optimizer's state use it)");
    stage_extra(stager, path({name}), value);
  }
  return staged;
}

void write_dcp_checkpoint(const StagedDcpCheckpoint& staged, const std::string& dir,
                          Communicator& comm) {
  TORCH_CHECK(comm.rank() == staged.rank && comm.world_size() == staged.world_size,
              "write_dcp_checkpoint: staged on rank ", staged.rank, " of ", staged.world_size,
              ", written on rank ", comm.rank(), " of ", comm.world_size(),
              "; use the model's communicator");
  const at::TensorOptions on_device = at::dtype(at::kLong).device(staged.collective_device);
  const fs::path target = fs::absolute(dir).lexically_normal();
  const fs::path partial = state_internal::partial_directory(target, comm, on_device);
  try {
    write_into(staged, partial, target, comm, on_device);
  } catch (...) {
    state_internal::remove_partial(partial);
    throw;
  }
}

void save_dcp_checkpoint(FullyShardedRoot& model, const torch::optim::Optimizer* optimizer,
                         const std::string& dir, const DcpCheckpointOptions& options) {
  write_dcp_checkpoint(stage_dcp_checkpoint(model, optimizer, options), dir, model.communicator());
}

DcpExtras load_dcp_checkpoint(FullyShardedRoot& model, torch::optim::Optimizer* optimizer,
                              const std::string& dir) {
  // One layout for the whole load; this rank's pieces give the shape of what to read.
  const state_internal::ModelLayout layout =
      state_internal::model_layout(model, "load_dcp_checkpoint");
  ShardedStateDict model_state = state_internal::sharded_state_dict(layout);
  FolderReader reader(dir);
  load_model(reader, dir, model_state);
  if (optimizer != nullptr) load_optim(reader, layout, *optimizer, dir, model_state);
  state_internal::load_sharded_state_dict(layout, model_state);
  DcpExtras extras;
  for (const DcpEntryMetadata& e : reader.metadata().entries) {
    if (e.is_tensor || e.path.empty() || is_string(e.path[0], kModel) ||
        is_string(e.path[0], kOptim)) {
      continue;
    }
    extras.emplace_back(e.fqn, reader.value(e));
  }
  return extras;
}

bool is_dcp_checkpoint(const std::string& dir) {
  std::error_code error;
  return fs::exists(fs::path(dir) / kDcpMetadataFile, error) ||
         fs::exists(fs::path(dir) / dcp_data_file(0), error);
}

}  // namespace fsdp
