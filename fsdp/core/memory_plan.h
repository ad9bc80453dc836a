// The per-rank memory and traffic plan of FSDP training: for one rank and one training step
// (forward, backward, optimizer step), the peak tracked memory broken down by term and the
// bytes sent and received by collective kind, before anything runs. One formula, used by
// `fsdp_plan` (tools/plan_report.h) before launch and by the runtime
// (FullyShardedRoot::memory_plan, check_plan in fully_sharded.h) while training;
// docs/REFERENCE.md §5a states it.
//
//   std::vector<fsdp::PlanUnit> units = {{"", 1290, 0, /*is_root=*/true},
//                                        {"blocks.0", 131712}, {"blocks.1", 131712}};
//   fsdp::MemoryPlan plan = fsdp::plan_memory(
//       units, fsdp::MemoryPlanOptions().world_size(4).optimizer(fsdp::OptimizerSpec::adam()));
//   plan.term_bytes(fsdp::PlanTerm::kOptimizerState);   // 8 x sum of shard numels
//   plan.peak_bytes;                                    // the whole step's peak
//   plan.traffic_of(fsdp::CollectiveKind::kAllGather).bytes_sent;
//
// How. plan_memory walks the step as the runtime runs it (internal/runtime.cc,
// flat_param.cc): units gathered in forward in the given order (pre-order, the root first),
// released after forward under FULL_SHARD/HYBRID_SHARD, gathered again in reverse order in
// backward with the chosen prefetch, each unit's gradients flattened and reduced with one
// reduction left in flight, then the optimizer step. Every allocation the runtime makes is
// an event of one term; the peak is the largest sum of live terms at any event. See
// Note [The memory plan] in memory_plan.cc for each event and its bytes.
//
// Units: bytes are counted in each flat parameter's own geometry (padded to a multiple of
// the ranks it is sharded over, fsdp/base/shard_geometry.h). Threading: pure functions.
// Errors: c10::Error for bad input (negative numels, world size < 1, a HYBRID shard group
// size that does not divide the world size). PyTorch has no counterpart (REFERENCE §5
// gives the FSDP paper's and ZeRO's estimates, which this makes exact per rank).
#ifndef FSDP_CORE_MEMORY_PLAN_H_
#define FSDP_CORE_MEMORY_PLAN_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include "fsdp/comm/communicator.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/training_state.h"

namespace fsdp {

// The optimizer as the plan needs it: state tensors per parameter element (each in the
// parameter's dtype) and the parameter-sized temporaries one parameter's update allocates
// at once (LibTorch 2.11's torch::optim implementations).
struct OptimizerSpec {
  std::string name;
  int64_t states_per_element = 0;
  int64_t step_temporaries = 0;

