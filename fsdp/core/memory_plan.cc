#include "fsdp/core/memory_plan.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <c10/util/Exception.h>

#include "fsdp/base/shard_geometry.h"

namespace fsdp {

OptimizerSpec OptimizerSpec::sgd(bool momentum) {
  return {momentum ? "sgd_momentum" : "sgd", momentum ? 1 : 0, 0};
}
OptimizerSpec OptimizerSpec::adam() { return {"adam", 2, 2}; }
OptimizerSpec OptimizerSpec::adamw() { return {"adamw", 2, 2}; }
OptimizerSpec OptimizerSpec::fused_adamw() { return {"fused_adamw", 2, 0}; }
OptimizerSpec OptimizerSpec::adagrad() { return {"adagrad", 1, 1}; }
OptimizerSpec OptimizerSpec::rmsprop(bool momentum, bool centered) {
  return {"rmsprop", 1 + (momentum ? 1 : 0) + (centered ? 1 : 0), centered ? 2 : 1};
}

c10::optional<OptimizerSpec> parse_optimizer_spec(absl::string_view name) {
  if (name == "sgd") return OptimizerSpec::sgd(false);
  if (name == "sgd_momentum") return OptimizerSpec::sgd(true);
  if (name == "adam") return OptimizerSpec::adam();
  if (name == "adamw") return OptimizerSpec::adamw();
  if (name == "fused_adamw") return OptimizerSpec::fused_adamw();
  if (name == "adagrad") return OptimizerSpec::adagrad();
  if (name == "rmsprop") return OptimizerSpec::rmsprop(false, false);
  return c10::nullopt;
}

PlanBackend plan_backend_of(absl::string_view backend_name) {
  if (backend_name == "gloo") return PlanBackend::kGloo;
  if (backend_name == "fake") return PlanBackend::kFake;
  return PlanBackend::kNccl;
}

const char* plan_term_name(PlanTerm term) {
  switch (term) {
    case PlanTerm::kShardedParameters:
      return "sharded_parameters";
    case PlanTerm::kShardedGradients:
      return "sharded_gradients";
    case PlanTerm::kOptimizerState:
      return "optimizer_state";
    case PlanTerm::kUnshardedParameters:
      return "unsharded_parameters";
    case PlanTerm::kUnshardedGradients:
      return "unsharded_gradients";
    case PlanTerm::kReductionBuffers:
      return "reduction_buffers";
    case PlanTerm::kMixedPrecisionCopies:
      return "mixed_precision_copies";
    case PlanTerm::kCommunicationBuffers:
      return "communication_buffers";
    case PlanTerm::kOptimizerTemporaries:
      return "optimizer_temporaries";
    case PlanTerm::kActivations:
      return "activations";
  }
  return "unknown";
}

int64_t MemoryPlan::bytes_sent() const {
  int64_t total = 0;
  for (const CollectiveTraffic& t : traffic) total += t.bytes_sent;
  return total;
}

int64_t MemoryPlan::bytes_received() const {
  int64_t total = 0;
  for (const CollectiveTraffic& t : traffic) total += t.bytes_received;
  return total;
}

// Note [The memory plan]
// plan_memory replays one steady-state training step of the runtime and counts, per term,
// every buffer it allocates through the compute device's allocator (the bytes the tracking
// allocator and the CUDA caching allocator count), in the order the runtime makes them.
// Per flat parameter h sharded over F ranks (FULL_SHARD, SHARD_GRAD_OP: F = W; HYBRID: the
// shard group; NO_SHARD: F = 1, s = P = numel): shard s_h = ceil(numel_h / F), padded
// P_h = s_h F; bytes per element: b (the shards' dtype), b_p (param_dtype), b_r
// (reduce_dtype), b_g (the sharded gradient's: b, or b_r with keep_low_precision_grads).
// A frozen flat parameter of another dtype (PlanFrozen) has its own b, and its own b_p
// unless it is floating and mixed precision is on.
// - Always held: sharded parameters b sum s_h (trainable and frozen), optimizer state
//   k b sum s_t (k = OptimizerSpec::states_per_element, trainable shards only).
// - Unshard of a unit (FlatParamHandle::prefetch/unshard): + b_p P_h unsharded per flat
//   parameter; the all-gather input is the shard cast to param_dtype (+ b_p s_h, mixed
//   precision only: without it the shard itself is the input) or, with CPU offload, the
//   shard copied to the device (+ b_p s_h); freed when the all-gather is waited for. The
//   fake backend copies every rank's input and concatenates them (+ 2 b_p P_h for the
//   duration of the call); Gloo and NCCL receive into the output.
// - Forward: units in order; FULL_SHARD/HYBRID_SHARD free each non-root unit after its
//   forward; SHARD_GRAD_OP keeps every unit; forward_prefetch gathers the next unit as one
//   starts. NO_SHARD computes on the shard itself (a param_dtype copy with mixed precision).
// - Backward: the root's pre-backward runs first (BACKWARD_PRE prefetches the last unit);
//   the root's gradients (b_p numel_t) are held from then on, since its output head's come
//   first and its sink waits for all of them. Each other unit in reverse order: gather (or
//   finish its prefetch), BACKWARD_PRE prefetch of the previous unit, its gradients
//   (+ b_p numel_t: the peak of a unit's backward), then the post-backward: free the
//   unit, finish the reduction in flight, flatten (+ b_r P_t, the gradients freed),
//   issue the reduction (+ b_r s_t output; Gloo's reduce-scatter receives W - 2 peers'
//   chunks into + (F - 2) b_r s_t until waited for; the fake backend sums into a copy,
//   + b_r s_t during the call, and all-reduce copies the tensor), BACKWARD_POST prefetch.
//   Finishing a reduction frees the flat gradient; HYBRID all-reduces the shard over the
//   R = W / F replicas; the reduced shard becomes the gradient (cast to b when b_r != b
//   and not keep_low_precision_grads: + b s_t, - b_r s_t). The root's reduction runs last.
//   A unit whose parameters are all frozen has no gradient sink: gathered again in its
//   pre-backward, it is freed once its inputs' gradients are complete, before the next
//   unit's gradients (Note [Frozen units reshard after their backward] in
//   internal/runtime.cc), then BACKWARD_POST prefetches. One that comes before every unit
//   with trainable parameters (the root counts as first when it trains) is taken to be
//   outside autograd, as when the model's inputs need no gradient (token ids, images): it
//   is neither gathered nor prefetched in backward (Note [Units outside autograd]).
// - Optimizer step: OptimizerSpec::step_temporaries x b max s_t for one parameter's update.
// - Activations: MemoryPlanOptions::activation_bytes, held from the start; a non-root
//   unit's PlanUnit::activation_bytes (a part of them) are freed once its gradients are
//   counted (a frozen unit: once it is freed), the rest are held to the end (an upper
//   bound: autograd frees each op's saved tensors as the op's backward runs).
// Traffic (Communicator's counters, CollectiveKind): an all-gather sends and receives
// (F - 1) b_p s_h, a reduce-scatter (F - 1) b_r s_t, an all-reduce of n elements on G ranks
// 2 (G - 1) ceil(n / G) b_r (NO_SHARD: G = W, n = numel_t; HYBRID: G = R, n = s_t).
// REFERENCE §5a states the totals these events add up to.
namespace {

struct FlatGeometry {
  int64_t numel = 0;
  int64_t shard = 0;   // elements of this rank's shard
  int64_t padded = 0;  // elements of the unsharded buffer
  int64_t b = 4;       // bytes per element of the shard
  int64_t b_p = 4;     // ... and of the unsharded buffer (gathered)
  bool mixed = false;  // gathered through a cast copy of the shard (b_p of them)
};

struct UnitRecord {
  std::string fqn;
  bool is_root = false;
  FlatGeometry trainable;            // numel 0: none
  std::vector<FlatGeometry> frozen;  // one per frozen flat parameter
  bool unsharded = false;
  bool gathering = false;  // a prefetch's all-gather input is held
  bool backward_started = false;
  bool outside_autograd = false;  // frozen, before every trainable unit
  int64_t activation_bytes = 0;   // PlanUnit::activation_bytes
  bool trains() const { return trainable.numel > 0; }
  std::vector<const FlatGeometry*> handles() const {
    std::vector<const FlatGeometry*> out;
    if (trainable.numel > 0) out.push_back(&trainable);
    for (const FlatGeometry& f : frozen) out.push_back(&f);
    return out;
  }
  std::string name() const { return is_root ? "the root" : absl::StrCat("unit '", fqn, "'"); }
};

class Replay {
 public:
  Replay(const std::vector<PlanUnit>& units, const MemoryPlanOptions& options) {
    plan_.options = options;
    const int64_t w = options.world_size();
    TORCH_CHECK(w >= 1, "plan_memory: world_size must be >= 1, got ", w);
    strategy_ = w == 1 ? ShardingStrategy::kNoShard : options.sharding_strategy();
    plan_.effective_strategy = strategy_;
    shard_ranks_ = strategy_ == ShardingStrategy::kNoShard ? 1 : w;
    if (is_hybrid(strategy_)) {
      const int64_t f =
          options.hybrid_shard_group_size() == 0 ? w : options.hybrid_shard_group_size();
      TORCH_CHECK(f >= 1 && w % f == 0, "plan_memory: hybrid_shard_group_size must divide ",
                  "world_size ", w, ", got ", f, "; pass a divisor of the world size (e.g. the ",
                  "ranks of one host)");
      shard_ranks_ = f;
      replicas_ = w / f;
    }
    b_ = c10::elementSize(options.dtype());
    b_p_ = c10::elementSize(options.param_dtype().value_or(options.dtype()));
    b_r_ = c10::elementSize(
        options.reduce_dtype().value_or(options.param_dtype().value_or(options.dtype())));
    cast_grad_ = !options.keep_low_precision_grads() && b_r_ != b_;
    host_untracked_ = options.cpu_offload() && !options.host_is_tracked();
    int64_t unit_activations = 0;
    for (const PlanUnit& unit : units) {
      TORCH_CHECK(unit.trainable_numel >= 0 && unit.frozen_numel >= 0, "plan_memory: unit '",
                  unit.fqn, "' has a negative numel (", unit.trainable_numel, " trainable, ",
                  unit.frozen_numel, " frozen)");
      UnitRecord record;
      record.fqn = unit.fqn;
      record.is_root = unit.is_root;
      record.trainable = geometry(unit.trainable_numel, options.dtype());
      if (unit.frozen_numel > 0)
        record.frozen.push_back(geometry(unit.frozen_numel, options.dtype()));
      for (const PlanFrozen& other : unit.frozen_other_dtypes) {
        TORCH_CHECK(other.numel >= 0, "plan_memory: unit '", unit.fqn, "' has ", other.numel,
                    " frozen elements of ", other.dtype, "; expected a count >= 0");
        if (other.numel > 0) {
          record.frozen.push_back(geometry(other.numel, other.dtype, other.gathered_dtype));
        }
      }
      if (record.handles().empty()) continue;
      TORCH_CHECK(unit.activation_bytes >= 0, "plan_memory: unit '", unit.fqn,
                  "' has negative activation_bytes (", unit.activation_bytes, ")");
      record.activation_bytes = unit.activation_bytes;
      unit_activations += unit.activation_bytes;
      units_.push_back(std::move(record));
    }
    TORCH_CHECK(unit_activations <= options.activation_bytes().value_or(0),
                "plan_memory: the units' activation_bytes add up to ", unit_activations,
                ", more than MemoryPlanOptions::activation_bytes (",
                options.activation_bytes().value_or(0), "), which holds them");
    bool trained_before = false;  // units_ is in forward order, the root first
    for (UnitRecord& unit : units_) {
      unit.outside_autograd = !unit.trains() && !trained_before;
      trained_before = trained_before || unit.trains();
    }
  }

