#include "fsdp/core/fully_sharded.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fsdp/state/fqn.h"
#include <c10/util/Exception.h>

namespace fsdp {
namespace {

struct FoundUnit {
  UnitBase* unit;
  std::string fqn;  // cleaned; "" for the root
};

// Units in pre-order, below `root` and not under an ignored module.
std::vector<FoundUnit> find_units(UnitBase& root,
                                  const absl::flat_hash_set<const torch::nn::Module*>& ignored) {
  std::vector<FoundUnit> units;
  std::vector<std::string> ignored_prefixes;
  apply_to_modules(root, [&](const torch::nn::Module& module, const std::string& prefix,
                             int /*depth*/) {
    for (const std::string& skip : ignored_prefixes) {
      if (absl::StartsWith(prefix, skip)) return;
    }
    if (ignored.contains(&module)) {
      ignored_prefixes.push_back(prefix);
      return;
    }
    if (auto* unit = dynamic_cast<const UnitBase*>(&module)) {
      std::string fqn = clean_tensor_name(prefix);
      if (!fqn.empty()) fqn.pop_back();  // the trailing "."
      units.push_back({const_cast<UnitBase*>(unit), fqn});
    }
  });
  return units;
}

bool inside(const std::string& fqn, const std::string& unit_fqn) {
  return unit_fqn.empty() || fqn == unit_fqn || absl::StartsWith(fqn, unit_fqn + ".");
}

}  // namespace

NoSyncScope::NoSyncScope(core_internal::RootState& root)
    : root_(root), previous_(root.sync_gradients()) {
  root_.set_sync_gradients(false);
}
NoSyncScope::~NoSyncScope() { root_.set_sync_gradients(previous_); }

SummonFullParamsScope::SummonFullParamsScope(core_internal::RootState& root, bool writeback,
                                             bool rank0_only)
    : root_(root) {
  root_.begin_summon(writeback, rank0_only);
}
SummonFullParamsScope::~SummonFullParamsScope() { root_.end_summon(); }

std::shared_ptr<core_internal::RootState> bind_fully_sharded(
    UnitBase& root, const FullyShardedDataParallelOptions& options) {
  TORCH_CHECK(options.communicator() != nullptr,
              "FullyShardedDataParallel: options.communicator is null");
  const absl::flat_hash_set<const torch::nn::Module*> ignored(options.ignored_modules().begin(),
                                                              options.ignored_modules().end());
  std::vector<FoundUnit> units = find_units(root, ignored);
  for (const FoundUnit& found : units) {
    TORCH_CHECK(found.unit->state() == nullptr, "FullyShardedDataParallel: unit '", found.fqn,
                "' is already bound to a FullyShardedDataParallel root; wrap the model once");
  }
  // Parameters of ignored modules are left out everywhere.
  absl::flat_hash_set<const c10::TensorImpl*> ignored_params;
  for (const torch::nn::Module* module : options.ignored_modules()) {
    for (const at::Tensor& p : module->parameters()) ignored_params.insert(p.unsafeGetTensorImpl());
  }

  // Children before parents (reverse pre-order): each unit flattens the parameters of
  // its subtree that no unit inside it took (PyTorch flattens bottom-up the same way).
  struct Claim {
    std::string fqn;
    std::string unit_fqn;
  };
  absl::flat_hash_map<const c10::TensorImpl*, Claim> claimed;
  std::vector<std::vector<NamedParam>> params_of(units.size());
  for (size_t k = units.size(); k-- > 0;) {
    const FoundUnit& unit = units[k];
    const std::string prefix = unit.fqn.empty() ? "" : unit.fqn + ".";
    for (const auto& item : unit.unit->wrapped_module()->named_parameters()) {
      const c10::TensorImpl* key = item.value().unsafeGetTensorImpl();
      if (ignored_params.contains(key)) continue;
      const std::string fqn = prefix + clean_tensor_name(item.key());
      auto [it, first] = claimed.try_emplace(key, Claim{fqn, unit.fqn});
      if (!first) {
        TORCH_CHECK(inside(it->second.unit_fqn, unit.fqn), "FullyShardedDataParallel: '",
                    it->second.fqn, "' (unit '", it->second.unit_fqn, "') and '", fqn,
                    "' (unit '", unit.fqn, "') are the same parameter in two units; a "
                    "shared parameter must live in one unit: make one unit contain both "
                    "users, or untie the parameter");
        continue;  // taken by a unit inside this one, or seen twice in this unit
      }
      params_of[k].push_back({fqn, item.value()});
    }
  }

  auto root_state = std::make_shared<core_internal::RootState>(options.communicator(),
                                                               options.sharding_strategy());
  for (size_t k = 0; k < units.size(); ++k) {
    std::unique_ptr<FlatParamHandle> handle;
    if (!params_of[k].empty()) {
      handle = std::make_unique<FlatParamHandle>(params_of[k], options.communicator(),
                                                 options.sharding_strategy());
    }
    auto state = std::make_shared<core_internal::UnitState>(units[k].fqn, k == 0,
                                                            root_state.get(), std::move(handle));
    state->install_gradient_sink();
    units[k].unit->bind(state);
    root_state->add_unit(std::move(state));
  }
  return root_state;
}

}  // namespace fsdp
