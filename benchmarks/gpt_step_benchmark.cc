// Training steps (zero_grad, forward, backward, Adam step) of the GPT model of
// examples/gpt under FSDP at W = 1, 2 and 4 over loopback: per-rank peak memory and wire
// bytes per step against REFERENCE §4-5, and step time against a baseline stepped
// alternately in the same run. benchmarks/run_all turns its JSON into RESULTS.md.
//
//   bazel run -c opt //benchmarks:gpt_step_benchmark            # starts its own 4 ranks
//   bazel run -c opt //benchmarks:gpt_step_benchmark -- --benchmark_filter=W:1
//
// Ranks. Run without RANK in the environment, the binary launches itself as 4 ranks
// (fsdp_run's launcher); rank 0 reports. W = 1 runs on a one-rank subgroup of rank 0,
// W = 2 on ranks {0, 1}, W = 4 on all four; ranks outside a benchmark's group skip it
// (they wait in the first collective of the next one they run). One intra-op thread
// per rank.
//
// Benchmarks (the Time column is the first training's step time):
//   BM_Strategy/<S>/W:<w>       strategy S against NO_SHARD at the same W (W = 2, 4;
//                               NO_SHARD itself has no baseline); at W = 1, where every
//                               strategy runs as NO_SHARD, FULL_SHARD against plain LibTorch
//   BM_Prefetch/<P>/W:2         FULL_SHARD with prefetch P (BACKWARD_PRE, BACKWARD_POST,
//                               FORWARD = forward prefetch and BACKWARD_PRE) against
//                               FULL_SHARD without any prefetch
//   BM_ModelSize/width:<d>/W:2  FULL_SHARD against NO_SHARD for widths 32 ... 192
//   BM_FirstStep/validate/W:2   the first step of a freshly built FULL_SHARD model with
//                               validate_execution_order against one without (both with
//                               the first iteration's size checks); each iteration builds
//                               both, so every timed step is a first step
//   BM_SizeChecks/sequences:<s>/W:2
//                               FULL_SHARD with Communicator::set_size_checks on in every
//                               step against FULL_SHARD with them on in the first only,
//                               <s> sequences per rank (1, and the main job's 16)
//   BM_ScheduleCheck/every:<N>/sequences:<s>/W:2
//                               FULL_SHARD checking the collective schedule every N steps
//                               (1, and the default 10) against a root that never checks,
//                               40 steps each, <s> sequences per rank (1, and 16)
// Model: GptOptions with vocab 128, context 64, 4 heads, 4 layers (each block a unit;
// embeddings, final norm and the tied head in the root), width 128 unless the name says
// otherwise (Psi = 0.82 M parameters at width 128, 1.82 M at 192). Each rank trains on
// kBatch sequences of kContext tokens. Sizes are small so that the whole run takes
// minutes on 2 cores.
//
// Counters (per rank 0, per step; `ref_` ones for the baseline):
//   ms, time_ratio   step time; ours / baseline
//   psi_M            parameters of the model, millions
//   peak_MB          peak bytes the training thread holds during a step of one sequence of
//                    kMemoryTokens tokens (so that activations, ~2% of the formula, do
//                    not hide model state), over what it held before the model was built
//   mem_formula_MB   model state per rank (fp32, Adam; s_i = shard numel, p_i = padded
//                    numel of unit i): plain and NO_SHARD 16 Psi; FULL_SHARD
//                    16 sum s_i + 2 x 4 max p_i (REFERENCE §5: the largest unit and its
//                    gradient unsharded) + 4 max p_i with BACKWARD_PRE (the prefetched
//                    unit); SHARD_GRAD_OP 16 sum s_i + 4 sum p_i (every unit stays
//                    unsharded from forward to backward) + 4 max p_i (a gradient)
//   mem_ratio        peak_MB / mem_formula_MB
//   wire_MB          bytes this rank sent, from the communicator's counters
//   wire_formula_MB  REFERENCE §4: FULL_SHARD 3 Psi s (W-1)/W; others 2 Psi s (W-1)/W
//   wire_ratio       wire_MB / wire_formula_MB
//   lo_ratio         `lo` tx bytes of /proc/net/dev in the timed step that sent least,
//                    / W / wire_formula_MB: TCP/IP headers count, and so does other
//                    loopback traffic on the machine, which only adds (hence the minimum)
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include "examples/gpt/model.h"
#include "fsdp/comm/communicator.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/benchmark_ranks.h"
#include "fsdp/comm/testing/loopback.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/tracking_allocator.h"

