#include "fsdp/wrap/policy.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

namespace fsdp {
namespace {

// Note [Modules an export never called]
// A torch.export archive records a module's class only in the nn_module_stack of the
// graph nodes its forward produced. ModuleList and ModuleDict have no forward, so the
// containers that hold a model's blocks (nanoGPT's transformer ModuleDict and its h
// ModuleList, a TransformerEncoder's layers) come without a class, as does a module the
// forward never uses. PyTorch's size_based_auto_wrap_policy excludes
// ModuleList and ModuleDict from wrapping; to pick what it picks on the real model, a
// class-less module that holds children and no parameters of its own is taken for one
// of these containers. A class-less module with parameters of its own (an unused
// Linear) is an ordinary module. The node alone does not tell a ModuleList from a
// ModuleDict, so such a module matches both: a policy that names only one of them (a
// ModuleWrapPolicy of ModuleList) also picks the other kind. tests/plan_oracle_test.sh
// checks the rest against _recursive_wrap on the Python models.
bool is_unknown_container(const ModuleNode& node) {
  return node.type_name == kUnknownModuleClass && !node.children.empty() && node.params.empty();
}

}  // namespace

bool ModuleType::matches(const ModuleNode& node) const {
  if (node.type_name == class_path_) return true;
  if ((class_path_ == "torch.nn.modules.container.ModuleList" ||
       class_path_ == "torch.nn.modules.container.ModuleDict") &&
      is_unknown_container(node)) {
    return true;
  }
  return cpp_test_ != nullptr && node.cpp_module != nullptr && cpp_test_(*node.cpp_module);
}

bool matches_any(const std::vector<ModuleType>& types, const ModuleNode& node) {
  for (const ModuleType& type : types) {
    if (type.matches(node)) return true;
  }
  return false;
}

AutoWrapPolicy always_wrap_policy() {
  return [](const ModuleNode&, bool, int64_t) { return true; };
}

AutoWrapPolicy lambda_auto_wrap_policy(std::function<bool(const ModuleNode&)> lambda_fn) {
  TORCH_CHECK(lambda_fn != nullptr, "lambda_auto_wrap_policy: lambda_fn is empty");
  return [fn = std::move(lambda_fn)](const ModuleNode& module, bool recurse, int64_t) {
    return recurse || fn(module);
  };
}

AutoWrapPolicy transformer_auto_wrap_policy(std::vector<ModuleType> transformer_layer_cls) {
  return
      [types = std::move(transformer_layer_cls)](const ModuleNode& module, bool recurse, int64_t) {
        return recurse || matches_any(types, module);
      };
}

AutoWrapPolicy wrap_batchnorm_individually() {
  return transformer_auto_wrap_policy({
      ModuleType::of<torch::nn::BatchNorm1dImpl>(),
      ModuleType::of<torch::nn::BatchNorm2dImpl>(),
      ModuleType::of<torch::nn::BatchNorm3dImpl>(),
      ModuleType::named("torch.nn.modules.batchnorm.SyncBatchNorm"),
  });
}

AutoWrapPolicy or_policy(std::vector<AutoWrapPolicy> policies) {
  return [members = std::move(policies)](const ModuleNode& module, bool recurse,
                                         int64_t nonwrapped_numel) {
    for (const AutoWrapPolicy& policy : members) {
      if (policy(module, recurse, nonwrapped_numel)) return true;
    }
    return false;
  };
}

std::vector<ModuleType> default_force_leaf_modules() {
  return {ModuleType::of<torch::nn::MultiheadAttentionImpl>()};
}

std::vector<ModuleType> default_exclude_wrap_modules() {
  return {ModuleType::of<torch::nn::ModuleListImpl>(), ModuleType::of<torch::nn::ModuleDictImpl>()};
}

AutoWrapPolicy size_based_auto_wrap_policy(SizeBasedPolicyOptions options) {
  TORCH_CHECK(options.min_num_params() >= 0,
              "size_based_auto_wrap_policy: min_num_params must be >= 0, got ",
              options.min_num_params());
  const int64_t min_num_params = options.min_num_params();
  std::vector<ModuleType> force_leaf =
      options.force_leaf_modules().value_or(default_force_leaf_modules());
  std::vector<ModuleType> exclude =
      options.exclude_wrap_modules().value_or(default_exclude_wrap_modules());
  return [=](const ModuleNode& module, bool recurse, int64_t nonwrapped_numel) {
    const bool is_large = nonwrapped_numel >= min_num_params;
    if (recurse) return is_large && !matches_any(force_leaf, module);
    return is_large && !matches_any(exclude, module);
  };
}

}  // namespace fsdp
