// FullyShardedDataParallel: the root of an FSDP model. It makes the wrapped model the
// root unit, binds every Unit<T> inside it (unit.h), flattens and shards each unit's
// parameters, and trains with the FSDP runtime (internal/runtime.h). Its non-template
// part, FullyShardedRoot, is what state dicts and checkpoints (fsdp/state) take.
//
//   auto comm = fsdp::init_from_environment();
//   fsdp::FullyShardedDataParallel<NetImpl> model(
//       std::make_shared<NetImpl>(),
//       fsdp::FullyShardedDataParallelOptions(comm).sharding_strategy(
//           fsdp::ShardingStrategy::kFullShard));
//   torch::optim::SGD optimizer(model->parameters(), /*lr=*/0.01);  // the flat shards
//   auto loss = model->forward(x).pow(2).mean();
//   loss.backward();      // gradients reduce-scattered into the shards' .grad
//   optimizer.step();
//
// Units: the annotated Unit<T> modules of the model (fsdp::Unit, or fsdp::wrap inside an
// EnableWrap scope; unit.h), or those an auto_wrap_policy picks, plus the root, which owns every
// parameter no unit inside it owns. Each unit flattens its parameters (shared ones once) into a
// FlatParamHandle. A parameter registered by several modules (tied weights) belongs to the lowest
// unit containing all of them, e.g. the root for an embedding unit tied to an output head in the
// root (PyTorch's guidance: shared parameters in one FSDP instance). A unit sharded on construction
// (EnableWrap) that took a shared parameter while another user is outside it is an error naming
// every FQN.
//
// Collectives per iteration (n = units with parameters; REFERENCE §4): FULL_SHARD:
// forward all-gathers n, backward all-gathers n - 1 (the root is not resharded after
// forward), reduce-scatters n; SHARD_GRAD_OP: all-gathers n, reduce-scatters n;
// NO_SHARD: all-reduces n. Gradients are averaged over ranks, so training matches one
// process on the global batch when each rank's loss is a mean over its equal share.
//
// Parameters: parameters() of the root gives the optimizer the sharded flat parameters,
// then the ignored parameters that require grad, as PyTorch's does. Call it on the
// FullyShardedDataParallelImpl (model->parameters()). Through a torch::nn::Module&,
// parameters() lists the original parameters (they stay registered so names and
// state-dict keys equal the unwrapped model's); those are not leaves once bound, so an
// optimizer built from them fails at construction with LibTorch's "can't optimize a
// non-leaf Tensor" instead of training nothing. PyTorch:
// torch.distributed.fsdp.FullyShardedDataParallel (use_orig_params=False).
//
// Options beyond sharding (each PyTorch's namesake): mixed_precision (MixedPrecision,
// options.h), sync_module_states, HYBRID strategies with hybrid_shard_group_size, per-unit
// strategies (unit_sharding_strategies, or fsdp::wrap's per-unit overrides),
// validate_execution_order (PyTorch's FSDP_DEBUG_LEVEL=DETAIL check), cpu_offload
// (CPUOffload, options.h), clip_grad_norm_ on the root, and deferred initialisation (EnableWrap
// below).
//
// Frozen parameters (requires_grad=false; PyTorch: use_orig_params=True): a unit whose
// parameters all are frozen gets a frozen flat parameter (no gradient, no reduction). A
// unit mixing frozen and trainable parameters (LoRA, a frozen embedding beside trained
// layers) gets several flat parameters: handle() holds the trainable ones,
// frozen_handles() the frozen ones, one per dtype (a bf16 base beside fp32 adapters stays
// bf16; stored non-floating values, e.g. 4-bit codes in uint8, are frozen and gathered as
// they are). All are gathered and freed together (each frozen one by its own all-gather,
// issued right after the trainable one's); only the trainable one has a gradient and is
// reduced, so reduce-scatter bytes and gradient memory count trainable elements only, and
// parameters() (the optimizer's list) leaves the frozen ones out. The trainable parameters
// of a unit share one dtype (their gradients are reduced together, as FSDP2 requires). A
// unit sharded at construction (EnableWrap) cannot mix them (its handle is made before
// the root splits units). See Note [Frozen parameters in a unit] in internal/runtime.cc
// and Note [Flat parameters of several dtypes] in flat_param.cc.
//
// Models built on the meta device (deferred initialisation; PyTorch: a model built under
// torch.device("meta"), fully_shard, then to_empty and init, or a checkpoint load). Model
// code that takes tensor options creates its parameters and buffers on c10::kMeta: no
// memory, no values. FullyShardedDataParallel then takes any auto_wrap_policy (it sees the
// meta tree), any strategy (HYBRID too), ignored modules and frozen parameters as for any
// model, and each rank allocates only its shard of each flat parameter, the root's own
// (embeddings, head) included, on device_id (the CPU without it); buffers and ignored
// parameters are allocated whole. Everything allocated so holds NaN (integer buffers:
// zeros) until init_parameters computes it or a state-dict reader (fsdp/state: safetensors,
// DCP, fsdp's own checkpoints) copies each rank's bytes into its shards. A checkpoint has
// no non-persistent buffers (a RoPE inv_freq): compute them with init_parameters before
// loading. sync_module_states is refused (nothing to broadcast).
//
//   auto lm = std::make_shared<LmImpl>(config, at::TensorOptions().device(c10::kMeta));
//   fsdp::FullyShardedDataParallel<LmImpl> model(lm, options);   // allocates the shards
//   torch::manual_seed(0);                                       // the same on every rank
//   model->init_parameters([](torch::nn::Module& m) { reset_parameters_of(m); });
//
// Ordinary LibTorch modules (torch::nn::Linear, ...) allocate and initialise on the CPU in
// their constructors and cannot be built on the meta device (LibTorch has no default-device
// context). A model of them built whole and then wrapped (with or without an
// auto_wrap_policy) holds one whole copy on every rank until this constructor has sharded
// it. Two ways around it: build the large parts in model code that takes tensor options
// and build them on c10::kMeta (above), or annotate the units (fsdp::wrap or Unit<T>) and
// build the model inside an EnableWrap scope that shards on construction, so each unit is
// sharded as soon as it is built.
//
// Threading: one root per rank, used by that rank's thread. Errors: c10::Error.
#ifndef FSDP_CORE_FULLY_SHARDED_H_
#define FSDP_CORE_FULLY_SHARDED_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <c10/util/Optional.h>
#include <torch/arg.h>

