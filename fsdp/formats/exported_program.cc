#include "fsdp/formats/exported_program.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp/formats/files.h"
#include "fsdp/formats/json.h"
#include "fsdp/formats/torch_zip.h"

namespace fsdp {
namespace {

using Json = nlohmann::json;

constexpr char kModelJson[] = "models/model.json";
constexpr char kWeightsConfig[] = "data/weights/model_weights_config.json";
constexpr char kWeightsDir[] = "data/weights/";
constexpr char kExpected[] = "expected an archive written by torch.export.save(ep, path)";

// Member `key` of the object `obj` (at `path` in file `where`), of the JSON kind `is`.
const Json& member(const Json& obj, const char* key, const std::string& path,
                   const std::string& where, bool (Json::*is)() const noexcept, const char* kind) {
  TORCH_CHECK(obj.is_object(), where, ": ", path, " is not a JSON object; ", kExpected);
  const auto it = obj.find(key);
  TORCH_CHECK(it != obj.end(), where, ": ", path, " has no \"", key, "\"; ", kExpected);
  TORCH_CHECK(((*it).*is)(), where, ": ", path, ".", key, " is not ", kind, "; ", kExpected);
  return *it;
}

const Json& object_at(const Json& obj, const char* key, const std::string& path,
                      const std::string& where) {
  return member(obj, key, path, where, &Json::is_object, "an object");
}
const Json& array_at(const Json& obj, const char* key, const std::string& path,
                     const std::string& where) {
  return member(obj, key, path, where, &Json::is_array, "an array");
}
const std::string& string_at(const Json& obj, const char* key, const std::string& path,
                             const std::string& where) {
  return member(obj, key, path, where, &Json::is_string, "a string").get_ref<const std::string&>();
}
int64_t int_at(const Json& obj, const char* key, const std::string& path,
               const std::string& where) {
  const Json& value = member(obj, key, path, where, &Json::is_number_integer, "an integer");
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    TORCH_CHECK(u <= static_cast<uint64_t>(INT64_MAX), where, ": ", path, ".", key, " = ", u,
                " is out of range; ", kExpected);
    return static_cast<int64_t>(u);
  }
  return value.get<int64_t>();
}

Json parse_json(std::string_view text, const std::string& where, const char* what) {
  Json json = parse_untrusted_json(text, absl::StrCat(where, ": ", what), kExpected);
  TORCH_CHECK(json.is_object(), where, ": ", what, " is not a JSON object; ", kExpected);
  return json;
}

// A parameter's or buffer's shape, dtype and flags from its graph.tensor_values entry.
void read_tensor_meta(const Json& meta, const std::string& path, const std::string& where,
                      ExportedTensorInfo& out) {
  out.dtype = exported_program_dtype(int_at(meta, "dtype", path, where));
  const Json& sizes = array_at(meta, "sizes", path, where);
  int64_t numel = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    const std::string dim = absl::StrCat(path, ".sizes[", d, "]");
    TORCH_CHECK(sizes[d].is_object() && sizes[d].contains("as_int"), where, ": ", dim, " of ",
                out.fqn, " is symbolic or malformed (", sizes[d].dump(),
                "); parameters and buffers must have static sizes ({\"as_int\": n})");
    const int64_t size = int_at(sizes[d], "as_int", dim, where);
    TORCH_CHECK(size >= 0, where, ": ", dim, " of ", out.fqn, " is negative (", size, ")");
    TORCH_CHECK(size == 0 || numel <= (int64_t{1} << 50) / size, where, ": ", out.fqn,
                " has more than 2^50 elements; ", kExpected);
    numel *= size;
    out.sizes.push_back(size);
  }
  const auto offset = meta.find("storage_offset");
  if (offset != meta.end() && offset->is_object() && offset->contains("as_int")) {
    out.storage_offset = int_at(*offset, "as_int", path + ".storage_offset", where);
  }
  const auto grad = meta.find("requires_grad");
  if (grad != meta.end() && grad->is_boolean()) out.requires_grad = grad->get<bool>();
  const auto device = meta.find("device");
  if (device != meta.end() && device->is_object()) {
    const auto type = device->find("type");
    if (type != device->end() && type->is_string()) out.device = type->get<std::string>();
  }
}