  MemoryPlan run() {
    hold_sharded_state();
    if (plan_.options.activation_bytes()) {
      add(PlanTerm::kActivations, *plan_.options.activation_bytes(), "activations");
    }
    forward();
    backward();
    optimizer_step();
    return std::move(plan_);
  }

 private:
  FlatGeometry geometry(int64_t numel, c10::ScalarType dtype,
                        c10::optional<c10::ScalarType> gathered_dtype = c10::nullopt) const {
    if (numel == 0) return {};
    // Stored (non-floating) values are gathered as they are (flat_param.cc).
    const c10::ScalarType gathered = gathered_dtype.value_or(
        c10::isFloatingType(dtype) ? plan_.options.param_dtype().value_or(dtype) : dtype);
    FlatGeometry g{numel,
                   numel,
                   numel,
                   static_cast<int64_t>(c10::elementSize(dtype)),
                   static_cast<int64_t>(c10::elementSize(gathered)),
                   gathered != dtype};
    if (strategy_ != ShardingStrategy::kNoShard) {
      g.shard = shard_numel(numel, shard_ranks_);
      g.padded = padded_numel(numel, shard_ranks_);
    }
    return g;
  }
  bool on_host(PlanTerm term) const {
    return host_untracked_ &&
           (term == PlanTerm::kShardedParameters || term == PlanTerm::kShardedGradients ||
            term == PlanTerm::kOptimizerState || term == PlanTerm::kOptimizerTemporaries);
  }

