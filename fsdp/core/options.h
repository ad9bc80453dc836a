// The user-facing enums and option structs of fsdp, in one place: how parameters are
// sharded and prefetched, mixed precision, CPU offload, a unit's own settings, and the
// options of summon_full_params, EnableWrap and the full state dict. All are plain values
// with LibTorch-style chainable setters (TORCH_ARG). PyTorch: torch.distributed.fsdp.api
// (ShardingStrategy, BackwardPrefetch, MixedPrecision, CPUOffload, FullStateDictConfig).
//
//   auto options = fsdp::FullyShardedDataParallelOptions(comm)        // fully_sharded.h
//                      .sharding_strategy(fsdp::ShardingStrategy::kShardGradOp)
//                      .backward_prefetch(fsdp::BackwardPrefetch::kBackwardPost)
//                      .mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16))
//                      .cpu_offload(fsdp::CPUOffload(/*offload_params=*/true));
//   auto scope = model->summon_full_params(fsdp::SummonFullParamsOptions().writeback(false));
//
// FullyShardedDataParallelOptions itself (the communicator, the auto-wrap policy, ignored
// modules: what PyTorch passes to the FullyShardedDataParallel constructor) lives in
// fully_sharded.h beside the root it configures; the training states of a model and its
// units (TrainingState, HandleTrainingState) in training_state.h.
//
// Threading: plain values and pure functions. Errors: none here; the root checks the
// options it is given (fully_sharded.h).
#ifndef FSDP_CORE_OPTIONS_H_
#define FSDP_CORE_OPTIONS_H_

#include <functional>
#include <vector>

#include "absl/strings/string_view.h"
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>