#include "fsdp/comm/communicator.h"
#include "fsdp/core/device_handle.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/memory_plan.h"
#include "fsdp/core/options.h"
#include "fsdp/core/training_state.h"
#include "fsdp/core/unit.h"
#include "fsdp/wrap/policy.h"
#include "fsdp/wrap/wrap_context.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace fsdp {

// PyTorch's CustomPolicy(lambda_fn) (torch.distributed.fsdp.wrap), given as
// FullyShardedDataParallelOptions::auto_wrap_policy: every module below the root that is
// not ignored (nested ones too) is asked; lambda_fn returns false (not a unit), true (a
// unit with the root's settings) or UnitOptions, a unit whose set fields override the
// root's (an empty UnitOptions is false, as PyTorch's empty dict). Overrides replace
// those a Unit<T> got from fsdp::wrap. lambda_fn must be pure (it is asked again for the
// units' settings). Threading: the constructing thread.
class CustomPolicy {
 public:
  using Result = std::variant<bool, UnitOptions>;
  explicit CustomPolicy(std::function<Result(const ModuleNode&)> lambda_fn)
      : lambda_fn_(std::move(lambda_fn)) {}
  // As an AutoWrapPolicy: recurse into everything, wrap iff unit_options has a value.
  bool operator()(const ModuleNode& module, bool recurse, int64_t /*nonwrapped_numel*/) const {
    return recurse || unit_options(module).has_value();
  }
  // `module`'s unit settings (empty: the root's), or nullopt if it is not a unit.
  c10::optional<UnitOptions> unit_options(const ModuleNode& module) const;

 private:
  std::function<Result(const ModuleNode&)> lambda_fn_;
};