  // The ledger: live bytes per term, each term's maximum, the peak of their sum.
  void add(PlanTerm term, int64_t bytes, const std::string& event) {
    const int i = static_cast<int>(term);
    live_[i] += bytes;
    plan_.max_bytes[i] = std::max(plan_.max_bytes[i], live_[i]);
    if (on_host(term)) {
      host_live_ += bytes;
      plan_.host_bytes = std::max(plan_.host_bytes, host_live_);
      return;
    }
    int64_t total = 0;
    for (int t = 0; t < kNumPlanTerms; ++t) {
      if (!on_host(static_cast<PlanTerm>(t))) total += live_[t];
    }
    if (bytes > 0 && total > plan_.peak_bytes) {
      plan_.peak_bytes = total;
      for (int t = 0; t < kNumPlanTerms; ++t) {
        plan_.at_peak_bytes[t] = on_host(static_cast<PlanTerm>(t)) ? 0 : live_[t];
      }
      plan_.peak_event = event;
    }
  }
  void free(PlanTerm term, int64_t bytes) { add(term, -bytes, ""); }
  void transient(PlanTerm term, int64_t bytes, const std::string& event) {
    add(term, bytes, event);
    free(term, bytes);
  }
  void count(CollectiveKind kind, int64_t bytes) {
    CollectiveTraffic& t = plan_.traffic[static_cast<int>(kind)];
    t.calls += 1;
    t.bytes_sent += bytes;
    t.bytes_received += bytes;
  }
  // An all-reduce of `numel` elements of b_r bytes on `ranks` ranks (Communicator's count).
  void all_reduce(int64_t numel, int64_t ranks, const std::string& event) {
    count(CollectiveKind::kAllReduce, 2 * (ranks - 1) * ceil_div(numel, ranks) * b_r_);
    if (plan_.options.backend() == PlanBackend::kFake) {
      transient(PlanTerm::kCommunicationBuffers, numel * b_r_, event);
    }
  }

