#include "fsdp/formats/safetensors.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp/formats/files.h"
#include "fsdp/formats/json.h"

namespace fsdp {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors holds little-endian bytes; fsdp reads them as they are");

using Json = nlohmann::json;

// The format's own limit on the header (safetensors' MAX_HEADER_SIZE), the shared JSON
// limit.
constexpr uint64_t kMaxHeaderBytes = kMaxJsonBytes;

struct DtypeName {
  const char* name;
  at::ScalarType dtype;
};
constexpr DtypeName kDtypes[] = {
    {"F32", at::kFloat}, {"F64", at::kDouble}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},  {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},   {"BOOL", at::kBool},
};

std::string dtype_list() {
  std::vector<std::string> names;
  for (const DtypeName& d : kDtypes) names.push_back(d.name);
  return absl::StrJoin(names, ", ");
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return "[" + absl::StrJoin(shape, ", ") + "]";
}

// The header length from the first 8 bytes, checked against the file's size.
uint64_t checked_header_length(std::string_view head, uint64_t file_size, const std::string& file) {
  TORCH_CHECK(file_size >= 8, "safetensors file '", file, "' is truncated: it has ", file_size,
              " bytes, fewer than the 8-byte header length every safetensors file starts with");
  TORCH_INTERNAL_ASSERT(head.size() >= 8);
  uint64_t length = 0;
  std::memcpy(&length, head.data(), 8);
  TORCH_CHECK(length <= kMaxHeaderBytes, "safetensors file '", file, "': header length ", length,
              " is larger than the format's limit of ", kMaxHeaderBytes,
              " bytes; the file is not safetensors or is corrupt");
  TORCH_CHECK(length <= file_size - 8, "safetensors file '", file, "': header length ", length,
              " runs past the end of the file (", file_size,
              " bytes): the file is truncated or not safetensors");
  return length;
}

std::string json_type(const Json& value) { return value.type_name(); }

// A non-negative integer, or throws `what` with the value's type.
int64_t non_negative(const Json& value, const std::string& file, const std::string& tensor,
                     const char* field) {
  TORCH_CHECK(
      value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0),
      "safetensors file '", file, "': tensor '", tensor, "': ", field,
      " must hold non-negative integers, found ", value.dump());
  const uint64_t v = value.get<uint64_t>();
  TORCH_CHECK(v <= static_cast<uint64_t>(INT64_MAX), "safetensors file '", file, "': tensor '",
              tensor, "': ", field, " value ", v, " is too large");
  return static_cast<int64_t>(v);
}

SafetensorsTensorInfo parse_tensor(const std::string& name, const Json& entry,
                                   const std::string& file, int64_t* begin, int64_t* end) {
  TORCH_CHECK(entry.is_object(), "safetensors file '", file, "': tensor '", name,
              "' must be an object with dtype, shape and data_offsets, found a JSON ",
              json_type(entry));
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    TORCH_CHECK(entry.contains(field), "safetensors file '", file, "': tensor '", name,
                "' has no '", field, "'; expected dtype, shape and data_offsets");
  }
  SafetensorsTensorInfo info;
  info.name = name;
  const Json& dtype = entry["dtype"];
  TORCH_CHECK(dtype.is_string(), "safetensors file '", file, "': tensor '", name,
              "': dtype must be a string, found ", dtype.dump());
  const std::string dtype_name = dtype.get<std::string>();
  bool known = false;
  for (const DtypeName& d : kDtypes) {
    if (dtype_name == d.name) {
      info.dtype = d.dtype;
      known = true;
    }
  }
  TORCH_CHECK(known, "safetensors file '", file, "': tensor '", name, "' has dtype '", dtype_name,
              "', which fsdp does not read; expected one of ", dtype_list());
  const Json& shape = entry["shape"];
  TORCH_CHECK(shape.is_array(), "safetensors file '", file, "': tensor '", name,
              "': shape must be an array, found ", shape.dump());
  uint64_t numel = 1;
  bool overflow = false;
  for (const Json& dim : shape) {
    info.shape.push_back(non_negative(dim, file, name, "shape"));
    overflow =
        overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(info.shape.back()), &numel);
  }
  const Json& offsets = entry["data_offsets"];
  TORCH_CHECK(offsets.is_array() && offsets.size() == 2, "safetensors file '", file, "': tensor '",
              name, "': data_offsets must be [begin, end], found ", offsets.dump());
  *begin = non_negative(offsets[0], file, name, "data_offsets");
  *end = non_negative(offsets[1], file, name, "data_offsets");
  TORCH_CHECK(*begin <= *end, "safetensors file '", file, "': tensor '", name, "': data_offsets [",
              *begin, ", ", *end, "] end before they begin");
  uint64_t nbytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, c10::elementSize(info.dtype), &nbytes);
  TORCH_CHECK(!overflow && nbytes == static_cast<uint64_t>(*end - *begin), "safetensors file '",
              file, "': tensor '", name, "': shape ", shape_string(info.shape), " of ", dtype_name,
              " needs ", overflow ? std::string("more than 2^64") : std::to_string(nbytes),
              " bytes, but its data_offsets [", *begin, ", ", *end, "] hold ", *end - *begin);
  info.nbytes = *end - *begin;
  return info;
}