  static OptimizerSpec sgd(bool momentum);  // momentum_buffer if momentum != 0
  static OptimizerSpec adam();              // exp_avg, exp_avg_sq; denom's two temporaries
  static OptimizerSpec adamw();             // as adam()
  static OptimizerSpec fused_adamw();       // fsdp::FusedAdamW: adamw()'s, no temporaries
  static OptimizerSpec adagrad();           // sum; std's temporary
  static OptimizerSpec rmsprop(bool momentum, bool centered);  // square_avg (+ buffers)
};

// "sgd", "sgd_momentum", "adam", "adamw", "fused_adamw", "adagrad", "rmsprop" (as
// command-line flags spell them), or nullopt.
c10::optional<OptimizerSpec> parse_optimizer_spec(absl::string_view name);

// How the communication backend allocates scratch memory through c10's allocator (see
// Note [The memory plan]): NCCL none, Gloo a receive buffer for reduce-scatter, the fake
// backend (ranks as threads) copies of every all-gather and reduction.
enum class PlanBackend { kNccl, kGloo, kFake };
// From Communicator::backend_name(): "nccl", "gloo", "fake"; others plan as kNccl.
PlanBackend plan_backend_of(absl::string_view backend_name);

// Frozen elements of one dtype other than MemoryPlanOptions::dtype: one of a unit's
// frozen_handles() (a bf16 base beside fp32 adapters; stored 4-bit codes in uint8). It is
// gathered in `gathered_dtype`; none: MemoryPlanOptions::param_dtype if it is floating and
// mixed precision is on, else its own dtype, as the runtime does (Note [Flat parameters of
// several dtypes] in flat_param.cc).
struct PlanFrozen {
  c10::ScalarType dtype = c10::ScalarType::Float;
  int64_t numel = 0;
  c10::optional<c10::ScalarType> gathered_dtype;
};

// One unit: elements of its trainable flat parameter (handle()) and of its frozen ones
// in MemoryPlanOptions::dtype (a unit whose parameters are all frozen has trainable_numel
// 0), before padding, and its frozen flat parameters of other dtypes. Units without
// parameters may be given (they plan nothing).
struct PlanUnit {
  std::string fqn;
  int64_t trainable_numel = 0;
  int64_t frozen_numel = 0;
  bool is_root = false;  // kept unsharded from forward to backward; reduced last
  // What autograd saves during this unit's forward, part of
  // MemoryPlanOptions::activation_bytes and freed once the unit's backward has run (0:
  // unknown, held to the end of the step as the rest of activation_bytes).
  int64_t activation_bytes = 0;
  std::vector<PlanFrozen> frozen_other_dtypes = {};
};

struct MemoryPlanOptions {
  TORCH_ARG(int64_t, world_size) = 1;
  // At world size 1 every strategy plans as kNoShard (as the runtime runs it).
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  // HYBRID strategies: ranks per shard group F (0: the whole world); divides world_size.
  TORCH_ARG(int64_t, hybrid_shard_group_size) = 0;
  // The shards' (and the optimizer state's) dtype.
  TORCH_ARG(c10::ScalarType, dtype) = c10::ScalarType::Float;
  // MixedPrecision: unsharded parameters (none: dtype) and reduction dtype (none:
  // param_dtype, else dtype); keep_low_precision_grads keeps the sharded gradient in
  // reduce_dtype.
  TORCH_ARG(c10::optional<c10::ScalarType>, param_dtype);
  TORCH_ARG(c10::optional<c10::ScalarType>, reduce_dtype);
  TORCH_ARG(bool, keep_low_precision_grads) = false;
  TORCH_ARG(OptimizerSpec, optimizer) = OptimizerSpec::adam();
  TORCH_ARG(BackwardPrefetch, backward_prefetch) = BackwardPrefetch::kBackwardPre;
  TORCH_ARG(bool, forward_prefetch) = false;
  // CPUOffload(offload_params): shards, gradients and optimizer state live in host memory.
  TORCH_ARG(bool, cpu_offload) = false;
  // Whether host memory is the tracked device's (a CPU compute device): then offloaded
  // state still counts in the peak (as the runtime's host copies are CPU allocations).
  TORCH_ARG(bool, host_is_tracked) = true;
  TORCH_ARG(PlanBackend, backend) = PlanBackend::kNccl;
  // Activation memory at the peak (bytes), if the caller can tell (from a batch shape and
  // context); nullopt: not planned (the C++ frontend's graph has no shapes before it runs).
  TORCH_ARG(c10::optional<int64_t>, activation_bytes);
};

// The terms of a rank's memory.
enum class PlanTerm : int {
  kShardedParameters = 0,  // every flat parameter's shard (trainable and frozen)
  kShardedGradients,       // the trainable shards' gradients
  kOptimizerState,         // OptimizerSpec::states_per_element per trainable shard element
  kUnshardedParameters,    // unsharded flat parameters in flight (param_dtype)
  kUnshardedGradients,     // autograd's gradients of the original parameters (param_dtype)
  kReductionBuffers,       // flat gradients and reduced shards (reduce_dtype)
  kMixedPrecisionCopies,   // shards cast to param_dtype for the all-gather, grads cast back
  kCommunicationBuffers,   // the backend's scratch, offload's device copies of shards
  kOptimizerTemporaries,   // one parameter's update temporaries in the optimizer step
  kActivations,            // MemoryPlanOptions::activation_bytes
};
inline constexpr int kNumPlanTerms = 10;
// "sharded_parameters", "sharded_gradients", "optimizer_state", ... (snake case).
const char* plan_term_name(PlanTerm term);

struct MemoryPlan {
  MemoryPlanOptions options;
  ShardingStrategy effective_strategy = ShardingStrategy::kNoShard;  // kNoShard at W = 1
  // Each term's own maximum over the step (bytes): for the sharded terms, their size
  // after the step (what memory holds between steps).
  std::array<int64_t, kNumPlanTerms> max_bytes{};
  // The peak of the sum of the terms held on the tracked device (bytes), and each term's
  // bytes at that moment.
  int64_t peak_bytes = 0;
  std::array<int64_t, kNumPlanTerms> at_peak_bytes{};
  // What the event was (e.g. "backward of unit 'blocks.3'").
  std::string peak_event;
  // CPU offload on a device whose host memory is not tracked: the host's bytes.
  int64_t host_bytes = 0;
  // Per collective kind (CollectiveKind's index), this rank's calls and bytes per step,
  // over every communicator of the model (shard and replicate groups).
  std::array<CollectiveTraffic, kNumCollectiveKinds> traffic{};

