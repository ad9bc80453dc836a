// Auto-wrap policies: which modules of a model become FSDP units.
//
// A policy is a pure function `(module, recurse, nonwrapped_numel) -> bool`, called by the
// recursive wrapper (recursive_wrap.h, plan.h) twice per visited module: first with
// recurse = true ("should the wrapper look inside this module?", nonwrapped_numel = all
// parameters of its subtree), then, after its children were handled, with
// recurse = false ("should this module become a unit?", nonwrapped_numel = parameters
// not already inside a unit below it). Numels count elements, shared parameters once.
//
//   auto policy = fsdp::size_based_auto_wrap_policy(
//       fsdp::SizeBasedPolicyOptions().min_num_params(1000000));
//   auto blocks = fsdp::transformer_auto_wrap_policy(
//       {fsdp::ModuleType::of<torch::nn::TransformerEncoderLayerImpl>()});
//
// Type matching (ModuleType) works for C++ module types (dynamic_cast, so subclasses
// match, like Python's isinstance) and for Python class paths (exact name, for
// TorchScript models exported by PyTorch; see module_tree.h).
//
// PyTorch: torch.distributed.fsdp.wrap (always_wrap_policy, lambda_auto_wrap_policy,
// transformer_auto_wrap_policy, size_based_auto_wrap_policy, _or_policy,
// _wrap_batchnorm_individually). Policies are copyable values, safe to call from several
// threads at once when the functions they hold are.
#ifndef FSDP_WRAP_POLICY_H_
#define FSDP_WRAP_POLICY_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include <c10/util/Type.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

#include "fsdp/wrap/module_tree.h"

namespace fsdp {

// `(module, recurse, nonwrapped_numel) -> bool`; see the file comment.
using AutoWrapPolicy =
    std::function<bool(const ModuleNode& module, bool recurse, int64_t nonwrapped_numel)>;

// A module type to match: a Python class path, plus for C++ types a dynamic_cast test.
class ModuleType {
 public:
  // A C++ module type, e.g. ModuleType::of<torch::nn::LinearImpl>(). Matches C++ modules
  // of type T or derived from it, and modules whose type name is T's Python class path
  // (torch.nn.modules.linear.Linear) or, for types outside torch::nn, T's C++ name.
  template <typename T>
  static ModuleType of() {
    return ModuleType(
        python_class_path_for_cpp(c10::demangle_type<T>()),
        [](const torch::nn::Module& m) { return dynamic_cast<const T*>(&m) != nullptr; });
  }

  // A type by name: a Python class path ("torch.nn.modules.activation.MultiheadAttention")
  // or a C++ class name; matches nodes whose type_name is exactly `class_path`. The
  // ModuleList and ModuleDict paths also match a module of unknown class
  // (kUnknownModuleClass, never called in a torch.export graph) that has children and no
  // parameters of its own: containers without forward() are what an export never calls.
  // See Note [Modules an export never called].
  static ModuleType named(std::string class_path) {
    return ModuleType(std::move(class_path), nullptr);
  }

  bool matches(const ModuleNode& node) const;
  const std::string& class_path() const { return class_path_; }

 private:
  ModuleType(std::string class_path, std::function<bool(const torch::nn::Module&)> test)
      : class_path_(std::move(class_path)), cpp_test_(std::move(test)) {}

  std::string class_path_;
  std::function<bool(const torch::nn::Module&)> cpp_test_;
};

// True iff any of `types` matches `node` (Python: isinstance(module, tuple(types))).
bool matches_any(const std::vector<ModuleType>& types, const ModuleNode& node);

// Wraps every module (PyTorch: always_wrap_policy).
AutoWrapPolicy always_wrap_policy();

// Recurses always; wraps a module iff `lambda_fn(module)` (PyTorch:
// lambda_auto_wrap_policy).
AutoWrapPolicy lambda_auto_wrap_policy(std::function<bool(const ModuleNode&)> lambda_fn);

// Recurses always; wraps modules of the given layer types, so everything else stays in
// the enclosing unit, e.g. a tied embedding in the root (PyTorch:
// transformer_auto_wrap_policy).
AutoWrapPolicy transformer_auto_wrap_policy(std::vector<ModuleType> transformer_layer_cls);

// PyTorch's ModuleWrapPolicy(module_classes): every module of these types becomes a
// unit, nested ones too, except the root and ignored modules; nonwrapped_numel is not
// used. PyTorch's FSDP runs it over all modules at once (_Policy._run_policy); as a
// recursive policy it is its __call__ (_module_wrap_policy: recurse into everything, wrap
// iff the type matches), which picks the same modules. tests/plan_oracle_test.sh checks
// fsdp_plan --policy=module against torch 2.11's ModuleWrapPolicy. A callable value: give
// it wherever an AutoWrapPolicy goes.
class ModuleWrapPolicy {
 public:
  explicit ModuleWrapPolicy(std::vector<ModuleType> module_classes)
      : module_classes_(std::move(module_classes)) {}
  bool operator()(const ModuleNode& module, bool recurse, int64_t /*nonwrapped_numel*/) const {
    return recurse || matches_any(module_classes_, module);
  }
  const std::vector<ModuleType>& module_classes() const { return module_classes_; }

 private:
  std::vector<ModuleType> module_classes_;
};

// Recurses always; wraps every BatchNorm (1d/2d/3d, SyncBatchNorm) (PyTorch:
// _wrap_batchnorm_individually).
AutoWrapPolicy wrap_batchnorm_individually();

// Says yes iff any of `policies` says yes, for recurse and wrap alike (PyTorch:
// _or_policy).
AutoWrapPolicy or_policy(std::vector<AutoWrapPolicy> policies);

// PyTorch 2.0's experimental ParamExecOrderWrapPolicy (torch.distributed.fsdp.wrap):
// units come from `init_policy` (a recursive policy, as any above); the order in which
// they run in the first iteration's forward then drives prefetching in both passes for
// the rest of training (forward: the next unit in that order starts gathering as a unit
// starts its forward; backward: the previous one, as a unit starts its backward). Give it
// to FullyShardedDataParallelOptions::param_exec_order_wrap_policy (fully_sharded.h).
// PyTorch's `tracing_config` (symbolic tracing at construction) has no counterpart.
struct ParamExecOrderWrapPolicy {
  TORCH_ARG(AutoWrapPolicy, init_policy) = always_wrap_policy();
};

// The size policy's defaults (PyTorch: size_based_auto_wrap_policy.FORCE_LEAF_MODULES
// and .EXCLUDE_WRAP_MODULES).
std::vector<ModuleType> default_force_leaf_modules();    // {MultiheadAttention}
std::vector<ModuleType> default_exclude_wrap_modules();  // {ModuleList, ModuleDict}

struct SizeBasedPolicyOptions {
  // A module is large iff its nonwrapped numel >= min_num_params. Must be >= 0.
  TORCH_ARG(int64_t, min_num_params) = 100000000;
  // Never recursed into (their children are never wrapped); unset = the default set.
  TORCH_ARG(std::optional<std::vector<ModuleType>>, force_leaf_modules);
  // Never wrapped themselves; unset = the default set.
  TORCH_ARG(std::optional<std::vector<ModuleType>>, exclude_wrap_modules);
};

// recurse: large and not a force-leaf module; wrap: large and not excluded
// (PyTorch: size_based_auto_wrap_policy). Throws c10::Error if min_num_params < 0.
AutoWrapPolicy size_based_auto_wrap_policy(SizeBasedPolicyOptions options = {});

}  // namespace fsdp

#endif  // FSDP_WRAP_POLICY_H_