std::map<std::string, std::string> parse_metadata(const Json& value, const std::string& file) {
  TORCH_CHECK(value.is_object(), "safetensors file '", file,
              "': __metadata__ must be an object of strings, found a JSON ", json_type(value));
  std::map<std::string, std::string> metadata;
  for (const auto& item : value.items()) {
    TORCH_CHECK(item.value().is_string(), "safetensors file '", file, "': __metadata__ '",
                item.key(), "' must be a string, found ", item.value().dump());
    metadata[item.key()] = item.value().get<std::string>();
  }
  return metadata;
}

// Offsets must tile the data exactly: sorted, each tensor starting where the previous one
// ends, the last ending at the end of the file (safetensors' own validation).
void check_tiling(const std::vector<SafetensorsTensorInfo>& tensors,
                  const std::vector<int64_t>& begins, uint64_t data_bytes,
                  const std::string& file) {
  int64_t expected = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (begins[i] < expected) {
      TORCH_CHECK(false, "safetensors file '", file, "': tensor '", tensors[i].name,
                  "' (data_offsets [", begins[i], ", ", begins[i] + tensors[i].nbytes,
                  "]) overlaps tensor '", tensors[i - 1].name, "' (ending at ", expected,
                  "); expected each tensor to start where the previous one ends");
    }
    TORCH_CHECK(begins[i] == expected, "safetensors file '", file, "': tensor '", tensors[i].name,
                "' starts at byte ", begins[i], " of the data, leaving a gap after ",
                i == 0 ? std::string("the header") : "tensor '" + tensors[i - 1].name + "'",
                " (which ends at ", expected,
                "); expected each tensor to start where the previous one ends");
    expected = begins[i] + tensors[i].nbytes;
  }
  TORCH_CHECK(static_cast<uint64_t>(expected) <= data_bytes, "safetensors file '", file,
              "' is truncated: its tensors need ", expected,
              " bytes after the header, the file has ", data_bytes);
  TORCH_CHECK(static_cast<uint64_t>(expected) == data_bytes, "safetensors file '", file, "' has ",
              data_bytes - expected,
              " bytes after its last tensor's data; expected the tensors to end the file");
}

}  // namespace

at::ScalarType safetensors_dtype(const std::string& name) {
  for (const DtypeName& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  TORCH_CHECK(false, "safetensors dtype '", name, "' is not supported; expected one of ",
              dtype_list());
}

std::string safetensors_dtype_name(at::ScalarType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (dtype == d.dtype) return d.name;
  }
  TORCH_CHECK(false, "dtype ", c10::toString(dtype),
              " has no safetensors name fsdp writes; expected one of ", dtype_list());
}

