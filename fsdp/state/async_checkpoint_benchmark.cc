// What a checkpoint save costs the training loop, synchronous against asynchronous, in
// one run: an MLP of kUnits units of Linear(kWidth, kWidth) (16.8 M parameters, Adam:
// a 201 MB checkpoint over all ranks) trained with FULL_SHARD on W = 2 ranks over Gloo.
//
//   bazel run -c opt //fsdp/state:async_checkpoint_benchmark   # starts its own 2 ranks
//
// Each iteration of BM_Save/<mode> (mode sync: save_sharded_checkpoint; async:
// async_save_sharded_checkpoint with a checkpoint communicator made once) runs on every
// rank: a save, then kStepsAfter training steps, then (async) wait() for the write, then
// kStepsAfter steps with no save in flight. Counters (rank 0, milliseconds):
//   stall_ms        the save call: the time the training loop stops (the manual time)
//   step_ms         mean step time with no save in flight
//   inflight_ms     mean step time of the kStepsAfter steps right after the save (for
//                   async: while the write runs beside them)
//   wait_ms         the wait() after those steps: write time the steps did not hide
//   checkpoint_MB   the checkpoint's bytes, all ranks (decimal MB)
// After the run rank 0 prints async/sync ratios. Files go to $TMPDIR (default /tmp).
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include <ATen/Functions.h>
#include <benchmark/benchmark.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/benchmark_ranks.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/async_checkpoint.h"
#include "fsdp/state/checkpoint.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
constexpr int kWorldSize = 2;
constexpr int kUnits = 4;
constexpr int64_t kWidth = 2048;
constexpr int64_t kBatch = 32;  // rows per rank per step
constexpr int kStepsAfter = 3;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int i = 0; i < kUnits; ++i) {
      layers.push_back(register_module(absl::StrFormat("layer%d", i),
                                       make_unit(torch::nn::Linear(kWidth, kWidth))));
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : layers) x = torch::nn::functional::relu(layer(x));
    return x;
  }
  std::vector<Unit<torch::nn::LinearImpl>> layers;
};

struct Setup {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Communicator> checkpoint_comm;
  FullyShardedDataParallel<NetImpl> model{nullptr};
  std::unique_ptr<torch::optim::Adam> adam;
  at::Tensor input;
  fs::path dir;
  int64_t checkpoint_bytes = 0;
  int64_t saves = 0;
};

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

void step(Setup& s) {
  s.adam->zero_grad();
  s.model->forward(s.input).square().mean().backward();
  s.adam->step();
}

Setup& setup() {
  static Setup* s = [] {
    auto* s = new Setup;
    s->comm = init_from_environment(RendezvousOptions().backend(Backend::kGloo));
    s->checkpoint_comm = make_checkpoint_communicator(*s->comm);
    at::manual_seed(0);
    s->model = FullyShardedDataParallel<NetImpl>(std::make_shared<NetImpl>(),
                                                 FullyShardedDataParallelOptions(s->comm));
    s->adam = std::make_unique<torch::optim::Adam>(s->model->parameters(),
                                                   torch::optim::AdamOptions(1e-4));
    s->input = at::randn({kBatch, kWidth});
    step(*s);  // Adam's state exists from here on; FSDP's first iteration is over
    for (const at::Tensor& shard : s->model->parameters()) {
      s->checkpoint_bytes += 3 * shard.nbytes() * kWorldSize;  // parameter, exp_avg(_sq)
    }
    const char* tmp = std::getenv("TMPDIR");
    s->dir = fs::path(tmp != nullptr ? tmp : "/tmp") / "fsdp_async_checkpoint_benchmark";
    if (s->comm->rank() == 0) fs::create_directories(s->dir);
    s->comm->barrier();  // host ordering (files): the folder exists before any rank writes
    return s;
  }();
  return *s;
}

std::map<std::string, std::map<std::string, double>>& results() {
  static auto* r = new std::map<std::string, std::map<std::string, double>>;
  return *r;
}

void BM_Save(benchmark::State& state, bool async) {
  Setup& s = setup();
  double stall = 0, inflight = 0, idle = 0, wait = 0;
  for (auto _ : state) {
    s.comm->barrier();  // host ordering: timing starts when every rank is ready
    const std::string dir = (s.dir / absl::StrFormat("step_%08d", ++s.saves)).string();
    auto start = std::chrono::steady_clock::now();
    AsyncSave save;
    if (async) {
      save = async_save_sharded_checkpoint(*s.model, s.adam.get(), dir, nullptr,
                                           AsyncSaveOptions().communicator(s.checkpoint_comm));
    } else {
      save_sharded_checkpoint(*s.model, s.adam.get(), dir);
    }
    const double t = ms_since(start);
    state.SetIterationTime(t / 1e3);
    stall += t;
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < kStepsAfter; ++i) step(s);
    inflight += ms_since(start) / kStepsAfter;
    start = std::chrono::steady_clock::now();
    save.wait();
    wait += ms_since(start);
    s.comm->barrier();  // host ordering: every rank's write is done before timing again
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < kStepsAfter; ++i) step(s);
    idle += ms_since(start) / kStepsAfter;
  }
  const double n = static_cast<double>(state.iterations());
  std::map<std::string, double>& r = results()[async ? "async" : "sync"];
  r = {{"stall_ms", stall / n},
       {"step_ms", idle / n},
       {"inflight_ms", inflight / n},
       {"wait_ms", wait / n},
       {"checkpoint_MB", s.checkpoint_bytes / 1e6}};
  for (const auto& [name, value] : r) state.counters[name] = value;
}

// Fixed iteration counts keep the ranks' collectives matched; sync and async alternate.
BENCHMARK_CAPTURE(BM_Save, sync, false)
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Save, async, true)
    ->Iterations(4)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  if (auto status = fsdp::comm_internal::launch_self_as_ranks(fsdp::kWorldSize, argc, argv)) {
    return *status;
  }
  at::set_num_threads(1);
  benchmark::Initialize(&argc, argv);
  fsdp::Setup& s = fsdp::setup();
  fsdp::comm_internal::run_benchmarks_on_rank(s.comm->rank());
  fsdp::wait_for_async_saves();
  s.comm->barrier();  // host ordering: every rank's results are in before rank 0 prints
  auto& r = fsdp::results();
  if (s.comm->rank() == 0 && r.count("sync") && r.count("async")) {
    std::cout << absl::StrFormat(
        "stall at the save call: async %.1f ms / sync %.1f ms = %.3f\n"
        "step with a save in flight: async %.1f ms (%.2fx its idle step of %.1f ms); sync "
        "%.1f ms (%.2fx)\n",
        r["async"]["stall_ms"], r["sync"]["stall_ms"],
        r["async"]["stall_ms"] / r["sync"]["stall_ms"], r["async"]["inflight_ms"],
        r["async"]["inflight_ms"] / r["async"]["step_ms"], r["async"]["step_ms"],
        r["sync"]["inflight_ms"], r["sync"]["inflight_ms"] / r["sync"]["step_ms"]);
  }
  if (s.comm->rank() == 0) std::filesystem::remove_all(s.dir);
  return 0;
}