  void hold_sharded_state() {
    const int64_t states = plan_.options.optimizer().states_per_element;
    for (const UnitRecord& unit : units_) {
      for (const FlatGeometry* h : unit.handles()) {
        add(PlanTerm::kShardedParameters, h->shard * h->b, "sharded parameters");
      }
      add(PlanTerm::kOptimizerState, states * unit.trainable.shard * b_, "optimizer state");
    }
  }

  // FlatParamHandle::prefetch of every flat parameter of the unit.
  void start_gather(UnitRecord& unit, const std::string& why) {
    if (unit.unsharded || unit.gathering) return;
    const std::string event = absl::StrCat(why, ": all-gather of ", unit.name());
    for (const FlatGeometry* h : unit.handles()) {
      if (strategy_ == ShardingStrategy::kNoShard) {
        if (!h->mixed && !plan_.options.cpu_offload()) continue;  // the shard is the parameter
        add(PlanTerm::kUnshardedParameters, h->padded * h->b_p, event);
        if (plan_.options.cpu_offload()) {
          transient(PlanTerm::kCommunicationBuffers, h->shard * h->b_p, event);
        }
        continue;
      }
      add(PlanTerm::kUnshardedParameters, h->padded * h->b_p, event);
      if (plan_.options.cpu_offload()) {
        add(PlanTerm::kCommunicationBuffers, h->shard * h->b_p, event);
      } else if (h->mixed) {
        add(PlanTerm::kMixedPrecisionCopies, h->shard * h->b_p, event);
      }
      if (plan_.options.backend() == PlanBackend::kFake) {
        transient(PlanTerm::kCommunicationBuffers, 2 * h->padded * h->b_p, event);
      }
      count(CollectiveKind::kAllGather, (shard_ranks_ - 1) * h->shard * h->b_p);
    }
    unit.gathering = true;
  }
  void finish_gather(UnitRecord& unit) {
    if (!unit.gathering) return;
    unit.gathering = false;
    unit.unsharded = true;
    if (strategy_ == ShardingStrategy::kNoShard) return;
    for (const FlatGeometry* h : unit.handles()) {
      if (plan_.options.cpu_offload()) {
        free(PlanTerm::kCommunicationBuffers, h->shard * h->b_p);
      } else if (h->mixed) {
        free(PlanTerm::kMixedPrecisionCopies, h->shard * h->b_p);
      }
    }
  }
  void unshard(UnitRecord& unit, const std::string& why) {
    start_gather(unit, why);
    finish_gather(unit);
  }
  void reshard(UnitRecord& unit) {
    if (!unit.unsharded) return;
    unit.unsharded = false;
    for (const FlatGeometry* h : unit.handles()) {
      if (strategy_ == ShardingStrategy::kNoShard && !h->mixed && !plan_.options.cpu_offload()) {
        continue;
      }
      free(PlanTerm::kUnshardedParameters, h->padded * h->b_p);
    }
  }

