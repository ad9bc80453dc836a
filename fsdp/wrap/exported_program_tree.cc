#include "fsdp/wrap/exported_program_tree.h"

#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include <c10/util/Exception.h>

namespace fsdp {
namespace {

// "blocks.0.weight" -> {"blocks.0", "weight"}; "weight" -> {"", "weight"}.
std::pair<std::string, std::string> split_last(const std::string& fqn) {
  const size_t dot = fqn.rfind('.');
  if (dot == std::string::npos) return {"", fqn};
  return {fqn.substr(0, dot), fqn.substr(dot + 1)};
}

// Index of the module `fqn` (every tensor's and module's parent is listed by
// parse_exported_program; a hand-made info may lack one).
int index_of(const absl::flat_hash_map<std::string, int>& module_index, const std::string& fqn,
             const std::string& user) {
  const auto it = module_index.find(fqn);
  TORCH_CHECK(it != module_index.end(), "module_tree_from_exported_program: '", user,
              "' needs module '", fqn,
              "', which the module list lacks; list every module "
              "after its parent (parse_exported_program does)");
  return it->second;
}

}  // namespace

ExportedProgramTree module_tree_from_exported_program(ExportedProgramInfo info) {
  ExportedProgramTree out;
  out.info = std::move(info);
  const std::vector<ExportedModuleInfo>& modules = out.info.modules;

  // Children and own parameters of each module, in the archive's order.
  absl::flat_hash_map<std::string, int> module_index;
  for (int i = 0; i < static_cast<int>(modules.size()); ++i) module_index[modules[i].fqn] = i;
  std::vector<std::vector<int>> children(modules.size());
  for (int i = 0; i < static_cast<int>(modules.size()); ++i) {
    if (modules[i].fqn.empty()) continue;
    children[index_of(module_index, split_last(modules[i].fqn).first, modules[i].fqn)].push_back(i);
  }
  // Identity of a weight: its first name (a tied name's tied_to).
  absl::flat_hash_map<std::string, const ExportedTensorInfo*> by_fqn;
  std::vector<std::vector<const ExportedTensorInfo*>> params(modules.size());
  for (const ExportedTensorInfo& param : out.info.parameters) {
    by_fqn.try_emplace(param.fqn, &param);
    params[index_of(module_index, split_last(param.fqn).first, param.fqn)].push_back(&param);
  }

  struct Frame {
    int module;
    int parent;  // tree index of the parent node, -1 for the root
  };
  std::vector<Frame> stack = {{index_of(module_index, "", "the root"), -1}};
  while (!stack.empty()) {
    const Frame frame = stack.back();
    stack.pop_back();
    const ExportedModuleInfo& module = modules[frame.module];
    std::string type_name = module.class_path.empty() ? kUnknownModuleClass : module.class_path;
    const int node =
        frame.parent < 0
            ? out.tree.add_root(std::move(type_name))
            : out.tree.add_child(frame.parent, split_last(module.fqn).second, std::move(type_name));
    for (const ExportedTensorInfo* param : params[frame.module]) {
      const ExportedTensorInfo* weight = param;
      if (!param->tied_to.empty()) {
        const auto it = by_fqn.find(param->tied_to);
        TORCH_CHECK(it != by_fqn.end(), "module_tree_from_exported_program: ", param->fqn,
                    " is tied to ", param->tied_to, ", which is not a parameter");
        weight = it->second;
      }
      out.tree.add_param(node, split_last(param->fqn).second, weight, param->numel());
    }
    const std::vector<int>& kids = children[frame.module];
    for (auto it = kids.rbegin(); it != kids.rend(); ++it) stack.push_back({*it, node});
  }
  return out;
}

ExportedProgramTree load_exported_program_tree(const std::string& path) {
  return module_tree_from_exported_program(read_exported_program(path));
}

}  // namespace fsdp