ABSL_FLAG(int, world_size, 4, "ranks to start: W = 1, 2, 4 benchmarks run when W >= 1, 2, 4");

namespace fsdp {
namespace {

using examples::GptImpl;
using examples::GptOptions;

constexpr int64_t kVocab = 128;
constexpr int64_t kContext = 64;
constexpr int64_t kWidth = 128;
constexpr int64_t kBatch = 1;         // sequences per rank and step
constexpr int64_t kMemoryTokens = 8;  // one sequence, for the peak-memory step
constexpr int kWarmupSteps = 2;       // the first creates Adam's state
constexpr int kTimedSteps = 8;
constexpr int kScheduleSteps = 40;  // BM_ScheduleCheck: N = 10 checks 4 times
constexpr int kTrainingThreadTag = 0;

// One way to train the model: plain LibTorch, or FSDP with these options.
struct Variant {
  std::string name;
  bool plain = false;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kBackwardPre;
  bool forward_prefetch = false;
  bool validate_execution_order = false;
  bool size_checks = false;  // Communicator::set_size_checks in every step, not the first only
  int64_t schedule_check_every = kDefaultScheduleCheckEvery;  // 0: this root never checks
  int64_t width = kWidth;
  int64_t sequences = kBatch;  // per rank and step (ours and the baseline alike)
};

Variant plain_variant() { return {"plain", /*plain=*/true}; }
Variant strategy_variant(ShardingStrategy strategy) {
  Variant v{sharding_strategy_name(strategy)};
  v.strategy = strategy;
  return v;
}

std::shared_ptr<GptImpl> make_model(int64_t width) {
  torch::manual_seed(0);  // the same initial model on every rank and for every variant
  return std::make_shared<GptImpl>(
      GptOptions().vocab_size(kVocab).context(kContext).width(width).heads(4).layers(4));
}

struct Batch {
  at::Tensor tokens, targets;  // [sequences, tokens], int64
};

Batch make_batch(int rank, int64_t sequences, int64_t tokens) {
  torch::manual_seed(1000 + rank);
  return {at::randint(kVocab, {sequences, tokens}, at::kLong),
          at::randint(kVocab, {sequences, tokens}, at::kLong)};
}

// REFERENCE §4-5 for one rank, in bytes per step (see the file comment).
struct Formula {
  int64_t memory = 0;
  int64_t wire = 0;
};

Formula formula_of(const FullyShardedDataParallel<GptImpl>& model, const Variant& variant) {
  int64_t psi = 0, sharded = 0, padded = 0, max_padded = 0;
  for (const auto& unit : model->units()) {
    const FlatParamHandle* handle = unit->handle();
    if (handle == nullptr) continue;
    psi += handle->numel();
    sharded += handle->shard_numel();
    padded += handle->padded_numel();
    max_padded = std::max(max_padded, handle->padded_numel());
  }
  const int world_size = model->communicator().world_size();
  const double ring = (world_size - 1.0) / world_size;
  const auto wire = [&](int passes) { return static_cast<int64_t>(passes * psi * 4 * ring); };
  switch (model->sharding_strategy()) {  // the effective one: NO_SHARD at W = 1
    case ShardingStrategy::kNoShard:
      return {16 * psi, wire(2)};
    case ShardingStrategy::kShardGradOp:
      return {16 * sharded + 4 * padded + 4 * max_padded, wire(2)};
    case ShardingStrategy::kFullShard: {
      const int unsharded_units =
          variant.backward_prefetch == BackwardPrefetch::kBackwardPre ? 3 : 2;
      return {16 * sharded + unsharded_units * 4 * max_padded, wire(3)};
    }
    case ShardingStrategy::kHybridShard:
    case ShardingStrategy::kHybridShardZero2:
      break;  // measured across hosts by tests/multi_host_test.sh
  }
  TORCH_CHECK(false, "gpt_step_benchmark has no formula for ",
              sharding_strategy_name(model->sharding_strategy()));
}

// One model under training and what its steps cost.
struct Training {
  std::function<void(const Batch&)> step;  // zero_grad, forward, backward, Adam step
  Communicator* comm = nullptr;            // null for plain LibTorch
  int64_t psi = 0;
  Formula formula;
  int64_t peak_bytes = 0;     // of one step, over the memory before the model existed
  double seconds = 0;         // timed steps, summed
  int64_t wire_bytes = 0;     // sent by this rank in timed steps (communicator counters)
  int64_t lo_min_bytes = -1;  // loopback tx of the timed step that sent least, all ranks
};

template <typename Model>
std::function<void(const Batch&)> adam_step(Model model) {
  auto adam =
      std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  return [model, adam](const Batch& batch) mutable {
    adam->zero_grad();
    const at::Tensor logits = model->forward(batch.tokens);
    torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), batch.targets.reshape({-1}))
        .backward();
    adam->step();
  };
}

