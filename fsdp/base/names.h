// Fully qualified names (FQNs) of parameters and modules in an FSDP-wrapped model.
//
// The helpers of PyTorch's torch/distributed/fsdp/_common_utils.py that every layer
// uses (bottom layer: it depends on no other fsdp package): the wrapper-name constants,
// `clean_tensor_name`, the pre-order traversal that builds module prefixes, parameter ->
// FQNs, and the root modules of a set.
//
//   torch::nn::Sequential seq(torch::nn::Linear(5, 5), torch::nn::Linear(5, 5));
//   fsdp::apply_to_modules(*seq, [](const torch::nn::Module& m,
//                                   const std::string& prefix, int depth) { ... });
//   fsdp::clean_tensor_name("_fsdp_wrapped_module.0.weight");  // "0.weight"
//
// Threading: every function here is a pure function of its arguments; none keeps state.
#ifndef FSDP_BASE_NAMES_H_
#define FSDP_BASE_NAMES_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include <torch/nn/module.h>

namespace fsdp {

// Name of the child that holds the module an FSDP unit wraps (PyTorch:
// FSDP_WRAPPED_MODULE) and the prefix it leaves in names (FSDP_PREFIX).
inline constexpr absl::string_view kFsdpWrappedModule = "_fsdp_wrapped_module";
inline constexpr absl::string_view kFsdpPrefix = "_fsdp_wrapped_module.";

// Name of the child that holds the module a checkpoint wrapper wraps, and its prefix
// (PyTorch: _CHECKPOINT_WRAPPED_MODULE / _CHECKPOINT_PREFIX).
inline constexpr absl::string_view kCheckpointWrappedModule = "_checkpoint_wrapped_module";
inline constexpr absl::string_view kCheckpointPrefix = "_checkpoint_wrapped_module.";

// Removes every "_fsdp_wrapped_module." and "_checkpoint_wrapped_module." at any depth:
// "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.attn.w"
// -> "layers.0.attn.w". Also used for module FQNs.
// PyTorch: torch.distributed.fsdp._common_utils.clean_tensor_name.
std::string clean_tensor_name(absl::string_view tensor_name);

// Called once per module in pre-order. `prefix` is the module's FQN followed by "." (""
// for the root), exactly as it prefixes the module's entries in a state dict; `depth` is
// 0 for the root.
using ModuleVisitor =
    std::function<void(const torch::nn::Module& module, const std::string& prefix, int depth)>;

// Pre-order traversal of the tree rooted at `root` over registered children, in
// registration order. A module registered under several names is visited once per name.
// PyTorch: torch.distributed.fsdp._common_utils._apply_to_modules.
void apply_to_modules(const torch::nn::Module& root, const ModuleVisitor& visit);

// The same traversal over a tree the caller may change (a visitor that wraps, binds or
// edits what it visits), so that nobody casts a visited module's const away. A visitor
// must not add or remove children of modules it has not visited yet.
using MutableModuleVisitor =
    std::function<void(torch::nn::Module& module, const std::string& prefix, int depth)>;
void apply_to_modules(torch::nn::Module& root, const MutableModuleVisitor& visit);

// Identity of a parameter: two tensors are the same parameter iff they share a
// TensorImpl (tied weights assign the same tensor to two modules).
using ParamKey = const c10::TensorImpl*;
inline ParamKey param_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }

// Maps each parameter of `model` to its cleaned FQN(s), in pre-order. A shared parameter
// maps to the first FQN met when `dedup_shared_params`, else to every FQN in traversal
// order. `order`, when given, receives the parameters in first-met order.
// Example: Linear a, b with b.weight = a.weight -> {W: ["a.weight"]} (dedup) or
// {W: ["a.weight", "b.weight"]}.
// PyTorch: torch.distributed.fsdp._common_utils._get_param_to_fqns.
absl::flat_hash_map<ParamKey, std::vector<std::string>> param_to_fqns(
    const torch::nn::Module& model, bool dedup_shared_params = true,
    std::vector<ParamKey>* order = nullptr);

// The modules of `modules` not contained (at any depth) in another module of `modules`.
// PyTorch: torch.distributed.fsdp._common_utils._get_root_modules.
absl::flat_hash_set<const torch::nn::Module*> get_root_modules(
    const absl::flat_hash_set<const torch::nn::Module*>& modules);

}  // namespace fsdp

#endif  // FSDP_BASE_NAMES_H_
