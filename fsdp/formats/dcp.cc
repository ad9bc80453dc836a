#include "fsdp/formats/dcp.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <c10/util/Exception.h>

#include "fsdp/formats/files.h"
#include "fsdp/formats/pickle.h"

namespace fsdp {
namespace {

using Kind = PickleValue::Kind;
using P = PickleValue;

constexpr char kModule[] = "torch.distributed.checkpoint.metadata.";
constexpr char kStorageInfo[] = "torch.distributed.checkpoint.filesystem._StorageInfo";
constexpr char kSize[] = "torch.Size";
constexpr char kGetLayout[] = "torch.serialization._get_layout";
constexpr char kMemFormat[] = "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING";

struct DtypeName {
  c10::ScalarType dtype;
  const char* name;  // the torch attribute, e.g. "torch.float32"
};
constexpr DtypeName kDtypes[] = {
    {c10::ScalarType::Float, "torch.float32"},
    {c10::ScalarType::Double, "torch.float64"},
    {c10::ScalarType::Half, "torch.float16"},
    {c10::ScalarType::BFloat16, "torch.bfloat16"},
    {c10::ScalarType::Long, "torch.int64"},
    {c10::ScalarType::Int, "torch.int32"},
    {c10::ScalarType::Short, "torch.int16"},
    {c10::ScalarType::Char, "torch.int8"},
    {c10::ScalarType::Byte, "torch.uint8"},
    {c10::ScalarType::Bool, "torch.bool"},
    {c10::ScalarType::ComplexFloat, "torch.complex64"},
};

bool allowed(const std::string& name) {
  if (absl::StartsWith(name, kModule) || name == kStorageInfo || name == kSize ||
      name == kGetLayout || name == "pathlib.PosixPath" || name == "collections.OrderedDict") {
    return true;
  }
  for (const DtypeName& d : kDtypes) {
    if (name == d.name) return true;
  }
  return false;
}

// ---- Reading, with messages naming the file.

class Parser {
 public:
  explicit Parser(const std::string& name) : name_(name) {}

  DcpMetadata parse(const PickleValuePtr& root) {
    const PickleValuePtr& state = object_state(root, "Metadata", "the file");
    DcpMetadata md;
    absl::flat_hash_map<std::string, size_t> position;  // fqn -> md.entries index
    for (const auto& [fqn, value] :
         items(field(state, "state_dict_metadata"), "state_dict_metadata")) {
      md.entries.push_back(entry(string_of(fqn, "a state_dict_metadata key"), value));
      check(position.emplace(md.entries.back().fqn, md.entries.size() - 1).second,
            "state_dict_metadata lists '", md.entries.back().fqn, "' twice");
    }
    const PickleValuePtr planner = state->get("planner_data");
    if (planner != nullptr && planner->kind == Kind::kDict) {
      for (const auto& [fqn, path] : items(planner, "planner_data")) {
        auto it = position.find(string_of(fqn, "a planner_data key"));
        if (it != position.end()) set_path(md.entries[it->second], path);
      }
    }
    for (const auto& [index, info] : items(field(state, "storage_data"), "storage_data")) {
      md.storage.push_back(storage(index, info));
      check(position.contains(md.storage.back().fqn), "storage_data has a record for '",
            md.storage.back().fqn, "', which state_dict_metadata does not list");
    }
    const PickleValuePtr version = state->get("version");
    if (version != nullptr && version->kind == Kind::kString) md.version = version->string;
    return md;
  }

 private:
  template <typename... Args>
  void check(bool condition, const Args&... what) const {
    TORCH_CHECK(condition, "'", name_,
                "' is not Distributed Checkpoint metadata fsdp can read: ", what...);
  }

