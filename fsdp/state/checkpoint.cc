#include "fsdp/state/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <zlib.h>

#include "fsdp/base/torch_compat.h"
#include "fsdp/formats/atomic_file.h"
#include "fsdp/formats/dcp.h"
#include "fsdp/formats/files.h"
#include "fsdp/formats/values.h"
#include "fsdp/state/internal/durable_files.h"
#include "fsdp/state/internal/model_layout.h"
#include "fsdp/state/internal/optim_state_dict_layout.h"
#include "fsdp/state/internal/state_dict_layout.h"
#include "fsdp/state/internal/torch_file.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using state_internal::errno_text;
using state_internal::is_partial_name;
using state_internal::message_of;
using state_internal::publish;
using state_internal::PyValue;
using state_internal::PyValuePtr;
using state_internal::remove_partial;
using state_internal::space_note;

// A torch.save archive (compat::save_torch_archive) as the file `path`, crash-safely.
void write_archive(const std::string& path, const std::vector<char>& bytes) {
  write_file_atomically(path, std::string_view(bytes.data(), bytes.size()));
}

constexpr char kFormat[] = "fsdp.sharded_checkpoint";
constexpr int64_t kVersion = 1;
constexpr char kMetadata[] = "metadata.pt";
constexpr char kModelPrefix[] = "model/";
constexpr char kOptimPrefix[] = "optim/";
constexpr char kSchedulerLastEpoch[] = "scheduler/last_epoch";
constexpr char kSchedulerLastLr[] = "scheduler/last_lr";

uint64_t crc32_of(const char* data, size_t size) {
  return ::crc32_z(::crc32_z(0, nullptr, 0), reinterpret_cast<const Bytef*>(data), size);
}

// ---- Reading values of a parsed file, with messages naming the file.

const PyValuePtr& expect(const PyValuePtr& value, PyValue::Kind kind, const std::string& what,
                         const std::string& file) {
  TORCH_CHECK(value->kind == kind, "'", file, "': ", what, " must be a ",
              state_internal::kind_name(kind), ", found a ",
              state_internal::kind_name(value->kind));
  return value;
}

// The dict's items as (str key, value) pairs.
std::vector<std::pair<std::string, PyValuePtr>> dict_items(const PyValuePtr& dict,
                                                           const std::string& what,
                                                           const std::string& file) {
  expect(dict, PyValue::Kind::kDict, what, file);
  std::vector<std::pair<std::string, PyValuePtr>> items;
  for (size_t i = 0; i + 1 < dict->items.size(); i += 2) {
    expect(dict->items[i], PyValue::Kind::kString, what + " keys", file);
    items.emplace_back(dict->items[i]->string, dict->items[i + 1]);
  }
  return items;
}

PyValuePtr dict_get(const PyValuePtr& dict, const std::string& key, const std::string& file) {
  for (const auto& [name, value] : dict_items(dict, "the metadata", file)) {
    if (name == key) return value;
  }
  TORCH_CHECK(false, "'", file, "' has no '", key, "' entry; it is not an fsdp checkpoint");
}

StateDict tensor_dict(const PyValuePtr& dict, const std::string& what, const std::string& file) {
  StateDict state_dict;
  for (const auto& [key, value] : dict_items(dict, what, file)) {
    expect(value, PyValue::Kind::kTensor, what + " value '" + key + "'", file);
    TORCH_CHECK(!state_dict.contains(key), "'", file, "' holds the key '", key, "' twice");
    state_dict.insert(key, value->tensor);
  }
  return state_dict;
}

std::vector<int64_t> int_list(const PyValuePtr& list, const std::string& what,
                              const std::string& file) {
  TORCH_CHECK(list->kind == PyValue::Kind::kList || list->kind == PyValue::Kind::kTuple, "'", file,
              "': ", what, " must be a list of ints");
  std::vector<int64_t> ints;
  for (const PyValuePtr& item : list->items) {
    ints.push_back(expect(item, PyValue::Kind::kInt, what, file)->integer);
  }
  return ints;
}

c10::Dict<std::string, at::Tensor> tensor_dict_value(const StateDict& state_dict) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state_dict) dict.insert(item.key(), item.value().contiguous());
  return dict;
}

// ---- Sharded checkpoints.

// One tensor of a sharded checkpoint as this rank holds it, and whether this rank's
// file holds its piece.
struct Item {
  std::string key;
  const ShardedTensor* tensor;
  bool written;
};

