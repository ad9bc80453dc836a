#include "fsdp/wrap/recursive_wrap.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include <c10/util/Exception.h>

#include "fsdp/base/names.h"
#include "fsdp/wrap/module_tree.h"
#include "fsdp/wrap/plan.h"

namespace fsdp {

void replace_registered_child(torch::nn::Module& parent, const ModuleNode& child,
                              std::shared_ptr<torch::nn::Module> wrapped) {
  parent.replace_module(child.name, std::move(wrapped));
}

RecursiveWrapResult recursive_wrap(std::shared_ptr<torch::nn::Module> root,
                                   const AutoWrapPolicy& policy,
                                   const WrapperFactory& wrapper_factory,
                                   const RecursiveWrapOptions& options) {
  TORCH_CHECK(root != nullptr, "recursive_wrap: root module is null");
  TORCH_CHECK(policy != nullptr, "recursive_wrap: auto_wrap_policy is empty");
  TORCH_CHECK(wrapper_factory != nullptr, "recursive_wrap: wrapper_factory is empty");
  TORCH_CHECK(options.replace_child() != nullptr, "recursive_wrap: replace_child is empty");

  const ModuleTree tree = ModuleTree::from_module(*root, options.unwrap());
  const absl::flat_hash_set<const torch::nn::Module*> ignored(options.ignored_modules().begin(),
                                                              options.ignored_modules().end());
  WrapPlanOptions plan_options;
  plan_options.only_wrap_children(options.only_wrap_children());
  for (const ModuleNode& node : tree.nodes()) {
    if (ignored.contains(node.cpp_module)) plan_options.ignored_modules().push_back(node.index);
  }
  for (const at::Tensor& param : options.ignored_params()) {
    plan_options.ignored_params().push_back(param_key(param));
  }
  const WrapPlan plan = plan_recursive_wrap(tree, policy, plan_options);

  RecursiveWrapResult result{root, plan.wrapped_numel, {}};
  for (const PlannedUnit& unit : plan.units) result.wrapped_fqns.push_back(unit.fqn);
  for (int k : plan.wrap_order) {
    const ModuleNode& node = tree.node(plan.units[k].node);
    if (node.parent < 0) {
      result.module = wrapper_factory(root);
      TORCH_CHECK(result.module != nullptr,
                  "recursive_wrap: wrapper_factory returned null "
                  "for the root module");
      continue;
    }
    // The tree was read from `root`, which we hold mutably.
    auto& parent = const_cast<torch::nn::Module&>(*tree.node(node.parent).cpp_module);
    std::shared_ptr<torch::nn::Module> child = parent.named_children()[node.name];
    std::shared_ptr<torch::nn::Module> wrapped = wrapper_factory(child);
    TORCH_CHECK(wrapped != nullptr, "recursive_wrap: wrapper_factory returned null for '", node.fqn,
                "'");
    options.replace_child()(parent, node, std::move(wrapped));
  }
  return result;
}

}  // namespace fsdp
