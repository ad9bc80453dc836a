#include "fsdp/wrap/plan.h"

#include <algorithm>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp {
namespace {

// Note [Wrap planning]
// PyTorch's `_recursive_wrap` recounts `module.parameters()` at every level of the recursion, which
// costs O(modules x depth). We count each subtree's distinct parameters once for the whole tree:
// every occurrence of a parameter adds its numel at its node, and every later occurrence
// (in pre-order) also subtracts it at the lowest common ancestor with the previous one,
// so a subtree sum counts a shared parameter exactly once (the usual distinct-count trick
// on trees). Parameter identity was resolved when the ModuleTree was built (dense slots),
// so planning needs no hashing. The decisions are then replayed with an explicit stack,
// calling the policy in PyTorch's order, and the same numbers reach it.

struct TreeFacts {
  std::vector<bool> ignored;           // node is in an ignored subtree
  std::vector<bool> ignored_slot;      // parameter slot is ignored
  std::vector<int> subtree_end;        // descendants of i are (i, subtree_end[i])
  std::vector<int64_t> subtree_numel;  // distinct non-ignored parameters below (and at) i
};

int lowest_common_ancestor(const ModuleTree& tree, int a, int b) {
  while (tree.node(a).depth > tree.node(b).depth) a = tree.node(a).parent;
  while (tree.node(b).depth > tree.node(a).depth) b = tree.node(b).parent;
  while (a != b) {
    a = tree.node(a).parent;
    b = tree.node(b).parent;
  }
  return a;
}

TreeFacts collect_facts(const ModuleTree& tree, const WrapPlanOptions& options) {
  const int n = tree.size();
  TreeFacts facts;
  facts.ignored.assign(n, false);
  for (int index : options.ignored_modules()) {
    TORCH_CHECK(index >= 0 && index < n, "wrap planning: ignored module index ", index,
                " is outside the tree of ", n, " modules");
    facts.ignored[index] = true;
  }
  facts.ignored_slot.assign(tree.num_param_slots(), false);
  for (const void* key : options.ignored_params()) {
    const int slot = tree.slot_of(key);
    if (slot >= 0) facts.ignored_slot[slot] = true;
  }
  for (int i = 0; i < n; ++i) {
    if (i > 0 && facts.ignored[tree.node(i).parent]) facts.ignored[i] = true;
    if (!facts.ignored[i]) continue;
    for (const ParamEntry& param : tree.node(i).params) facts.ignored_slot[param.slot] = true;
  }

  facts.subtree_numel.assign(n, 0);
  std::vector<int> last_node(tree.num_param_slots(), -1);  // last node holding each slot
  for (int i = 0; i < n; ++i) {
    for (const ParamEntry& param : tree.node(i).params) {
      if (facts.ignored_slot[param.slot]) continue;
      facts.subtree_numel[i] += param.numel;
      int& last = last_node[param.slot];
      if (last >= 0) {
        facts.subtree_numel[lowest_common_ancestor(tree, last, i)] -= param.numel;
      }
      last = i;
    }
  }
  facts.subtree_end.resize(n);
  for (int i = 0; i < n; ++i) facts.subtree_end[i] = i + 1;
  for (int i = n - 1; i > 0; --i) {
    const int parent = tree.node(i).parent;
    facts.subtree_numel[parent] += facts.subtree_numel[i];
    facts.subtree_end[parent] = std::max(facts.subtree_end[parent], facts.subtree_end[i]);
  }
  return facts;
}

void check_not_wrapped(const ModuleTree& tree, const TreeFacts& facts) {
  for (const ModuleNode& node : tree.nodes()) {
    TORCH_CHECK(facts.ignored[node.index] || !node.is_fsdp_wrapper, "module '", node.fqn, "' (",
                node.type_name,
                ") is already an FSDP unit; auto-wrapping expects a model without units: "
                "remove the manual wrap, or list the module in ignored_modules");
  }
}

// Replays `_recursive_wrap`'s recursion as one scan in pre-order: a module is entered (recurse?)
// when the scan reaches it and left (wrap?) when the scan passes its subtree; a subtree
// the policy does not recurse into is skipped whole. Returns is_unit per node.
std::vector<bool> decide_units(const ModuleTree& tree, const AutoWrapPolicy& policy,
                               const TreeFacts& facts, bool only_wrap_children,
                               int64_t* root_wrapped_numel, std::vector<int64_t>* remainder) {
  const int n = tree.size();
  std::vector<bool> is_unit(n, false);
  std::vector<int64_t> wrapped_below(n, 0);  // sum of the children's return values
  *root_wrapped_numel = 0;
  auto leave = [&](int v) {
    const int64_t rest = facts.subtree_numel[v] - wrapped_below[v];
    const bool may_wrap = !(only_wrap_children && v == 0);
    int64_t returned = wrapped_below[v];  // `_recursive_wrap`'s second return value
    if (may_wrap && policy(tree.node(v), /*recurse=*/false, rest)) {
      is_unit[v] = true;
      (*remainder)[v] = rest;
      returned = facts.subtree_numel[v];
    }
    if (v == 0) {
      *root_wrapped_numel = returned;
    } else {
      wrapped_below[tree.node(v).parent] += returned;
    }
  };
  std::vector<int> open;  // entered modules whose subtree the scan has not passed yet
  int i = 0;
  while (i < n) {
    while (!open.empty() && i >= facts.subtree_end[open.back()]) {
      leave(open.back());
      open.pop_back();
    }
    if (!facts.ignored[i] && policy(tree.node(i), /*recurse=*/true, facts.subtree_numel[i])) {
      open.push_back(i++);
    } else {
      i = facts.subtree_end[i];  // not recursed into: returns 0, children never offered
    }
  }
  for (auto it = open.rbegin(); it != open.rend(); ++it) leave(*it);
  return is_unit;
}

// Flattened numel per unit: each parameter goes to the first unit (children before
// parents, earlier siblings first) whose subtree holds it.
std::vector<int64_t> owned_numels(const ModuleTree& tree, const TreeFacts& facts,
                                  const std::vector<bool>& is_unit) {
  const int n = tree.size();
  std::vector<int> unit_of(n, -1);  // innermost unit at or above each node
  for (int i = 0; i < n; ++i) {
    unit_of[i] = is_unit[i] ? i : (i == 0 ? -1 : unit_of[tree.node(i).parent]);
  }
  // Does unit a wrap before unit b (post-order)?
  auto wraps_first = [&](int a, int b) {
    if (a < b && b < facts.subtree_end[a]) return false;  // a encloses b
    if (b < a && a < facts.subtree_end[b]) return true;   // b encloses a
    return a < b;
  };
  std::vector<int> owner(tree.num_param_slots(), -1);  // slot -> unit node
  std::vector<int64_t> slot_numel(tree.num_param_slots(), 0);
  for (int i = 0; i < n; ++i) {
    if (unit_of[i] < 0) continue;
    for (const ParamEntry& param : tree.node(i).params) {
      if (facts.ignored_slot[param.slot]) continue;
      int& unit = owner[param.slot];
      if (unit < 0 || wraps_first(unit_of[i], unit)) unit = unit_of[i];
      slot_numel[param.slot] = param.numel;
    }
  }
  std::vector<int64_t> owned(n, 0);
  for (size_t slot = 0; slot < owner.size(); ++slot) {
    if (owner[slot] >= 0) owned[owner[slot]] += slot_numel[slot];
  }
  return owned;
}

WrapPlan make_plan(const ModuleTree& tree, const AutoWrapPolicy& policy,
                   const WrapPlanOptions& options, bool fsdp_root) {
  TORCH_CHECK(tree.size() > 0, "wrap planning: the module tree is empty");
  const TreeFacts facts = collect_facts(tree, options);
  check_not_wrapped(tree, facts);
  WrapPlan plan;
  plan.total_numel = facts.subtree_numel[0];
  std::vector<int64_t> remainder(tree.size(), 0);
  std::vector<bool> is_unit(tree.size(), false);
  if (policy != nullptr) {
    is_unit = decide_units(tree, policy, facts, options.only_wrap_children() || fsdp_root,
                           &plan.wrapped_numel, &remainder);
  } else {
    TORCH_CHECK(fsdp_root, "plan_recursive_wrap: auto_wrap_policy is empty");
  }
  if (fsdp_root) {
    // The FSDP constructor wraps the root last, around whatever no child unit took.
    is_unit[0] = true;
    remainder[0] = plan.total_numel - plan.wrapped_numel;
  }
  const std::vector<int64_t> owned = owned_numels(tree, facts, is_unit);
  for (int i = 0; i < tree.size(); ++i) {
    if (!is_unit[i]) continue;
    plan.units.push_back({i, tree.node(i).fqn, owned[i], remainder[i]});
  }
  // Post-order: by end of subtree, and an enclosing unit after the units inside it.
  plan.wrap_order.resize(plan.units.size());
  for (size_t k = 0; k < plan.units.size(); ++k) plan.wrap_order[k] = static_cast<int>(k);
  std::sort(plan.wrap_order.begin(), plan.wrap_order.end(), [&](int a, int b) {
    const int node_a = plan.units[a].node, node_b = plan.units[b].node;
    if (facts.subtree_end[node_a] != facts.subtree_end[node_b]) {
      return facts.subtree_end[node_a] < facts.subtree_end[node_b];
    }
    return node_a > node_b;
  });
  return plan;
}

}  // namespace

WrapPlan plan_recursive_wrap(const ModuleTree& tree, const AutoWrapPolicy& policy,
                             const WrapPlanOptions& options) {
  return make_plan(tree, policy, options, /*fsdp_root=*/false);
}

WrapPlan plan_fsdp_units(const ModuleTree& tree, const AutoWrapPolicy& policy,
                         const WrapPlanOptions& options) {
  return make_plan(tree, policy, options, /*fsdp_root=*/true);
}

}  // namespace fsdp