// "key,fqn,class" items joined by ';' (serialize.py's nn_module_stack); commas inside
// brackets or parentheses belong to the key.
// Returns the innermost module's FQN.
std::string read_module_stack(const std::string& stack, const std::string& where,
                              absl::flat_hash_map<std::string, std::string>& class_of,
                              std::vector<std::string>& order) {
  std::string innermost;
  for (absl::string_view item : absl::StrSplit(stack, ';')) {
    std::vector<absl::string_view> parts;
    int depth = 0;
    size_t start = 0;
    for (size_t i = 0; i < item.size(); ++i) {
      const char c = item[i];
      if (c == '[' || c == '(') ++depth;
      if (c == ']' || c == ')') --depth;
      if (c == ',' && depth == 0) {
        parts.push_back(item.substr(start, i - start));
        start = i + 1;
      }
    }
    parts.push_back(item.substr(start));
    TORCH_CHECK(parts.size() == 3, where, ": nn_module_stack entry '", item,
                "' is not of the form key,fqn,class; ", kExpected);
    // A module called more than once may carry an "@N" suffix on its path.
    std::string fqn(parts[1].substr(0, parts[1].find('@')));
    innermost = fqn;
    if (class_of.emplace(fqn, std::string(parts[2])).second) order.push_back(std::move(fqn));
  }
  return innermost;
}

// Which graph values the nodes read: all of them, and those read by each module's own
// nodes (its innermost module on the stack).
struct GraphReads {
  absl::flat_hash_set<std::string> all;
  absl::flat_hash_map<std::string, std::vector<std::string>> by_module;
};

// Tensor names under `json` ({"as_tensor": {"name": n}}, {"as_tensors": [{"name": n}]}),
// to a bounded depth (node arguments nest a few levels).
void tensor_names(const Json& json, int depth, std::vector<std::string>& out) {
  if (depth > 16) return;
  auto add = [&](const Json& ref) {
    if (ref.is_object() && ref.contains("name") && ref["name"].is_string()) {
      out.push_back(ref["name"].get<std::string>());
    }
  };
  if (json.is_object()) {
    for (const auto& [key, value] : json.items()) {
      if (key == "as_tensor") add(value);
      if (key == "as_tensors" && value.is_array()) {
        for (const Json& ref : value) add(ref);
      }
      tensor_names(value, depth + 1, out);
    }
  } else if (json.is_array()) {
    for (const Json& value : json) tensor_names(value, depth + 1, out);
  }
}

// Adds every FQN prefix of `fqn` (its ancestors) and `fqn` itself to `modules`.
void add_with_ancestors(const std::string& fqn, absl::flat_hash_set<std::string>& seen,
                        std::vector<std::string>& modules) {
  size_t dot = 0;
  while ((dot = fqn.find('.', dot)) != std::string::npos) {
    std::string prefix = fqn.substr(0, dot++);
    if (seen.insert(prefix).second) modules.push_back(std::move(prefix));
  }
  if (seen.insert(fqn).second) modules.push_back(fqn);
}

std::string module_of(const std::string& tensor_fqn) {
  const size_t dot = tensor_fqn.rfind('.');
  return dot == std::string::npos ? "" : tensor_fqn.substr(0, dot);
}