// Replicated tensors are written by rank 0 only, and under HYBRID strategies a flat
// parameter's pieces by its first shard group only (see writes_pieces).
std::vector<Item> items_of(const state_internal::ModelLayout& layout,
                           const ShardedStateDict& model_state,
                           const ShardedOptimStateDict& optim_state) {
  const absl::flat_hash_set<std::string> copies = state_internal::pieces_written_elsewhere(layout);
  auto item = [&](std::string key, const std::string& fqn, const ShardedTensor& tensor) {
    const bool written = tensor.local.numel() > 0 && !copies.contains(fqn) &&
                         (!tensor.replicated || layout.rank == 0);
    return Item{std::move(key), &tensor, written};
  };
  std::vector<Item> items;
  for (const auto& entry : model_state) {
    items.push_back(item(kModelPrefix + entry.key(), entry.key(), entry.value()));
  }
  for (const auto& param : optim_state) {
    for (const auto& state : param.value()) {
      items.push_back(item(absl::StrCat(kOptimPrefix, param.key(), "/", state.key()), param.key(),
                           state.value()));
    }
  }
  return items;
}

// The staged form of `piece`: on the host (in pinned memory if `pin`) where this rank
// writes it, else a 0-element tensor of its dtype. A piece already on the CPU is a copy
// (sharded_state_dict, sharded_optim_state_dict) and is taken as it is.
ShardedTensor staged_piece(const ShardedTensor& piece, bool written, bool pin) {
  ShardedTensor staged{piece.global_shape, piece.offset, at::Tensor(), piece.replicated};
  if (!written) {
    staged.local = at::empty({0}, at::dtype(piece.local.scalar_type()));
  } else if (piece.local.is_cpu()) {
    staged.local = piece.local;
  } else {
    staged.local =
        at::empty(piece.local.sizes(), piece.local.options().device(at::kCPU).pinned_memory(pin));
    staged.local.copy_(piece.local);
  }
  return staged;
}

// The scheduler's entries (replicated: rank 0 writes them).
void stage_scheduler(const SchedulerState& scheduler, int rank, StagedShardedCheckpoint& staged) {
  at::Tensor last_epoch = at::scalar_tensor(scheduler.last_epoch, at::kLong).reshape({1});
  at::Tensor last_lr = at::empty({static_cast<int64_t>(scheduler.last_lr.size())}, at::kDouble);
  std::copy(scheduler.last_lr.begin(), scheduler.last_lr.end(), last_lr.data_ptr<double>());
  const bool written = rank == 0;
  staged.entries.push_back(
      {kSchedulerLastEpoch, staged_piece({{}, 0, last_epoch, true}, written, false), written});
  staged.entries.push_back({kSchedulerLastLr,
                            staged_piece({last_lr.sizes().vec(), 0, last_lr, true},
                                         written && last_lr.numel() > 0, false),
                            written && last_lr.numel() > 0});
}

// The dtype c10::toString names `name` ("Float", "Long", ...).
at::ScalarType dtype_named(const std::string& name, const std::string& where) {
  for (at::ScalarType t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
                           at::kShort, at::kChar, at::kByte, at::kBool}) {
    if (name == c10::toString(t)) return t;
  }
  TORCH_CHECK(false, "'", where, "': unknown dtype '", name, "'");
}

std::string rank_file(int rank) { return absl::StrFormat("rank_%05d.pt", rank); }

// A checkpoint's metadata: where each tensor's pieces are.
struct Piece {
  int rank;
  int64_t offset;
  int64_t numel;
};
struct TensorMeta {
  std::string dtype;
  std::vector<int64_t> shape;
  bool replicated = false;
  std::vector<Piece> pieces;
};
struct FileMeta {
  int64_t bytes;
  uint64_t crc32;
};

c10::IValue metadata_value(int world_size, const std::vector<Item>& items,
                           const std::vector<int64_t>& gathered, size_t stride) {
  c10::impl::GenericDict files(c10::StringType::get(), c10::AnyType::get());
  for (int r = 0; r < world_size; ++r) {
    files.insert(rank_file(r),
                 c10::List<int64_t>({gathered[r * stride + 1], gathered[r * stride + 2]}));
  }
  c10::impl::GenericDict tensors(c10::StringType::get(), c10::AnyType::get());
  for (size_t i = 0; i < items.size(); ++i) {
    const ShardedTensor& t = *items[i].tensor;
    c10::List<int64_t> pieces;
    for (int r = 0; r < world_size; ++r) {
      const int64_t offset = gathered[r * stride + 3 + 2 * i];
      const int64_t numel = gathered[r * stride + 4 + 2 * i];
      if (numel == 0) continue;  // not in this rank's file
      pieces.push_back(r);
      pieces.push_back(offset);
      pieces.push_back(numel);
    }
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    entry.insert("dtype", std::string(c10::toString(t.local.scalar_type())));
    entry.insert("shape", c10::List<int64_t>(t.global_shape));
    entry.insert("replicated", t.replicated);
    entry.insert("pieces", pieces);
    tensors.insert(items[i].key, entry);
  }
  c10::impl::GenericDict metadata(c10::StringType::get(), c10::AnyType::get());
  metadata.insert("format", std::string(kFormat));
  metadata.insert("version", kVersion);
  metadata.insert("world_size", int64_t{world_size});
  metadata.insert("files", files);
  metadata.insert("tensors", tensors);
  return metadata;
}