  const PickleValuePtr& object_state(const PickleValuePtr& value, const std::string& cls,
                                     const std::string& what) {
    check(value->kind == Kind::kObject && value->string == kModule + cls, what, " must be a ", cls,
          ", found a ",
          value->kind == Kind::kObject ? value->string : pickle_kind_name(value->kind));
    check(value->state != nullptr, cls, " without its fields");
    return value->state;
  }
  PickleValuePtr field(const PickleValuePtr& state, const char* key) {
    check(state->kind == Kind::kDict, "an object's fields must be a dict, found a ",
          pickle_kind_name(state->kind));
    PickleValuePtr value = state->get(key);
    check(value != nullptr, "the field '", key, "' is missing");
    return value;
  }
  std::vector<std::pair<PickleValuePtr, PickleValuePtr>> items(const PickleValuePtr& dict,
                                                               const char* what) {
    check(dict->kind == Kind::kDict, what, " must be a dict, found a ",
          pickle_kind_name(dict->kind));
    std::vector<std::pair<PickleValuePtr, PickleValuePtr>> out;
    for (size_t i = 0; i + 1 < dict->items.size(); i += 2) {
      out.emplace_back(dict->items[i], dict->items[i + 1]);
    }
    return out;
  }
  std::string string_of(const PickleValuePtr& value, const char* what) {
    check(value->kind == Kind::kString, what, " must be a str, found a ",
          pickle_kind_name(value->kind));
    return value->string;
  }
  int64_t int_of(const PickleValuePtr& value, const std::string& what) {
    check(value != nullptr && value->kind == Kind::kInt, what, " must be an int");
    return value->integer;
  }
  // A torch.Size (or a plain tuple or list) of ints.
  std::vector<int64_t> size_of(const PickleValuePtr& value, const std::string& what) {
    PickleValuePtr tuple = value;
    if (value->kind == Kind::kObject && value->string == kSize && value->items.size() == 1) {
      tuple = value->items[0];
    }
    check(tuple->kind == Kind::kTuple || tuple->kind == Kind::kList, what,
          " must be a torch.Size, found a ",
          tuple->kind == Kind::kObject ? tuple->string : pickle_kind_name(tuple->kind));
    std::vector<int64_t> out;
    for (const PickleValuePtr& d : tuple->items) out.push_back(int_of(d, what));
    return out;
  }

  DcpEntryMetadata entry(std::string fqn, const PickleValuePtr& value) {
    DcpEntryMetadata e;
    e.fqn = std::move(fqn);
    e.path = {e.fqn};
    if (value->kind == Kind::kObject &&
        value->string == absl::StrCat(kModule, "BytesStorageMetadata")) {
      e.is_tensor = false;
      return e;
    }
    const PickleValuePtr& state = object_state(value, "TensorStorageMetadata", "'" + e.fqn + "'");
    properties(field(state, "properties"), e);
    e.size = size_of(field(state, "size"), "the size of '" + e.fqn + "'");
    int64_t numel = 1;
    for (int64_t d : e.size) {
      check(d >= 0 && !__builtin_mul_overflow(numel, d, &numel), "the size of '", e.fqn, "' (",
            absl::StrJoin(e.size, ", "), ") is negative or has more than 2^63 elements");
    }
    const PickleValuePtr chunks = field(state, "chunks");
    check(chunks->kind == Kind::kList, "the chunks of '", e.fqn, "' must be a list");
    for (const PickleValuePtr& c : chunks->items) {
      const PickleValuePtr& cs =
          object_state(c, "ChunkStorageMetadata", "a chunk of '" + e.fqn + "'");
      DcpChunk chunk{size_of(field(cs, "offsets"), "a chunk's offsets"),
                     size_of(field(cs, "sizes"), "a chunk's sizes")};
      check_chunk(e, chunk);
      e.chunks.push_back(std::move(chunk));
    }
    check_cover(e, numel);
    return e;
  }