// (the unit's wrapped module or the Unit<T> itself, its strategy) pairs.
using UnitShardingStrategies = std::vector<std::pair<const torch::nn::Module*, ShardingStrategy>>;

// One entry of FullyShardedDataParallelOptions::ignored_states: a module (with everything
// below it) or a single parameter. PyTorch: an element of FSDP's `ignored_states`.
class IgnoredState {
 public:
  IgnoredState(const torch::nn::Module* module) : module_(module) {}        // NOLINT: implicit
  IgnoredState(at::Tensor parameter) : parameter_(std::move(parameter)) {}  // NOLINT
  const torch::nn::Module* module() const { return module_; }               // null for a parameter
  const at::Tensor& parameter() const { return parameter_; }  // undefined for a module

 private:
  const torch::nn::Module* module_ = nullptr;
  at::Tensor parameter_;
};

// FullyShardedDataParallelOptions::schedule_check_every's default: one check every 10
// iterations. Measured on the GPT of examples/gpt at W = 2 over Gloo: see
// benchmarks/RESULTS.md ("Collective schedule check").
inline constexpr int64_t kDefaultScheduleCheckEvery = 10;

struct FullyShardedDataParallelOptions {
  explicit FullyShardedDataParallelOptions(std::shared_ptr<Communicator> communicator)
      : communicator_(std::move(communicator)) {}
  // The ranks to shard over.
  TORCH_ARG(std::shared_ptr<Communicator>, communicator);
  // At world size 1 every strategy runs as kNoShard (nothing to shard, no collectives).
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  // When to start gathering the next unit in backward (PyTorch's default: BACKWARD_PRE).
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  // Start gathering the next unit (in the previous iteration's order) as a unit starts
  // its forward. See Note [Prefetching] in internal/runtime.cc.
  // Neither prefetch gathers more than one unit ahead, and each unit waits (on the host)
  // for its all-gather, so under FULL_SHARD at most the root, the unit computing and the
  // one prefetched are unsharded at a time; on a device the host runs at most two units
  // ahead of it (PyTorch's limit_all_gathers=True, here always on, with no option: Note
  // [Limiting all-gathers] in internal/runtime.cc). See Note [Streams and freeing
  // unsharded memory] in flat_param.cc.
  TORCH_ARG(bool, forward_prefetch) = false;
  // Modules (with everything below them) FSDP leaves alone: not flattened, not sharded.
  TORCH_ARG(std::vector<const torch::nn::Module*>, ignored_modules);
  // Modules and single parameters FSDP leaves alone (PyTorch's ignored_states; give it or
  // ignored_modules, not both): no unit flattens them, also inside auto-wrapped or
  // annotated units; they stay ordinary replicated tensors under their own names in
  // parameters() and in state dicts. If they require grad they train like any tensor
  // outside FSDP: their gradients are each rank's own, not averaged across ranks (as in
  // PyTorch), and clip_grad_norm_ counts them once.
  TORCH_ARG(std::vector<IgnoredState>, ignored_states);
  // Which modules become units (see Note [Auto-wrapping] in fully_sharded.cc). Unset:
  // every annotated Unit<T> in the model. Set: the modules the policy picks (fsdp/wrap's
  // recursive_wrap, PyTorch's _recursive_wrap, over the model seen without unbound
  // Unit<T>s); a picked module must sit in a Unit<T> (annotated or not) or be a child of
  // a torch::nn::Sequential (with a Tensor -> Tensor forward), which is rebuilt around a
  // unit; anything else is an error naming its FQN. Units the policy does not pick stay
  // pass-throughs.
  TORCH_ARG(AutoWrapPolicy, auto_wrap_policy) = nullptr;
  // Units from its init_policy (as auto_wrap_policy; give one or the other), prefetching
  // in both passes in the order the units ran in the first iteration (wrap/policy.h). It
  // overrides backward_prefetch (BACKWARD_PRE) and forward_prefetch (on).
  TORCH_ARG(c10::optional<ParamExecOrderWrapPolicy>, param_exec_order_wrap_policy);
  // Low-precision forward/backward and gradient reduction (none: everything in the
  // parameters' dtypes).
  TORCH_ARG(c10::optional<MixedPrecision>, mixed_precision);
  // Broadcast rank 0's parameters and buffers (outside ignored modules) to every rank
  // before sharding, so ranks that initialised the model differently start identical.
  // One broadcast per unit and dtype, and one per dtype for the buffers.
  TORCH_ARG(bool, sync_module_states) = false;
  // Units that run with another strategy than sharding_strategy: FULL_SHARD,
  // SHARD_GRAD_OP or NO_SHARD (e.g. a small unit replicated), under a non-HYBRID root;
  // not the root itself; not a unit fsdp::wrap gave a strategy. PyTorch: a nested
  // FullyShardedDataParallel with its own sharding_strategy.
  TORCH_ARG(UnitShardingStrategies, unit_sharding_strategies);
  // HYBRID strategies: F, the ranks of one shard group (e.g. LOCAL_WORLD_SIZE, one
  // host); world_size must be a multiple of it (Communicator::split_hybrid).
  TORCH_ARG(int, hybrid_shard_group_size) = 0;
  // Check on the first iteration that every rank runs the units in the same order (n
  // small all-gathers more, once; see Note [Execution order validation] in
  // internal/runtime.cc), and keep the size checks of every collective
  // (Communicator::set_size_checks) on in every iteration, not in the first only: ranks
  // that run units of different sizes in any iteration stop with the same CommError on
  // every rank. Off by default, as in PyTorch: on the GPT of examples/gpt at W = 2 over
  // Gloo the order check adds 2.6-4.9 ms to the first step (8-17% of one 27-31 ms step;
  // BM_FirstStep in benchmarks/gpt_step_benchmark.cc) and the size checks 11-16 ms to
  // every later one (16-37%; BM_SizeChecks). Without it, the first iteration is still
  // size-checked (Note [First-iteration size checks]); a later divergence makes Gloo
  // terminate the rank that receives the longer message, after one line naming the
  // collective and the cause ("fsdp: Gloo terminates rank 0 in all_gather_into_tensor #8:
  // a peer sent a message of 64 bytes where this rank expected 40: the ranks are not
  // running the same units in the same order ..."). It also catches swapped units of
  // equal size in the first iteration.
  TORCH_ARG(bool, validate_execution_order) = false;
  // Compare the collective schedule of every rank every N iterations of the root (a
  // forward and its backward, or a forward without grad; counted from 1), at the end of
  // the iteration: each rank hashes (kind, group, element count, dtype) of every
  // collective of the communicator's family, and the ranks all-gather the hashes over a
  // side channel (Communicator::enable_schedule_checks; Note [Collective schedule
  // checks] in fsdp/comm/internal/schedule.cc). Ranks that took different branches then
  // stop with one CommError on every rank naming the step, its first differing
  // collective and what each rank ran, also when the divergence made a collective time
  // out before the check. 0: off. Needs a root communicator that moves CPU buffers (gloo,
  // the fake backend); with NCCL it is off. Default kDefaultScheduleCheckEvery (its cost
  // is measured there). PyTorch has no counterpart. See also
  // FullyShardedRoot::check_collective_schedule.
  TORCH_ARG(int64_t, schedule_check_every) = kDefaultScheduleCheckEvery;
  // The compute device (PyTorch's device_id); see Note [Compute device] in
  // fully_sharded.cc. Set: the model's CPU parameters and buffers (outside ignored
  // modules and ignored_states) are moved there at construction, before flattening, and
  // a parameter or buffer already on another non-CPU device is an error naming it; a
  // CUDA device without an index means the current CUDA device. Unset: the device of the
  // parameters (CPU unless the model was moved). The device's handle (device_handle.h)
  // must be linked: for CUDA, //fsdp/core:cuda_device_handle. Whether the communicator
  // takes tensors of that device is the communicator's to say (c10d Gloo refuses what it
  // cannot reduce, NCCL takes only CUDA tensors).
  TORCH_ARG(c10::optional<c10::Device>, device_id);
  // CPU offload of the shards, their gradients and the optimizer state (CPUOffload
  // in options.h); off by default, as in PyTorch. parameters() then returns host tensors: build
  // the optimizer from them after construction. With a CPU compute device the host
  // copies are allocations of their own (same values as without offload). Applies to
  // every unit, also those EnableWrap sharded on construction (give the scope the same
  // options).
  TORCH_ARG(CPUOffload, cpu_offload);
  // Check every step against the model's own plan (memory_plan.h): each root forward
  // starts a measurement window that FullyShardedRoot::check_plan, called after the
  // optimizer step, closes. While on, each root forward resets the compute device's peak
  // memory statistics (DeviceHandle::reset_peak_memory_stats) for the calling thread's
  // memory tag, or the whole process. Off by default (fsdp's own; PyTorch has none).
  TORCH_ARG(bool, plan_check) = false;
};

