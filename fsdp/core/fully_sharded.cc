#include "fsdp/core/fully_sharded.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/nn/modules/container/sequential.h>

#include "fsdp/base/names.h"
#include "fsdp/base/torch_compat.h"
#include "fsdp/core/internal/runtime.h"
#include "fsdp/wrap/module_tree.h"
#include "fsdp/wrap/recursive_wrap.h"

namespace fsdp {
namespace core_internal {

// Note [Annotated modules]
// fsdp::wrap inside an EnableWrap scope leaves the module as it is, so its parent holds
// and calls the user's type (a ModuleList entry stays a BlockImpl), and records the
// annotation here, keyed by the module: the unit settings and, if the scope shards on
// construction, the flat parameter made at once. The root that binds the model registers
// a unit in the module's place exactly as for a module its auto_wrap_policy picks
// (make_picked_unit: a Sequential child is swapped for an AnyUnitImpl, any other parent
// keeps calling the module, through fsdp::forward_as, and a direct call is the error of
// Note [A unit's module called directly] in unit.cc) and hands the unit the annotation.
// Entries hold their module weakly: one whose module is gone is dropped at the next
// annotation. Ranks may be threads, so the table is locked.
struct WrapAnnotationEntry {
  std::weak_ptr<torch::nn::Module> module;
  UnitOptions options;
  std::unique_ptr<FlatParamHandle> handle;
};

struct WrapAnnotations {
  std::mutex mutex;
  absl::flat_hash_map<const torch::nn::Module*, WrapAnnotationEntry> entries;
  // The live entry of `module`, or null (the caller holds the lock).
  WrapAnnotationEntry* find(const torch::nn::Module& module) {
    auto it = entries.find(&module);
    if (it == entries.end()) return nullptr;
    if (it->second.module.lock().get() != &module) {  // gone; the address was reused
      entries.erase(it);
      return nullptr;
    }
    return &it->second;
  }
};

WrapAnnotations& wrap_annotations() {
  static auto* annotations = new WrapAnnotations();  // never destroyed: modules outlive statics
  return *annotations;
}

// The flat parameter a unit or an annotated module below a module being sharded made.
const FlatParamHandle* constructed_handle_of(const torch::nn::Module& module) {
  if (const auto* unit = dynamic_cast<const UnitBase*>(&module)) return unit->constructed_handle();
  WrapAnnotations& annotations = wrap_annotations();
  std::lock_guard<std::mutex> lock(annotations.mutex);
  const WrapAnnotationEntry* entry = annotations.find(module);
  return entry == nullptr ? nullptr : entry->handle.get();
}

// The annotation fsdp::wrap recorded for `module`, removed, or nullopt.
c10::optional<WrapAnnotationEntry> take_wrap_annotation(const torch::nn::Module& module) {
  WrapAnnotations& annotations = wrap_annotations();
  std::lock_guard<std::mutex> lock(annotations.mutex);
  WrapAnnotationEntry* entry = annotations.find(module);
  if (entry == nullptr) return c10::nullopt;
  WrapAnnotationEntry taken = std::move(*entry);
  annotations.entries.erase(&module);
  return taken;
}

struct UnitBinder {
  static void bind(UnitBase& unit, std::shared_ptr<UnitState> state) {
    unit.bind(std::move(state));
  }
  // An fsdp::wrap annotation, for the unit registered in its module's place (Note
  // [Annotated modules]).
  static void annotate(UnitBase& unit, const UnitOptions& options,
                       std::unique_ptr<FlatParamHandle> handle) {
    unit.annotation_ = {/*annotated=*/true, options};
    unit.constructed_handle_ = std::move(handle);
  }
  // CustomPolicy's overrides for a unit it picked.
  static void override_options(UnitBase& unit, const UnitOptions& options) {
    if (options.sharding_strategy()) {
      unit.annotation_.options.sharding_strategy(options.sharding_strategy());
    }
    if (options.mixed_precision()) {
      unit.annotation_.options.mixed_precision(options.mixed_precision());
    }
  }
};

}  // namespace core_internal
namespace {

// Note [Auto-wrapping]
// With an auto_wrap_policy, fsdp/wrap's recursive_wrap (PyTorch's _recursive_wrap) runs
// over the model with only_wrap_children, seeing through every Unit<T> (a Unit's place in
// the tree shows the module it wraps). Its factory changes nothing; its replace_child
// makes each picked module a unit where its parent calls it: a Unit<T> around it is
// activated; a torch::nn::Sequential child is swapped, in the Sequential's own AnyModule
// list and its registered children, for an AnyUnitImpl around it; any other parent (a
// ModuleList the parent casts from, a typed member) keeps calling the module itself, so
// a HeldModuleUnit around it takes its place among the parent's registered children only
// (names and state dicts as PyTorch's) and the parent's calls reach it through
// fsdp::forward_as; a direct call is an error naming the unit (Note [A unit's module
// called directly] in unit.cc).

// A unit around a module its parent holds and calls itself (see the Note): it has no
// forward of its own; fsdp::forward_as runs the module through it.
class HeldModuleUnit : public UnitBase {
 public:
  explicit HeldModuleUnit(std::shared_ptr<torch::nn::Module> module)
      : UnitBase(UnitAnnotation{}),
        module_(register_module(std::string(kFsdpWrappedModule), std::move(module))) {}
  std::shared_ptr<torch::nn::Module> wrapped_module() const override { return module_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
};

// recursive_wrap's replace_child for FSDP (see the Note): makes the picked `child` a unit
// where `parent` calls it and adds it to `picked`.
UnitBase* make_picked_unit(torch::nn::Module& parent, const std::string& child_name,
                           std::shared_ptr<torch::nn::Module> registered,
                           absl::flat_hash_set<const UnitBase*>& picked) {
  if (auto* unit = dynamic_cast<UnitBase*>(registered.get())) {
    picked.insert(unit);
    return unit;
  }
  if (auto* sequential = dynamic_cast<torch::nn::SequentialImpl*>(&parent)) {
    for (auto it = sequential->begin(); it != sequential->end(); ++it) {
      if (it->ptr() != registered) continue;
      auto unit = std::make_shared<AnyUnitImpl>(std::move(*it));
      *it = torch::nn::AnyModule(unit);
      sequential->replace_module(child_name, unit);
      picked.insert(unit.get());
      return unit.get();
    }
  }
  auto unit = std::make_shared<HeldModuleUnit>(std::move(registered));
  parent.replace_module(child_name, unit);
  picked.insert(unit.get());
  return unit.get();
}

// What FSDP leaves alone: ignored_modules or ignored_states, resolved.
struct Ignored {
  std::vector<const torch::nn::Module*> modules;
  absl::flat_hash_set<const torch::nn::Module*> module_set;
  absl::flat_hash_set<const c10::TensorImpl*> params;  // the modules' and the single ones
  std::vector<at::Tensor> param_list;                  // the same, once each
  std::vector<at::Tensor> trained;                     // those that require grad, once each
};

// `root`'s units add the ignored_modules of their UnitOptions.
Ignored resolve_ignored(const FullyShardedDataParallelOptions& options,
                        const torch::nn::Module& root) {
  TORCH_CHECK(options.ignored_modules().empty() || options.ignored_states().empty(),
              "FullyShardedDataParallel: give ignored_modules or ignored_states, not both "
              "(ignored_states takes modules too)");
  Ignored ignored;
  ignored.modules = options.ignored_modules();
  // The root itself has no settings of its own (and is not in a shared_ptr yet).
  for (const auto& module : root.modules(/*include_self=*/false)) {
    if (const auto* unit = dynamic_cast<const UnitBase*>(module.get())) {
      const std::vector<const torch::nn::Module*>& own = unit->unit_options().ignored_modules();
      ignored.modules.insert(ignored.modules.end(), own.begin(), own.end());
    }
  }
  std::vector<at::Tensor> params;
  for (const IgnoredState& state : options.ignored_states()) {
    if (state.module() != nullptr) {
      ignored.modules.push_back(state.module());
    } else {
      TORCH_CHECK(state.parameter().defined(),
                  "FullyShardedDataParallel: ignored_states "
                  "holds an undefined tensor; pass the model's parameters or modules");
      params.push_back(state.parameter());
    }
  }
  for (const torch::nn::Module* module : ignored.modules) {
    TORCH_CHECK(module != nullptr, "FullyShardedDataParallel: a null module is ignored");
    ignored.module_set.insert(module);
    for (const at::Tensor& p : module->parameters()) params.push_back(p);
  }
  for (const at::Tensor& p : params) {
    if (!ignored.params.insert(p.unsafeGetTensorImpl()).second) continue;
    ignored.param_list.push_back(p);
    if (p.requires_grad()) ignored.trained.push_back(p);
  }
  return ignored;
}

// auto_wrap_policy, or param_exec_order_wrap_policy's init_policy; null if neither.
AutoWrapPolicy wrap_policy(const FullyShardedDataParallelOptions& options) {
  TORCH_CHECK(!(options.auto_wrap_policy() && options.param_exec_order_wrap_policy()),
              "FullyShardedDataParallel: give auto_wrap_policy or "
              "param_exec_order_wrap_policy (whose init_policy picks the units), not both");
  if (options.param_exec_order_wrap_policy()) {
    TORCH_CHECK(options.param_exec_order_wrap_policy()->init_policy() != nullptr,
                "FullyShardedDataParallel: param_exec_order_wrap_policy has no init_policy");
    return options.param_exec_order_wrap_policy()->init_policy();
  }
  return options.auto_wrap_policy();
}

// The units the policy picks (see the Note), and the root.
absl::flat_hash_set<const UnitBase*> apply_policy(UnitBase& root,
                                                  const FullyShardedDataParallelOptions& options,
                                                  const Ignored& ignored) {
  RecursiveWrapOptions wrap_options;
  wrap_options.only_wrap_children(true).ignored_params(ignored.param_list);
  for (const torch::nn::Module* module : ignored.modules) {
    wrap_options.ignored_modules().push_back(module);
    // The tree shows the module a Unit<T> wraps in the Unit's place.
    if (auto* unit = dynamic_cast<const UnitBase*>(module)) {
      wrap_options.ignored_modules().push_back(unit->wrapped_module().get());
    }
  }
  wrap_options.unwrap([](const torch::nn::Module& module) -> const torch::nn::Module* {
    auto* unit = dynamic_cast<const UnitBase*>(&module);
    return unit == nullptr ? nullptr : unit->wrapped_module().get();
  });
  absl::flat_hash_set<const UnitBase*> picked = {&root};
  AutoWrapPolicy policy = wrap_policy(options);
  // A copy: `policy` may be wrapped in an or_policy below.
  std::shared_ptr<const CustomPolicy> custom;
  if (const auto* given = policy.target<CustomPolicy>()) {
    custom = std::make_shared<const CustomPolicy>(*given);
  }
  wrap_options.replace_child([&picked, custom](torch::nn::Module& parent, const ModuleNode& child,
                                               std::shared_ptr<torch::nn::Module> registered) {
    UnitBase* unit = make_picked_unit(parent, child.name, std::move(registered), picked);
    if (custom == nullptr) return;
    if (c10::optional<UnitOptions> own = custom->unit_options(child)) {
      core_internal::UnitBinder::override_options(*unit, *own);
    }
  });
  if (options.mixed_precision() && options.mixed_precision()->full_precision_modules()) {
    // See Note [Mixed precision] in internal/runtime.cc: as PyTorch's _or_policy with
    // _wrap_module_cls_individually over _module_classes_to_ignore.
    policy = or_policy({policy, lambda_auto_wrap_policy(
                                    [full = options.mixed_precision()->full_precision_modules()](
                                        const ModuleNode& node) {
                                      return node.cpp_module != nullptr && full(*node.cpp_module);
                                    })});
  }
  recursive_wrap(
      root.wrapped_module(), policy,
      [](std::shared_ptr<torch::nn::Module> module) { return module; }, wrap_options);
  return picked;
}

struct FoundUnit {
  UnitBase* unit;
  std::string fqn;  // cleaned; "" for the root
};

// Units in pre-order, below `root` and not under an ignored module.
std::vector<FoundUnit> find_units(UnitBase& root,
                                  const absl::flat_hash_set<const torch::nn::Module*>& ignored) {
  std::vector<FoundUnit> units;
  std::vector<std::string> ignored_prefixes;
  apply_to_modules(root, [&](torch::nn::Module& module, const std::string& prefix, int /*depth*/) {
    for (const std::string& skip : ignored_prefixes) {
      if (absl::StartsWith(prefix, skip)) return;
    }
    auto* unit = dynamic_cast<UnitBase*>(&module);
    if (ignored.contains(&module) || (unit && ignored.contains(unit->wrapped_module().get()))) {
      ignored_prefixes.push_back(prefix);
      return;
    }
    if (unit != nullptr) {
      std::string fqn = clean_tensor_name(prefix);
      if (!fqn.empty()) fqn.pop_back();  // the trailing "."
      units.push_back({unit, fqn});
    }
  });
  return units;
}

// Every rank's `tensors` := rank 0's: one broadcast per dtype of their concatenation.
void broadcast_from_rank0(Communicator& comm, const std::vector<at::Tensor>& tensors) {
  std::map<c10::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& t : tensors) by_dtype[t.scalar_type()].push_back(t.detach());
  for (auto& [dtype, group] : by_dtype) {
    TORCH_CHECK(is_supported_dtype(dtype),
                "FullyShardedDataParallel: sync_module_states "
                "cannot broadcast tensors of dtype ",
                dtype,
                "; convert them or leave their "
                "module out with ignored_modules");
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : group) flat.push_back(t.reshape({-1}));
    at::Tensor buffer = at::cat(flat);
    comm.broadcast(buffer, /*root=*/0);
    int64_t offset = 0;
    for (at::Tensor& t : group) {
      t.copy_(buffer.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

// The buffers of `root`'s tree except those of `ignored` and `excluded` modules (and
// everything below them).
std::vector<at::Tensor> buffers_outside(const torch::nn::Module& root,
                                        const std::vector<const torch::nn::Module*>& ignored,
                                        const std::vector<const torch::nn::Module*>& excluded) {
  absl::flat_hash_set<const c10::TensorImpl*> skip;
  for (const auto* list : {&ignored, &excluded}) {
    for (const torch::nn::Module* module : *list) {
      for (const at::Tensor& b : module->buffers()) skip.insert(b.unsafeGetTensorImpl());
    }
  }
  std::vector<at::Tensor> buffers;
  for (const at::Tensor& b : root.buffers()) {
    if (!skip.contains(b.unsafeGetTensorImpl())) buffers.push_back(b);
  }
  return buffers;
}

// One rank has nothing to shard: every strategy runs as NO_SHARD, without collectives,
// as in PyTorch.
ShardingStrategy effective_strategy(const FullyShardedDataParallelOptions& options) {
  return options.communicator()->world_size() == 1 ? ShardingStrategy::kNoShard
                                                   : options.sharding_strategy();
}

// The strategy of `unit` (the root if `is_root`): its own from fsdp::wrap, or the one
// unit_sharding_strategies gives it, or the root's. `fqn` names it in errors.
// `unit` may be null (a module fsdp::wrap annotated, being sharded on construction).
ShardingStrategy unit_strategy(const FullyShardedDataParallelOptions& options,
                               const UnitOptions& own, const torch::nn::Module* unit,
                               const torch::nn::Module& wrapped, bool is_root,
                               const std::string& fqn) {
  const ShardingStrategy root = effective_strategy(options);
  c10::optional<ShardingStrategy> asked = own.sharding_strategy();
  const char* source = "fsdp::wrap";
  for (const auto& [module, strategy] : options.unit_sharding_strategies()) {
    if ((unit == nullptr || module != unit) && module != &wrapped) continue;
    TORCH_CHECK(!asked, "FullyShardedDataParallel: unit '", fqn,
                "' has a sharding strategy from fsdp::wrap and from unit_sharding_strategies; "
                "give it one");
    asked = strategy;
    source = "unit_sharding_strategies";
  }
  if (!asked || *asked == options.sharding_strategy()) return root;
  TORCH_CHECK(!is_hybrid(*asked) && !is_hybrid(root) && !is_root,
              "FullyShardedDataParallel: ", source, " gives unit '", fqn, "' ",
              sharding_strategy_name(*asked), " under a ", sharding_strategy_name(root),
              " root; only non-root units, and only FULL_SHARD, "
              "SHARD_GRAD_OP or NO_SHARD under a non-HYBRID root, can differ");
  // One rank shards nothing, whatever was asked (as effective_strategy).
  return options.communicator()->world_size() == 1 ? ShardingStrategy::kNoShard : *asked;
}

ShardingStrategy unit_strategy(const FullyShardedDataParallelOptions& options, const UnitBase& unit,
                               bool is_root, const std::string& fqn) {
  return unit_strategy(options, unit.unit_options(), &unit, *unit.wrapped_module(), is_root, fqn);
}

// The mixed precision of a unit with settings `own`: its own from fsdp::wrap, or the root's.
const c10::optional<MixedPrecision>& unit_mixed_precision(
    const FullyShardedDataParallelOptions& options, const UnitOptions& own) {
  return own.mixed_precision() ? own.mixed_precision() : options.mixed_precision();
}

bool is_full_precision(const c10::optional<MixedPrecision>& mp, const torch::nn::Module& wrapped) {
  return mp && mp->full_precision_modules() && mp->full_precision_modules()(wrapped);
}

// The mixed-precision and offload parts of a unit's FlatParamOptions.
FlatParamOptions flat_param_options(const c10::optional<MixedPrecision>& mp,
                                    const torch::nn::Module& wrapped, const CPUOffload& offload) {
  FlatParamOptions flat;
  flat.offload_params(offload.offload_params());
  if (mp && !is_full_precision(mp, wrapped)) {
    flat.param_dtype(mp->param_dtype())
        .reduce_dtype(mp->reduce_dtype())
        .keep_low_precision_grads(mp->keep_low_precision_grads());
  }
  return flat;
}

// A root taking over a unit's constructed flat parameter: it must be what the root
// itself would have made.
void check_constructed_handle(const FlatParamHandle& handle, const std::string& unit_fqn,
                              ShardingStrategy strategy, const FlatParamOptions& want,
                              const Communicator& comm) {
  TORCH_CHECK(handle.device() == want.device_handle()->device(), "FullyShardedDataParallel: unit '",
              unit_fqn, "' was sharded at construction (EnableWrap) on ", handle.device(),
              ", but this root computes on ", want.device_handle()->device(),
              "; give the scope the root's device_id");
  const c10::ScalarType param_dtype =
      want.param_dtype().value_or(handle.sharded_flat_param().scalar_type());
  TORCH_CHECK(handle.offloads_params() == want.offload_params(), "FullyShardedDataParallel: unit '",
              unit_fqn, "' was sharded at construction (EnableWrap) with cpu_offload ",
              handle.offloads_params() ? "on" : "off", ", but this root has it ",
              want.offload_params() ? "on" : "off", "; pass the root the options the scope had");
  TORCH_CHECK(handle.strategy() == strategy && handle.param_dtype() == param_dtype &&
                  handle.reduce_dtype() == want.reduce_dtype().value_or(param_dtype) &&
                  &handle.communicator() == &comm,
              "FullyShardedDataParallel: unit '", unit_fqn, "' was sharded at construction ",
              "(EnableWrap) as ", sharding_strategy_name(handle.strategy()), " with param dtype ",
              handle.param_dtype(), " (reduce dtype ", handle.reduce_dtype(),
              "), but this root uses ", sharding_strategy_name(strategy), " with param dtype ",
              param_dtype, " (reduce dtype ", want.reduce_dtype().value_or(param_dtype), ")",
              &handle.communicator() == &comm ? "" : " and another communicator",
              "; pass the root the options the scope had");
}

// sync_module_states: rank 0's unit parameters (those not sharded at construction) and
// buffers outside ignored modules, one unit at a time.
void sync_module_states(Communicator& comm, const torch::nn::Module& root, const Ignored& ignored,
                        const std::vector<std::vector<NamedParam>>& params_of) {
  for (const std::vector<NamedParam>& params : params_of) {
    std::vector<at::Tensor> tensors;
    for (const NamedParam& p : params) tensors.push_back(p.param);
    broadcast_from_rank0(comm, tensors);
  }
  broadcast_from_rank0(comm, buffers_outside(root, ignored.modules, {}));
}

// Note [Shared parameters]
// A parameter registered by several modules (tied weights) belongs to the lowest unit that
// contains every module registering it. PyTorch FSDP lets the first unit built (the
// innermost) take it, which breaks when an enclosing module uses it after that unit has
// resharded (pytorch#83052); its guidance is that shared parameters live in one unit. The
// owner's forward encloses every user's, so the parameter is unsharded whenever it is
// read. Units containing all registrations form a chain from the root down; in pre-order
// the deepest of them comes last.
struct ParamOwners {
  absl::flat_hash_map<const c10::TensorImpl*, size_t> unit;  // index into the units
  absl::flat_hash_map<const c10::TensorImpl*, std::vector<std::string>> fqns;  // every name
};

ParamOwners assign_param_owners(UnitBase& root, const std::vector<FoundUnit>& units,
                                const absl::flat_hash_set<const c10::TensorImpl*>& ignored) {
  ParamOwners owners;
  for (const auto& item : root.named_parameters()) {
    const c10::TensorImpl* key = item.value().unsafeGetTensorImpl();
    if (!ignored.contains(key)) owners.fqns[key].push_back(clean_tensor_name(item.key()));
  }
  for (size_t k = 0; k < units.size(); ++k) {
    absl::flat_hash_map<const c10::TensorImpl*, size_t> registrations;
    for (const auto& item : units[k].unit->wrapped_module()->named_parameters()) {
      ++registrations[item.value().unsafeGetTensorImpl()];
    }
    for (const auto& [key, count] : registrations) {
      auto it = owners.fqns.find(key);
      if (it != owners.fqns.end() && count == it->second.size()) owners.unit[key] = k;
    }
  }
  return owners;
}

// Note [Construction fingerprint]
// Ranks that build different models or options (another sharding strategy, another wrap
// plan, a different mixed precision) would issue collectives of different sizes or in a
// different order: a hang or silent corruption far from the cause. So every root
// all-gathers a fingerprint of what it built (one hash of the description below, plus
// its strategy, unit count and parameter count) and compares before anything else
// communicates. PyTorch leaves this to FSDP_DEBUG_LEVEL=DETAIL's checks. The fingerprint
// travels as a tensor on the compute device (Note [Compute device]; NCCL takes only CUDA
// tensors) and is read back on the CPU.
void check_same_construction(Communicator& comm, c10::Device device,
                             const FullyShardedDataParallelOptions& options,
                             const std::vector<std::string>& unit_names,
                             const std::vector<int64_t>& unit_numels) {
  if (comm.world_size() == 1) return;
  std::string description = absl::StrCat(sharding_strategy_name(options.sharding_strategy()),
                                         "/F=", options.hybrid_shard_group_size());
  const c10::optional<MixedPrecision>& mp = options.mixed_precision();
  if (mp) {
    absl::StrAppend(&description, "/mp=", mp->param_dtype() ? int(*mp->param_dtype()) : -1, ",",
                    mp->reduce_dtype() ? int(*mp->reduce_dtype()) : -1, ",",
                    mp->buffer_dtype() ? int(*mp->buffer_dtype()) : -1);
  }
  int64_t total = 0;
  for (size_t k = 0; k < unit_names.size(); ++k) {
    absl::StrAppend(&description, "|", unit_names[k], "=", unit_numels[k]);
    total += unit_numels[k];
  }
  const int64_t mine[4] = {static_cast<int64_t>(std::hash<std::string>()(description)),
                           static_cast<int64_t>(options.sharding_strategy()),
                           static_cast<int64_t>(unit_names.size()), total};
  const auto on_device = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor all = at::empty({4 * comm.world_size()}, on_device);
  comm.all_gather_into_tensor(all, at::tensor(std::vector<int64_t>(mine, mine + 4), on_device));
  all = all.cpu();
  const int64_t* a = all.data_ptr<int64_t>();
  for (int r = 0; r < comm.world_size(); ++r) {
    if (a[4 * r] == a[0]) continue;
    const int64_t* theirs = a + 4 * r;
    std::string what;
    if (theirs[1] != a[1]) {
      what = absl::StrCat(
          "sharding strategy ", sharding_strategy_name(static_cast<ShardingStrategy>(theirs[1])),
          " vs rank 0's ", sharding_strategy_name(static_cast<ShardingStrategy>(a[1])));
    } else if (theirs[2] != a[2] || theirs[3] != a[3]) {
      what = absl::StrCat("a wrap plan of ", theirs[2], " units and ", theirs[3],
                          " parameters vs rank 0's ", a[2], " units and ", a[3]);
    } else {
      what = "different options (hybrid group size, mixed precision) or unit names and settings";
    }
    TORCH_CHECK(false, "FullyShardedDataParallel: rank ", r,
                " built a different model than "
                "rank 0: ",
                what,
                ". Every rank must construct the same model with the same "
                "options (see Note [Construction fingerprint])");
  }
}

// Registers a unit in the place of every module below `root` that fsdp::wrap annotated
// (Note [Annotated modules]); the root's own module, if annotated, gives the root its
// annotation's flat parameter.
void make_annotated_units(UnitBase& root) {
  if (c10::optional<core_internal::WrapAnnotationEntry> own =
          core_internal::take_wrap_annotation(*root.wrapped_module())) {
    if (own->handle != nullptr) {
      core_internal::UnitBinder::annotate(root, root.unit_options(), std::move(own->handle));
    }
  }
  // Depth-first over the module tree (finite: LibTorch refuses cycles).
  std::vector<std::shared_ptr<torch::nn::Module>> stack = {root.wrapped_module()};
  while (!stack.empty()) {
    std::shared_ptr<torch::nn::Module> parent = std::move(stack.back());
    stack.pop_back();
    for (const auto& item : parent->named_children()) {
      std::shared_ptr<torch::nn::Module> child = item.value();
      if (auto* unit = dynamic_cast<UnitBase*>(child.get())) {
        stack.push_back(unit->wrapped_module());
        continue;
      }
      if (c10::optional<core_internal::WrapAnnotationEntry> annotation =
              core_internal::take_wrap_annotation(*child)) {
        absl::flat_hash_set<const UnitBase*> made;
        UnitBase* unit = make_picked_unit(*parent, item.key(), child, made);
        core_internal::UnitBinder::annotate(*unit, annotation->options,
                                            std::move(annotation->handle));
      }
      stack.push_back(std::move(child));
    }
  }
}

// The units this root binds, in pre-order (the root first): every annotated unit outside
// ignored modules, or those the auto_wrap_policy picks. Throws if one is bound already or
// if a unit sharded at construction lies under an ignored module.
std::vector<FoundUnit> select_units(UnitBase& root, const FullyShardedDataParallelOptions& options,
                                    const Ignored& ignored) {
  std::vector<FoundUnit> units;
  if (wrap_policy(options) != nullptr) {
    const absl::flat_hash_set<const UnitBase*> active = apply_policy(root, options, ignored);
    units = find_units(root, ignored.module_set);
    units.erase(std::remove_if(units.begin(), units.end(),
                               [&](const FoundUnit& f) { return !active.contains(f.unit); }),
                units.end());
  } else {
    units = find_units(root, ignored.module_set);
    units.erase(std::remove_if(units.begin(), units.end(),
                               [](const FoundUnit& f) { return !f.unit->annotated(); }),
                units.end());
  }
  for (const FoundUnit& found : units) {
    TORCH_CHECK(!found.unit->is_bound(), "FullyShardedDataParallel: unit '", found.fqn,
                "' is already bound to a FullyShardedDataParallel root; wrap the model once");
  }
  // A unit sharded at construction that this root will not bind (under an ignored
  // module) would run on freed parameters.
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const auto* unit = dynamic_cast<const UnitBase*>(item.value().get());
    const bool found =
        std::any_of(units.begin(), units.end(), [&](const FoundUnit& f) { return f.unit == unit; });
    TORCH_CHECK(unit == nullptr || unit->constructed_handle() == nullptr || found,
                "FullyShardedDataParallel: unit '", clean_tensor_name(item.key()),
                "' was sharded at construction (EnableWrap) but is inside an ignored "
                "module; build ignored modules outside that scope");
  }
  return units;
}

// What each unit (index k of the selected units) flattens.
struct UnitParams {
  std::vector<std::vector<NamedParam>> to_flatten;            // still whole
  std::vector<std::unique_ptr<FlatParamHandle>> constructed;  // see EnableWrap
};

// Checks that a unit sharded at construction took only parameters it owns and none that
// is ignored; marks them taken.
void check_constructed_params(const FlatParamHandle& handle, const FoundUnit& unit, size_t k,
                              const ParamOwners& owners, const Ignored& ignored,
                              absl::flat_hash_set<const c10::TensorImpl*>& taken) {
  const std::vector<at::Tensor>& originals = handle.original_params();
  for (size_t i = 0; i < originals.size(); ++i) {
    const c10::TensorImpl* key = originals[i].unsafeGetTensorImpl();
    const std::string& fqn = handle.param_infos()[i].fqn;
    TORCH_CHECK(!ignored.params.contains(key), "FullyShardedDataParallel: '", fqn,
                "' is ignored, but unit '", unit.fqn,
                "' sharded it at construction "
                "(EnableWrap); give the unit its ignored modules "
                "(UnitOptions::ignored_modules) or build them outside units made under "
                "that scope");
    TORCH_CHECK(owners.unit.at(key) == k, "FullyShardedDataParallel: unit '", unit.fqn,
                "' sharded '", fqn,
                "' at construction (EnableWrap), but the same "
                "parameter is also registered outside that unit (as ",
                absl::StrJoin(owners.fqns.at(key), ", "),
                "); a shared parameter must "
                "live in one unit: build every module that uses it inside one unit");
    taken.insert(key);
  }
}

// Each unit flattens the parameters it owns (see Note [Shared parameters]), named by
// their first FQN in pre-order; units sharded at construction keep what they took.
// Ignored parameters are left out everywhere.
UnitParams collect_unit_params(UnitBase& root, const std::vector<FoundUnit>& units,
                               const Ignored& ignored) {
  const ParamOwners owners = assign_param_owners(root, units, ignored.params);
  absl::flat_hash_set<const c10::TensorImpl*> taken;
  UnitParams result;
  result.to_flatten.resize(units.size());
  result.constructed.resize(units.size());
  for (size_t k = 0; k < units.size(); ++k) {
    const FoundUnit& unit = units[k];
    const std::string prefix = unit.fqn.empty() ? "" : unit.fqn + ".";
    std::unique_ptr<FlatParamHandle>& constructed = result.constructed[k];
    constructed = unit.unit->take_constructed_handle();
    if (constructed != nullptr) {
      constructed->add_fqn_prefix(prefix);
      check_constructed_params(*constructed, unit, k, owners, ignored, taken);
    }
    for (const auto& item : unit.unit->wrapped_module()->named_parameters()) {
      const c10::TensorImpl* key = item.value().unsafeGetTensorImpl();
      auto owner = owners.unit.find(key);
      if (owner == owners.unit.end() || owner->second != k || !taken.insert(key).second) {
        continue;  // ignored, owned by another unit, or met before
      }
      result.to_flatten[k].push_back({prefix + clean_tensor_name(item.key()), item.value()});
    }
  }
  return result;
}

// Each unit's FQN with its own settings from fsdp::wrap, for the construction fingerprint.
std::vector<std::string> unit_names(const std::vector<FoundUnit>& units) {
  std::vector<std::string> names;
  for (const FoundUnit& unit : units) {
    std::string name = unit.fqn;
    const UnitOptions& own = unit.unit->unit_options();
    if (own.sharding_strategy()) {
      absl::StrAppend(&name, "/", sharding_strategy_name(*own.sharding_strategy()));
    }
    if (const c10::optional<MixedPrecision>& mp = own.mixed_precision()) {
      absl::StrAppend(&name, "/mp=", mp->param_dtype() ? int(*mp->param_dtype()) : -1, ",",
                      mp->reduce_dtype() ? int(*mp->reduce_dtype()) : -1);
    }
    names.push_back(std::move(name));
  }
  return names;
}

std::vector<int64_t> unit_numels(const UnitParams& params) {
  std::vector<int64_t> numels;
  for (size_t k = 0; k < params.to_flatten.size(); ++k) {
    int64_t numel = params.constructed[k] != nullptr ? params.constructed[k]->numel() : 0;
    for (const NamedParam& p : params.to_flatten[k]) numel += p.param.numel();
    numels.push_back(numel);
  }
  return numels;
}

// The ranks flat parameters are sharded over, and (HYBRID) the replicas gradients are
// all-reduced over.
struct ShardGroups {
  std::shared_ptr<Communicator> shard;
  std::shared_ptr<Communicator> replicate;  // HYBRID only
};

// Units sharded at construction under a HYBRID strategy (EnableWrap) used the groups
// their scope split; the root reuses them, so every unit shares one pair of groups.
ShardGroups shard_groups(const FullyShardedDataParallelOptions& options, ShardingStrategy strategy,
                         const std::vector<std::unique_ptr<FlatParamHandle>>& constructed = {}) {
  if (!is_hybrid(strategy)) return {options.communicator(), nullptr};
  for (const std::unique_ptr<FlatParamHandle>& handle : constructed) {
    if (handle != nullptr && handle->replicate_communicator() != nullptr) {
      return {handle->shared_communicator(), handle->shared_replicate_communicator()};
    }
  }
  Communicator& comm = *options.communicator();
  const int f = options.hybrid_shard_group_size();
  TORCH_CHECK(f >= 1 && comm.world_size() % f == 0,
              "FullyShardedDataParallel: ", sharding_strategy_name(strategy),
              " needs hybrid_shard_group_size F >= 1 "
              "dividing the world size ",
              comm.world_size(), ", got ", f,
              "; set it to the ranks of one host (e.g. LOCAL_WORLD_SIZE)");
  HybridGroups groups = comm.split_hybrid(f);
  return {groups.shard_group, groups.replicate_group};
}

// A unit's parameters in flat parameters of one kind and dtype each (order kept in each):
// the trainable ones first, then the frozen ones of each dtype, dtypes in the order they
// first appear. See Note [Frozen parameters in a unit] in internal/runtime.cc and Note
// [Flat parameters of several dtypes] in flat_param.cc.
std::vector<std::vector<NamedParam>> group_by_kind_and_dtype(std::vector<NamedParam> params,
                                                             const std::string& unit_fqn) {
  std::vector<NamedParam> trainable;
  std::vector<std::vector<NamedParam>> frozen;  // one per dtype
  for (NamedParam& p : params) {
    if (p.param.requires_grad()) {
      TORCH_CHECK(
          trainable.empty() || trainable.front().param.scalar_type() == p.param.scalar_type(),
          "FullyShardedDataParallel: the trainable parameters of unit '", unit_fqn,
          "' must share one dtype (their gradients are reduced together, as in "
          "PyTorch's FSDP), but '",
          trainable.front().fqn, "' is ", trainable.front().param.scalar_type(), " and '", p.fqn,
          "' is ", p.param.scalar_type(),
          "; convert them to one dtype, freeze one of them, or put them in separate "
          "units (an auto_wrap_policy or fsdp::wrap)");
      trainable.push_back(std::move(p));
      continue;
    }
    auto group = std::find_if(frozen.begin(), frozen.end(), [&](const auto& g) {
      return g.front().param.scalar_type() == p.param.scalar_type();
    });
    if (group == frozen.end()) {
      frozen.emplace_back();
      group = frozen.end() - 1;
    }
    group->push_back(std::move(p));
  }
  std::vector<std::vector<NamedParam>> groups;
  if (!trainable.empty()) groups.push_back(std::move(trainable));
  for (auto& group : frozen) groups.push_back(std::move(group));
  return groups;
}

// Makes each unit's flat parameter (or takes the one made at construction) and runtime
// state, binds the unit and adds it to `root_state`. Returns the wrapped modules that
// stay in full precision.
std::vector<const torch::nn::Module*> bind_units(const FullyShardedDataParallelOptions& options,
                                                 const ShardGroups& groups,
                                                 const std::shared_ptr<DeviceHandle>& device,
                                                 const std::vector<FoundUnit>& units,
                                                 UnitParams& params,
                                                 core_internal::RootState& root_state) {
  // Every unit's strategy is checked before any parameter is flattened, so a model
  // refused here is left as it was.
  std::vector<ShardingStrategy> strategies;
  for (size_t k = 0; k < units.size(); ++k) {
    strategies.push_back(unit_strategy(options, *units[k].unit, k == 0, units[k].fqn));
  }
  std::vector<const torch::nn::Module*> full_precision_modules;
  for (size_t k = 0; k < units.size(); ++k) {
    const torch::nn::Module& wrapped = *units[k].unit->wrapped_module();
    const c10::optional<MixedPrecision>& mp =
        unit_mixed_precision(options, units[k].unit->unit_options());
    const bool full_precision = is_full_precision(mp, wrapped);
    FlatParamOptions unit_options = flat_param_options(mp, wrapped, options.cpu_offload());
    unit_options.replicate_communicator(groups.replicate);
    unit_options.device_handle(device);
    const ShardingStrategy own = strategies[k];
    std::unique_ptr<FlatParamHandle> handle = std::move(params.constructed[k]);
    std::vector<std::unique_ptr<FlatParamHandle>> frozen_handles;
    if (handle != nullptr) {
      check_constructed_handle(*handle, units[k].fqn, own, unit_options, *groups.shard);
    } else if (!params.to_flatten[k].empty()) {
      for (std::vector<NamedParam>& group :
           group_by_kind_and_dtype(std::move(params.to_flatten[k]), units[k].fqn)) {
        auto made =
            std::make_unique<FlatParamHandle>(std::move(group), groups.shard, own, unit_options);
        if (handle == nullptr) {
          handle = std::move(made);
        } else {
          frozen_handles.push_back(std::move(made));
        }
      }
    }
    auto state = std::make_shared<core_internal::UnitState>(
        units[k].fqn, k == 0, &root_state, std::move(handle), std::move(frozen_handles));
    if (full_precision) {
      full_precision_modules.push_back(&wrapped);
      if (state->handle() != nullptr) {
        state->set_input_casting(state->handle()->param_dtype(), /*restore_output_dtype=*/true);
      }
    } else if (mp && (k == 0 ? mp->cast_root_forward_inputs() : mp->cast_forward_inputs())) {
      state->set_input_casting(mp->param_dtype(), /*restore_output_dtype=*/false);
    }
    if (dynamic_cast<const HeldModuleUnit*>(units[k].unit) != nullptr) {
      state->set_parent_holds_module(c10::demangle(typeid(wrapped).name()));
    }
    core_internal::UnitBinder::bind(*units[k].unit, state);
    // See Note [Original parameters are not leaves].
    state->install_gradient_sink();
    root_state.add_unit(std::move(state));
  }
  return full_precision_modules;
}

// The root's state beyond its units: buffer casts (mixed precision's buffer_dtype), the
// ignored parameters, execution-order validation.
void configure_root(const torch::nn::Module& root, const FullyShardedDataParallelOptions& options,
                    const Ignored& ignored,
                    const std::vector<const torch::nn::Module*>& full_precision_modules,
                    core_internal::RootState& root_state) {
  const c10::optional<MixedPrecision>& mp = options.mixed_precision();
  if (mp && mp->buffer_dtype()) {
    std::vector<at::Tensor> buffers;
    for (const at::Tensor& b : buffers_outside(root, ignored.modules, full_precision_modules)) {
      if (at::isFloatingType(b.scalar_type())) buffers.push_back(b);
    }
    root_state.set_buffer_casts(std::move(buffers), *mp->buffer_dtype());
  }
  root_state.set_ignored_params(ignored.trained);
  root_state.set_validate_execution_order(options.validate_execution_order());
  TORCH_CHECK(options.schedule_check_every() >= 0,
              "FullyShardedDataParallelOptions: schedule_check_every must be >= 0 (0: off), got ",
              options.schedule_check_every());
  Communicator& comm = *options.communicator();
  if (options.schedule_check_every() > 0 && comm.supports_schedule_checks()) {
    comm.enable_schedule_checks();  // every rank, here
    root_state.set_schedule_check_every(options.schedule_check_every());
  }
}

// Note [Compute device]
// PyTorch's device_id: FSDP computes on one device per rank, and the runtime reaches it
// only through that device's DeviceHandle (device_handle.h): storage free/reallocate,
// memory statistics, streams and events. With device_id the module's CPU tensors are
// moved there at construction, before flattening, as PyTorch's _move_module_to_device
// does (ignored modules' and ignored_states' tensors stay where they are, and so do the
// parameters of units sharded at construction, whose handle must already be on the
// device). Without it the device is the parameters' (the first unit parameter's; CPU for
// a model without any). One handle serves the root and every unit's flat parameter.
std::shared_ptr<DeviceHandle> compute_device(const FullyShardedDataParallelOptions& options,
                                             const UnitParams& params) {
  if (options.device_id()) return DeviceHandle::for_device(*options.device_id());
  for (const std::unique_ptr<FlatParamHandle>& handle : params.constructed) {
    if (handle != nullptr) return DeviceHandle::for_device(handle->device());
  }
  for (const std::vector<NamedParam>& unit : params.to_flatten) {
    // Meta parameters have no device yet: see Note [Initialisation on the meta device].
    if (!unit.empty() && !unit.front().param.is_meta()) {
      return DeviceHandle::for_device(unit.front().param.device());
    }
  }
  return DeviceHandle::for_device(c10::Device(c10::kCPU));
}

// Moves the CPU parameters and buffers of `root` to `device` in place (set_data: the
// same tensors, so FQNs, ignored sets and the units' lists stay valid). See Note
// [Compute device].
void move_to_device(torch::nn::Module& root, c10::Device device, const Ignored& ignored,
                    const UnitParams& params) {
  absl::flat_hash_set<const c10::TensorImpl*> stay = ignored.params;
  for (const torch::nn::Module* module : ignored.modules) {
    for (const at::Tensor& buffer : module->buffers()) stay.insert(buffer.unsafeGetTensorImpl());
  }
  for (const std::unique_ptr<FlatParamHandle>& handle : params.constructed) {
    if (handle == nullptr) continue;
    for (const at::Tensor& p : handle->original_params()) stay.insert(p.unsafeGetTensorImpl());
  }
  at::NoGradGuard no_grad;
  const auto move = [&](const std::string& name, const at::Tensor& tensor) {
    if (!tensor.defined() || stay.contains(tensor.unsafeGetTensorImpl()) || tensor.is_meta() ||
        tensor.device() == device) {
      return;
    }
    TORCH_CHECK(tensor.device().is_cpu(), "FullyShardedDataParallel: '", clean_tensor_name(name),
                "' is on ", tensor.device(), " but device_id is ", device,
                "; FSDP moves only CPU tensors to device_id (PyTorch: \"Inconsistent compute "
                "device and device_id\")");
    tensor.set_data(tensor.to(device));
  };
  for (const auto& item : root.named_parameters()) move(item.key(), item.value());
  for (const auto& item : root.named_buffers()) move(item.key(), item.value());
}

// Note [Initialisation on the meta device]
// A model whose code creates its tensors on c10::kMeta (PyTorch: built under
// torch.device("meta")) has shapes and dtypes but no values and no memory, so every rank
// can build the whole model and let FSDP decide what to allocate: the policy sees the meta
// tree (numels only), each unit's FlatParamHandle allocates just this rank's shard on the
// compute device (Note [Flat parameters of meta parameters] in flat_param.cc), and what
// FSDP leaves whole (buffers, ignored modules' and ignored_states' parameters) is allocated
// here, full, on the compute device. Every fresh allocation holds NaN (zeros for integer
// buffers) until something writes it, so a value nothing computed shows up instead of
// garbage. Values then come from FullyShardedRoot::init_parameters (PyTorch: to_empty, then
// reset_parameters) or from a state-dict reader, which copies each rank's bytes into its
// shards; non-persistent buffers (a RoPE inv_freq) are in no checkpoint, so init_parameters
// computes them. sync_module_states has nothing to broadcast and is refused.
//
// init_parameters walks the model's modules in pre-order (the order a constructor that
// builds and initialises children one after another draws random numbers in), and for each
// module with parameters or buffers of its own points each of its parameters at a scratch
// full tensor (NaN) on the compute device, calls the user's init, checks that every scratch
// value was written, copies this rank's elements into the shard
// (FlatParamHandle::copy_into_shard) and drops the scratch. So the peak is the shards plus
// one module's own parameters (at most one unit's), and since every rank draws the whole
// module from the same generator state and keeps its part, the shards equal the chunks of a
// one-process build that constructs the same modules in the same order from the same seed.
// A parameter registered by several modules (tied weights) keeps the values of its first
// registration in pre-order; the later modules' init writes a scratch that is dropped (it
// still draws, as in a one-process build that ties the head to the embedding after both
// were built).
std::vector<at::Tensor> materialize_meta_states(torch::nn::Module& root, c10::Device device,
                                                const Ignored& ignored) {
  std::vector<at::Tensor> materialized;
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  const auto allocate = [&](const at::Tensor& tensor) {
    if (!tensor.defined() || !tensor.is_meta() ||
        !seen.insert(tensor.unsafeGetTensorImpl()).second) {
      return;
    }
    at::Tensor value = at::empty(tensor.sizes(), tensor.options().device(device));
    if (at::isFloatingType(value.scalar_type()) || at::isComplexType(value.scalar_type())) {
      value.fill_(std::numeric_limits<double>::quiet_NaN());
    } else {
      value.zero_();
    }
    compat::materialize_meta_tensor(tensor, value);
    materialized.push_back(tensor);
  };
  for (const at::Tensor& buffer : root.buffers()) allocate(buffer);
  for (const at::Tensor& param : ignored.param_list) allocate(param);
  return materialized;
}

// Note [Original parameters are not leaves]
// A bound unit's original parameters stay registered (names and state dicts equal the
// unwrapped model's), so Module::parameters() through any torch::nn::Module& still lists
// them; it is not virtual, so the root's parameters() (the sharded flat parameters)
// cannot replace it there. An optimizer over them would train nothing. So each unit's
// gradient sink (Note [Gradient sinks] in internal/runtime.cc) is connected at
// construction, not only at the first forward: the original parameters are never leaves,
// and LibTorch's optimizers refuse them ("can't optimize a non-leaf Tensor"). Each
// iteration's first forward still makes the sink that backward uses.

// Binds `root` and every Unit inside it; returns the root's runtime state.
std::shared_ptr<core_internal::RootState> bind_fully_sharded(
    UnitBase& root, const FullyShardedDataParallelOptions& options) {
  TORCH_CHECK(options.communicator() != nullptr,
              "FullyShardedDataParallel: options.communicator is null");
  make_annotated_units(root);  // first: their UnitOptions may ignore modules
  const Ignored ignored = resolve_ignored(options, root);
  std::vector<FoundUnit> units = select_units(root, options, ignored);
  UnitParams params = collect_unit_params(root, units, ignored);
  std::shared_ptr<DeviceHandle> device = compute_device(options, params);
  if (options.device_id()) move_to_device(root, device->device(), ignored, params);
  Communicator& comm = *options.communicator();
  check_same_construction(comm, device->device(), options, unit_names(units),
                          unit_numels(params));  // first
  // See Note [Initialisation on the meta device].
  std::vector<at::Tensor> materialized = materialize_meta_states(root, device->device(), ignored);
  if (options.sync_module_states() && comm.world_size() > 1) {
    for (const std::vector<NamedParam>& unit : params.to_flatten) {
      for (const NamedParam& p : unit) {
        TORCH_CHECK(!p.param.is_meta(), "FullyShardedDataParallel: sync_module_states with '",
                    p.fqn,
                    "' on the meta device: it has no values to broadcast yet; drop "
                    "sync_module_states and fill the shards with init_parameters (the same "
                    "seed on every rank) or a checkpoint reader");
      }
    }
    sync_module_states(comm, root, ignored, params.to_flatten);
  }
  const ShardingStrategy strategy = effective_strategy(options);
  auto root_state = std::make_shared<core_internal::RootState>(
      options.communicator(), device, strategy, options.backward_prefetch(),
      options.forward_prefetch());
  if (options.param_exec_order_wrap_policy()) root_state->prefetch_in_first_iteration_order();
  const std::vector<const torch::nn::Module*> full_precision_modules =
      bind_units(options, shard_groups(options, strategy, params.constructed), device, units,
                 params, *root_state);
  configure_root(root, options, ignored, full_precision_modules, *root_state);
  root_state->set_materialized(std::move(materialized));
  return root_state;
}

}  // namespace

namespace core_internal {

// An EnableWrap scope's settings, and the parameters units built in it sharded so far.
struct WrapConfig {
  FullyShardedDataParallelOptions options;
  bool shard_on_construction;
  ShardGroups groups;  // with shard_on_construction: what the units shard over
  absl::flat_hash_set<const c10::TensorImpl*> sharded;
};

void annotate_for_wrap(const std::shared_ptr<torch::nn::Module>& module,
                       const UnitOptions& overrides) {
  TORCH_CHECK(module != nullptr, "fsdp::wrap: the module is null");
  WrapScope<WrapConfig>* scope = WrapScope<WrapConfig>::active();
  if (scope == nullptr) return;  // PyTorch's wrap outside enable_wrap: the module unchanged
  TORCH_CHECK(dynamic_cast<const UnitBase*>(module.get()) == nullptr,
              "fsdp::wrap: the module is already a unit (a Unit<T>); wrap the module it "
              "holds, or use the Unit<T> alone");
  const FullyShardedDataParallelOptions& defaults = scope->config().options;
  UnitOptions options = overrides;
  if (!options.sharding_strategy()) options.sharding_strategy(defaults.sharding_strategy());
  if (!options.mixed_precision()) options.mixed_precision(defaults.mixed_precision());
  {
    WrapAnnotations& annotations = wrap_annotations();
    std::lock_guard<std::mutex> lock(annotations.mutex);
    TORCH_CHECK(annotations.find(*module) == nullptr,
                "fsdp::wrap: the module is annotated already; wrap it once");
  }
  std::unique_ptr<FlatParamHandle> handle = shard_on_construction(*module, nullptr, options);
  WrapAnnotations& annotations = wrap_annotations();
  std::lock_guard<std::mutex> lock(annotations.mutex);
  for (auto it = annotations.entries.begin(); it != annotations.entries.end();) {
    if (it->second.module.expired()) {
      annotations.entries.erase(it++);
    } else {
      ++it;
    }
  }
  annotations.entries[module.get()] = {module, std::move(options), std::move(handle)};
}

std::unique_ptr<FlatParamHandle> shard_on_construction(const torch::nn::Module& wrapped,
                                                       const UnitBase* unit,
                                                       const UnitOptions& own) {
  WrapScope<WrapConfig>* scope = WrapScope<WrapConfig>::active();
  if (scope == nullptr || !scope->config().shard_on_construction) return nullptr;
  WrapConfig& config = scope->config();
  // Units built inside this one took their parameters already.
  absl::flat_hash_set<const c10::TensorImpl*> nested;
  for (const auto& module : wrapped.modules()) {
    if (module.get() == &wrapped) continue;
    const FlatParamHandle* inner = constructed_handle_of(*module);
    if (inner == nullptr) continue;
    for (const at::Tensor& p : inner->original_params()) nested.insert(p.unsafeGetTensorImpl());
  }
  // The unit's ignored modules stay whole (the root ignores them too).
  for (const torch::nn::Module* module : own.ignored_modules()) {
    TORCH_CHECK(module != nullptr, "EnableWrap: a null module in a unit's ignored_modules");
    for (const at::Tensor& p : module->parameters()) nested.insert(p.unsafeGetTensorImpl());
  }
  std::vector<NamedParam> params;
  absl::flat_hash_set<const c10::TensorImpl*> seen;
  for (const auto& item : wrapped.named_parameters()) {
    const c10::TensorImpl* key = item.value().unsafeGetTensorImpl();
    if (nested.contains(key) || !seen.insert(key).second) continue;
    TORCH_CHECK(!config.sharded.contains(key), "EnableWrap: parameter '",
                clean_tensor_name(item.key()),
                "' of a unit being built was already sharded "
                "by another unit built before it and not inside it; a shared parameter must "
                "live in one unit: build both users inside one unit");
    params.push_back({clean_tensor_name(item.key()), item.value()});
  }
  if (params.empty()) return nullptr;
  for (const NamedParam& p : params) config.sharded.insert(p.param.unsafeGetTensorImpl());
  FlatParamOptions flat = flat_param_options(unit_mixed_precision(config.options, own), wrapped,
                                             config.options.cpu_offload());
  flat.replicate_communicator(config.groups.replicate);
  if (const c10::optional<c10::Device>& device_id = config.options.device_id()) {
    // See Note [Compute device]: the unit's parameters move before they are flattened.
    flat.device_handle(DeviceHandle::for_device(*device_id));
    const c10::Device device = flat.device_handle()->device();
    at::NoGradGuard no_grad;
    for (const NamedParam& p : params) {
      if (p.param.is_meta() || p.param.device() == device) continue;  // meta: the handle's
      TORCH_CHECK(p.param.device().is_cpu(), "EnableWrap: '", p.fqn, "' is on ", p.param.device(),
                  " but device_id is ", device, "; FSDP moves only CPU tensors to device_id");
      p.param.set_data(p.param.to(device));
    }
  }
  return std::make_unique<FlatParamHandle>(
      std::move(params), config.groups.shard,
      unit_strategy(config.options, own, unit, wrapped, /*is_root=*/false, "<being built>"), flat);
}

}  // namespace core_internal

c10::optional<WrapAnnotation> wrap_annotation(const torch::nn::Module& module) {
  core_internal::WrapAnnotations& annotations = core_internal::wrap_annotations();
  std::lock_guard<std::mutex> lock(annotations.mutex);
  const core_internal::WrapAnnotationEntry* entry = annotations.find(module);
  if (entry == nullptr) return c10::nullopt;
  return WrapAnnotation{entry->options, entry->handle.get()};
}

c10::optional<UnitOptions> CustomPolicy::unit_options(const ModuleNode& module) const {
  const Result result = lambda_fn_(module);
  if (const bool* wrap = std::get_if<bool>(&result)) {
    return *wrap ? c10::optional<UnitOptions>(UnitOptions()) : c10::nullopt;
  }
  const UnitOptions& options = std::get<UnitOptions>(result);
  if (!options.sharding_strategy() && !options.mixed_precision()) return c10::nullopt;
  return options;
}

EnableWrap::EnableWrap(const FullyShardedDataParallelOptions& options,
                       const EnableWrapOptions& wrap_options) {
  const bool shard_on_construction = wrap_options.shard_on_construction();
  TORCH_CHECK(options.communicator() != nullptr, "EnableWrap: options.communicator is null");
  TORCH_CHECK(!shard_on_construction || wrap_policy(options) == nullptr,
              "EnableWrap: auto_wrap_policy is not supported (nor param_exec_order_wrap_policy) "
              "when sharding at construction; annotate units with fsdp::wrap or fsdp::Unit, or "
              "build the model on the meta device (fully_sharded.h) to use a policy");
  ShardGroups groups;
  if (shard_on_construction) {  // split once: the root reuses these groups
    groups = shard_groups(options, effective_strategy(options));
  }
  scope_ = std::make_unique<WrapScope<core_internal::WrapConfig>>(
      core_internal::WrapConfig{options, shard_on_construction, std::move(groups), {}});
}

EnableWrap::~EnableWrap() = default;

NoSyncScope::NoSyncScope(FullyShardedRoot& root)
    : root_(root), previous_(root.state_->sync_gradients()) {
  root_.state_->set_sync_gradients(false);
}
NoSyncScope::~NoSyncScope() { root_.state_->set_sync_gradients(previous_); }

SummonFullParamsScope::SummonFullParamsScope(FullyShardedRoot& root,
                                             const SummonFullParamsOptions& options)
    : root_(root) {
  root_.state_->begin_summon(options);
}
SummonFullParamsScope::~SummonFullParamsScope() { root_.state_->end_summon(); }

FullyShardedRoot::FullyShardedRoot(UnitBase& root, const FullyShardedDataParallelOptions& options)
    : root_(&root), state_(bind_fully_sharded(root, options)) {
  state_->plan_window().enabled = options.plan_check();
}

FullyShardedRoot::~FullyShardedRoot() = default;

std::vector<FlatParamHandle*> FullyShardedUnit::frozen_handles() const {
  std::vector<FlatParamHandle*> result;
  for (const auto& frozen : frozen_handles_) result.push_back(frozen.get());
  return result;
}

std::vector<FlatParamHandle*> FullyShardedUnit::handles() const {
  std::vector<FlatParamHandle*> result;
  if (handle_ != nullptr) result.push_back(handle_.get());
  for (const auto& frozen : frozen_handles_) result.push_back(frozen.get());
  return result;
}

std::vector<at::Tensor> FullyShardedRoot::parameters(bool recurse) const {
  std::vector<at::Tensor> params;
  for (const auto& unit : state_->units()) {
    if (unit->handle() != nullptr) params.push_back(unit->handle()->sharded_flat_param());
    if (!recurse) return params;  // the root's own
  }
  const std::vector<at::Tensor>& ignored = state_->ignored_params();
  params.insert(params.end(), ignored.begin(), ignored.end());
  return params;
}

at::Tensor FullyShardedRoot::clip_grad_norm_(double max_norm, double norm_type) {
  return state_->clip_grad_norm(max_norm, norm_type);
}

void FullyShardedRoot::check_collective_schedule() {
  check_idle("check_collective_schedule");
  state_->comm().check_collective_schedule();
}

void FullyShardedRoot::init_parameters(const ModuleInit& init) {
  // See Note [Initialisation on the meta device].
  TORCH_CHECK(init != nullptr, "init_parameters: the init function is empty");
  check_idle("init_parameters");
  struct Slot {
    FlatParamHandle* handle;
    size_t index;
  };
  absl::flat_hash_map<const c10::TensorImpl*, Slot> slots;
  for (const auto& unit : state_->units()) {
    for (FlatParamHandle* handle : unit->handles()) {
      TORCH_CHECK(handle->state() == FlatParamState::kSharded ||
                      (handle->strategy() == ShardingStrategy::kNoShard &&
                       handle->state() == FlatParamState::kUnsharded),
                  "init_parameters: unit '", unit->fqn(), "' is unsharded (",
                  flat_param_state_name(handle->state()), "); call it outside summon_full_params");
      for (size_t i = 0; i < handle->original_params().size(); ++i) {
        slots[handle->original_params()[i].unsafeGetTensorImpl()] = {handle, i};
      }
    }
  }
  absl::flat_hash_set<const c10::TensorImpl*> unwritten;  // buffers still NaN from construction
  for (const at::Tensor& t : state_->materialized()) unwritten.insert(t.unsafeGetTensorImpl());
  absl::flat_hash_set<const c10::TensorImpl*> done;  // parameters initialised
  const auto has_nan = [](const at::Tensor& t) {
    return (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type())) &&
           at::isnan(t).any().item<bool>();
  };
  at::NoGradGuard no_grad;
  const c10::Device device = state_->device().device();
  // The root unit itself holds no state of its own.
  for (const auto& item : root_->named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    torch::nn::Module& module = *item.value();
    if (dynamic_cast<const UnitBase*>(&module) != nullptr) continue;  // no state of its own
    const auto params = module.named_parameters(/*recurse=*/false);
    const auto buffers = module.named_buffers(/*recurse=*/false);
    if (params.is_empty() && buffers.is_empty()) continue;
    struct Swapped {
      std::string fqn;
      at::Tensor param;  // the registered tensor, pointed at `scratch` during init
      at::Tensor own;    // its own data, restored after
      bool first;        // its first registration: keep what init wrote
    };
    std::vector<Swapped> swapped;
    for (const auto& p : params) {
      const at::Tensor& param = p.value();
      if (!param.defined()) continue;
      // In the shard's dtype: a unit's parameters are views of a buffer in the mixed
      // precision param_dtype.
      auto slot = slots.find(param.unsafeGetTensorImpl());
      const c10::ScalarType dtype = slot != slots.end()
                                        ? slot->second.handle->sharded_flat_param().scalar_type()
                                        : param.scalar_type();
      at::Tensor scratch = at::full(param.sizes(), std::numeric_limits<double>::quiet_NaN(),
                                    at::TensorOptions().dtype(dtype).device(device));
      at::Tensor own = param.data();
      param.set_data(scratch);
      swapped.push_back(
          {clean_tensor_name(item.key().empty() ? p.key() : item.key() + "." + p.key()), param, own,
           done.insert(param.unsafeGetTensorImpl()).second});
    }
    try {
      init(module);
    } catch (...) {
      for (Swapped& s : swapped) s.param.set_data(s.own);
      throw;
    }
    for (Swapped& s : swapped) {
      const at::Tensor value = s.param.data();
      s.param.set_data(s.own);
      if (!s.first) continue;  // a tied parameter met again: its first registration's values
      TORCH_CHECK(!has_nan(value), "init_parameters: parameter '", s.fqn,
                  "' holds NaN after the init function ran on its module (",
                  c10::demangle(typeid(module).name()),
                  "); it must write every parameter and buffer of the module it is given");
      unwritten.erase(s.param.unsafeGetTensorImpl());
      auto slot = slots.find(s.param.unsafeGetTensorImpl());
      if (slot != slots.end()) {
        slot->second.handle->copy_into_shard(slot->second.index, value);
      } else {
        s.param.detach().copy_(value);  // ignored: whole on every rank
      }
    }
    for (const auto& b : buffers) {
      if (!unwritten.contains(b.value().unsafeGetTensorImpl())) continue;
      TORCH_CHECK(!has_nan(b.value()), "init_parameters: buffer '",
                  clean_tensor_name(item.key().empty() ? b.key() : item.key() + "." + b.key()),
                  "' was built on the meta device and the init function did not compute it on "
                  "its module (",
                  c10::demangle(typeid(module).name()),
                  "); a buffer computed in the constructor (a RoPE inv_freq) must be computed "
                  "again by init");
      unwritten.erase(b.value().unsafeGetTensorImpl());
    }
  }
  std::vector<at::Tensor> still;
  for (const at::Tensor& t : state_->materialized()) {
    if (unwritten.contains(t.unsafeGetTensorImpl())) still.push_back(t);
  }
  state_->set_materialized(std::move(still));
}

const std::vector<std::shared_ptr<FullyShardedUnit>>& FullyShardedRoot::units() const {
  return state_->unit_views();
}

TrainingState FullyShardedRoot::training_state() const { return state_->training_state(); }

ShardingStrategy FullyShardedRoot::sharding_strategy() const { return state_->strategy(); }

Communicator& FullyShardedRoot::communicator() const { return state_->comm(); }

DeviceHandle& FullyShardedRoot::device_handle() const { return state_->device(); }

torch::nn::Module& FullyShardedRoot::root_module() const { return *root_; }

void FullyShardedRoot::check_idle(const char* what) const {
  state_->assert_in_states({TrainingState::kIdle}, what);
}

}  // namespace fsdp