  void forward() {
    const bool reshard_after = reshards_after_forward(strategy_);
    for (size_t k = 0; k < units_.size(); ++k) {
      UnitRecord& unit = units_[k];
      unshard(unit, absl::StrCat("forward of ", unit.name()));
      if (plan_.options.forward_prefetch() && k + 1 < units_.size()) {
        start_gather(units_[k + 1], absl::StrCat("forward prefetch after ", unit.name()));
      }
      if (!unit.is_root && reshard_after) reshard(unit);
    }
  }

  // The latest unit in forward order, other than `current`, whose backward has not started.
  UnitRecord* next_in_backward(const UnitRecord* current) {
    for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
      if (&*it != current && !it->backward_started && !it->outside_autograd) return &*it;
    }
    return nullptr;
  }
  void prefetch_after(const UnitRecord* current, BackwardPrefetch when) {
    if (plan_.options.backward_prefetch() != when) return;
    if (UnitRecord* next = next_in_backward(current)) {
      start_gather(*next, absl::StrCat("backward prefetch after ", current->name()));
    }
  }

  void backward() {
    UnitRecord* root = nullptr;
    for (UnitRecord& unit : units_) {
      if (unit.is_root) root = &unit;
    }
    if (root != nullptr) {  // its output's hook runs first
      root->backward_started = true;
      unshard(*root, "backward of the root");
      prefetch_after(root, BackwardPrefetch::kBackwardPre);
      if (root->trains()) {
        add(PlanTerm::kUnshardedGradients, root->trainable.numel * b_p_, "gradients of the root");
      }
    }
    for (auto it = units_.rbegin(); it != units_.rend(); ++it) {
      UnitRecord& unit = *it;
      if (unit.is_root || unit.outside_autograd) continue;
      const std::string event = absl::StrCat("backward of ", unit.name());
      unit.backward_started = true;
      unshard(unit, event);
      prefetch_after(&unit, BackwardPrefetch::kBackwardPre);
      if (!unit.trains()) {  // no gradient sink: freed once its inputs' gradients are done
        reshard(unit);
        free(PlanTerm::kActivations, unit.activation_bytes);
        prefetch_after(&unit, BackwardPrefetch::kBackwardPost);
        continue;
      }
      add(PlanTerm::kUnshardedGradients, unit.trainable.numel * b_p_, event);
      free(PlanTerm::kActivations, unit.activation_bytes);
      post_backward(unit);
    }
    if (root != nullptr && root->trains()) post_backward(*root);
    finish_reduction();
    for (UnitRecord& unit : units_) reshard(unit);  // end of the iteration
  }