namespace core_internal {
struct WrapConfig;  // the scope's settings and what it sharded (fully_sharded.cc)
}  // namespace core_internal

// PyTorch's enable_wrap(wrapper_cls=FullyShardedDataParallel, **options) as an RAII
// scope: while it lives on a thread, fsdp::wrap (unit.h) called on that thread makes
// units with these options' sharding_strategy and mixed_precision, each overridable per
// call (PyTorch's wrap overrides). The root that binds them later takes everything else
// (communicator, prefetching, ...) from its own options.
//
//   fsdp::FullyShardedDataParallelOptions options(comm);
//   std::shared_ptr<NetImpl> net;
//   {
//     fsdp::EnableWrap scope(options);
//     net = std::make_shared<NetImpl>();  // its fsdp::wrap calls make units
//   }
//   fsdp::FullyShardedDataParallel<NetImpl> model(net, options);
//
// Deferred initialisation (shard_on_construction): every unit built in the scope (by
// fsdp::wrap or as a Unit<T>) flattens and shards its module's parameters (those no unit
// built inside it took) as soon as it is constructed, so building a model holds its
// units' shards plus one unit's full parameters at a time, never the whole model; the
// root made later takes those flat parameters over. Parameters outside units (the
// root's own: embeddings, head) stay whole until the root is made, unless the model itself
// is annotated in the scope (`net = fsdp::wrap(std::make_shared<NetImpl>());`), which
// shards them as soon as it is built; the root takes that flat parameter over too. PyTorch:
// constructing each layer and wrapping it in FSDP at once, the C++ counterpart of deferring
// initialisation to the meta device. Every rank must build the same model (same units, same order);
// the root's options must give each unit what the scope gave it (strategy, mixed precision,
// communicator); the root's ignored_modules cannot lie inside units made so (they do not
// exist yet when the unit shards): give them to the unit instead, as PyTorch's
// wrap(module, ignored_modules=...) does (`fsdp::wrap(block,
// fsdp::UnitOptions().ignored_modules({block->adapter.get()}))`), and sync_module_states leaves
// their parameters alone (each rank keeps its own chunk's initial values: build them from the same
// seed). HYBRID strategies work (the scope splits the shard and replicate groups once,
// hybrid_shard_group_size as for the root, and the root reuses them); an auto_wrap_policy does not
// (the units must exist as they are built: build on the meta device to combine deferred
// initialisation with a policy, see the file comment). A parameter shared by two units built so
// must be inside the later one's module.
//
// Errors: c10::Error (also when a scope is already active on the thread: scopes do not
// nest). One per thread (ranks may be threads).
class [[nodiscard]] EnableWrap {
 public:
  explicit EnableWrap(const FullyShardedDataParallelOptions& options,
                      const EnableWrapOptions& wrap_options = {});
  ~EnableWrap();
  EnableWrap(const EnableWrap&) = delete;
  EnableWrap& operator=(const EnableWrap&) = delete;

