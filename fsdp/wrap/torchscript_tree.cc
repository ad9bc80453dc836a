#include "fsdp/wrap/torchscript_tree.h"

#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/import.h>

namespace fsdp {
namespace {

std::string type_name_of(const torch::jit::Module& module) {
  return normalize_torchscript_type_name(module.type()->name()->qualifiedName());
}

}  // namespace

ModuleTree module_tree_from_torchscript(const torch::jit::Module& module) {
  ModuleTree tree;
  struct Frame {
    torch::jit::Module module;
    int parent;
    std::string name;
  };
  std::vector<Frame> stack = {{module, -1, ""}};
  while (!stack.empty()) {
    Frame frame = std::move(stack.back());
    stack.pop_back();
    const int index = frame.parent < 0
                          ? tree.add_root(type_name_of(frame.module))
                          : tree.add_child(frame.parent, frame.name, type_name_of(frame.module));
    for (const auto& param : frame.module.named_parameters(/*recurse=*/false)) {
      tree.add_param(index, param.name, param.value.unsafeGetTensorImpl(), param.value.numel());
    }
    std::vector<Frame> children;
    for (const auto& child : frame.module.named_children()) {
      children.push_back({child.value, index, child.name});
    }
    for (auto it = children.rbegin(); it != children.rend(); ++it) {
      stack.push_back(std::move(*it));
    }
  }
  return tree;
}

ModuleTree load_torchscript_tree(const std::string& path) {
  TORCH_CHECK(std::ifstream(path).good(), "cannot open '", path,
              "': expected a TorchScript file written by torch.jit.script(model).save(path)");
  torch::jit::Module module;
  try {
    module = torch::jit::load(path, c10::Device(c10::kCPU));
  } catch (const std::exception& e) {
    // Keep only the first non-empty line: the loader may start its message with a
    // newline and appends a C++ stack trace.
    absl::string_view what = absl::StripLeadingAsciiWhitespace(e.what());
    what = what.substr(0, what.find('\n'));
    TORCH_CHECK(false, "'", path, "' is not a readable TorchScript archive (",
                what.empty() ? "the loader gave no reason" : std::string(what),
                "); expected a file written by torch.jit.script(model).save(path)");
  }
  ModuleTree tree = module_tree_from_torchscript(module);
  TORCH_CHECK(!absl::EndsWith(tree.node(0).type_name, "PlaceholderModule"), "'", path,
              "' holds a scripted function, not a module; save a module with "
              "torch.jit.script(model).save(path)");
  return tree;
}

}  // namespace fsdp