  // Note [Chunks cover a tensor exactly once]
  // Counting the elements the chunks hold is not enough: rows 74..109 and 76..79 add up
  // to as many as rows 74..113, and the rows never stored would be read as whatever
  // memory held. The chunks (boxes inside the tensor, checked above) cover each element
  // exactly once iff the sum of their indicator functions is the tensor's indicator.
  // An indicator of a box [a, b) is the product over dimensions of (H(x - a) - H(x - b))
  // (H the step function); expanded, it is a signed sum over the box's 2^d corners of
  // products of steps, and such products at distinct points are linearly independent.
  // So the chunks tile the tensor exactly when, for every corner point, the signs the
  // chunks put there add up to the sign the tensor's own corners put there: one pass
  // over the chunks' corners with a hash map, O(k 2^d) for k chunks, whatever their
  // sizes (no per-element bitmap). Only dimensions some chunk splits count in d (in
  // practice 1 or 2); empty chunks cover nothing and are skipped. A layout splitting so
  // many dimensions that the corners exceed kMaxCorners is refused.
  void check_cover(const DcpEntryMetadata& e, int64_t numel) {
    constexpr int64_t kMaxCorners = int64_t{1} << 24;
    const size_t ndim = e.size.size();
    std::vector<const DcpChunk*> chunks;
    std::vector<size_t> split;  // the dimensions some chunk does not span
    std::vector<bool> is_split(ndim, false);
    unsigned __int128 stored = 0;
    for (const DcpChunk& c : e.chunks) {
      int64_t volume = 1;
      for (int64_t s : c.sizes) volume *= s;  // <= numel: the chunk is inside the tensor
      if (volume == 0) continue;
      stored += static_cast<unsigned __int128>(volume);
      chunks.push_back(&c);
      for (size_t d = 0; d < ndim; ++d) {
        if (!is_split[d] && c.sizes[d] != e.size[d]) {
          is_split[d] = true;
          split.push_back(d);
        }
      }
    }
    auto refuse = [&](const char* what) {
      check(false, "the ", e.chunks.size(), " chunks of '", e.fqn, "' hold ",
            static_cast<uint64_t>(std::min<unsigned __int128>(stored, UINT64_MAX)),
            " elements of its tensor of size (", absl::StrJoin(e.size, ", "), ") with ", numel,
            " elements: ", what, "; the checkpoint is damaged or was edited");
    };
    if (stored != static_cast<unsigned __int128>(numel)) {
      refuse(stored > static_cast<unsigned __int128>(numel) ? "some elements are stored twice"
                                                            : "some elements are not stored");
    }
    if (numel == 0) return;
    check(split.size() < 24 && (int64_t(chunks.size()) << split.size()) <= kMaxCorners,
          "the chunks of '", e.fqn, "' split it along ", split.size(), " dimensions into ",
          chunks.size(), " pieces, more than fsdp checks");
    absl::flat_hash_map<std::vector<int64_t>, int64_t> weight;
    std::vector<int64_t> corner(split.size());
    auto add_corners = [&](const std::vector<int64_t>& lo, const std::vector<int64_t>& extent,
                           int64_t sign) {
      for (uint64_t bits = 0; bits < (uint64_t{1} << split.size()); ++bits) {
        int64_t s = sign;
        for (size_t i = 0; i < split.size(); ++i) {
          const bool high = (bits >> i) & 1;
          corner[i] = lo[split[i]] + (high ? extent[split[i]] : 0);
          if (high) s = -s;
        }
        weight[corner] += s;
      }
    };
    for (const DcpChunk* c : chunks) add_corners(c->offsets, c->sizes, 1);
    add_corners(std::vector<int64_t>(ndim, 0), e.size, -1);
    for (const auto& [point, w] : weight) {
      if (w != 0) refuse("some elements are stored twice and others not at all");
    }
  }
  void check_chunk(const DcpEntryMetadata& e, const DcpChunk& c) {
    bool inside = c.offsets.size() == e.size.size() && c.sizes.size() == e.size.size();
    for (size_t d = 0; inside && d < e.size.size(); ++d) {
      inside = c.offsets[d] >= 0 && c.sizes[d] >= 0 && c.offsets[d] <= e.size[d] &&
               c.sizes[d] <= e.size[d] - c.offsets[d];
    }
    check(inside, "a chunk of '", e.fqn, "' at offsets (", absl::StrJoin(c.offsets, ", "),
          ") with sizes (", absl::StrJoin(c.sizes, ", "), ") lies outside its tensor of size (",
          absl::StrJoin(e.size, ", "), ")");
  }
  // TensorProperties: a tuple (dtype, layout, requires_grad, memory_format, pin_memory)
  // from its __getstate__, or a dict of fields from older writers.
  void properties(const PickleValuePtr& value, DcpEntryMetadata& e) {
    const PickleValuePtr& state = object_state(value, "TensorProperties", "properties");
    PickleValuePtr dtype, requires_grad;
    if (state->kind == Kind::kTuple && !state->items.empty()) {
      dtype = state->items[0];
      if (state->items.size() > 2) requires_grad = state->items[2];
    } else if (state->kind == Kind::kDict) {
      dtype = state->get("dtype");
      requires_grad = state->get("requires_grad");
    }
    check(dtype != nullptr && dtype->kind == Kind::kGlobal, "the dtype of '", e.fqn,
          "' is missing");
    bool known = false;
    for (const DtypeName& d : kDtypes) {
      if (dtype->string == d.name) {
        e.dtype = d.dtype;
        known = true;
      }
    }
    check(known, "'", e.fqn, "' has dtype ", dtype->string, ", which fsdp does not read");
    e.requires_grad = requires_grad != nullptr && requires_grad->kind == Kind::kBool &&
                      requires_grad->integer != 0;
  }
  void set_path(DcpEntryMetadata& e, const PickleValuePtr& path) {
    check(path->kind == Kind::kTuple || path->kind == Kind::kList, "the planner_data of '", e.fqn,
          "' must be a tuple");
    e.path.clear();
    for (const PickleValuePtr& p : path->items) {
      check(p->kind == Kind::kString || p->kind == Kind::kInt, "the planner_data of '", e.fqn,
            "' must hold strs and ints");
      if (p->kind == Kind::kString) {
        e.path.emplace_back(p->string);
      } else {
        e.path.emplace_back(p->integer);
      }
    }
  }
  DcpStorageInfo storage(const PickleValuePtr& index, const PickleValuePtr& info) {
    DcpStorageInfo s;
    const PickleValuePtr& is = object_state(index, "MetadataIndex", "a storage_data key");
    s.fqn = string_of(field(is, "fqn"), "a MetadataIndex's fqn");
    const PickleValuePtr offset = is->get("offset");
    if (offset != nullptr && offset->kind != Kind::kNone) {
      s.chunk_offsets = size_of(offset, "the offset of a record of '" + s.fqn + "'");
    }
    const PickleValuePtr chunk_index = is->get("index");
    if (chunk_index != nullptr && chunk_index->kind != Kind::kNone) {
      s.index = int_of(chunk_index, "a MetadataIndex's index");
    }
    check(info->kind == Kind::kObject && info->string == kStorageInfo && info->state != nullptr,
          "a storage_data value must be a _StorageInfo");
    s.relative_path = string_of(field(info->state, "relative_path"), "relative_path");
    s.offset = int_of(field(info->state, "offset"), "a _StorageInfo's offset");
    s.length = int_of(field(info->state, "length"), "a _StorageInfo's length");
    check(s.offset >= 0 && s.length >= 0, "the record of '", s.fqn,
          "' has a negative offset or length");
    check(!s.relative_path.empty() && s.relative_path.find('/') == std::string::npos &&
              s.relative_path[0] != '.',
          "the record of '", s.fqn, "' names the file '", s.relative_path,
          "', which is not a file of the folder");
    const PickleValuePtr transforms = info->state->get("transform_descriptors");
    check(transforms == nullptr || transforms->kind == Kind::kNone ||
              ((transforms->kind == Kind::kList || transforms->kind == Kind::kTuple) &&
               transforms->items.empty()),
          "the record of '", s.fqn,
          "' is stored through transforms (e.g. compression), which fsdp does not read");
    return s;
  }