int64_t SafetensorsTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t SafetensorsTensorSpec::nbytes() const {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsHeader parse_safetensors_header(std::string_view head, uint64_t file_size,
                                           const std::string& file) {
  const uint64_t length = checked_header_length(head, file_size, file);
  TORCH_INTERNAL_ASSERT(head.size() >= 8 + length, "parse_safetensors_header: got ", head.size(),
                        " bytes of a header of ", length);
  const Json json = parse_untrusted_json(head.substr(8, length),
                                         "the header of safetensors file '" + file + "'", "");
  TORCH_CHECK(json.is_object(), "safetensors file '", file, "': the header is a JSON ",
              json_type(json), "; expected an object of tensors");
  SafetensorsHeader header;
  header.data_offset = static_cast<int64_t>(8 + length);
  std::vector<std::pair<int64_t, size_t>> order;
  std::vector<int64_t> begins;
  for (const auto& item : json.items()) {
    if (item.key() == "__metadata__") {
      header.metadata = parse_metadata(item.value(), file);
      continue;
    }
    int64_t begin = 0, end = 0;
    header.tensors.push_back(parse_tensor(item.key(), item.value(), file, &begin, &end));
    begins.push_back(begin);
  }
  // File order: by offset (a zero-byte tensor before a larger one at the same offset).
  std::vector<size_t> index(header.tensors.size());
  for (size_t i = 0; i < index.size(); ++i) index[i] = i;
  std::sort(index.begin(), index.end(), [&](size_t a, size_t b) {
    return std::make_pair(begins[a], header.tensors[a].nbytes) <
           std::make_pair(begins[b], header.tensors[b].nbytes);
  });
  std::vector<SafetensorsTensorInfo> sorted;
  std::vector<int64_t> sorted_begins;
  for (size_t i : index) {
    sorted.push_back(std::move(header.tensors[i]));
    sorted_begins.push_back(begins[i]);
  }
  check_tiling(sorted, sorted_begins, file_size - 8 - length, file);
  for (size_t i = 0; i < sorted.size(); ++i)
    sorted[i].offset = header.data_offset + sorted_begins[i];
  header.tensors = std::move(sorted);
  return header;
}

// ---- SafetensorsFile ----

SafetensorsFile::SafetensorsFile(ReadableFile file, SafetensorsHeader header)
    : file_(std::move(file)), header_(std::move(header)) {
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  ReadableFile file = ReadableFile::open(path, "safetensors file");
  const auto size = static_cast<uint64_t>(file.size());
  std::string head = file.read(0, std::min<int64_t>(file.size(), 8));
  const uint64_t length = checked_header_length(head, size, path);
  head.resize(8 + length);
  file.read_into(head.data() + 8, 8, static_cast<int64_t>(length));
  SafetensorsHeader header = parse_safetensors_header(head, size, path);
  return SafetensorsFile(std::move(file), std::move(header));
}

const SafetensorsTensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& name) const {
  const SafetensorsTensorInfo* info = find(name);
  TORCH_CHECK(info != nullptr, "safetensors file '", path(), "' holds no tensor '", name, "'");
  return *info;
}

void SafetensorsFile::read_range_into(const std::string& name, int64_t begin, int64_t numel,
                                      const at::Tensor& out) const {
  const SafetensorsTensorInfo& t = info(name);
  TORCH_CHECK(begin >= 0 && numel >= 0 && begin <= t.numel() - numel, "safetensors file '", path(),
              "': elements [", begin, ", ", begin + numel, ") are outside tensor '", name, "' (",
              t.numel(), " elements)");
  TORCH_CHECK(out.defined() && out.device().is_cpu() && out.is_contiguous() &&
                  out.scalar_type() == t.dtype && out.numel() == numel,
              "safetensors file '", path(), "': reading tensor '", name,
              "' needs a contiguous CPU tensor of ", c10::toString(t.dtype), " with ", numel,
              " elements to read into, got ",
              out.defined() ? absl::StrCat(c10::toString(out.scalar_type()), " on ",
                                           out.device().str(), " with ", out.numel(), " elements",
                                           out.is_contiguous() ? "" : ", not contiguous")
                            : std::string("an undefined tensor"));
  const auto item = static_cast<int64_t>(c10::elementSize(t.dtype));
  file_.read_into(static_cast<char*>(out.data_ptr()), t.offset + begin * item, numel * item);
}

at::Tensor SafetensorsFile::read_range(const std::string& name, int64_t begin,
                                       int64_t numel) const {
  at::Tensor out = at::empty({numel}, at::TensorOptions().dtype(info(name).dtype));
  read_range_into(name, begin, numel, out);
  return out;
}

at::Tensor SafetensorsFile::read(const std::string& name) const {
  const SafetensorsTensorInfo& t = info(name);
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
  read_range_into(name, 0, t.numel(), out);
  return out;
}