 private:
  std::unique_ptr<WrapScope<core_internal::WrapConfig>> scope_;
};

namespace core_internal {
class RootState;  // the runtime state of a bound root (internal/runtime.h)
}  // namespace core_internal

class FullyShardedRoot;

// While it lives, backward passes accumulate gradients unsharded on each rank with no
// communication (FullyShardedRoot::no_sync). Not copyable or movable: keep it in a local
// (`auto scope = model->no_sync();`).
class [[nodiscard]] NoSyncScope {
 public:
  explicit NoSyncScope(FullyShardedRoot& root);
  ~NoSyncScope();
  NoSyncScope(const NoSyncScope&) = delete;
  NoSyncScope& operator=(const NoSyncScope&) = delete;

 private:
  FullyShardedRoot& root_;
  bool previous_;
};

// While it lives, the original parameters hold their full values
// (FullyShardedRoot::summon_full_params). Not copyable or movable.
class [[nodiscard]] SummonFullParamsScope {
 public:
  explicit SummonFullParamsScope(FullyShardedRoot& root,
                                 const SummonFullParamsOptions& options = {});
  ~SummonFullParamsScope();
  SummonFullParamsScope(const SummonFullParamsScope&) = delete;
  SummonFullParamsScope& operator=(const SummonFullParamsScope&) = delete;

