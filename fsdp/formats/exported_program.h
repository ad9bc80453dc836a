// What a torch.export archive (`torch.export.save(ep, "m.pt2")`) says about its model:
// the module hierarchy with each called module's class, and every parameter and buffer
// with its shape, dtype, requires_grad flag and stored weight. A pure reader over bytes
// and files that knows nothing of FSDP (fsdp/wrap's exported_program_tree.h turns it into
// the planner's ModuleTree). Weight bytes are never read, only their sizes.
//
//   fsdp::ExportedProgramInfo info = fsdp::read_exported_program("gpt.pt2");
//   info.modules[1].fqn;              // "tok"
//   info.modules[1].class_path;       // "torch.nn.modules.sparse.Embedding"
//   info.parameters[0].sizes;         // {100, 32}
//   info.parameters[27].tied_to;      // "tok.weight" (head.weight is tok.weight)
//
// The archive (torch 2.11): an uncompressed zip under one folder `<stem>/` holding
// `archive_format` ("pt2"), `models/model.json` (the export schema, version 8.x),
// `data/weights/model_weights_config.json` ({"config": {FQN: {"path_name": "weight_N",
// "is_param": bool, "tensor_meta": {...}}}}) and `data/weights/weight_N` (raw storage
// bytes; 0 bytes for a model exported on the meta device). In model.json:
// graph_module.signature.input_specs[] names parameters (parameter.parameter_name) and
// buffers (buffer.buffer_name) with their graph inputs (arg.name);
// graph_module.graph.tensor_values[arg.name] holds their dtype (export-schema numbers,
// exported_program_dtype), sizes ([{"as_int": n}]) and requires_grad;
// graph_module.graph.nodes[].metadata.nn_module_stack ("key,fqn,class;...") gives each
// called module's class; graph_module.module_call_graph[].fqn lists the modules.
//
// PyTorch: torch.export.save / torch.export.load (torch/_export/serde/serialize.py).
//
// Errors: c10::Error that names the file (or `where`) and what was expected: a file that
// is not a zip or a damaged one, a zip that is not a .pt2 archive, an export schema major
// version other than 8, JSON that is not of the form above, an unknown dtype number, a
// symbolic parameter size, a parameter without an entry in model_weights_config.json, a
// weight file missing from the archive or shorter than its tensor. Bad input never
// crashes (tools/fuzz.sh exported_program fuzzes the JSON side).
// Threading: pure functions; read_exported_program reads the file once.
#ifndef FSDP_FORMATS_EXPORTED_PROGRAM_H_
#define FSDP_FORMATS_EXPORTED_PROGRAM_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/ScalarType.h>

namespace fsdp {

// Export-schema major version this reader understands (torch 2.11 writes 8.17).
inline constexpr int kExportSchemaMajorVersion = 8;

// One module of the exported model.
struct ExportedModuleInfo {
  std::string fqn;         // "" for the root, "blocks.0.mlp" below it
  std::string class_path;  // "torch.nn.modules.linear.Linear"; "" if never called
};

// One parameter or buffer name. Tied parameters (one nn.Parameter under several names) are
// several entries; each later name's `tied_to` is the first name. See Note [Ties in .pt2
// archives] in the .cc.
struct ExportedTensorInfo {
  std::string fqn;             // "blocks.0.mlp.0.weight"
  std::vector<int64_t> sizes;  // the shape; {} for a scalar
  c10::ScalarType dtype = c10::ScalarType::Float;
  bool requires_grad = true;   // false for a frozen parameter and for buffers
  bool persistent = true;      // buffers: in the state dict (always true for parameters)
  std::string device;          // "cpu", "cuda", "meta", ...
  std::string graph_input;     // its placeholder in the graph, e.g. "p_tok_weight"
  int64_t storage_offset = 0;  // elements
  std::string tied_to;         // parameters: the first name of the same weight, or ""
  // data/weights/<weight_file> in the archive; "" for a buffer without a stored weight.
  std::string weight_file;
  int64_t stored_bytes = 0;  // size of that record (0 for a meta-device export)
  bool pickled = false;      // the record is a torch.save pickle (a tensor subclass)

  int64_t numel() const;
  int64_t nbytes() const { return numel() * static_cast<int64_t>(c10::elementSize(dtype)); }
};

struct ExportedProgramInfo {
  int schema_major = 0;
  int schema_minor = 0;
  std::string torch_version;  // model.json's "torch_version", "" if absent
  // Every module named by the module call graph, by a called module's stack or by a
  // parameter or buffer FQN, in the module call graph's order (PyTorch's named_modules()
  // order), then the others in order of appearance. The root ("") is first.
  std::vector<ExportedModuleInfo> modules;
  std::vector<ExportedTensorInfo> parameters;  // input_specs order (named_parameters())
  std::vector<ExportedTensorInfo> buffers;     // input_specs order (named_buffers())
  // True iff every parameter lives on the meta device (no weight bytes in the archive).
  bool meta = false;
};

// c10's dtype for an export-schema ScalarType number (torch/_export/serde/schema.py:
// 1 BYTE ... 7 FLOAT ... 13 BFLOAT16, 28 UINT16, 29-32 FLOAT8 kinds). Throws c10::Error
// for any other number.
c10::ScalarType exported_program_dtype(int64_t schema_dtype);

// Parses model.json and model_weights_config.json (their texts). Fills stored_bytes with
// -1 (unknown: the archive's records are not seen here). `where` names the source in
// errors. Throws c10::Error as described in the file comment.
ExportedProgramInfo parse_exported_program(std::string_view model_json,
                                           std::string_view weights_config_json,
                                           const std::string& where);

// True iff the zip record names (as PyTorchStreamReader::getAllRecords lists them) are
// those of a .pt2 archive (an `archive_format` record).
bool is_exported_program_records(const std::vector<std::string>& records);

// Opens `path` with caffe2::serialize::PyTorchStreamReader, parses it and checks that each
// weight file exists and holds its tensor's bytes (any size on the meta device).
ExportedProgramInfo read_exported_program(const std::string& path);

}  // namespace fsdp

#endif  // FSDP_FORMATS_EXPORTED_PROGRAM_H_