// ---- SafetensorsCheckpoint ----

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::string& path) {
  namespace fs = std::filesystem;
  SafetensorsCheckpoint ckpt;
  ckpt.path_ = path;
  std::error_code ec;
  TORCH_CHECK(fs::exists(path, ec), "safetensors checkpoint '", path,
              "' does not exist; expected a .safetensors file or a folder with ",
              kSafetensorsIndexName, " or ", kSafetensorsSingleName);
  auto add_whole_file = [&](const std::string& file) {
    ckpt.files_.push_back(SafetensorsFile::open(file));
    for (const SafetensorsTensorInfo& t : ckpt.files_.back().header().tensors) {
      ckpt.owner_[t.name] = 0;
    }
  };
  if (!fs::is_directory(path, ec)) {
    add_whole_file(path);
    return ckpt;
  }
  const std::string index_path = (fs::path(path) / kSafetensorsIndexName).string();
  if (!fs::exists(index_path, ec)) {
    const std::string single = (fs::path(path) / kSafetensorsSingleName).string();
    TORCH_CHECK(fs::exists(single, ec), "folder '", path, "' holds neither ", kSafetensorsIndexName,
                " nor ", kSafetensorsSingleName,
                "; expected a Hugging Face model folder (save_pretrained)");
    add_whole_file(single);
    return ckpt;
  }
  const Json index = read_json_file(index_path, "safetensors index", "");
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
              "index '", index_path,
              "' has no \"weight_map\" object; expected {\"metadata\": {...}, \"weight_map\": "
              "{tensor: file}}");
  std::map<std::string, size_t> file_position;
  for (const auto& item : index["weight_map"].items()) {
    TORCH_CHECK(item.value().is_string(), "index '", index_path, "': tensor '", item.key(),
                "' maps to ", item.value().dump(), "; expected a file name");
    const std::string name = item.value().get<std::string>();
    auto it = file_position.find(name);
    if (it == file_position.end()) {
      const std::string file = (fs::path(path) / name).string();
      TORCH_CHECK(name.find('/') == std::string::npos && name != "..", "index '", index_path,
                  "' names file '", name, "' for tensor '", item.key(),
                  "', a path that leaves folder '", path,
                  "' or enters another; expected the name of a file inside the folder, as "
                  "save_pretrained writes");
      TORCH_CHECK(fs::exists(file, ec), "index '", index_path, "' names file '", name,
                  "' for tensor '", item.key(), "', but '", file,
                  "' does not exist; expected every file of the index in '", path, "'");
      ckpt.files_.push_back(SafetensorsFile::open(file));
      it = file_position.emplace(name, ckpt.files_.size() - 1).first;
    }
    TORCH_CHECK(ckpt.files_[it->second].find(item.key()) != nullptr, "index '", index_path,
                "' puts tensor '", item.key(), "' in '", ckpt.files_[it->second].path(),
                "', which holds no such tensor");
    ckpt.owner_[item.key()] = it->second;
  }
  return ckpt;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> names;
  for (const auto& item : owner_) names.push_back(item.first);
  return names;
}

bool SafetensorsCheckpoint::contains(const std::string& name) const {
  return owner_.count(name) > 0;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto it = owner_.find(name);
  TORCH_CHECK(it != owner_.end(), "safetensors checkpoint '", path_, "' holds no tensor '", name,
              "'");
  return files_[it->second];
}

// ---- Writers ----

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsTensorSpec> specs,
                                     std::map<std::string, std::string> metadata)
    : path_(std::move(path)), specs_(std::move(specs)) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  std::set<std::string> seen;
  for (const SafetensorsTensorSpec& spec : specs_) {
    TORCH_CHECK(seen.insert(spec.name).second, "safetensors file '", path_, "': tensor '",
                spec.name, "' is listed twice; expected each name once");
    TORCH_CHECK(spec.name != "__metadata__", "safetensors file '", path_,
                "': '__metadata__' is reserved and cannot name a tensor");
    const int64_t nbytes = spec.nbytes();
    header[spec.name] = {{"dtype", safetensors_dtype_name(spec.dtype)},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  // Pad with spaces so that the data starts 8-byte aligned (as safetensors writes).
  text.append((8 - text.size() % 8) % 8, ' ');
  file_ = std::make_unique<AtomicFile>(path_);
  const uint64_t length = text.size();
  file_->append(std::string_view(reinterpret_cast<const char*>(&length), 8));
  file_->append(text);
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const std::string& name, const at::Tensor& tensor) {
  TORCH_CHECK(file_ != nullptr, "safetensors file '", path_, "' is already committed");
  TORCH_CHECK(next_ < specs_.size(), "safetensors file '", path_, "': tensor '", name,
              "' is one more than the ", specs_.size(), " listed");
  const SafetensorsTensorSpec& spec = specs_[next_];
  TORCH_CHECK(name == spec.name, "safetensors file '", path_, "': expected tensor '", spec.name,
              "' next, got '", name, "'");
  TORCH_CHECK(tensor.scalar_type() == spec.dtype && tensor.sizes() == spec.shape,
              "safetensors file '", path_, "': tensor '", name, "' was listed as ",
              c10::toString(spec.dtype), " ", shape_string(spec.shape), ", got ",
              c10::toString(tensor.scalar_type()), " ", shape_string(tensor.sizes().vec()));
  const at::Tensor data = tensor.detach().to(at::kCPU).contiguous();
  file_->append(std::string_view(static_cast<const char*>(data.data_ptr()),
                                 static_cast<size_t>(data.nbytes())));
  ++next_;
}

void SafetensorsWriter::commit() {
  TORCH_CHECK(file_ != nullptr, "safetensors file '", path_, "' is already committed");
  TORCH_CHECK(next_ == specs_.size(), "safetensors file '", path_, "': ", next_, " of ",
              specs_.size(), " tensors written; expected all before commit()");
  std::unique_ptr<AtomicFile> file = std::move(file_);
  file->commit();
}

void save_safetensors_file(const std::string& path,
                           const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                           std::map<std::string, std::string> metadata) {
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& [name, tensor] : tensors) {
    specs.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  }
  SafetensorsWriter writer(path, std::move(specs), std::move(metadata));
  for (const auto& [name, tensor] : tensors) writer.write(name, tensor);
  writer.commit();
}