  const std::string& name_;
};

// ---- Writing.

PickleValuePtr torch_size(const std::vector<int64_t>& dims) {
  std::vector<PickleValuePtr> items;
  for (int64_t d : dims) items.push_back(P::integer_value(d));
  return P::object(kSize, {P::tuple(std::move(items))});
}

PickleValuePtr fields(std::vector<std::pair<const char*, PickleValuePtr>> named) {
  std::vector<PickleValuePtr> items;
  for (auto& [key, value] : named) {
    items.push_back(P::str(key));
    items.push_back(std::move(value));
  }
  return P::dict(std::move(items));
}

PickleValuePtr dataclass(const char* cls, PickleValuePtr state) {
  return P::object(absl::StrCat(kModule, cls), {}, std::move(state));
}

const char* dtype_name(c10::ScalarType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  TORCH_CHECK(false, "serialize_dcp_metadata: dtype ", c10::toString(dtype),
              " has no Distributed Checkpoint name here; convert the tensor to a supported "
              "dtype (float32, bfloat16, int64, ...)");
}

PickleValuePtr entry_value(const DcpEntryMetadata& e) {
  if (!e.is_tensor) return P::object(absl::StrCat(kModule, "BytesStorageMetadata"), {});
  PickleValuePtr properties = dataclass(
      "TensorProperties",
      P::tuple({P::global(dtype_name(e.dtype)), P::object(kGetLayout, {P::str("torch.strided")}),
                P::boolean(e.requires_grad), P::object(kMemFormat, {P::integer_value(0)}),
                P::boolean(false)}));
  std::vector<PickleValuePtr> chunks;
  for (const DcpChunk& c : e.chunks) {
    chunks.push_back(dataclass("ChunkStorageMetadata", fields({{"offsets", torch_size(c.offsets)},
                                                               {"sizes", torch_size(c.sizes)}})));
  }
  return dataclass("TensorStorageMetadata", fields({{"properties", properties},
                                                    {"size", torch_size(e.size)},
                                                    {"chunks", P::list(std::move(chunks))}}));
}

PickleValuePtr path_value(const DcpEntryMetadata& e) {
  std::vector<PickleValuePtr> items;
  for (const DcpPathElement& p : e.path) {
    items.push_back(std::holds_alternative<std::string>(p)
                        ? P::str(std::get<std::string>(p))
                        : P::integer_value(std::get<int64_t>(p)));
  }
  return P::tuple(std::move(items));
}

PickleValuePtr storage_key(const DcpStorageInfo& s) {
  return dataclass("MetadataIndex",
                   fields({{"fqn", P::str(s.fqn)},
                           {"offset", s.chunk_offsets ? torch_size(*s.chunk_offsets) : P::none()},
                           {"index", s.index ? P::integer_value(*s.index) : P::none()}}));
}

PickleValuePtr storage_value(const DcpStorageInfo& s) {
  return P::object(kStorageInfo, {},
                   fields({{"relative_path", P::str(s.relative_path)},
                           {"offset", P::integer_value(s.offset)},
                           {"length", P::integer_value(s.length)}}));
}

}  // namespace

std::string dcp_data_file(int rank) { return absl::StrCat("__", rank, "_0.distcp"); }

const DcpEntryMetadata* DcpMetadata::find(std::string_view fqn) const {
  for (const DcpEntryMetadata& e : entries) {
    if (e.fqn == fqn) return &e;
  }
  return nullptr;
}

const DcpStorageInfo* DcpMetadata::find_storage(
    std::string_view fqn, const std::optional<std::vector<int64_t>>& chunk_offsets) const {
  for (const DcpStorageInfo& s : storage) {
    if (s.fqn == fqn && s.chunk_offsets == chunk_offsets) return &s;
  }
  return nullptr;
}

DcpMetadata parse_dcp_metadata(std::string_view bytes, const std::string& name) {
  PickleHooks hooks;
  hooks.allow_global = allowed;
  return Parser(name).parse(read_pickle(bytes, hooks, name));
}

DcpMetadata read_dcp_metadata(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kDcpMetadataFile);
  std::string bytes;
  try {
    bytes = read_regular_file(path, "Distributed Checkpoint metadata", kMaxMetadataBytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "'", dir,
                "' is not a complete Distributed Checkpoint: ", e.what_without_backtrace());
  }
  return parse_dcp_metadata(bytes, path);
}

