// One training step (zero_grad, forward, backward, Adam step) of an MLP-block model:
// (1) FSDP at W = 1 against plain LibTorch training of the same model, (2) FULL_SHARD
// against NO_SHARD at W = 2 over loopback, each pair stepped alternately in the same
// run, with (3) per-rank peak memory (the tracking allocator) and wire bytes per step
// against REFERENCE §4-5.
//
//   bazel run -c opt //fsdp/core:step_benchmark        # starts its own 2 ranks, ~1.5 min
//
// Run without RANK in the environment, the binary launches itself as 2 ranks (fsdp_run's
// launcher, as collectives_benchmark.cc does); rank 0 reports. The W = 1 benchmark runs
// on rank 0 alone (a one-rank Gloo communicator) while rank 1 waits; both ranks then run
// the W = 2 benchmark with fixed iteration counts, so the collectives match. One
// intra-op thread per rank. Each benchmark builds both trainings, warms each up alone
// (measuring its peak on its last warm-up step), then alternates one step of the
// reference and one of ours per iteration, so load from elsewhere on the machine hits
// both alike.
//
// Model: 4 blocks, each a unit of Linear(256, 1024) + Linear(1024, 256) with a residual
// (525,568 parameters), and a root-owned head Linear(256, 16); Psi = 2,106,384; 128 rows
// per rank. Counters (per rank, per step; `ref_` ones for the reference):
//   ms, time_ratio   step time; ours / reference (the Time column is ours)
//   peak_MB          peak bytes the training thread holds during a step, over what it
//                    held before the model was built: model state, activations (~5 MB at
//                    128 rows) and temporaries; Gloo's own buffers are excluded
//   mem_formula_MB   REFERENCE §5: plain and NO_SHARD 16 Psi; FULL_SHARD 16 Psi / W
//                    (shard numels) + 2 x 4 max psi_i (the largest unit and its gradient)
//                    + 4 max psi_i for the unit the default BACKWARD_PRE prefetches
//   mem_ratio        peak_MB / mem_formula_MB
//   wire_MB          bytes this rank sent, from the communicator's counters
//   wire_formula_MB  REFERENCE §4: FULL_SHARD 3 Psi s (W-1)/W; NO_SHARD 2 Psi s (W-1)/W
//   wire_ratio       wire_MB / wire_formula_MB
//   lo_ratio         `lo` tx bytes of /proc/net/dev per rank / wire_formula_MB (includes
//                    TCP/IP headers and any other loopback traffic on the machine)
// After the table rank 0 prints one summary line per comparison.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "absl/strings/str_format.h"
#include "fsdp/comm/communicator.h"
#include "fsdp/comm/internal/benchmark_ranks.h"
#include "fsdp/comm/internal/loopback.h"
#include "fsdp/comm/gloo.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/internal/mlp_model.h"
#include "fsdp/core/tracking_allocator.h"
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace fsdp {
namespace {

constexpr int kWorldSize = 2;
constexpr int64_t kDim = 256;
constexpr int kBlocks = 4;
constexpr int64_t kOut = 16;
constexpr int64_t kRowsPerRank = 128;
constexpr int kWarmupSteps = 2;  // the first creates Adam's state
constexpr int kTimedSteps = 20;
constexpr int kTrainingThreadTag = 0;

using ModelImpl = core_internal::MlpModelImpl;

std::shared_ptr<ModelImpl> make_model() {
  torch::manual_seed(0);
  return std::make_shared<ModelImpl>(kDim, kBlocks, kOut);
}

struct Ranks {
  std::shared_ptr<Communicator> world;  // W = kWorldSize
  std::shared_ptr<Communicator> solo;   // W = 1 (rank 0 only)
};

Ranks& ranks() {
  static Ranks* instance = [] {
    const LaunchEnvironment env = read_launch_environment();
    auto* r = new Ranks;
    r->world = make_gloo_communicator(connect_store(env), env.rank, env.world_size,
                                      GlooOptions().hostname("127.0.0.1"));
    if (env.rank == 0) {
      r->solo = make_gloo_communicator(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                       GlooOptions().hostname("127.0.0.1"));
    }
    return r;
  }();
  return *instance;
}


// REFERENCE §4-5 for one rank, in bytes per step.
struct Formula {
  int64_t memory = 0;
  int64_t wire = 0;
};

template <typename Model>
Formula formula_of(const Model& model, const FullyShardedDataParallelOptions& options) {
  int64_t psi = 0, sharded = 0, max_padded = 0;
  for (const auto& unit : model->units()) {
    const FlatParamHandle* handle = unit->handle();
    if (handle == nullptr) continue;
    psi += handle->numel();
    sharded += handle->shard_numel();
    max_padded = std::max(max_padded, handle->padded_numel());
  }
  const int world_size = options.communicator()->world_size();
  const double ring = (world_size - 1.0) / world_size;
  if (options.sharding_strategy() == ShardingStrategy::kNoShard) {
    return {16 * psi, static_cast<int64_t>(2 * psi * 4 * ring)};
  }
  const int64_t unsharded_units = options.backward_prefetch() == BackwardPrefetch::kNone ? 2 : 3;
  return {16 * sharded + unsharded_units * 4 * max_padded,
          static_cast<int64_t>(3 * psi * 4 * ring)};
}

struct Batch {
  at::Tensor x, y;
};

Batch make_batch(int rank) {
  torch::manual_seed(1000 + rank);
  return {at::randn({kRowsPerRank, kDim}), at::randn({kRowsPerRank, kOut})};
}

// One model under training, plain or FSDP, and what its steps cost.
struct Training {
  std::function<void()> step;    // zero_grad, forward, backward, Adam step
  Communicator* comm = nullptr;  // null for plain LibTorch
  Formula formula;
  int64_t peak_bytes = 0;  // of one step, over the memory before the model existed
  double seconds = 0;      // timed steps, summed
  int64_t wire_bytes = 0;  // sent by this rank in timed steps (communicator counters)
  int64_t lo_bytes = 0;    // loopback tx in timed steps, all ranks
};

Training plain_training(const Batch& batch) {
  auto model = make_model();
  auto adam =
      std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  int64_t psi = 0;
  for (const at::Tensor& p : model->parameters()) psi += p.numel();
  Training t;
  t.step = [model, adam, batch] {
    adam->zero_grad();
    torch::nn::functional::mse_loss(model->forward(batch.x), batch.y).backward();
    adam->step();
  };
  t.formula = {16 * psi, 0};
  return t;
}

Training fsdp_training(const Batch& batch, const std::shared_ptr<Communicator>& comm,
                       ShardingStrategy strategy) {
  FullyShardedDataParallelOptions options(comm);
  options.sharding_strategy(strategy);  // other options: the defaults users get
  FullyShardedDataParallel<ModelImpl> model(make_model(), options);
  auto adam =
      std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  Training t;
  t.step = [model, adam, batch]() mutable {
    adam->zero_grad();
    torch::nn::functional::mse_loss(model->forward(batch.x), batch.y).backward();
    adam->step();
  };
  t.comm = comm.get();
  t.formula = formula_of(model, options);
  return t;
}

// Builds a training with `make`, warms it up and measures the peak of one step.
template <typename Make>
Training prepare(Make&& make) {
  const int64_t baseline = memory_allocated(kTrainingThreadTag);
  Training t = make();
  for (int i = 0; i < kWarmupSteps - 1; ++i) t.step();  // the first creates Adam's state
  reset_peak_memory_stats(kTrainingThreadTag);
  t.step();
  t.peak_bytes = max_memory_allocated(kTrainingThreadTag) - baseline;
  return t;
}

// One timed step; returns its seconds.
double timed_step(Training& t) {
  const int64_t sent_before = t.comm ? t.comm->counters().total().bytes_sent : 0;
  const int64_t lo_before = comm_internal::loopback_tx_bytes();
  const auto start = std::chrono::steady_clock::now();
  t.step();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  t.lo_bytes += comm_internal::loopback_tx_bytes() - lo_before;
  if (t.comm) t.wire_bytes += t.comm->counters().total().bytes_sent - sent_before;
  t.seconds += seconds;
  return seconds;
}

// Counters of one training, names prefixed with `prefix`.
void set_counters(benchmark::State& state, const std::string& prefix, const Training& t) {
  const double steps = static_cast<double>(state.iterations());
  state.counters[prefix + "ms"] = t.seconds / steps * 1e3;
  state.counters[prefix + "peak_MB"] = t.peak_bytes / 1e6;
  state.counters[prefix + "mem_formula_MB"] = t.formula.memory / 1e6;
  state.counters[prefix + "mem_ratio"] = static_cast<double>(t.peak_bytes) / t.formula.memory;
  if (t.comm == nullptr || t.comm->world_size() == 1) return;
  const double world = t.comm->world_size();
  state.counters[prefix + "wire_MB"] = t.wire_bytes / steps / 1e6;
  state.counters[prefix + "wire_formula_MB"] = t.formula.wire / 1e6;
  state.counters[prefix + "wire_ratio"] = t.wire_bytes / steps / t.formula.wire;
  state.counters[prefix + "lo_ratio"] = t.lo_bytes / world / steps / t.formula.wire;
}

// Steps `ours` and `reference` alternately (so load changes on the machine hit both
// alike); the benchmark's time is ours per step, `time_ratio` ours / reference.
void run_pair(benchmark::State& state, Training ours, Training reference) {
  if (ours.comm != nullptr) ours.comm->barrier();
  for (auto _ : state) {
    timed_step(reference);
    state.SetIterationTime(timed_step(ours));
  }
  state.SetItemsProcessed(state.iterations() * kRowsPerRank);
  set_counters(state, "", ours);
  set_counters(state, "ref_", reference);
  state.counters["time_ratio"] = ours.seconds / reference.seconds;
}

// (1) FSDP on one rank against plain LibTorch training of the same model.
void BM_FsdpVsPlain_W1_FullShard(benchmark::State& state) {
  const Batch batch = make_batch(0);
  Training plain = prepare([&] { return plain_training(batch); });
  Training fsdp =
      prepare([&] { return fsdp_training(batch, ranks().solo, ShardingStrategy::kFullShard); });
  run_pair(state, std::move(fsdp), std::move(plain));
}

// (2) FULL_SHARD against NO_SHARD on W = 2 ranks.
void BM_FullShardVsNoShard_W2(benchmark::State& state) {
  const std::shared_ptr<Communicator>& comm = ranks().world;
  const Batch batch = make_batch(comm->rank());
  Training no_shard =
      prepare([&] { return fsdp_training(batch, comm, ShardingStrategy::kNoShard); });
  Training full_shard =
      prepare([&] { return fsdp_training(batch, comm, ShardingStrategy::kFullShard); });
  run_pair(state, std::move(full_shard), std::move(no_shard));
}

void register_all(int rank) {
  using Fn = void (*)(benchmark::State&);
  std::vector<std::pair<const char*, Fn>> benchmarks;
  if (rank == 0) {  // one rank: rank 1 waits at the first W = 2 benchmark
    benchmarks.push_back({"BM_FsdpVsPlain/W1/FULL_SHARD", BM_FsdpVsPlain_W1_FullShard});
  }
  benchmarks.push_back({"BM_FullShardVsNoShard/W2", BM_FullShardVsNoShard_W2});
  for (const auto& [name, fn] : benchmarks) {
    benchmark::RegisterBenchmark(name, fn)
        ->Iterations(kTimedSteps)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

// The console table, then one summary line per benchmark from its counters.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) runs_.push_back({run.run_name.function_name, run.counters});
    ConsoleReporter::ReportRuns(runs);
  }

  void print_summary(std::ostream& out) const {
    for (const auto& [name, c] : runs_) {
      const bool w1 = name.find("W1") != std::string::npos;
      const char* ours = w1 ? "FSDP FULL_SHARD W=1" : "FULL_SHARD W=2";
      const char* reference = w1 ? "plain LibTorch" : "NO_SHARD W=2";
      auto get = [&c = c](const std::string& key) {
        auto it = c.find(key);
        return it == c.end() ? 0.0 : it->second.value;
      };
      out << absl::StrFormat("%s: %s %.1f ms / %s %.1f ms per step = %.3f%s\n", name, ours,
                             get("ms"), reference, get("ref_ms"), get("time_ratio"),
                             w1 ? " (aim <= 1.05)" : "");
      for (const auto& [prefix, who] :
           {std::pair<std::string, const char*>{"", ours}, {"ref_", reference}}) {
        out << absl::StrFormat("  %s per rank: peak %.2f MB vs formula %.2f MB (%.3f)", who,
                               get(prefix + "peak_MB"), get(prefix + "mem_formula_MB"),
                               get(prefix + "mem_ratio"));
        if (!w1) {
          out << absl::StrFormat("; wire %.3f MB/step vs formula %.3f MB (%.4f), lo %.4f",
                                 get(prefix + "wire_MB"), get(prefix + "wire_formula_MB"),
                                 get(prefix + "wire_ratio"), get(prefix + "lo_ratio"));
        }
        out << "\n";
      }
    }
  }

 private:
  std::vector<std::pair<std::string, benchmark::UserCounters>> runs_;
};

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  if (auto status = fsdp::comm_internal::launch_self_as_ranks(fsdp::kWorldSize, argc, argv)) {
    return *status;
  }
  at::set_num_threads(1);
  fsdp::MemoryTracker tracker;  // before any model exists: see tracking_allocator.h
  fsdp::MemoryTagGuard tag(fsdp::kTrainingThreadTag);
  benchmark::Initialize(&argc, argv);
  const int rank = fsdp::ranks().world->rank();  // rendezvous before timing anything
  fsdp::register_all(rank);
  if (rank == 0) {
    fsdp::SummaryReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
    reporter.print_summary(std::cout);
  } else {
    fsdp::comm_internal::NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  return 0;
}