class CheckpointReader {
 public:
  explicit CheckpointReader(std::string dir) : dir_(std::move(dir)) {
    TORCH_CHECK(fs::is_directory(dir_), "no checkpoint directory '", dir_, "'");
    const std::string path = (fs::path(dir_) / kMetadata).string();
    TORCH_CHECK(fs::exists(path), "'", dir_, "' is not a complete checkpoint: it has no ",
                kMetadata);
    const PyValuePtr root = state_internal::read_torch_file(
        read_regular_file(path, "checkpoint metadata", kMaxMetadataBytes), path);
    const PyValuePtr format = dict_get(root, "format", path);
    TORCH_CHECK(format->kind == PyValue::Kind::kString && format->string == kFormat, "'", path,
                "' is not the metadata of an fsdp sharded checkpoint");
    const int64_t version =
        expect(dict_get(root, "version", path), PyValue::Kind::kInt, "version", path)->integer;
    TORCH_CHECK(version == kVersion, "'", dir_, "' was written in checkpoint format version ",
                version, "; this build of fsdp reads version ", kVersion,
                " (use the fsdp that wrote it, or a newer one)");
    world_size_ =
        expect(dict_get(root, "world_size", path), PyValue::Kind::kInt, "world_size", path)
            ->integer;
    for (const auto& [name, value] : dict_items(dict_get(root, "files", path), "files", path)) {
      const std::vector<int64_t> size_crc = int_list(value, "a file's size and crc32", path);
      TORCH_CHECK(size_crc.size() == 2, "'", path, "': bad entry for file ", name);
      files_[name] = {size_crc[0], static_cast<uint64_t>(size_crc[1])};
    }
    for (const auto& [key, value] : dict_items(dict_get(root, "tensors", path), "tensors", path)) {
      TensorMeta meta;
      meta.dtype =
          expect(dict_get(value, "dtype", path), PyValue::Kind::kString, "dtype", path)->string;
      meta.shape = int_list(dict_get(value, "shape", path), "shape", path);
      meta.replicated =
          expect(dict_get(value, "replicated", path), PyValue::Kind::kBool, "replicated", path)
              ->integer != 0;
      const std::vector<int64_t> pieces = int_list(dict_get(value, "pieces", path), "pieces", path);
      TORCH_CHECK(pieces.size() % 3 == 0, "'", path, "': bad pieces for '", key, "'");
      for (size_t i = 0; i < pieces.size(); i += 3) {
        TORCH_CHECK(pieces[i] >= 0 && pieces[i] < world_size_, "'", path, "': bad rank for '", key,
                    "'");
        meta.pieces.push_back({static_cast<int>(pieces[i]), pieces[i + 1], pieces[i + 2]});
      }
      check_cover(path, key, meta);
      keys_.push_back(key);
      tensors_[key] = std::move(meta);
    }
  }

  const std::string& dir() const { return dir_; }
  const std::vector<std::string>& keys() const { return keys_; }
  const TensorMeta& meta(const std::string& key) const { return tensors_.at(key); }
  // The number of elements of tensor `key` (its shape was checked when it was read).
  int64_t numel(const std::string& key) const {
    int64_t n = 1;
    for (int64_t d : meta(key).shape) n *= d;
    return n;
  }
  bool has(const std::string& key) const { return tensors_.contains(key); }

  // Throws unless the files holding the pieces of `key` have at least `numel` elements
  // of `dtype` (called before allocating a tensor whose size comes from the metadata).
  void check_backed(const std::string& key, int64_t numel, at::ScalarType dtype) {
    int64_t available = 0;
    absl::flat_hash_set<int> ranks;
    for (const Piece& p : meta(key).pieces) {
      if (!ranks.insert(p.rank).second) continue;
      const std::string path = (fs::path(dir_) / rank_file(p.rank)).string();
      available += ReadableFile::open(path, "checkpoint file").size();
    }
    TORCH_CHECK(numel <= available / static_cast<int64_t>(c10::elementSize(dtype)), "'", dir_,
                "': '", key, "' has ", numel, " elements of ", c10::toString(dtype),
                ", but the files holding it have ", available,
                " bytes; the checkpoint is damaged or was edited");
  }

  // Copies elements [begin, begin + out.numel()) of tensor `key` (flattened) into `out`.
  void read(const std::string& key, int64_t begin, at::Tensor out) {
    const int64_t end = begin + out.numel();
    int64_t covered = 0;
    for (const Piece& piece : tensors_.at(key).pieces) {
      const int64_t lo = std::max(begin, piece.offset);
      const int64_t hi = std::min(end, piece.offset + piece.numel);
      if (lo >= hi) continue;
      const at::Tensor* local = rank_tensors(piece.rank).find(key);
      TORCH_CHECK(local != nullptr && local->dim() == 1 && local->numel() == piece.numel, "'", dir_,
                  "/", rank_file(piece.rank), "' lacks the piece of '", key,
                  "' its metadata lists");
      out.narrow(0, lo - begin, hi - lo).copy_(local->narrow(0, lo - piece.offset, hi - lo));
      covered += hi - lo;
    }
    TORCH_CHECK(covered == out.numel(), "checkpoint '", dir_, "' holds ", covered, " of the ",
                out.numel(), " elements of '", key, "' this rank needs; it is incomplete");
  }