Training make_training(const Variant& variant, const std::shared_ptr<Communicator>& comm) {
  Training t;
  if (variant.plain) {
    auto model = make_model(variant.width);
    for (const at::Tensor& p : model->parameters()) t.psi += p.numel();
    t.step = adam_step(model);
    t.formula = {16 * t.psi, 0};
    return t;
  }
  FullyShardedDataParallelOptions options(comm);
  options.sharding_strategy(variant.strategy)
      .backward_prefetch(variant.backward_prefetch)
      .forward_prefetch(variant.forward_prefetch)
      .validate_execution_order(variant.validate_execution_order)
      .schedule_check_every(variant.schedule_check_every);
  FullyShardedDataParallel<GptImpl> model(make_model(variant.width), options);
  for (const auto& unit : model->units()) {
    if (unit->handle() != nullptr) t.psi += unit->handle()->numel();
  }
  t.step = adam_step(model);
  if (variant.size_checks) {
    // FSDP checks the first iteration only; on for the whole step, then off again so that
    // a baseline stepped in between runs without them.
    t.step = [step = std::move(t.step), comm](const Batch& batch) {
      comm->set_size_checks(true);
      step(batch);
      comm->set_size_checks(false);
    };
  }
  t.comm = comm.get();
  t.formula = formula_of(model, variant);
  return t;
}

// Builds a training, warms it up and measures the peak of one small step.
Training prepare(const Variant& variant, const std::shared_ptr<Communicator>& comm,
                 const Batch& batch) {
  const int64_t baseline = memory_allocated(kTrainingThreadTag);
  Training t = make_training(variant, comm);
  for (int i = 0; i < kWarmupSteps; ++i) t.step(batch);
  const Batch small = make_batch(comm->rank(), 1, kMemoryTokens);
  reset_peak_memory_stats(kTrainingThreadTag);
  t.step(small);
  t.peak_bytes = max_memory_allocated(kTrainingThreadTag) - baseline;
  return t;
}

// One timed step; returns its seconds.
double timed_step(Training& t, const Batch& batch) {
  const int64_t sent_before = t.comm ? t.comm->counters().total().bytes_sent : 0;
  const int64_t lo_before = comm_internal::loopback_tx_bytes();
  const auto start = std::chrono::steady_clock::now();
  t.step(batch);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t lo = comm_internal::loopback_tx_bytes() - lo_before;
  if (t.lo_min_bytes < 0 || lo < t.lo_min_bytes) t.lo_min_bytes = lo;
  if (t.comm) t.wire_bytes += t.comm->counters().total().bytes_sent - sent_before;
  t.seconds += seconds;
  return seconds;
}

// Counters of one training, names prefixed with `prefix`.
void set_counters(benchmark::State& state, const std::string& prefix, const Training& t,
                  int world_size) {
  const double steps = static_cast<double>(state.iterations());
  state.counters[prefix + "ms"] = t.seconds / steps * 1e3;
  state.counters[prefix + "psi_M"] = t.psi / 1e6;
  state.counters[prefix + "peak_MB"] = t.peak_bytes / 1e6;
  state.counters[prefix + "mem_formula_MB"] = t.formula.memory / 1e6;
  state.counters[prefix + "mem_ratio"] = static_cast<double>(t.peak_bytes) / t.formula.memory;
  if (t.comm == nullptr || world_size == 1) return;
  state.counters[prefix + "wire_MB"] = t.wire_bytes / steps / 1e6;
  state.counters[prefix + "wire_formula_MB"] = t.formula.wire / 1e6;
  state.counters[prefix + "wire_ratio"] = t.wire_bytes / steps / t.formula.wire;
  state.counters[prefix + "lo_ratio"] =
      static_cast<double>(t.lo_min_bytes) / world_size / t.formula.wire;
}