 private:
  FullyShardedRoot& root_;
};

// One unit of a bound model, as the root lists it (FullyShardedRoot::units()): its FQN,
// its flat parameter and its state. PyTorch: a FullyShardedDataParallel instance's
// _fsdp_wrapped_module prefix, _handle and _handle.training_state.
class FullyShardedUnit {
 public:
  virtual ~FullyShardedUnit() = default;
  FullyShardedUnit(const FullyShardedUnit&) = delete;
  FullyShardedUnit& operator=(const FullyShardedUnit&) = delete;

  const std::string& fqn() const { return fqn_; }  // cleaned; "" for the root
  bool is_root() const { return is_root_; }
  // The unit's flat parameter: its trainable parameters (if none requires grad: its frozen
  // parameters of the first dtype met in registration order); null for a unit that owns no
  // parameters.
  FlatParamHandle* handle() const { return handle_.get(); }
  // The unit's other flat parameters, all frozen (they never require grad), one per dtype in
  // the order the dtypes first appear: the frozen parameters beside trainable ones, and
  // frozen parameters of a dtype other than handle()'s. Empty for a unit of one kind and
  // dtype. See Note [Flat parameters of several dtypes] in flat_param.cc.
  std::vector<FlatParamHandle*> frozen_handles() const;
  // handle() (if set) then frozen_handles(): every flat parameter of the unit.
  std::vector<FlatParamHandle*> handles() const;
  // The unit's place in the pass (PyTorch: _handle._training_state); the flat
  // parameter's own memory state is handle()->state().
  HandleTrainingState handle_training_state() const { return handle_state_; }

 protected:
  FullyShardedUnit(std::string fqn, bool is_root, std::unique_ptr<FlatParamHandle> handle,
                   std::vector<std::unique_ptr<FlatParamHandle>> frozen_handles = {})
      : fqn_(std::move(fqn)),
        is_root_(is_root),
        handle_(std::move(handle)),
        frozen_handles_(std::move(frozen_handles)) {}

  std::string fqn_;
  bool is_root_;
  std::unique_ptr<FlatParamHandle> handle_;
  std::vector<std::unique_ptr<FlatParamHandle>> frozen_handles_;
  HandleTrainingState handle_state_ = HandleTrainingState::kIdle;
};

// The root of an FSDP model without its module type: what FullyShardedDataParallelImpl<T>
// adds to its module, and what state dicts and checkpoints (fsdp/state) take. Made only
// as a base of FullyShardedDataParallelImpl<T>. PyTorch: the root
// FullyShardedDataParallel instance.
class FullyShardedRoot {
 public:
  virtual ~FullyShardedRoot();
  FullyShardedRoot(const FullyShardedRoot&) = delete;
  FullyShardedRoot& operator=(const FullyShardedRoot&) = delete;

  // The sharded flat parameters of every unit (handle(), none of frozen_handles()), in
  // pre-order, then the ignored parameters that require grad: what the optimizer updates.
  // With recurse = false, the root's own flat parameter only (none if the root owns no
  // parameters), as PyTorch's parameters(recurse=False) on the root FSDP instance.
  std::vector<at::Tensor> parameters(bool recurse = true) const;