 private:
  const StateDict& rank_tensors(int rank) {
    auto it = loaded_.find(rank);
    if (it != loaded_.end()) return it->second;
    const std::string name = rank_file(rank);
    const std::string path = (fs::path(dir_) / name).string();
    auto meta = files_.find(name);
    TORCH_CHECK(meta != files_.end(), "'", dir_, "' metadata lists no file ", name);
    const std::string bytes = read_regular_file(path, "checkpoint file");
    TORCH_CHECK(int64_t(bytes.size()) == meta->second.bytes, "checkpoint file '", path, "' has ",
                bytes.size(), " bytes, the metadata says ", meta->second.bytes,
                ": it is truncated or damaged; use another checkpoint");
    TORCH_CHECK(crc32_of(bytes.data(), bytes.size()) == meta->second.crc32, "checkpoint file '",
                path, "' fails its CRC-32 check: it is damaged; use another checkpoint");
    return loaded_
        .emplace(rank,
                 tensor_dict(state_internal::read_torch_file(bytes, path), "the pieces", path))
        .first->second;
  }

  // Note [Pieces cover a tensor exactly once]
  // Each piece is a flat range [offset, offset + numel) of the tensor's row-major
  // flattening. Sorted by offset (O(k log k) for k pieces), the non-empty ones must
  // start where the previous one ends, the first at 0 and the last ending at the
  // tensor's size: no overlap, no hole, nothing outside, checked before a byte is read.
  // Counting the elements copied is not enough (an overlap can make up for a hole).
  static void check_cover(const std::string& path, const std::string& key, TensorMeta& meta) {
    int64_t numel = 1;
    for (int64_t d : meta.shape) {
      TORCH_CHECK(d >= 0 && !__builtin_mul_overflow(numel, d, &numel), "'", path, "': '", key,
                  "' has shape ", state_internal::shape_string(meta.shape),
                  ", which is negative or has more than 2^63 elements");
    }
    std::vector<const Piece*> pieces;
    for (const Piece& p : meta.pieces) {
      TORCH_CHECK(p.offset >= 0 && p.numel >= 0 && p.offset <= numel && p.numel <= numel - p.offset,
                  "'", path, "': a piece of '", key, "' (elements [", p.offset, ", ",
                  p.offset + p.numel, ") in rank ", p.rank, "'s file) lies outside its ", numel,
                  " elements");
      if (p.numel > 0) pieces.push_back(&p);
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece* a, const Piece* b) { return a->offset < b->offset; });
    int64_t end = 0;
    for (const Piece* p : pieces) {
      TORCH_CHECK(p->offset == end, "'", path, "': the pieces of '", key, "' ",
                  p->offset < end ? "overlap" : "leave a hole", ": elements [",
                  std::min(p->offset, end), ", ", std::max(p->offset, end), ") are stored ",
                  p->offset < end ? "twice" : "nowhere",
                  "; the checkpoint is damaged or was edited");
      end = p->offset + p->numel;
    }
    TORCH_CHECK(end == numel, "'", path, "': the pieces of '", key, "' leave a hole: elements [",
                end, ", ", numel, ") are stored nowhere; the checkpoint is damaged or was edited");
  }

  std::string dir_;
  int64_t world_size_ = 0;
  absl::flat_hash_map<std::string, FileMeta> files_;
  std::vector<std::string> keys_;
  absl::flat_hash_map<std::string, TensorMeta> tensors_;
  absl::flat_hash_map<int, StateDict> loaded_;
};

// The scheduler state a checkpoint holds, if it has one.
std::optional<SchedulerState> read_scheduler(CheckpointReader& reader) {
  if (!reader.has(kSchedulerLastEpoch)) return std::nullopt;
  SchedulerState scheduler;
  at::Tensor last_epoch = at::empty({1}, at::kLong);
  reader.read(kSchedulerLastEpoch, 0, last_epoch);
  scheduler.last_epoch = checked_count(last_epoch.item<int64_t>(),
                                       absl::StrCat("'", reader.dir(), "': ", kSchedulerLastEpoch));
  if (reader.has(kSchedulerLastLr)) {
    const int64_t numel = reader.numel(kSchedulerLastLr);
    reader.check_backed(kSchedulerLastLr, numel, at::kDouble);
    at::Tensor last_lr = at::empty({numel}, at::kDouble);
    reader.read(kSchedulerLastLr, 0, last_lr);
    for (int64_t i = 0; i < numel; ++i) {
      scheduler.last_lr.push_back(checked_finite(
          last_lr.data_ptr<double>()[i], absl::StrCat("'", reader.dir(), "': ", kSchedulerLastLr)));
    }
  }
  return scheduler;
}

