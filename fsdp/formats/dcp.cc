#include "fsdp/formats/dcp.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <c10/util/Exception.h>

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
    for (const auto& [fqn, value] :
         items(field(state, "state_dict_metadata"), "state_dict_metadata")) {
      md.entries.push_back(entry(string_of(fqn, "a state_dict_metadata key"), value));
    }
    const PickleValuePtr planner = state->get("planner_data");
    if (planner != nullptr && planner->kind == Kind::kDict) {
      for (const auto& [fqn, path] : items(planner, "planner_data")) {
        set_path(md, string_of(fqn, "a planner_data key"), path);
      }
    }
    for (const auto& [index, info] : items(field(state, "storage_data"), "storage_data")) {
      md.storage.push_back(storage(index, info));
      check(md.find(md.storage.back().fqn) != nullptr, "storage_data has a record for '",
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
    return e;
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
  void set_path(DcpMetadata& md, const std::string& fqn, const PickleValuePtr& path) {
    for (DcpEntryMetadata& e : md.entries) {
      if (e.fqn != fqn) continue;
      check(path->kind == Kind::kTuple || path->kind == Kind::kList, "the planner_data of '", fqn,
            "' must be a tuple");
      e.path.clear();
      for (const PickleValuePtr& p : path->items) {
        check(p->kind == Kind::kString || p->kind == Kind::kInt, "the planner_data of '", fqn,
              "' must hold strs and ints");
        if (p->kind == Kind::kString) {
          e.path.emplace_back(p->string);
        } else {
          e.path.emplace_back(p->integer);
        }
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

std::string errno_text() { return std::strerror(errno); }

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
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "'", dir, "' is not a complete Distributed Checkpoint: it has no ",
              kDcpMetadataFile, " (", errno_text(), ")");
  std::stringstream bytes;
  bytes << in.rdbuf();
  return parse_dcp_metadata(bytes.str(), path);
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
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "'", dir, "' is not a complete Distributed Checkpoint: its .metadata says '",
              info.fqn, "' is in '", info.relative_path, "', which cannot be opened (",
              errno_text(), ")");
  struct stat st = {};
  const bool statted = ::fstat(fd, &st) == 0;
  const int64_t size = statted ? static_cast<int64_t>(st.st_size) : -1;
  std::string bytes;
  bool ok = statted && info.offset <= size && info.length <= size - info.offset;
  if (ok) {
    bytes.resize(static_cast<size_t>(info.length));
    size_t done = 0;
    while (ok && done < bytes.size()) {
      const ssize_t n = ::pread(fd, bytes.data() + done, bytes.size() - done,
                                static_cast<off_t>(info.offset) + static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      ok = n > 0;
      if (ok) done += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  TORCH_CHECK(ok, "'", path, "' has ", size, " bytes, but .metadata puts '", info.fqn,
              "' at bytes [", info.offset, ", ", info.offset + info.length,
              "): the file is truncated or belongs to another checkpoint");
  return bytes;
}

}  // namespace fsdp
