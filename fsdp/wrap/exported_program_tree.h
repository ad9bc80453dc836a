// ModuleTree snapshots of torch.export archives (`torch.export.save(ep, "m.pt2")`), so the
// wrap planner plans architectures that PyTorch users export today, beside TorchScript
// (torchscript_tree.h).
//
//   fsdp::ExportedProgramTree exported = fsdp::load_exported_program_tree("gpt.pt2");
//   exported.tree.node(0).type_name;           // "__main__.GPT"
//   exported.parameter(exported.tree.node(1).params[0]).sizes;  // {vocab, dim}
//
// Module classes come from the graph's nn_module_stack. A module the exported forward
// never called (a ModuleList or ModuleDict, which have no forward, or an unused module)
// has no class in the archive: its type_name is kUnknownModuleClass ("unknown"), and
// ModuleType matches such a module as a ModuleList / ModuleDict when it holds children
// and no parameters of its own (policy.h), so policies pick what PyTorch's
// _recursive_wrap picks on the real model. Tied parameters (ExportedTensorInfo::tied_to)
// share one key, as in TorchScript trees. Shapes, dtypes, requires_grad (frozen
// parameters) and buffers are in `info`; a meta-device export (0-byte weights) reads
// like any other.
//
// PyTorch: torch.export.load(path).module() and its named_modules() / named_parameters().
// Errors: c10::Error naming the file and the reason (exported_program.h).
// Threading: pure functions; loading reads the file once.
#ifndef FSDP_WRAP_EXPORTED_PROGRAM_TREE_H_
#define FSDP_WRAP_EXPORTED_PROGRAM_TREE_H_

#include <string>

#include "fsdp/formats/exported_program.h"
#include "fsdp/wrap/module_tree.h"

namespace fsdp {

// A tree and the archive contents it was built from. The tree's parameter keys point into
// `info.parameters` (the first name of each distinct weight), so the value is move-only.
struct ExportedProgramTree {
  ExportedProgramInfo info;
  ModuleTree tree;

  ExportedProgramTree() = default;
  ExportedProgramTree(ExportedProgramTree&&) = default;
  ExportedProgramTree& operator=(ExportedProgramTree&&) = default;
  ExportedProgramTree(const ExportedProgramTree&) = delete;
  ExportedProgramTree& operator=(const ExportedProgramTree&) = delete;

  // The parameter (its first name) behind a tree entry.
  const ExportedTensorInfo& parameter(const ParamEntry& entry) const {
    return *static_cast<const ExportedTensorInfo*>(entry.key);
  }
};

// Builds the tree: modules in pre-order (children in the archive's named_modules order),
// each module's own parameters in named_parameters order.
ExportedProgramTree module_tree_from_exported_program(ExportedProgramInfo info);

// read_exported_program(path), then module_tree_from_exported_program.
ExportedProgramTree load_exported_program_tree(const std::string& path);

}  // namespace fsdp

#endif  // FSDP_WRAP_EXPORTED_PROGRAM_TREE_H_