// Parameters and buffers from the signature's input specs, with their tensor values.
void read_inputs(const Json& graph_module, const std::string& where, ExportedProgramInfo& out) {
  const Json& signature = object_at(graph_module, "signature", "graph_module", where);
  const Json& specs = array_at(signature, "input_specs", "graph_module.signature", where);
  const Json& graph = object_at(graph_module, "graph", "graph_module", where);
  const Json& values = object_at(graph, "tensor_values", "graph_module.graph", where);
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string path = absl::StrCat("input_specs[", i, "]");
    TORCH_CHECK(specs[i].is_object(), where, ": ", path, " is not an object; ", kExpected);
    const bool is_param = specs[i].contains("parameter");
    if (!is_param && !specs[i].contains("buffer")) continue;  // user inputs, constants
    const Json& spec = object_at(specs[i], is_param ? "parameter" : "buffer", path, where);
    ExportedTensorInfo tensor;
    tensor.fqn = string_at(spec, is_param ? "parameter_name" : "buffer_name", path, where);
    TORCH_CHECK(!tensor.fqn.empty(), where, ": ", path, " has an empty name; ", kExpected);
    const std::string& arg = string_at(object_at(spec, "arg", path, where), "name", path, where);
    const auto value = values.find(arg);
    TORCH_CHECK(value != values.end(), where, ": ", tensor.fqn, " (graph input '", arg,
                "') has no entry in graph.tensor_values; ", kExpected);
    tensor.requires_grad = is_param;
    tensor.graph_input = arg;
    read_tensor_meta(*value, absl::StrCat("tensor_values[\"", arg, "\"]"), where, tensor);
    if (!is_param) {
      const auto persistent = spec.find("persistent");
      tensor.persistent =
          persistent == spec.end() || !persistent->is_boolean() || persistent->get<bool>();
    }
    (is_param ? out.parameters : out.buffers).push_back(std::move(tensor));
  }
}

// Modules: the call graph's FQNs, then those of called modules, then the owners of
// parameters and buffers, each after its ancestors; classes from the nodes' stacks.
GraphReads read_modules(const Json& graph_module, const std::string& where,
                        ExportedProgramInfo& out) {
  GraphReads reads;
  absl::flat_hash_map<std::string, std::string> class_of;
  std::vector<std::string> called;
  const Json& nodes = array_at(object_at(graph_module, "graph", "graph_module", where), "nodes",
                               "graph_module.graph", where);
  for (const Json& node : nodes) {
    if (!node.is_object()) continue;
    std::vector<std::string> inputs;
    if (const auto in = node.find("inputs"); in != node.end()) tensor_names(*in, 0, inputs);
    reads.all.insert(inputs.begin(), inputs.end());
    const auto metadata = node.find("metadata");
    if (metadata == node.end() || !metadata->is_object()) continue;
    const auto stack = metadata->find("nn_module_stack");
    if (stack == metadata->end() || !stack->is_string()) continue;
    std::vector<std::string>& mine = reads.by_module[read_module_stack(
        stack->get_ref<const std::string&>(), where, class_of, called)];
    mine.insert(mine.end(), inputs.begin(), inputs.end());
  }
  std::vector<std::string> names;
  absl::flat_hash_set<std::string> seen = {""};
  names.push_back("");
  const auto call_graph = graph_module.find("module_call_graph");
  if (call_graph != graph_module.end() && call_graph->is_array()) {
    for (const Json& entry : *call_graph) {
      if (entry.is_object() && entry.contains("fqn") && entry["fqn"].is_string()) {
        add_with_ancestors(entry["fqn"].get<std::string>(), seen, names);
      }
    }
  }
  for (const std::string& fqn : called) add_with_ancestors(fqn, seen, names);
  for (const auto* list : {&out.parameters, &out.buffers}) {
    for (const ExportedTensorInfo& t : *list) add_with_ancestors(module_of(t.fqn), seen, names);
  }
  for (std::string& fqn : names) {
    const auto it = class_of.find(fqn);
    out.modules.push_back({std::move(fqn), it == class_of.end() ? "" : it->second});
  }
  return reads;
}