namespace fsdp {

// PyTorch: torch.distributed.fsdp.ShardingStrategy.
enum class ShardingStrategy {
  kFullShard,    // parameters, gradients, optimizer state sharded; reshard after forward
  kShardGradOp,  // parameters kept unsharded from forward to backward
  kNoShard,      // replicated, gradients all-reduced (DDP)
  // FULL_SHARD inside each shard group, replicated across groups: gradients are
  // reduce-scattered inside the group, then all-reduced across groups.
  kHybridShard,
  kHybridShardZero2,  // the same with SHARD_GRAD_OP inside the group (_HYBRID_SHARD_ZERO2)
};

// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2".
const char* sharding_strategy_name(ShardingStrategy strategy);
// The strategy `name` names, or nullopt: the names above, and the lower-case spellings
// of command-line flags ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard",
// "hybrid_shard_zero2": no leading underscore). Exact matches only, so
// parse_sharding_strategy(sharding_strategy_name(s)) == s (PyTorch: ShardingStrategy[name],
// which takes the upper-case names).
c10::optional<ShardingStrategy> parse_sharding_strategy(absl::string_view name);
bool is_hybrid(ShardingStrategy strategy);
// Whether a unit frees its parameters after forward (FULL_SHARD, HYBRID_SHARD).
bool reshards_after_forward(ShardingStrategy strategy);

// When to start gathering the next unit's parameters in backward.
// PyTorch: torch.distributed.fsdp.BackwardPrefetch (kNone is None).
enum class BackwardPrefetch {
  kNone,
  kBackwardPre,   // gather the next unit's parameters when this unit's backward starts
  kBackwardPost,  // ... when this unit's gradient reduction was issued
};

// Whether `module` is a BatchNorm (1d, 2d, 3d): MixedPrecision's default
// full_precision_modules.
bool is_batch_norm(const torch::nn::Module& module);

// Mixed-precision training (see Note [Mixed precision] in internal/runtime.cc).
// PyTorch: torch.distributed.fsdp.MixedPrecision, with _module_classes_to_ignore as
// full_precision_modules. The optimizer always sees full-precision flat shards.
struct MixedPrecision {
  // dtype of the unsharded parameters in forward and backward, and of the all-gathers
  // (none: the parameters' own).
  TORCH_ARG(c10::optional<c10::ScalarType>, param_dtype);
  // dtype of gradient reduction (reduce-scatter / all-reduce); none: param_dtype if set,
  // else the parameters' own.
  TORCH_ARG(c10::optional<c10::ScalarType>, reduce_dtype);
  // dtype of the floating buffers while the model runs forward and backward; they are
  // cast back to their own dtype when each iteration ends (none: no cast).
  TORCH_ARG(c10::optional<c10::ScalarType>, buffer_dtype);
  // Keep the reduced gradient shards in reduce_dtype for the optimizer instead of
  // casting them to the parameters' dtype.
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  // Non-root units cast floating tensor arguments of their forward to param_dtype.
  TORCH_ARG(bool, cast_forward_inputs) = false;
  // The root casts floating tensor arguments of its forward to param_dtype.
  TORCH_ARG(bool, cast_root_forward_inputs) = true;
  // Units whose wrapped module this picks stay in full precision (parameters, buffers,
  // gradients), casting floating inputs up and their tensor output back. With an
  // auto_wrap_policy every module it picks is made a unit, as in PyTorch.
  TORCH_ARG(std::function<bool(const torch::nn::Module&)>, full_precision_modules) = is_batch_norm;
};

// PyTorch: torch.distributed.fsdp.CPUOffload (FSDP2: CPUOffloadPolicy).
struct CPUOffload {
  CPUOffload(bool offload_params = false)  // NOLINT: implicit, as cpu_offload(true) reads
      : offload_params_(offload_params) {}
  // Keep every unit's sharded flat parameter, its gradient and (as the optimizer makes it
  // beside the parameter) the optimizer state in host memory, pinned when the compute
  // device is CUDA; the optimizer steps on the CPU. Each unshard copies the unit's shard
  // to the device on a side stream before its all-gather (with forward_prefetch or
  // backward prefetching, while the previous unit computes); each reduced gradient shard
  // is copied back to the host, and .grad is final when backward() returns. The device
  // then holds only the unsharded units in flight and their gradients' reductions
  // (REFERENCE §5 has the bytes). See Note [CPU offload] in flat_param.cc.
  TORCH_ARG(bool, offload_params);
};

// Settings of one unit that differ from its root's: PyTorch's wrap() overrides (PyTorch:
// the arguments of a nested FullyShardedDataParallel). Unset: the root's. Given to
// fsdp::wrap (unit.h) or returned by a CustomPolicy (fully_sharded.h).
struct UnitOptions {
  // FULL_SHARD, SHARD_GRAD_OP or NO_SHARD under a non-HYBRID root; under a HYBRID root
  // only the root's own (as unit_sharding_strategies).
  TORCH_ARG(c10::optional<ShardingStrategy>, sharding_strategy);
  // This unit's parameter and reduction dtypes, input casting (cast_forward_inputs) and
  // full_precision_modules; buffers follow the root's.
  TORCH_ARG(c10::optional<MixedPrecision>, mixed_precision);
  // Modules inside this unit's module that FSDP leaves alone, with everything below them,
  // as if given to the root's ignored_modules (which it adds them to): not flattened, also
  // when an EnableWrap scope shards the unit as it is built, when the root's modules do not
  // exist yet. Given to fsdp::wrap or a Unit<T>; a CustomPolicy's are not read. PyTorch:
  // wrap(module, ignored_modules=[...]).
  TORCH_ARG(std::vector<const torch::nn::Module*>, ignored_modules);
};

// What FullyShardedRoot::summon_full_params (fully_sharded.h) gathers and how. PyTorch:
// the arguments of FullyShardedDataParallel.summon_full_params (use_orig_params=False),
// same defaults.
struct SummonFullParamsOptions {
  // Units below the root too (false: the root's own parameters only; the other units'
  // original parameters stay sharded and must not be read).
  TORCH_ARG(bool, recurse) = true;
  // Edits made to the full parameters are copied back into the shards when the scope
  // ends (to the original parameters' values: also with offload_to_cpu).
  TORCH_ARG(bool, writeback) = true;
  // Only rank 0 keeps the full values: the other ranks' original parameters must not be
  // read (their memory is freed). Not with writeback.
  TORCH_ARG(bool, rank0_only) = false;
  // The full parameters are CPU tensors while the scope lives: each original parameter
  // is a CPU copy, and the compute device holds only the shards. As in PyTorch, only
  // sharded units offload (not NO_SHARD, nor world size 1), and a CPU compute device has
  // nothing to move. Best with rank0_only, so one rank holds the copy.
  TORCH_ARG(bool, offload_to_cpu) = false;
  // Each original parameter's grad() is its full gradient (all-gathered from the shards'
  // gradients; undefined where the shard has none) while the scope lives; gradients are
  // not written back. Not with offload_to_cpu (as in PyTorch).
  TORCH_ARG(bool, with_grads) = false;
};

// How an EnableWrap scope (fully_sharded.h) makes units, beyond the root's options.
struct EnableWrapOptions {
  // Each unit built in the scope shards its parameters at once (see Deferred
  // initialisation at EnableWrap in fully_sharded.h).
  TORCH_ARG(bool, shard_on_construction) = false;
};

// How fsdp::full_state_dict (fsdp/state/state_dict.h) gathers. PyTorch:
// torch.distributed.fsdp.FullStateDictConfig (rank0_only, offload_to_cpu).
struct FullStateDictOptions {
  // Only rank 0 receives the state dict; the others get an empty one and never hold a
  // full copy (they still take part in the all-gathers).
  TORCH_ARG(bool, rank0_only) = false;
  // Copy the values to the CPU (for a model on a GPU).
  TORCH_ARG(bool, offload_to_cpu) = false;
};

}  // namespace fsdp

#endif  // FSDP_CORE_OPTIONS_H_