  void post_backward(UnitRecord& unit) {
    reshard(unit);
    finish_reduction();
    const std::string event = absl::StrCat("gradient reduction of ", unit.name());
    const FlatGeometry& t = unit.trainable;
    add(PlanTerm::kReductionBuffers, t.padded * b_r_, event);  // the flat gradient
    free(PlanTerm::kUnshardedGradients, t.numel * b_p_);
    if (strategy_ == ShardingStrategy::kNoShard) {
      if (plan_.options.world_size() > 1) all_reduce(t.numel, plan_.options.world_size(), event);
    } else {
      add(PlanTerm::kReductionBuffers, t.shard * b_r_, event);  // the reduced shard
      count(CollectiveKind::kReduceScatter, (shard_ranks_ - 1) * t.shard * b_r_);
      if (plan_.options.backend() == PlanBackend::kFake) {
        transient(PlanTerm::kCommunicationBuffers, t.shard * b_r_, event);
      } else if (plan_.options.backend() == PlanBackend::kGloo && shard_ranks_ > 2) {
        gloo_receive_ = (shard_ranks_ - 2) * t.shard * b_r_;
        add(PlanTerm::kCommunicationBuffers, gloo_receive_, event);
      }
    }
    reducing_ = &unit;
    prefetch_after(&unit, BackwardPrefetch::kBackwardPost);
  }

  void finish_reduction() {
    if (reducing_ == nullptr) return;
    UnitRecord& unit = *std::exchange(reducing_, nullptr);
    const FlatGeometry& t = unit.trainable;
    const std::string event = absl::StrCat("gradient of ", unit.name());
    free(PlanTerm::kCommunicationBuffers, std::exchange(gloo_receive_, 0));
    int64_t reduced = t.numel;  // NO_SHARD: the flat gradient is the output
    if (strategy_ != ShardingStrategy::kNoShard) {
      free(PlanTerm::kReductionBuffers, t.padded * b_r_);
      reduced = t.shard;
      if (is_hybrid(strategy_)) all_reduce(t.shard, replicas_, event);
    }
    free(PlanTerm::kReductionBuffers, reduced * b_r_);
    add(PlanTerm::kShardedGradients, reduced * (cast_grad_ ? b_ : b_r_), event);
  }

  void optimizer_step() {
    int64_t largest = 0;
    for (const UnitRecord& unit : units_) largest = std::max(largest, unit.trainable.shard);
    transient(PlanTerm::kOptimizerTemporaries,
              plan_.options.optimizer().step_temporaries * largest * b_, "optimizer step");
  }

  MemoryPlan plan_;
  ShardingStrategy strategy_;
  int64_t shard_ranks_ = 1;
  int64_t replicas_ = 1;
  int64_t b_ = 4, b_p_ = 4, b_r_ = 4;
  bool cast_grad_ = false;
  bool host_untracked_ = false;
  std::vector<UnitRecord> units_;
  std::array<int64_t, kNumPlanTerms> live_{};
  int64_t host_live_ = 0;
  UnitRecord* reducing_ = nullptr;
  int64_t gloo_receive_ = 0;
};

double mib(int64_t bytes) { return bytes / (1024.0 * 1024.0); }

}  // namespace

MemoryPlan plan_memory(const std::vector<PlanUnit>& units, const MemoryPlanOptions& options) {
  return Replay(units, options).run();
}

double PlanComparison::ratio() const {
  if (planned == 0) return measured == 0 ? 1.0 : std::numeric_limits<double>::infinity();
  return static_cast<double>(measured) / static_cast<double>(planned);
}

