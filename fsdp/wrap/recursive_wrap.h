// The recursive wrapper: applies an auto-wrap policy to a C++ frontend module tree,
// replacing each chosen module by the wrapper a factory makes (PyTorch:
// torch.distributed.fsdp.wrap._recursive_wrap, with `wrapper_cls` as a factory).
//
//   auto factory = [](std::shared_ptr<torch::nn::Module> m) { return make_unit(m); };
//   fsdp::RecursiveWrapResult r = fsdp::recursive_wrap(
//       model.ptr(), fsdp::always_wrap_policy(), factory,
//       fsdp::RecursiveWrapOptions().only_wrap_children(true));
//
// Decisions come from plan_recursive_wrap (plan.h), so the units are exactly `_recursive_wrap`'s;
// wrappers are created in PyTorch's order (children before parents). fsdp/wrap knows
// nothing of sharding: what a wrapper does is the factory's business.
//
// Threading: mutates the model; call it from one thread while nothing else uses the model.
#ifndef FSDP_WRAP_RECURSIVE_WRAP_H_
#define FSDP_WRAP_RECURSIVE_WRAP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>

#include "fsdp/wrap/module_tree.h"
#include "fsdp/wrap/policy.h"

namespace fsdp {

// Makes the wrapper for a module (PyTorch: `wrapper_cls(module, **kwargs)`). Must not
// return nullptr.
using WrapperFactory =
    std::function<std::shared_ptr<torch::nn::Module>(std::shared_ptr<torch::nn::Module> module)>;

// Puts `wrapped` where `parent` holds `child` (child.name is its name there, child.fqn
// its FQN). The default, replace_registered_child, replaces the registered child, which
// is what named_modules(), named_parameters() and state dicts see. A parent whose
// forward() reaches the child through another handle (a typed member, Sequential's
// AnyModule list) also needs that handle rebound; FullyShardedDataParallel passes a
// function that does so (Note [Auto-wrapping] in fsdp/core/fully_sharded.cc).
using ReplaceChildFn = std::function<void(torch::nn::Module& parent, const ModuleNode& child,
                                          std::shared_ptr<torch::nn::Module> wrapped)>;

// parent.replace_module(child.name, wrapped).
void replace_registered_child(torch::nn::Module& parent, const ModuleNode& child,
                              std::shared_ptr<torch::nn::Module> wrapped);

struct RecursiveWrapOptions {
  // Modules left alone, with everything below them; their parameters are not counted.
  TORCH_ARG(std::vector<const torch::nn::Module*>, ignored_modules);
  // Further parameters not to count.
  TORCH_ARG(std::vector<at::Tensor>, ignored_params);
  // Wrap the root's children but never the root (PyTorch's only_wrap_children).
  TORCH_ARG(bool, only_wrap_children) = false;
  TORCH_ARG(ReplaceChildFn, replace_child) = replace_registered_child;
  // Wrappers to see through (ModuleTree::from_module): the policy sees the module such a
  // wrapper holds, and the factory receives the wrapper itself.
  TORCH_ARG(UnwrapFn, unwrap);
};

struct RecursiveWrapResult {
  // The root, or its wrapper if the policy wrapped the root itself.
  std::shared_ptr<torch::nn::Module> module;
  // `_recursive_wrap`'s second return value: parameters now inside wrappers (elements).
  int64_t wrapped_numel = 0;
  // FQNs (before wrapping) of the wrapped modules, in pre-order.
  std::vector<std::string> wrapped_fqns;
};

// Throws c10::Error if root, policy or factory is empty, the factory returns nullptr,
// or a non-ignored module is already an FSDP wrapper (naming its FQN).
RecursiveWrapResult recursive_wrap(std::shared_ptr<torch::nn::Module> root,
                                   const AutoWrapPolicy& policy,
                                   const WrapperFactory& wrapper_factory,
                                   const RecursiveWrapOptions& options = {});

}  // namespace fsdp

#endif  // FSDP_WRAP_RECURSIVE_WRAP_H_
