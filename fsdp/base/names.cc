#include "fsdp/base/names.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace fsdp {

std::string clean_tensor_name(absl::string_view tensor_name) {
  return absl::StrReplaceAll(tensor_name, {{kFsdpPrefix, ""}, {kCheckpointPrefix, ""}});
}

namespace {

// apply_to_modules for a const (Module = const torch::nn::Module) or mutable tree.
template <typename Module, typename Visitor>
void pre_order(Module& root, const Visitor& visit) {
  struct Frame {
    Module* module;
    std::string prefix;
    int depth;
  };
  // Explicit stack: trees may be deeper than the call stack allows.
  std::vector<Frame> stack = {{&root, "", 0}};
  while (!stack.empty()) {
    Frame frame = std::move(stack.back());
    stack.pop_back();
    visit(*frame.module, frame.prefix, frame.depth);
    const auto children = frame.module->named_children();
    for (auto it = children.end(); it != children.begin();) {
      --it;
      stack.push_back(
          {it->value().get(), absl::StrCat(frame.prefix, it->key(), "."), frame.depth + 1});
    }
  }
}

}  // namespace

void apply_to_modules(const torch::nn::Module& root, const ModuleVisitor& visit) {
  pre_order(root, visit);
}

void apply_to_modules(torch::nn::Module& root, const MutableModuleVisitor& visit) {
  pre_order(root, visit);
}

absl::flat_hash_map<ParamKey, std::vector<std::string>> param_to_fqns(
    const torch::nn::Module& model, bool dedup_shared_params, std::vector<ParamKey>* order) {
  absl::flat_hash_map<ParamKey, std::vector<std::string>> result;
  apply_to_modules(model,
                   [&](const torch::nn::Module& module, const std::string& prefix, int /*depth*/) {
                     for (const auto& item : module.named_parameters(/*recurse=*/false)) {
                       const std::string fqn = clean_tensor_name(absl::StrCat(prefix, item.key()));
                       auto [it, inserted] = result.try_emplace(param_key(item.value()));
                       if (inserted) {
                         it->second.push_back(fqn);
                         if (order != nullptr) order->push_back(it->first);
                       } else if (!dedup_shared_params) {
                         it->second.push_back(fqn);
                       }
                     }
                   });
  return result;
}

absl::flat_hash_set<const torch::nn::Module*> get_root_modules(
    const absl::flat_hash_set<const torch::nn::Module*>& modules) {
  // A module is not a root iff it lies strictly below some member of the set.
  absl::flat_hash_set<const torch::nn::Module*> contained;
  for (const torch::nn::Module* module : modules) {
    apply_to_modules(*module, [&](const torch::nn::Module& m, const std::string&, int depth) {
      if (depth > 0 && modules.contains(&m)) contained.insert(&m);
    });
  }
  absl::flat_hash_set<const torch::nn::Module*> roots;
  for (const torch::nn::Module* module : modules) {
    if (!contained.contains(module)) roots.insert(module);
  }
  return roots;
}

}  // namespace fsdp
