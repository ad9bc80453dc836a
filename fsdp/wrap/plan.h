// The wrap planner: which modules of a tree become FSDP units, as a pure function of the
// tree and a policy. It runs the algorithm of PyTorch's `_recursive_wrap` over a
// ModuleTree (C++ frontend, TorchScript or synthetic), without changing any model.
//
//   fsdp::ModuleTree tree = fsdp::ModuleTree::from_module(*model);
//   fsdp::WrapPlan plan = fsdp::plan_fsdp_units(
//       tree, fsdp::size_based_auto_wrap_policy(
//                 fsdp::SizeBasedPolicyOptions().min_num_params(40)));
//   for (const fsdp::PlannedUnit& unit : plan.units) { unit.fqn; unit.numel; }
//
// See Note [Wrap planning] in plan.cc for how PyTorch's numbers are reproduced in
// O(modules + parameters) instead of `_recursive_wrap`'s O(modules x depth).
//
// Threading: pure; the policy is called from the calling thread only, in `_recursive_wrap`'s
// order (recurse = true on the way down, recurse = false on the way up).
#ifndef FSDP_WRAP_PLAN_H_
#define FSDP_WRAP_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include <torch/arg.h>

#include "fsdp/wrap/module_tree.h"
#include "fsdp/wrap/policy.h"

namespace fsdp {

struct WrapPlanOptions {
  // Node indices of modules to leave out: neither they nor anything below them is
  // offered to the policy, and their parameters are not counted anywhere.
  TORCH_ARG(std::vector<int>, ignored_modules);
  // Further parameters (by ParamEntry::key) not to count anywhere.
  TORCH_ARG(std::vector<const void*>, ignored_params);
  // Offer the root's children but not the root itself (PyTorch's only_wrap_children;
  // it applies to the root only, as in PyTorch).
  TORCH_ARG(bool, only_wrap_children) = false;
};

struct PlannedUnit {
  int node = 0;     // index in the ModuleTree
  std::string fqn;  // the module's FQN, "" for the root
  // Parameters this unit flattens: those in its subtree, not ignored, not owned by a
  // unit inside it; a parameter shared by several units belongs to the first one that
  // wraps (children before parents, earlier siblings first), as in PyTorch. Elements.
  int64_t numel = 0;
  // `_recursive_wrap`'s `remainder` offered to the policy with recurse = false (elements). Equals
  // `numel` unless parameters are shared across units.
  int64_t remainder = 0;
};

struct WrapPlan {
  std::vector<PlannedUnit> units;  // in pre-order of the tree
  // Indices into `units` in the order `_recursive_wrap` creates the wrappers: post-order
  // (children before parents, earlier siblings first).
  std::vector<int> wrap_order;
  int64_t total_numel = 0;    // distinct, non-ignored parameters of the tree
  int64_t wrapped_numel = 0;  // `_recursive_wrap`'s second return value for the root
};

// PyTorch's `_recursive_wrap(root, policy, wrapper_cls, ignored_modules, ignored_params,
// only_wrap_children)`: the units it would create. Throws c10::Error if the policy is
// empty, an ignored index is out of range, or a non-ignored module is already an FSDP
// wrapper (naming its FQN).
WrapPlan plan_recursive_wrap(const ModuleTree& tree, const AutoWrapPolicy& policy,
                             const WrapPlanOptions& options = {});

// The units FullyShardedDataParallel(root, auto_wrap_policy=policy) creates: the
// children as `_recursive_wrap(..., only_wrap_children=true)` decides, then the root,
// always (`options.only_wrap_children` is ignored). Without a policy (nullptr), the root
// alone. Same errors as plan_recursive_wrap.
WrapPlan plan_fsdp_units(const ModuleTree& tree, const AutoWrapPolicy& policy,
                         const WrapPlanOptions& options = {});

}  // namespace fsdp

#endif  // FSDP_WRAP_PLAN_H_
