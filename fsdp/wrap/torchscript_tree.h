// ModuleTree snapshots of TorchScript modules, so the wrap planner can plan real
// architectures exported from PyTorch with `torch.jit.script(model).save(path)`.
//
//   fsdp::ModuleTree tree = fsdp::load_torchscript_tree("resnet18.pt");
//   tree.node(0).type_name;  // "torchvision.models.resnet.ResNet"
//
// load_torchscript_tree reads the archive as data and runs none of its code: the module
// objects and tensor records of its data.pkl (through fsdp/formats/pickle.h, where
// classes are tags), and, from the class declarations the archive carries as text
// (code/__torch__/....py), which classes are modules and which attributes are parameters.
// A module whose class restores itself with its own __setstate__ cannot be read that way
// and is refused; load_torchscript_tree_trusted loads any archive with torch::jit::load,
// which runs the archive's code (PyTorch documents torch.jit.load as unsafe for files
// from untrusted sources), for files the caller trusts.
//
// Type names are normalised to Python class paths (see module_tree.h). Parameters shared
// between submodules in Python stay shared (same key) after scripting. Both loaders give
// the same tree for an archive both can read.
//
// Errors: c10::Error naming the path and what is wrong (missing, not a TorchScript
// archive, a scripted function instead of a module, a damaged or inconsistent record, a
// class with its own __setstate__). Threading: pure functions; loading reads the file once.
// PyTorch counterpart: torch.jit.load(path) followed by named_children/named_parameters.
#ifndef FSDP_WRAP_TORCHSCRIPT_TREE_H_
#define FSDP_WRAP_TORCHSCRIPT_TREE_H_

#include <string>

#include <torch/csrc/jit/api/module.h>

#include "fsdp/wrap/module_tree.h"

namespace fsdp {

// Snapshot of a loaded TorchScript module (children and parameters in definition order).
ModuleTree module_tree_from_torchscript(const torch::jit::Module& module);

// Reads the TorchScript archive at `path` as data (no code from the file runs) and
// snapshots its module tree. Throws c10::Error naming the path if the file is missing,
// unreadable, not a TorchScript archive, damaged, or holds a module whose class defines
// __setstate__ (then only load_torchscript_tree_trusted can read it).
ModuleTree load_torchscript_tree(const std::string& path);

// Loads `path` with torch::jit::load on the CPU and snapshots it. RUNS THE FILE'S CODE
// (its classes' __setstate__ methods): only for files from a trusted source. Throws
// c10::Error naming the path if the file is missing or not a loadable TorchScript archive.
ModuleTree load_torchscript_tree_trusted(const std::string& path);

}  // namespace fsdp

#endif  // FSDP_WRAP_TORCHSCRIPT_TREE_H_