// Note [A failed save leaves nothing]
// A save that fails for any reason (a full disk, a permission, an exception or a lost
// rank in a collective) removes its partial directory on every rank that is still alive
// before the error leaves save_sharded_checkpoint, so no hidden ".<name>.partial-..."
// directory keeps the space. A failed write says how much space the checkpoint needs
// (the sum of the ranks' files) and how much is free once the partial directory is gone.
// A process killed mid-save cannot clean up: remove_partial_checkpoints, called at the
// next start, removes what it left.
void save_into(const fs::path& partial, const fs::path& target, Communicator& comm,
               const at::TensorOptions& on_device, const std::vector<Item>& items) {
  const int rank = comm.rank();
  // Every rank learns whether every other rank succeeded, so none waits for a dead one.
  auto all_ok = [&](bool ok, const std::string& step, const std::string& error) {
    at::Tensor flag = at::scalar_tensor(ok ? 1 : 0, on_device).reshape({1});
    comm.all_reduce(flag, ReduceOp::kSum);
    TORCH_CHECK(ok, "save_sharded_checkpoint: ", step, " failed on rank ", rank, ": ", error);
    TORCH_CHECK(flag.item<int64_t>() == comm.world_size(), "save_sharded_checkpoint: ", step,
                " failed on ", comm.world_size() - flag.item<int64_t>(),
                " other rank(s); see their errors");
  };
  std::string error;
  bool ok = true;
  if (rank == 0) {
    try {
      TORCH_CHECK(fs::is_directory(target.parent_path()), "the parent directory '",
                  target.parent_path().string(), "' does not exist");
      fs::remove_all(partial);
      fs::create_directory(partial);
    } catch (const std::exception& e) {
      ok = false;
      error = message_of(e);
    }
  }
  all_ok(ok, "creating '" + partial.string() + "'", error);

  // This rank's file, and what rank 0 needs for the metadata: [written, bytes, crc32,
  // (offset, numel) per item].
  const size_t stride = 3 + 2 * items.size();
  at::Tensor mine = at::zeros({static_cast<int64_t>(stride)}, at::kLong);
  auto* m = mine.data_ptr<int64_t>();
  try {
    c10::Dict<std::string, at::Tensor> pieces;
    for (size_t i = 0; i < items.size(); ++i) {
      const ShardedTensor& t = *items[i].tensor;
      if (!items[i].written) continue;
      m[3 + 2 * i] = t.offset;
      m[4 + 2 * i] = t.local.numel();
      pieces.insert(items[i].key, t.local.to(at::kCPU).contiguous());
    }
    const std::vector<char> bytes = compat::save_torch_archive(pieces);
    m[1] = static_cast<int64_t>(bytes.size());
    write_archive((partial / rank_file(rank)).string(), bytes);
    m[0] = 1;
    m[2] = static_cast<int64_t>(crc32_of(bytes.data(), bytes.size()));
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  at::Tensor all = at::empty({static_cast<int64_t>(stride) * comm.world_size()}, on_device);
  comm.all_gather_into_tensor(all, mine.to(on_device.device()));
  all = all.cpu();
  const int64_t* a = all.data_ptr<int64_t>();
  std::string failed;
  int64_t needed = 0;
  for (int r = 0; r < comm.world_size(); ++r) {
    if (a[r * stride] == 0) absl::StrAppend(&failed, failed.empty() ? "" : ", ", r);
    needed += a[r * stride + 1];
  }
  if (!failed.empty()) remove_partial(partial);
  TORCH_CHECK(m[0] == 1, "save_sharded_checkpoint: rank ", rank, " cannot write its shard: ", error,
              "; ", space_note(target.parent_path(), needed));
  TORCH_CHECK(failed.empty(), "save_sharded_checkpoint: rank(s) ", failed,
              " could not write their shards; see their errors. '", target.string(),
              "' is unchanged; ", space_note(target.parent_path(), needed));

  ok = true;
  if (rank == 0) {
    try {
      write_archive(
          (partial / kMetadata).string(),
          compat::save_torch_archive(metadata_value(
              comm.world_size(), items, std::vector<int64_t>(a, a + all.numel()), stride)));
      publish(partial, target);
    } catch (const std::exception& e) {
      ok = false;
      remove_partial(partial);
      error = absl::StrCat(message_of(e), "; ", space_note(target.parent_path(), needed));
    }
  }
  all_ok(ok, "publishing '" + target.string() + "'", error);
}

}  // namespace

void save_state_dict(const StateDict& state_dict, const std::string& path) {
  write_archive(path, compat::save_torch_archive(tensor_dict_value(state_dict)));
}

StateDict load_state_dict(const std::string& path) {
  return tensor_dict(
      state_internal::read_torch_file(read_regular_file(path, "torch.save file"), path),
      "the state dict", path);
}