  int64_t term_bytes(PlanTerm term) const { return max_bytes[static_cast<int>(term)]; }
  CollectiveTraffic traffic_of(CollectiveKind kind) const {
    return traffic[static_cast<int>(kind)];
  }
  int64_t bytes_sent() const;      // all kinds
  int64_t bytes_received() const;  // all kinds
  bool activations_planned() const { return options.activation_bytes().has_value(); }
};

// The plan for `units` (in forward order, the root first) on one rank. Every rank has the
// same plan (every rank holds one shard of each flat parameter). Throws c10::Error on bad
// input (see the file comment).
MemoryPlan plan_memory(const std::vector<PlanUnit>& units, const MemoryPlanOptions& options);

// What a rank measured over one step, to compare with its plan (FullyShardedRoot::check_plan
// measures it): bytes of the sharded flat parameters, of their gradients and of the
// optimizer's state after the step, the peak of tracked memory during it less what was
// allocated before it that is not model state, and the communicators' counters' increase.
struct PlanMeasurement {
  int64_t sharded_parameter_bytes = 0;
  int64_t sharded_gradient_bytes = 0;
  int64_t optimizer_state_bytes = 0;
  int64_t peak_bytes = 0;
  std::array<CollectiveTraffic, kNumCollectiveKinds> traffic{};
};

// The tolerances of the plan check: measured / planned may exceed 1 by this much.
inline constexpr double kPlanTermTolerance = 0.05;  // model-state terms and traffic
inline constexpr double kPlanPeakTolerance = 0.10;  // the whole peak

// One measured figure against its plan.
struct PlanComparison {
  std::string what;  // "sharded_parameters", ..., "peak", "all_gather_into_tensor bytes_sent"
  int64_t measured = 0;
  int64_t planned = 0;
  double tolerance = 0;
  // Whether exceeding fails the check (the peak is reported only, unless activations
  // were planned: without them the plan cannot bound it).
  bool enforced = true;
  double ratio() const;  // measured / planned (1 when both are 0, infinity over a 0 plan)
  bool exceeded() const { return enforced && ratio() > 1.0 + tolerance; }
};

struct PlanCheckResult {
  std::vector<PlanComparison> rows;
  // The first enforced row above its tolerance, or null.
  const PlanComparison* first_exceeded() const;
  // The row named `what` (must exist).
  const PlanComparison& row(absl::string_view what) const;
  // For a progress line: "plan: params 1.000 grads 1.000 optim 1.000 traffic 1.000 peak
  // 0.973" (measured / planned; the peak marked "(no activations)" when not planned).
  std::string summary() const;
};

// The rows, in the order of PlanCheckResult::summary: parameters, gradients, optimizer
// state, the bytes sent by every collective kind the plan or the measurement has, their
// total ("traffic"), then the peak.
PlanCheckResult compare_with_plan(const MemoryPlan& plan, const PlanMeasurement& measured);

// A table of the plan: each term's maximum and its bytes at the peak, then traffic by
// collective kind; bytes also in MiB.
std::string memory_plan_table(const MemoryPlan& plan);

}  // namespace fsdp

#endif  // FSDP_CORE_MEMORY_PLAN_H_