std::vector<std::vector<size_t>> plan_safetensors_shards(
    const std::vector<SafetensorsTensorSpec>& specs, int64_t max_shard_size) {
  TORCH_CHECK(max_shard_size > 0, "max_shard_size must be positive, got ", max_shard_size);
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  int64_t current_size = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t size = specs[i].nbytes();
    if (current_size + size > max_shard_size && !current.empty()) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += size;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));
  return shards;
}

std::string safetensors_shard_name(size_t k, size_t n) {
  if (n == 1) return kSafetensorsSingleName;
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return name;
}

SafetensorsFolderWriter::SafetensorsFolderWriter(std::string dir,
                                                 std::vector<SafetensorsTensorSpec> specs,
                                                 const SafetensorsWriteOptions& options)
    : dir_(std::move(dir)), specs_(std::move(specs)), options_(options) {
  plan_ = plan_safetensors_shards(specs_, options_.max_shard_size());
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  TORCH_CHECK(!ec, "cannot create folder '", dir_, "': ", ec.message());
  for (size_t k = 0; k < plan_.size(); ++k)
    file_names_.push_back(safetensors_shard_name(k, plan_.size()));
  open_file(0);
}

SafetensorsFolderWriter::~SafetensorsFolderWriter() = default;

void SafetensorsFolderWriter::open_file(size_t file) {
  std::vector<SafetensorsTensorSpec> specs;
  for (size_t i : plan_[file]) specs.push_back(specs_[i]);
  file_ = file;
  written_in_file_ = 0;
  writer_ = std::make_unique<SafetensorsWriter>(
      (std::filesystem::path(dir_) / file_names_[file]).string(), std::move(specs),
      options_.metadata());
}

void SafetensorsFolderWriter::write(const std::string& name, const at::Tensor& tensor) {
  TORCH_CHECK(writer_ != nullptr, "safetensors folder '", dir_, "' is already committed");
  while (written_in_file_ == plan_[file_].size() && file_ + 1 < plan_.size()) {
    writer_->commit();
    open_file(file_ + 1);
  }
  writer_->write(name, tensor);
  ++written_in_file_;
}

std::vector<std::string> SafetensorsFolderWriter::commit() {
  TORCH_CHECK(writer_ != nullptr, "safetensors folder '", dir_, "' is already committed");
  while (written_in_file_ == plan_[file_].size() && file_ + 1 < plan_.size()) {
    writer_->commit();
    open_file(file_ + 1);
  }
  writer_->commit();
  writer_.reset();
  if (plan_.size() > 1) {
    Json weight_map = Json::object();
    int64_t total = 0;
    for (size_t k = 0; k < plan_.size(); ++k) {
      for (size_t i : plan_[k]) {
        weight_map[specs_[i].name] = file_names_[k];
        total += specs_[i].nbytes();
      }
    }
    const Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomically((std::filesystem::path(dir_) / kSafetensorsIndexName).string(),
                          index.dump(2) + "\n");
  }
  return file_names_;
}

}  // namespace fsdp