// Note [Ties in .pt2 archives]
// torch.export.save stores each storage once: names of one weight share a weight file
// (with the same offset and shape). On the meta device every storage is at address 0, so
// every parameter shares weight_0 and the files say nothing. The graph does: export
// reads a tied weight through one placeholder only, so a tied name's own placeholder is
// never read, and the module that owns it reads its partner's placeholder instead
// (tok.weight unused, tok's embedding reads p_head_weight). A parameter whose placeholder
// no node reads is tied to the first parameter of another module, of the same shape and
// dtype, that its own module's nodes read; an unread parameter of a module never called
// stays untied. The first name of a weight, in input_specs order, is the one the others
// are tied to.
void resolve_ties(const GraphReads& reads, ExportedProgramInfo& out) {
  std::vector<ExportedTensorInfo>& params = out.parameters;
  std::vector<int> root(params.size());
  absl::flat_hash_map<std::string, int> by_input;
  absl::flat_hash_map<std::string, int> by_weight;
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    root[i] = i;
    by_input.emplace(params[i].graph_input, i);
    if (params[i].device == "meta" || params[i].weight_file.empty()) continue;
    const std::string key =
        absl::StrCat(params[i].weight_file, "@", params[i].storage_offset, ":",
                     absl::StrJoin(params[i].sizes, "x"), ":", c10::toString(params[i].dtype));
    root[i] = by_weight.emplace(key, i).first->second;
  }
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    if (params[i].device != "meta" || reads.all.contains(params[i].graph_input)) continue;
    const std::string owner = module_of(params[i].fqn);
    const auto read = reads.by_module.find(owner);
    if (read == reads.by_module.end()) continue;
    for (const std::string& input : read->second) {
      const auto it = by_input.find(input);
      if (it == by_input.end()) continue;
      const ExportedTensorInfo& other = params[it->second];
      if (module_of(other.fqn) == owner || other.sizes != params[i].sizes ||
          other.dtype != params[i].dtype) {
        continue;
      }
      root[i] = root[it->second];
      break;
    }
  }
  // The first name of each group is the one the others are tied to.
  absl::flat_hash_map<int, int> first_of_root;
  for (int i = 0; i < static_cast<int>(params.size()); ++i) {
    int r = root[i];
    while (root[r] != r) r = root[r];
    const int first = first_of_root.emplace(r, i).first->second;
    if (first != i) params[i].tied_to = params[first].fqn;
  }
}

// model_weights_config.json: the stored weight of every parameter (required) and buffer.
void read_weights_config(const Json& config, const std::string& where, ExportedProgramInfo& out) {
  const Json& entries = object_at(config, "config", "model_weights_config.json", where);
  for (auto* list : {&out.parameters, &out.buffers}) {
    for (ExportedTensorInfo& tensor : *list) {
      const auto it = entries.find(tensor.fqn);
      if (it == entries.end()) {
        TORCH_CHECK(list == &out.buffers, where, ": parameter ", tensor.fqn,
                    " has no entry in data/weights/model_weights_config.json (a missing "
                    "weight); ",
                    kExpected);
        continue;
      }
      tensor.weight_file =
          string_at(*it, "path_name", absl::StrCat("config[\"", tensor.fqn, "\"]"), where);
      TORCH_CHECK(!tensor.weight_file.empty() &&
                      tensor.weight_file.find('/') == std::string::npos &&
                      tensor.weight_file != "." && tensor.weight_file != "..",
                  where, ": weight of ", tensor.fqn, " has an invalid path_name '",
                  tensor.weight_file, "'; ", kExpected);
      tensor.stored_bytes = -1;
      const auto pickled = it->find("use_pickle");
      tensor.pickled = pickled != it->end() && pickled->is_boolean() && pickled->get<bool>();
    }
  }
}

}  // namespace

int64_t ExportedTensorInfo::numel() const {
  int64_t n = 1;
  for (const int64_t size : sizes) n *= size;
  return n;
}

c10::ScalarType exported_program_dtype(int64_t schema_dtype) {
  using c10::ScalarType;
  switch (schema_dtype) {
    case 1:
      return ScalarType::Byte;
    case 2:
      return ScalarType::Char;
    case 3:
      return ScalarType::Short;
    case 4:
      return ScalarType::Int;
    case 5:
      return ScalarType::Long;
    case 6:
      return ScalarType::Half;
    case 7:
      return ScalarType::Float;
    case 8:
      return ScalarType::Double;
    case 9:
      return ScalarType::ComplexHalf;
    case 10:
      return ScalarType::ComplexFloat;
    case 11:
      return ScalarType::ComplexDouble;
    case 12:
      return ScalarType::Bool;
    case 13:
      return ScalarType::BFloat16;
    case 28:
      return ScalarType::UInt16;
    case 29:
      return ScalarType::Float8_e4m3fn;
    case 30:
      return ScalarType::Float8_e5m2;
    case 31:
      return ScalarType::Float8_e4m3fnuz;
    case 32:
      return ScalarType::Float8_e5m2fnuz;
    default:
      break;
  }
  TORCH_CHECK(false, "unknown export-schema dtype number ", schema_dtype,
              ": expected 1-13 or 28-32 (torch/_export/serde/schema.py ScalarType)");
}