// The communicators of W = 1, 2, 4 (null on ranks outside the group).
struct Groups {
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> of_size[5];
};

Groups& groups() {
  static Groups* instance = [] {
    auto* g = new Groups;
    // Ranks outside a group wait for it in their next collective: minutes, not seconds.
    g->world = init_from_environment(
        RendezvousOptions().timeout(std::chrono::hours(1)).backend(Backend::kGloo));
    const int rank = g->world->rank();
    for (int w : {1, 2}) {
      if (w < g->world->world_size() && rank < w) {
        std::vector<int> members(w);
        for (int r = 0; r < w; ++r) members[r] = r;
        g->of_size[w] = g->world->new_subgroup(members);
      }
    }
    g->of_size[g->world->world_size()] = g->world;
    return g;
  }();
  return *instance;
}

// Trains `ours` and the optional `baseline` on W ranks, stepping them alternately (so
// load changes on the machine hit both alike).
void run(benchmark::State& state, int world_size, const Variant& ours,
         const std::optional<Variant>& baseline) {
  const std::shared_ptr<Communicator>& comm = groups().of_size[world_size];
  const Batch batch = make_batch(comm->rank(), ours.sequences, kContext);
  std::optional<Training> reference;
  if (baseline) reference = prepare(*baseline, comm, batch);
  Training training = prepare(ours, comm, batch);
  comm->barrier();  // host ordering: timing starts when every rank is ready
  for (auto _ : state) {
    if (reference) timed_step(*reference, batch);
    state.SetIterationTime(timed_step(training, batch));
  }
  state.SetItemsProcessed(state.iterations() * ours.sequences * kContext);
  set_counters(state, "", training, world_size);
  if (!reference) return;
  set_counters(state, "ref_", *reference, world_size);
  state.counters["time_ratio"] = training.seconds / reference->seconds;
}

// The first step of fresh trainings of `ours` and `baseline`, alternately, every iteration.
void run_first_steps(benchmark::State& state, int world_size, const Variant& ours,
                     const Variant& baseline) {
  const std::shared_ptr<Communicator>& comm = groups().of_size[world_size];
  const Batch batch = make_batch(comm->rank(), kBatch, kContext);
  double ours_seconds = 0, baseline_seconds = 0;
  for (auto _ : state) {
    Training reference = make_training(baseline, comm);
    Training training = make_training(ours, comm);
    comm->barrier();  // host ordering: timing starts when every rank is ready
    baseline_seconds += timed_step(reference, batch);
    const double seconds = timed_step(training, batch);
    ours_seconds += seconds;
    state.SetIterationTime(seconds);
  }
  const double steps = static_cast<double>(state.iterations());
  state.counters["ms"] = ours_seconds / steps * 1e3;
  state.counters["ref_ms"] = baseline_seconds / steps * 1e3;
  state.counters["time_ratio"] = ours_seconds / baseline_seconds;
}