void save_optim_state_dict(const OptimStateDict& state_dict, const std::string& path) {
  c10::Dict<std::string, c10::Dict<std::string, at::Tensor>> dict;
  for (const auto& param : state_dict) {
    dict.insert(param.key(), tensor_dict_value(param.value()));
  }
  write_archive(path, compat::save_torch_archive(dict));
}

OptimStateDict load_optim_state_dict(const std::string& path) {
  OptimStateDict state_dict;
  const PyValuePtr root =
      state_internal::read_torch_file(read_regular_file(path, "torch.save file"), path);
  for (const auto& [fqn, value] : dict_items(root, "the optimizer state dict", path)) {
    state_dict.insert(fqn, tensor_dict(value, "the state of '" + fqn + "'", path));
  }
  return state_dict;
}

void save_sharded_checkpoint(FullyShardedRoot& model, const torch::optim::Optimizer* optimizer,
                             const std::string& dir, const SchedulerState* scheduler) {
  write_sharded_checkpoint(stage_sharded_checkpoint(model, optimizer, scheduler), dir,
                           model.communicator());
}

StagedShardedCheckpoint stage_sharded_checkpoint(FullyShardedRoot& model,
                                                 const torch::optim::Optimizer* optimizer,
                                                 const SchedulerState* scheduler) {
  // One layout for the whole save (it walks the module tree); checks `model` is idle.
  const state_internal::ModelLayout layout =
      state_internal::model_layout(model, "save_sharded_checkpoint");
  const ShardedStateDict model_state = state_internal::sharded_state_dict(layout);
  const ShardedOptimStateDict optim_state =
      optimizer != nullptr ? state_internal::sharded_optim_state_dict(layout, *optimizer)
                           : ShardedOptimStateDict();
  StagedShardedCheckpoint staged;
  staged.device = model.device_handle().device();
  for (const Item& item : items_of(layout, model_state, optim_state)) {
    staged.entries.push_back({item.key,
                              staged_piece(*item.tensor, item.written, staged.device.is_cuda()),
                              item.written});
  }
  if (scheduler != nullptr) stage_scheduler(*scheduler, model.communicator().rank(), staged);
  return staged;
}

void write_sharded_checkpoint(const StagedShardedCheckpoint& staged, const std::string& dir,
                              Communicator& comm) {
  std::vector<Item> items;
  for (const StagedShardedCheckpoint::Entry& entry : staged.entries) {
    items.push_back({entry.key, &entry.piece, entry.written});
  }
  // The bookkeeping collectives below run on the compute device (NCCL takes only CUDA
  // tensors); their results are read on the CPU.
  const at::TensorOptions on_device = at::dtype(at::kLong).device(staged.device);
  const fs::path target = fs::absolute(dir).lexically_normal();
  const fs::path partial = state_internal::partial_directory(target, comm, on_device);
  // See Note [A failed save leaves nothing].
  try {
    save_into(partial, target, comm, on_device, items);
  } catch (...) {
    remove_partial(partial);
    throw;
  }
}

std::pair<std::string, c10::IValue> scheduler_dcp_extra(const SchedulerState& scheduler) {
  c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
  entry.insert(std::string("last_epoch"), scheduler.last_epoch);
  entry.insert(std::string("_last_lr"), c10::List<double>(scheduler.last_lr));
  return {kDcpSchedulerKey, c10::IValue(entry)};
}

std::optional<SchedulerState> scheduler_from_dcp_extras(const DcpExtras& extras) {
  const std::string epoch_key = absl::StrCat(kDcpSchedulerKey, ".last_epoch");
  const std::string lr_key = absl::StrCat(kDcpSchedulerKey, "._last_lr");
  const c10::IValue* epoch = nullptr;
  const c10::IValue* lr = nullptr;
  for (const auto& [name, value] : extras) {
    if (name == epoch_key) epoch = &value;
    if (name == lr_key) lr = &value;
  }
  if (epoch == nullptr && lr == nullptr) return std::nullopt;
  TORCH_CHECK(epoch != nullptr && lr != nullptr && epoch->isInt() && lr->isList(),
              "the checkpoint's scheduler state must be '", epoch_key, "' (an int) and '", lr_key,
              "' (a list of floats), as torch.optim.lr_scheduler's state_dict holds them; found ",
              epoch == nullptr ? "no " + epoch_key : "'" + epoch_key + "' a " + epoch->tagKind(),
              " and ", lr == nullptr ? "no " + lr_key : "'" + lr_key + "' a " + lr->tagKind(),
              ": save it with scheduler_dcp_extra");
  SchedulerState scheduler;
  scheduler.last_epoch = checked_count(epoch->toInt(), "the checkpoint's '" + epoch_key + "'");
  for (const c10::IValue& value : lr->toListRef()) {
    TORCH_CHECK(value.isDouble() || value.isInt(), "the checkpoint's '", lr_key,
                "' must hold numbers (one learning rate per param group), found a ",
                value.tagKind());
    scheduler.last_lr.push_back(
        checked_finite(value.isDouble() ? value.toDouble() : double(value.toInt()),
                       "the checkpoint's '" + lr_key + "'"));
  }
  return scheduler;
}