ExportedProgramInfo parse_exported_program(std::string_view model_json,
                                           std::string_view weights_config_json,
                                           const std::string& where) {
  const Json model = parse_json(model_json, where, kModelJson);
  ExportedProgramInfo out;
  const Json& version = object_at(model, "schema_version", "model.json", where);
  out.schema_major = static_cast<int>(
      std::clamp<int64_t>(int_at(version, "major", "schema_version", where), -1, 1 << 30));
  out.schema_minor = static_cast<int>(
      std::clamp<int64_t>(int_at(version, "minor", "schema_version", where), -1, 1 << 30));
  TORCH_CHECK(out.schema_major == kExportSchemaMajorVersion, where,
              ": unsupported export schema version ", out.schema_major, ".", out.schema_minor,
              ": this reader understands version ", kExportSchemaMajorVersion,
              ".x (torch 2.11's torch.export.save); re-export the model with torch 2.11");
  const auto torch_version = model.find("torch_version");
  if (torch_version != model.end() && torch_version->is_string()) {
    out.torch_version = torch_version->get<std::string>();
  }
  const Json& graph_module = object_at(model, "graph_module", "model.json", where);
  read_inputs(graph_module, where, out);
  const GraphReads reads = read_modules(graph_module, where, out);
  read_weights_config(parse_json(weights_config_json, where, kWeightsConfig), where, out);
  resolve_ties(reads, out);
  out.meta = !out.parameters.empty() &&
             std::all_of(out.parameters.begin(), out.parameters.end(),
                         [](const ExportedTensorInfo& t) { return t.device == "meta"; });
  return out;
}

bool is_exported_program_records(const std::vector<std::string>& records) {
  return std::find(records.begin(), records.end(), "archive_format") != records.end();
}

ExportedProgramInfo read_exported_program(const std::string& path) {
  const ReadableFile file = ReadableFile::open(path, ".pt2 archive");
  std::optional<TorchZipArchive> archive;
  std::vector<std::string> records;
  try {
    archive = TorchZipArchive::open_file(file);
    records = archive->reader().getAllRecords();
  } catch (const std::exception&) {
    TORCH_CHECK(false, "'", path, "' is not a readable zip archive (missing, truncated or ",
                "damaged: its directory of files cannot be read); ", kExpected);
  }
  TORCH_CHECK(is_exported_program_records(records), "'", path,
              "' is a zip archive but not a .pt2 archive (no archive_format record); ", kExpected);
  const std::set<std::string> names(records.begin(), records.end());
  for (const char* required : {kModelJson, kWeightsConfig}) {
    TORCH_CHECK(names.count(required) > 0, "'", path, "' is a .pt2 archive without ", required,
                " (damaged or not written by torch.export.save); ", kExpected);
  }
  auto text = [&](const char* name) {
    try {
      return archive->read(name);
    } catch (const std::exception&) {
      TORCH_CHECK(false, "'", path, "': ", name, " cannot be read (a damaged archive); ",
                  kExpected);
    }
  };
  ExportedProgramInfo info =
      parse_exported_program(text(kModelJson), text(kWeightsConfig), absl::StrCat("'", path, "'"));
  for (auto* list : {&info.parameters, &info.buffers}) {
    for (ExportedTensorInfo& tensor : *list) {
      if (tensor.weight_file.empty()) continue;
      const std::string record = kWeightsDir + tensor.weight_file;
      TORCH_CHECK(names.count(record) > 0, "'", path, "': the weight of ", tensor.fqn, " (", record,
                  ") is missing from the archive; ", kExpected);
      tensor.stored_bytes = archive->record_size(record);
      TORCH_CHECK(
          tensor.device == "meta" || tensor.pickled || tensor.stored_bytes >= tensor.nbytes(), "'",
          path, "': the weight of ", tensor.fqn, " (", record, ") holds ", tensor.stored_bytes,
          " bytes, expected at least ", tensor.nbytes(), " (", c10::toString(tensor.dtype), ", ",
          tensor.numel(), " elements); ", kExpected);
    }
  }
  return info;
}

}  // namespace fsdp