void register_one(const std::string& name, int world_size, Variant ours,
                  std::optional<Variant> baseline, int iterations = kTimedSteps) {
  benchmark::RegisterBenchmark(
      absl::StrCat(name, "/W:", world_size).c_str(),
      [=](benchmark::State& state) { run(state, world_size, ours, baseline); })
      ->Iterations(iterations)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

// The benchmarks of every group this rank belongs to, W = 1 first.
void register_all(int rank, int world_size) {
  const ShardingStrategy strategies[] = {ShardingStrategy::kNoShard, ShardingStrategy::kShardGradOp,
                                         ShardingStrategy::kFullShard};
  // At W = 1 every strategy runs as NO_SHARD: FULL_SHARD (the default) stands for them.
  if (rank == 0) {
    register_one("BM_Strategy/FULL_SHARD", 1, strategy_variant(ShardingStrategy::kFullShard),
                 plain_variant());
  }
  for (int w : {2, 4}) {
    if (w > world_size || rank >= w) continue;
    for (ShardingStrategy s : strategies) {
      std::optional<Variant> baseline;
      if (s != ShardingStrategy::kNoShard) baseline = strategy_variant(ShardingStrategy::kNoShard);
      register_one(absl::StrCat("BM_Strategy/", sharding_strategy_name(s)), w, strategy_variant(s),
                   baseline);
    }
    if (w != 2) continue;
    Variant none = strategy_variant(ShardingStrategy::kFullShard);
    none.name = "NONE";
    none.backward_prefetch = BackwardPrefetch::kNone;
    Variant pre = none, post = none, forward = none;
    pre.name = "BACKWARD_PRE";
    pre.backward_prefetch = BackwardPrefetch::kBackwardPre;
    post.name = "BACKWARD_POST";
    post.backward_prefetch = BackwardPrefetch::kBackwardPost;
    forward = pre;
    forward.name = "FORWARD";
    forward.forward_prefetch = true;
    for (const Variant& v : {pre, post, forward}) {
      register_one(absl::StrCat("BM_Prefetch/", v.name), w, v, none);
    }
    Variant validated = strategy_variant(ShardingStrategy::kFullShard);
    validated.validate_execution_order = true;
    const Variant unvalidated = strategy_variant(ShardingStrategy::kFullShard);
    benchmark::RegisterBenchmark(
        "BM_FirstStep/validate/W:2",
        [=](benchmark::State& state) { run_first_steps(state, 2, validated, unvalidated); })
        ->Iterations(kTimedSteps)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    // Size checks in every step (one small all-gather before each of the step's 14
    // collectives) against the first iteration only, at kBatch and at the main job's 16
    // sequences per rank.
    for (int64_t sequences : {kBatch, int64_t{16}}) {
      Variant checked = strategy_variant(ShardingStrategy::kFullShard);
      checked.size_checks = true;
      Variant unchecked = strategy_variant(ShardingStrategy::kFullShard);
      checked.sequences = unchecked.sequences = sequences;
      register_one(absl::StrCat("BM_SizeChecks/sequences:", sequences), w, checked, unchecked);
    }
    // Collective schedule checks every N steps (N = 1, and the default) against a root
    // that never checks (FullyShardedDataParallelOptions::schedule_check_every); both
    // record their collectives (the communicator's schedule is on for the family once
    // any root enabled it). 40 steps, so that N = 10 checks 4 times.
    for (int64_t every : {int64_t{1}, kDefaultScheduleCheckEvery}) {
      for (int64_t sequences : {kBatch, int64_t{16}}) {
        Variant checked = strategy_variant(ShardingStrategy::kFullShard);
        checked.schedule_check_every = every;
        Variant unchecked = strategy_variant(ShardingStrategy::kFullShard);
        unchecked.schedule_check_every = 0;
        checked.sequences = unchecked.sequences = sequences;
        register_one(absl::StrCat("BM_ScheduleCheck/every:", every, "/sequences:", sequences), w,
                     checked, unchecked, kScheduleSteps);
      }
    }
    for (int64_t width : {32, 64, 128, 192}) {
      Variant full = strategy_variant(ShardingStrategy::kFullShard);
      Variant replicated = strategy_variant(ShardingStrategy::kNoShard);
      full.width = replicated.width = width;
      register_one(absl::StrCat("BM_ModelSize/width:", width), w, full, replicated);
    }
  }
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);  // every flag, for the ranks
  benchmark::Initialize(&argc, argv);
  absl::ParseCommandLine(argc, argv);
  const int world_size = absl::GetFlag(FLAGS_world_size);
  if (auto status = fsdp::comm_internal::launch_self_as_ranks(
          world_size, static_cast<int>(args.size()), args.data())) {
    return *status;
  }
  at::set_num_threads(1);
  fsdp::MemoryTracker tracker;  // before any model exists: see tracking_allocator.h
  fsdp::MemoryTagGuard tag(fsdp::kTrainingThreadTag);
  const int rank = fsdp::groups().world->rank();  // rendezvous before timing anything
  fsdp::register_all(rank, world_size);
  fsdp::comm_internal::run_benchmarks_on_rank(rank);
  return 0;
}