const PlanComparison* PlanCheckResult::first_exceeded() const {
  for (const PlanComparison& row : rows) {
    if (row.exceeded()) return &row;
  }
  return nullptr;
}

const PlanComparison& PlanCheckResult::row(absl::string_view what) const {
  for (const PlanComparison& row : rows) {
    if (row.what == what) return row;
  }
  TORCH_CHECK(false, "PlanCheckResult: no row '", what, "'");
}

std::string PlanCheckResult::summary() const {
  const PlanComparison& peak = row("peak");
  return absl::StrFormat("plan: params %.3f grads %.3f optim %.3f traffic %.3f peak %.3f%s",
                         row("sharded_parameters").ratio(), row("sharded_gradients").ratio(),
                         row("optimizer_state").ratio(), row("traffic").ratio(), peak.ratio(),
                         peak.enforced ? "" : " (no activations)");
}

PlanCheckResult compare_with_plan(const MemoryPlan& plan, const PlanMeasurement& measured) {
  PlanCheckResult result;
  auto add = [&](std::string what, int64_t got, int64_t want, double tolerance, bool enforced) {
    result.rows.push_back({std::move(what), got, want, tolerance, enforced});
  };
  add("sharded_parameters", measured.sharded_parameter_bytes,
      plan.term_bytes(PlanTerm::kShardedParameters), kPlanTermTolerance, true);
  add("sharded_gradients", measured.sharded_gradient_bytes,
      plan.term_bytes(PlanTerm::kShardedGradients), kPlanTermTolerance, true);
  add("optimizer_state", measured.optimizer_state_bytes, plan.term_bytes(PlanTerm::kOptimizerState),
      kPlanTermTolerance, true);
  int64_t sent = 0;
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    const CollectiveTraffic& got = measured.traffic[k];
    const CollectiveTraffic& want = plan.traffic[k];
    sent += got.bytes_sent;
    if (got.calls == 0 && want.calls == 0) continue;
    add(absl::StrCat(collective_name(static_cast<CollectiveKind>(k)), " bytes_sent"),
        got.bytes_sent, want.bytes_sent, kPlanTermTolerance, true);
  }
  add("traffic", sent, plan.bytes_sent(), kPlanTermTolerance, true);
  add("peak", measured.peak_bytes, plan.peak_bytes, kPlanPeakTolerance, plan.activations_planned());
  return result;
}

std::string memory_plan_table(const MemoryPlan& plan) {
  std::string out = absl::StrFormat(
      "per rank, one step: %s at W = %d, optimizer %s%s\n%-24s %16s %10s %16s %10s\n",
      sharding_strategy_name(plan.effective_strategy), plan.options.world_size(),
      plan.options.optimizer().name, plan.activations_planned() ? "" : " (activations not planned)",
      "term", "max_bytes", "MiB", "at_peak_bytes", "MiB");
  for (int t = 0; t < kNumPlanTerms; ++t) {
    absl::StrAppendFormat(&out, "%-24s %16d %10.2f %16d %10.2f\n",
                          plan_term_name(static_cast<PlanTerm>(t)), plan.max_bytes[t],
                          mib(plan.max_bytes[t]), plan.at_peak_bytes[t],
                          mib(plan.at_peak_bytes[t]));
  }
  absl::StrAppendFormat(&out, "%-24s %16s %10s %16d %10.2f  (%s)\n", "peak", "", "",
                        plan.peak_bytes, mib(plan.peak_bytes), plan.peak_event);
  if (plan.host_bytes > 0) {
    absl::StrAppendFormat(&out, "%-24s %16d %10.2f\n", "host (offloaded)", plan.host_bytes,
                          mib(plan.host_bytes));
  }
  absl::StrAppendFormat(&out, "%-24s %8s %16s %10s\n", "collective", "calls", "bytes_sent", "MiB");
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    const CollectiveTraffic& t = plan.traffic[k];
    if (t.calls == 0) continue;
    absl::StrAppendFormat(&out, "%-24s %8d %16d %10.2f\n",
                          collective_name(static_cast<CollectiveKind>(k)), t.calls, t.bytes_sent,
                          mib(t.bytes_sent));
  }
  return out;
}

}  // namespace fsdp