  // While the returned scope lives, backward passes accumulate gradients unsharded on
  // each rank with no communication (no reduce-scatter, no all-reduce); the first
  // backward after it reduces the sum. Every rank must use it the same way. PyTorch:
  // FullyShardedDataParallel.no_sync().
  [[nodiscard]] NoSyncScope no_sync() { return NoSyncScope(*this); }

  // While the returned scope lives, every original parameter holds its full value (one
  // all-gather per unit, on every rank; see SummonFullParamsOptions for what else).
  // Needs the model idle (not inside forward/backward); writeback with rank0_only, and
  // with_grads with offload_to_cpu, are errors. Every rank calls it. PyTorch:
  // FullyShardedDataParallel.summon_full_params().
  [[nodiscard]] SummonFullParamsScope summon_full_params(
      const SummonFullParamsOptions& options = {}) {
    return SummonFullParamsScope(*this, options);
  }

  // Scales every gradient (the flat shards' and the ignored modules' parameters') by
  // min(1, max_norm / (total_norm + 1e-6)), where total_norm is the norm of all of them
  // together as if unsharded (see Note [Gradient norm over shards] in
  // internal/runtime.cc); returns total_norm, a 0-dim float32 tensor equal on every rank.
  // norm_type: p > 0, or INFINITY. Every rank calls it (one collective), after backward
  // and before the optimizer step; the model must be idle. Only the root has this
  // method: units below it cannot clip alone (PyTorch raises for a non-root instance).
  // PyTorch: FullyShardedDataParallel.clip_grad_norm_.
  at::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0);

  // Computes every parameter's and buffer's initial values with `init`, one module at a
  // time, and keeps only this rank's shard of each: how a model built on c10::kMeta gets
  // its values (see "Models built on the meta device" in the file comment). `init` is
  // called once per module that has parameters or buffers of its own, in pre-order (the
  // order a constructor builds and initialises modules in), with the module's own
  // parameters (recurse = false) pointed at full tensors on the compute device in the
  // shards' dtype, filled with NaN; it must write each of them and recompute each buffer
  // the constructor computed (a RoPE inv_freq), in place, without registering new ones:
  // e.g. `[](torch::nn::Module& m) { if (auto* l = m.as<MyLinearImpl>())
  // l->reset_parameters(); ... }`. Each rank then copies its elements into its shards and
  // drops the full tensors, so the peak is the shards plus one module's own parameters.
  // With the same seed on every rank (torch::manual_seed before the call), the shards
  // hold the chunks of a one-process build that creates and initialises the same modules
  // in the same order from that seed. A parameter registered by several modules (tied
  // weights) keeps what its first registration's init wrote; later ones write a copy that
  // is dropped. Works on any idle model (it re-initialises one that has values). Errors:
  // c10::Error if a parameter still holds NaN after its module's init, if a buffer that was
  // on the meta device was not computed (naming it and its module), if the model is not
  // idle; an exception from `init` passes through with the module's parameters restored.
  // Every rank calls it (no collectives). PyTorch: module.to_empty(device=...) then each
  // module's reset_parameters() (FSDP1's param_init_fn, torchtitan's init_weights).
  using ModuleInit = std::function<void(torch::nn::Module&)>;
  void init_parameters(const ModuleInit& init);

  // The plan of one training step of this model on this rank (memory_plan.h): its units
  // (in pre-order), world size, strategy, shard group, dtypes, prefetching, CPU offload and
  // backend, with `optimizer`'s state and `activation_bytes` (nullopt: activations not
  // planned). Units whose modules MixedPrecision keeps in full precision are planned in
  // the other units' dtypes. Every rank gets the same plan.
  MemoryPlan memory_plan(const OptimizerSpec& optimizer,
                         c10::optional<int64_t> activation_bytes = c10::nullopt) const;

  // With FullyShardedDataParallelOptions::plan_check: measures the step since the root's
  // last forward (its sharded parameters, their gradients and `optimizer`'s state now, the
  // peak of tracked device memory, the traffic of every communicator of the model) and
  // compares it with memory_plan(optimizer_spec_of(optimizer), activation_bytes). Call it
  // after optimizer.step(), before any other forward; collectives issued in that window
  // outside the model (clip_grad_norm_, a loss all-reduce) count as traffic, so check
  // before them. Returns the comparison (PlanCheckResult::summary for a progress line);
  // throws c10::Error naming the rank, the first term above its tolerance
  // (kPlanTermTolerance, kPlanPeakTolerance), its measured and planned bytes, if any is.
  // The first step of an optimizer that creates its state lazily (Adam) measures the
  // state made during it. Throws c10::Error without plan_check or before any forward.
  PlanCheckResult check_plan(const torch::optim::Optimizer& optimizer,
                             c10::optional<int64_t> activation_bytes = c10::nullopt);
  // Compares the collective schedules of all ranks now (what
  // FullyShardedDataParallelOptions::schedule_check_every does every N iterations), e.g.
  // after the last step of training, so that a divergence in the steps since the last
  // periodic check is reported too. Every rank calls it; the model must be idle. Throws
  // CommError on every rank if the ranks issued different collectives
  // (Communicator::check_collective_schedule has the message), c10::Error if the checks
  // are off (schedule_check_every 0, or an NCCL communicator). PyTorch has no
  // counterpart.
  void check_collective_schedule();

  // Units in pre-order (the root first), for inspection.
  const std::vector<std::shared_ptr<FullyShardedUnit>>& units() const;
  TrainingState training_state() const;
  ShardingStrategy sharding_strategy() const;  // effective (kNoShard at world size 1)
  Communicator& communicator() const;
  // The compute device's handle (FullyShardedDataParallelOptions::device_id): every unit's
  // flat parameter lives on its device().
  DeviceHandle& device_handle() const;

  // The root as a module (the FullyShardedDataParallelImpl itself): its named_parameters()
  // and named_buffers() carry the model's names, wrapper prefixes included.
  torch::nn::Module& root_module() const;
  // Throws c10::Error with PyTorch's message ("<what>: expected to be in states
  // [TrainingState.IDLE] but current state is ...") unless the model is idle.
  void check_idle(const char* what) const;

 protected:
  // Binds `root` (the FullyShardedDataParallelImpl being built) and every Unit inside it:
  // flattens and shards their parameters. Throws c10::Error on bad models (see the file
  // comment).
  FullyShardedRoot(UnitBase& root, const FullyShardedDataParallelOptions& options);

 private:
  friend class NoSyncScope;
  friend class SummonFullParamsScope;
  UnitBase* root_;
  std::shared_ptr<core_internal::RootState> state_;
};

