// ModuleTree snapshots of TorchScript modules, so the wrap planner can plan real
// architectures exported from PyTorch with `torch.jit.script(model).save(path)`.
//
//   fsdp::ModuleTree tree = fsdp::load_torchscript_tree("resnet18.pt");
//   tree.node(0).type_name;  // "torchvision.models.resnet.ResNet"
//
// Type names are normalised to Python class paths (see module_tree.h). Parameters shared
// between submodules in Python stay shared (same key) after scripting.
//
// Threading: pure functions; loading reads the file once.
#ifndef FSDP_WRAP_TORCHSCRIPT_TREE_H_
#define FSDP_WRAP_TORCHSCRIPT_TREE_H_

#include <string>

#include <torch/csrc/jit/api/module.h>

#include "fsdp/wrap/module_tree.h"

namespace fsdp {

// Snapshot of a loaded TorchScript module (children and parameters in definition order).
ModuleTree module_tree_from_torchscript(const torch::jit::Module& module);

// Loads `path` with torch::jit::load on the CPU and snapshots it. Throws c10::Error
// naming the path if the file is missing, unreadable, or not a TorchScript archive.
ModuleTree load_torchscript_tree(const std::string& path);

}  // namespace fsdp

#endif  // FSDP_WRAP_TORCHSCRIPT_TREE_H_
