// Collectives at 4 KB ... 64 MB per rank on W = 2 ranks over loopback: algbw and busbw
// (nccl-tests formulas, docs/REFERENCE.md §4), fsdp's Gloo layer against direct c10d calls in the
// same run, and wire bytes from the `lo` counters of /proc/net/dev against the formula.
//
//   bazel run -c opt //fsdp/comm:collectives_benchmark        # starts its own 2 ranks
//
// Run without RANK in the environment, the binary launches itself as 2 ranks (fsdp_run's
// launcher); rank 0 reports. Every rank runs the same benchmarks with fixed iteration
// counts, so the collectives match. Counters per benchmark:
//   algbw        S / t in bytes/s (decimal prefixes), S = per-rank bytes x W (all-gather,
//                reduce-scatter) or the buffer bytes (all-reduce)
//   busbw        algbw x (W-1)/W (all-gather, reduce-scatter), x 2(W-1)/W (all-reduce)
//   wire_ratio   lo bytes per rank per call / the formula's bytes sent per rank
// The c10d baselines, called directly on a ProcessGroupGloo of LibTorch 2.11:
// `_allgather_base` (c10d's ring all-gather, against our direct exchange),
// `_reduce_scatter_base` (c10d's native reduce-scatter for Gloo, against our exchange and
// local sum; see Note [Gloo collectives]), `allreduce` (ring) for all-reduce.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <ATen/Functions.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "fsdp/comm/communicator.h"
#include "fsdp/comm/gloo.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/benchmark_ranks.h"
#include "fsdp/comm/testing/loopback.h"

namespace fsdp {
namespace {

constexpr int kWorldSize = 2;

struct Ranks {
  std::shared_ptr<Communicator> comm;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> baseline;
};

Ranks& ranks() {
  static Ranks* instance = [] {
    const LaunchEnvironment env = read_launch_environment();
    c10::intrusive_ptr<c10d::Store> store = connect_store(env);
    auto* r = new Ranks;
    r->comm = make_gloo_communicator(store, env.rank, env.world_size,
                                     GlooOptions().hostname("127.0.0.1"));
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    options->threads = 1;
    r->baseline = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("baseline", store), env.rank, env.world_size,
        options);
    return r;
  }();
  return *instance;
}

int64_t iterations_for(int64_t bytes) {
  return std::max<int64_t>(5, std::min<int64_t>(500, (int64_t{256} << 20) / bytes));
}

enum class Op { kAllGather, kReduceScatter, kAllReduce };

// Formula bytes one rank sends per call, and the nccl-tests S and bus factor.
struct Shape {
  int64_t sent;
  int64_t algbw_bytes;
  double bus_factor;
};

Shape shape_of(Op op, int64_t bytes) {
  const int64_t w = kWorldSize;
  switch (op) {
    case Op::kAllGather:
    case Op::kReduceScatter:
      return {(w - 1) * bytes, bytes * w, (w - 1.0) / w};
    case Op::kAllReduce:
      return {2 * (w - 1) * bytes / w, bytes, 2.0 * (w - 1) / w};
  }
  return {};
}

void report(benchmark::State& state, Op op, int64_t bytes, int64_t lo_before) {
  const Shape s = shape_of(op, bytes);
  const int64_t lo_per_rank_call = (comm_internal::loopback_tx_bytes() - lo_before) / kWorldSize /
                                   static_cast<int64_t>(state.iterations());
  state.counters["algbw"] = benchmark::Counter(static_cast<double>(s.algbw_bytes),
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["busbw"] = benchmark::Counter(s.algbw_bytes * s.bus_factor,
                                               benchmark::Counter::kIsIterationInvariantRate);
  state.counters["wire_ratio"] = static_cast<double>(lo_per_rank_call) / s.sent;
}

// `bytes` per rank: the shard for all-gather and reduce-scatter, the buffer for all-reduce.
void run_ours(benchmark::State& state, Op op) {
  const int64_t bytes = state.range(0);
  const int64_t n = bytes / 4;
  Communicator& comm = *ranks().comm;
  at::Tensor shard = at::ones({n});
  at::Tensor full = at::ones({n * kWorldSize});
  comm.barrier();  // host ordering: the byte counter and timing start on every rank together
  const int64_t lo_before = comm_internal::loopback_tx_bytes();
  for (auto _ : state) {
    switch (op) {
      case Op::kAllGather:
        comm.all_gather_into_tensor(full, shard);
        break;
      case Op::kReduceScatter:
        comm.reduce_scatter_tensor(shard, full);
        break;
      case Op::kAllReduce:
        comm.all_reduce(shard);
        break;
    }
  }
  report(state, op, bytes, lo_before);
}

void run_c10d(benchmark::State& state, Op op) {
  const int64_t bytes = state.range(0);
  const int64_t n = bytes / 4;
  c10d::ProcessGroupGloo& group = *ranks().baseline;
  at::Tensor shard = at::ones({n});
  at::Tensor full = at::ones({n * kWorldSize});
  std::vector<at::Tensor> shards = {shard};
  group.barrier()->wait();
  const int64_t lo_before = comm_internal::loopback_tx_bytes();
  for (auto _ : state) {
    switch (op) {
      case Op::kAllGather:
        group._allgather_base(full, shard)->wait();
        break;
      case Op::kReduceScatter:
        group._reduce_scatter_base(shard, full)->wait();
        break;
      case Op::kAllReduce:
        group.allreduce(shards)->wait();
        break;
    }
  }
  report(state, op, bytes, lo_before);
}

void BM_AllGather(benchmark::State& s) { run_ours(s, Op::kAllGather); }
void BM_C10dAllGather(benchmark::State& s) { run_c10d(s, Op::kAllGather); }
void BM_ReduceScatter(benchmark::State& s) { run_ours(s, Op::kReduceScatter); }
void BM_C10dReduceScatter(benchmark::State& s) { run_c10d(s, Op::kReduceScatter); }
void BM_AllReduce(benchmark::State& s) { run_ours(s, Op::kAllReduce); }
void BM_C10dAllReduce(benchmark::State& s) { run_c10d(s, Op::kAllReduce); }

void register_all() {
  using Fn = void (*)(benchmark::State&);
  const std::pair<const char*, Fn> benchmarks[] = {
      {"BM_AllGather", BM_AllGather},         {"BM_C10dAllGather", BM_C10dAllGather},
      {"BM_ReduceScatter", BM_ReduceScatter}, {"BM_C10dReduceScatter", BM_C10dReduceScatter},
      {"BM_AllReduce", BM_AllReduce},         {"BM_C10dAllReduce", BM_C10dAllReduce},
  };
  for (const auto& [name, fn] : benchmarks) {
    for (int64_t bytes = 4 << 10; bytes <= (64 << 20); bytes *= 4) {
      benchmark::RegisterBenchmark(name, fn)
          ->Arg(bytes)
          ->Iterations(iterations_for(bytes))
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  return fsdp::comm_internal::benchmark_main(fsdp::kWorldSize, argc, argv,
                                             []() -> fsdp::Communicator& {
                                               fsdp::register_all();
                                               return *fsdp::ranks().comm;
                                             });
}