std::optional<SchedulerState> load_sharded_checkpoint(FullyShardedRoot& model,
                                                      torch::optim::Optimizer* optimizer,
                                                      const std::string& dir) {
  static const std::string kWhat = "load_sharded_checkpoint";
  const state_internal::ModelLayout layout = state_internal::model_layout(model, kWhat.c_str());
  // This rank's pieces: the shape of what to read.
  ShardedStateDict model_state = state_internal::sharded_state_dict(layout);
  CheckpointReader reader(dir);
  std::vector<std::string> model_keys;
  for (const std::string& key : reader.keys()) {
    if (absl::StartsWith(key, kModelPrefix)) model_keys.push_back(key.substr(strlen(kModelPrefix)));
  }
  state_internal::check_same_keys(model_state.keys(), model_keys,
                                  kWhat + " ('" + dir + "' holds another model)");
  for (auto& entry : model_state) {
    ShardedTensor& piece = entry.value();
    const TensorMeta& meta = reader.meta(kModelPrefix + entry.key());
    TORCH_CHECK(meta.shape == piece.global_shape, kWhat, ": size mismatch for '", entry.key(),
                "': the checkpoint has shape ", state_internal::shape_string(meta.shape),
                ", the model has ", state_internal::shape_string(piece.global_shape));
    TORCH_CHECK(meta.dtype == c10::toString(piece.local.scalar_type()), kWhat,
                ": dtype mismatch for '", entry.key(), "': the checkpoint has ", meta.dtype,
                ", the model has ", c10::toString(piece.local.scalar_type()));
    reader.read(kModelPrefix + entry.key(), piece.offset, piece.local);
  }
  if (optimizer != nullptr) {
    ShardedOptimStateDict optim_state;
    for (const std::string& key : reader.keys()) {
      if (!absl::StartsWith(key, kOptimPrefix)) continue;
      const size_t slash = key.rfind('/');
      const std::string fqn = key.substr(strlen(kOptimPrefix), slash - strlen(kOptimPrefix));
      const TensorMeta& meta = reader.meta(key);
      const ShardedTensor* param = model_state.find(fqn);
      TORCH_CHECK(param != nullptr, kWhat, ": '", dir, "' has optimizer state for '", fqn,
                  "', which the model does not have");
      ShardedTensor piece;
      piece.global_shape = meta.shape;
      piece.replicated = meta.replicated;
      piece.offset = meta.replicated ? 0 : param->offset;
      const at::ScalarType dtype = dtype_named(meta.dtype, dir);
      const int64_t numel = meta.replicated ? reader.numel(key) : param->local.numel();
      if (meta.replicated) reader.check_backed(key, numel, dtype);
      piece.local = at::empty({numel}, dtype);
      reader.read(key, piece.offset, piece.local);
      if (!optim_state.contains(fqn)) optim_state.insert(fqn, ShardedParamOptimState());
      optim_state[fqn].insert(key.substr(slash + 1), std::move(piece));
    }
    state_internal::load_sharded_optim_state_dict(layout, *optimizer, optim_state);
  }
  state_internal::load_sharded_state_dict(layout, model_state);
  return read_scheduler(reader);
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  std::optional<std::string> latest;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name[0] == '.' || !entry.is_directory()) continue;
    if (!fs::exists(entry.path() / kMetadata) && !fs::exists(entry.path() / kDcpMetadataFile)) {
      continue;
    }
    if (!latest || name > fs::path(*latest).filename().string()) latest = entry.path().string();
  }
  return latest;
}