std::string serialize_dcp_metadata(const DcpMetadata& md) {
  std::vector<PickleValuePtr> entries, planner, storage;
  for (const DcpEntryMetadata& e : md.entries) {
    entries.push_back(P::str(e.fqn));
    entries.push_back(entry_value(e));
    planner.push_back(P::str(e.fqn));
    planner.push_back(path_value(e));
  }
  for (const DcpStorageInfo& s : md.storage) {
    storage.push_back(storage_key(s));
    storage.push_back(storage_value(s));
  }
  const PickleValuePtr metadata =
      dataclass("Metadata", fields({{"state_dict_metadata", P::dict(std::move(entries))},
                                    {"planner_data", P::dict(std::move(planner))},
                                    {"storage_data", P::dict(std::move(storage))},
                                    {"storage_meta", P::none()},
                                    {"version", P::str(md.version)}}));
  return write_pickle(*metadata);
}

std::string read_dcp_entry(const std::string& dir, const DcpStorageInfo& info) {
  const std::string path = absl::StrCat(dir, "/", info.relative_path);
  std::optional<ReadableFile> file;
  try {
    file = ReadableFile::open(path, "Distributed Checkpoint data");
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "'", dir, "' is not a complete Distributed Checkpoint: its .metadata says '",
                info.fqn, "' is in '", info.relative_path, "': ", e.what_without_backtrace());
  }
  TORCH_CHECK(info.offset <= file->size() && info.length <= file->size() - info.offset, "'", path,
              "' has ", file->size(), " bytes, but .metadata puts '", info.fqn, "' at bytes [",
              info.offset, ", ", info.offset + info.length,
              "): the file is truncated or belongs to another checkpoint");
  return file->read(info.offset, info.length);
}

}  // namespace fsdp