// The OptimizerSpec of a LibTorch optimizer: torch::optim::SGD (momentum of its first
// parameter group), Adam, AdamW, fsdp::FusedAdamW (fused_adamw.h: AdamW's state, no step
// temporaries), Adagrad, RMSprop (momentum, centered); throws c10::Error
// naming the supported ones for any other.
OptimizerSpec optimizer_spec_of(const torch::optim::Optimizer& optimizer);
// Bytes of every state tensor `optimizer` holds (the C++ optimizers keep their step
// counts as integers, not tensors).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

// The root module: the model's own module type with FullyShardedRoot's API.
template <typename Contained>
class FullyShardedDataParallelImpl : public UnitImpl<Contained>, public FullyShardedRoot {
 public:
  FullyShardedDataParallelImpl(std::shared_ptr<Contained> module,
                               const FullyShardedDataParallelOptions& options)
      : UnitImpl<Contained>(std::move(module)), FullyShardedRoot(*this, options) {}

  // The sharded flat parameters, not the original ones that Module::parameters() lists.
  using FullyShardedRoot::parameters;
};

template <typename Contained>
class FullyShardedDataParallel
    : public torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Contained>> {
 public:
  using torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Contained>>::ModuleHolder;
  FullyShardedDataParallel(std::shared_ptr<Contained> module,
                           const FullyShardedDataParallelOptions& options)
      : torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Contained>>(
            std::make_shared<FullyShardedDataParallelImpl<Contained>>(std::move(module), options)) {
  }
};

}  // namespace fsdp

#endif  // FSDP_CORE_FULLY_SHARDED_H_