std::vector<std::string> remove_partial_checkpoints(const std::string& root) {
  std::vector<std::string> removed;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    if (!is_partial_name(entry.path().filename().string()) || !entry.is_directory()) continue;
    remove_partial(entry.path());
    TORCH_CHECK(!fs::exists(entry.path()), "cannot remove the partial checkpoint '",
                entry.path().string(), "' an interrupted save left; remove it by hand");
    removed.push_back(entry.path().string());
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

// Note [A resume that fails changes nothing]
// load_latest_sharded_checkpoint tries the checkpoints under a root newest first. Each
// rank loads the files it needs (load_sharded_checkpoint verifies each one's size and
// CRC-32 against the metadata before parsing it), then the ranks exchange one small
// record each (all_gather: which checkpoint, whether it loaded, the error) so that all
// of them agree on the outcome before any returns: a caller that truncates its records or
// prints "resumed" after it returns does so only when every rank holds the same
// checkpoint. A checkpoint that fails on any rank is skipped with the failing ranks'
// errors (naming the damaged files), and the next older one is tried; when none loads,
// every rank raises the same error and nothing on disk was touched.
namespace {

constexpr int64_t kMaxMessage = 1000;  // characters of a rank's error that travel

struct RankOutcome {
  int64_t name_hash;
  bool ok;
  std::string error;
};

// Every rank's outcome of trying checkpoint `name` ("" when it has none left).
std::vector<RankOutcome> agree(Communicator& comm, const at::TensorOptions& on_device,
                               const std::string& name, const std::string& error) {
  const int64_t stride = 2 + kMaxMessage;
  at::Tensor mine = at::zeros({stride}, at::kLong);
  int64_t* m = mine.data_ptr<int64_t>();
  m[0] = static_cast<int64_t>(std::hash<std::string>()(name) & 0x7fffffffffffffff);
  m[1] = error.empty() ? 1 : 0;
  for (size_t i = 0; i < error.size() && int64_t(i) < kMaxMessage; ++i) {
    m[2 + i] = static_cast<unsigned char>(error[i]);
  }
  at::Tensor all = at::empty({stride * comm.world_size()}, on_device);
  comm.all_gather_into_tensor(all, mine.to(on_device.device()));
  all = all.cpu();
  const int64_t* a = all.data_ptr<int64_t>();
  std::vector<RankOutcome> outcomes;
  for (int r = 0; r < comm.world_size(); ++r) {
    const int64_t* record = a + r * stride;
    RankOutcome outcome{record[0], record[1] == 1, ""};
    for (int64_t i = 0; i < kMaxMessage && record[2 + i] != 0; ++i) {
      outcome.error.push_back(static_cast<char>(record[2 + i]));
    }
    outcomes.push_back(std::move(outcome));
  }
  return outcomes;
}

// The failing ranks' errors, ranks with the same error together: "rank 1: ...".
std::string failures_text(const std::vector<RankOutcome>& outcomes) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(outcomes.size()); ++r) {
    if (outcomes[r].ok) continue;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& group) { return group.first == outcomes[r].error; });
    if (it == groups.end()) it = groups.insert(groups.end(), {outcomes[r].error, {}});
    it->second.push_back(r);
  }
  std::vector<std::string> parts;
  for (const auto& [error, ranks] : groups) {
    parts.push_back(absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "),
                                 ": ", error));
  }
  return absl::StrJoin(parts, "; ");
}

// The directories under `root` that hold a checkpoint, complete or not (metadata.pt or a
// rank file, or a Distributed Checkpoint's .metadata or rank file), newest (last in name order)
// first; partial directories excluded.
std::vector<std::string> checkpoint_candidates(const std::string& root) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name[0] == '.' || !entry.is_directory()) continue;
    if (fs::exists(entry.path() / kMetadata) || fs::exists(entry.path() / rank_file(0)) ||
        is_dcp_checkpoint(entry.path().string())) {
      names.push_back(name);
    }
  }
  std::sort(names.rbegin(), names.rend());
  return names;
}

}  // namespace

std::optional<LoadedCheckpoint> load_latest_sharded_checkpoint(FullyShardedRoot& model,
                                                               torch::optim::Optimizer* optimizer,
                                                               const std::string& root) {
  Communicator& comm = model.communicator();
  const at::TensorOptions on_device = at::dtype(at::kLong).device(model.device_handle().device());
  const std::vector<std::string> names = checkpoint_candidates(root);
  LoadedCheckpoint loaded;
  for (size_t i = 0;; ++i) {
    const std::string name = i < names.size() ? names[i] : "";
    const std::string dir = (fs::path(root) / name).string();
    std::string error;
    if (!name.empty()) {
      try {
        if (is_dcp_checkpoint(dir)) {
          loaded.extras = load_dcp_checkpoint(model, optimizer, dir);
          loaded.scheduler = scheduler_from_dcp_extras(loaded.extras);
        } else {
          loaded.scheduler = load_sharded_checkpoint(model, optimizer, dir);
          loaded.extras.clear();
        }
      } catch (const std::exception& e) {
        error = message_of(e);
      }
    }
    const std::vector<RankOutcome> outcomes = agree(comm, on_device, name, error);
    for (int r = 1; r < comm.world_size(); ++r) {
      TORCH_CHECK(outcomes[r].name_hash == outcomes[0].name_hash,
                  "load_latest_sharded_checkpoint: the ranks see different checkpoints under '",
                  root, "' (rank ", r,
                  " another one than rank 0); it must be a folder every rank sees (for several "
                  "hosts, on a shared file system)");
    }
    if (name.empty()) break;
    if (std::all_of(outcomes.begin(), outcomes.end(), [](const auto& o) { return o.ok; })) {
      loaded.dir = dir;
      return loaded;
    }
    loaded.skipped.push_back(absl::StrCat("'", dir, "': ", failures_text(outcomes)));
  }
  TORCH_CHECK(loaded.skipped.empty(), "no checkpoint under '", root,
              "' loads on every rank: ", absl::StrJoin(loaded.skipped, "; "));
  return std::nullopt;
}

}  // namespace fsdp
