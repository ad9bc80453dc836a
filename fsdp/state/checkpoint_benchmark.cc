// Checkpoint save and load throughput for a 100.7 M-parameter model (8 units of
// Linear(4096, 3072)) on W = 2 ranks, against raw file writes of the same bytes on the
// same disk in the same run.
//
//   bazel run -c opt //fsdp/state:checkpoint_benchmark   # starts its own 2 ranks
//
// Counters: MBps = checkpoint bytes (all ranks together, decimal MB) / wall time. Full:
// rank 0 gathers (full_state_dict, rank0_only) and writes one file; loading reads it on
// every rank. Sharded: every rank writes its own file (save_sharded_checkpoint) and
// reads back. RawWrite: each rank writes (write + fsync) as many bytes as its sharded
// file. Files go to $TMPDIR (default /tmp). After the run rank 0 prints each save/load
// rate as a ratio to RawWrite. ModelLayout: the time of one model-layout build, which a
// sharded save or load makes once.
#include <fcntl.h>
#include <unistd.h>

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
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/benchmark_ranks.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/state/checkpoint.h"
#include "fsdp/state/internal/model_layout.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
constexpr int kWorldSize = 2;
constexpr int kUnits = 8;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    for (int i = 0; i < kUnits; ++i) {
      layers.push_back(
          register_module(absl::StrFormat("layer%d", i), make_unit(torch::nn::Linear(4096, 3072))));
    }
  }
  at::Tensor forward(at::Tensor x) { return x; }  // only the state is measured
  std::vector<Unit<torch::nn::LinearImpl>> layers;
};

struct Setup {
  std::shared_ptr<Communicator> comm;
  FullyShardedDataParallel<NetImpl> model{nullptr};
  fs::path dir;
  int64_t model_bytes = 0;
};

Setup& setup() {
  static Setup* s = [] {
    auto* s = new Setup;
    s->comm = init_from_environment(RendezvousOptions().backend(Backend::kGloo));
    s->model = FullyShardedDataParallel<NetImpl>(std::make_shared<NetImpl>(),
                                                 FullyShardedDataParallelOptions(s->comm));
    for (const at::Tensor& shard : s->model->parameters()) {
      s->model_bytes += shard.nbytes() * kWorldSize;  // all ranks' shards
    }
    const char* tmp = std::getenv("TMPDIR");
    s->dir = fs::path(tmp != nullptr ? tmp : "/tmp") / "fsdp_checkpoint_benchmark";
    if (s->comm->rank() == 0) fs::create_directories(s->dir);
    s->comm->barrier();  // host ordering (files): the folder exists before any rank writes
    return s;
  }();
  return *s;
}

std::map<std::string, double>& rates() {
  static auto* r = new std::map<std::string, double>;
  return *r;
}

// Times `body` per iteration on every rank (each iteration starts together) and
// reports MBps for `bytes` per iteration.
template <typename Body>
void measure(benchmark::State& state, const std::string& name, int64_t bytes, Body body) {
  Setup& s = setup();
  double seconds = 0;
  for (auto _ : state) {
    s.comm->barrier();  // host ordering: timing starts when every rank is ready
    const auto start = std::chrono::steady_clock::now();
    body();
    s.comm->barrier();
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(t);
    seconds += t;
  }
  const double mbps = double(bytes) * state.iterations() / seconds / 1e6;
  state.counters["MBps"] = mbps;
  state.counters["MB"] = double(bytes) / 1e6;
  rates()[name] = mbps;
}

void BM_RawWrite(benchmark::State& state) {
  Setup& s = setup();
  const std::vector<char> bytes(static_cast<size_t>(s.model_bytes / kWorldSize), 'x');
  const std::string path = (s.dir / absl::StrFormat("raw_%d", s.comm->rank())).string();
  measure(state, "RawWrite", s.model_bytes, [&] {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    size_t done = 0;
    while (done < bytes.size()) done += ::write(fd, bytes.data() + done, bytes.size() - done);
    ::fsync(fd);
    ::close(fd);
  });
}

void BM_SaveSharded(benchmark::State& state) {
  Setup& s = setup();
  measure(state, "SaveSharded", s.model_bytes,
          [&] { save_sharded_checkpoint(*s.model, nullptr, (s.dir / "sharded").string()); });
}

void BM_LoadSharded(benchmark::State& state) {
  Setup& s = setup();
  measure(state, "LoadSharded", s.model_bytes,
          [&] { load_sharded_checkpoint(*s.model, nullptr, (s.dir / "sharded").string()); });
}

void BM_SaveFull(benchmark::State& state) {
  Setup& s = setup();
  measure(state, "SaveFull", s.model_bytes, [&] {
    const StateDict full = full_state_dict(*s.model, FullStateDictOptions().rank0_only(true));
    if (s.comm->rank() == 0) save_state_dict(full, (s.dir / "model.pt").string());
  });
}

void BM_LoadFull(benchmark::State& state) {
  Setup& s = setup();
  measure(state, "LoadFull", s.model_bytes,
          [&] { load_full_state_dict(*s.model, load_state_dict((s.dir / "model.pt").string())); });
}

// One build of the model layout that every sharded save and load starts with (it walks
// the module tree and maps each parameter to its flat parameter); a save made three
// before issue 25, one since.
void BM_ModelLayout(benchmark::State& state) {
  Setup& s = setup();
  for (auto _ : state) {
    benchmark::DoNotOptimize(state_internal::model_layout(*s.model, "BM_ModelLayout"));
  }
}

// Fixed iteration counts keep the ranks' collectives matched.
BENCHMARK(BM_RawWrite)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveSharded)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoadSharded)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SaveFull)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoadFull)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ModelLayout)->Iterations(1000)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  return fsdp::comm_internal::benchmark_main(
      fsdp::kWorldSize, argc, argv, []() -> fsdp::Communicator& { return *fsdp::setup().comm; },
      [](int rank) {
        if (rank == 0) {
          const auto& r = fsdp::rates();
          for (const auto& [name, mbps] : r) {
            if (name != "RawWrite" && r.count("RawWrite")) {
              std::cout << absl::StrFormat("%s / RawWrite = %.2f\n", name, mbps / r.at("RawWrite"));
            }
          }
          std::filesystem::remove_all(fsdp::setup().dir);
        }
      });
}
