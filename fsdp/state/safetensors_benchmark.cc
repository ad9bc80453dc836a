// Loading a >= 1 GB safetensors folder into a sharded model: fsdp's load_safetensors
// (each rank preads only its shards' bytes) against the safetensors Python library in
// the same run (benchmarks/peer/safetensors_load.py: load_file of everything, and
// safe_open slices of the rank's rows), at W = 1, 2, 4. Prints, per rank, the bytes
// read, the seconds, the throughput and the memory the load adds (fsdp: the tracking
// allocator's peak; Python: peak RSS). The folder is written first (16 tensors of
// 4096 x 4096 F32, 1.07 GB, 64 MB files) and is in the page cache when read.
//
//   bazel run -c opt //fsdp/state:safetensors_benchmark -- [DIR] [PYTHON] [GB]
//   (defaults: /tmp/fsdp_safetensors_benchmark, $FSDP_TORCH_PREFIX/bin/python3 or
//   ~/.cache/fsdp/torch-2.11.0/bin/python3, 1.07)
// Not part of the test command: minutes on 2 cores, 1 GB of disk, ~3 GB of memory at W = 4.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <torch/nn/module.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/tracking_allocator.h"
#include "fsdp/formats/safetensors.h"
#include "fsdp/state/safetensors_state_dict.h"

namespace fsdp {
namespace {

constexpr int64_t kRows = 4096;

// One weight, left uninitialised (the load overwrites it).
struct SlabImpl : torch::nn::Module {
  SlabImpl() { weight = register_parameter("weight", at::empty({kRows, kRows})); }
  at::Tensor forward(at::Tensor x) { return x; }
  at::Tensor weight;
};

struct SlabsImpl : torch::nn::Module {
  explicit SlabsImpl(int n) {
    auto list = register_module("layers", std::make_shared<torch::nn::Module>());
    for (int i = 0; i < n; ++i) {
      units.push_back(
          list->register_module(std::to_string(i), Unit<SlabImpl>(std::make_shared<SlabImpl>())));
    }
  }
  at::Tensor forward(at::Tensor x) { return x; }
  std::vector<Unit<SlabImpl>> units;
};

void write_folder(const std::string& dir, int n) {
  if (std::filesystem::exists(dir + "/" + kSafetensorsIndexName)) return;
  std::vector<SafetensorsTensorSpec> specs;
  for (int i = 0; i < n; ++i) {
    specs.push_back({"layers." + std::to_string(i) + ".weight", at::kFloat, {kRows, kRows}});
  }
  SafetensorsFolderWriter writer(dir, specs,
                                 SafetensorsWriteOptions().max_shard_size(kRows * kRows * 4));
  const at::Tensor values = at::arange(kRows * kRows, at::kFloat).reshape({kRows, kRows});
  for (const auto& spec : specs) writer.write(spec.name, values);
  writer.commit();
}

void run_fsdp(const std::string& dir, int n, int world_size) {
  std::vector<double> seconds(world_size);
  std::vector<int64_t> shard(world_size), added(world_size);
  MemoryTracker tracker;
  FakeWorld::run(FakeWorld::create(world_size), [&](Communicator& comm) {
    const int rank = comm.rank();
    MemoryTagGuard tag(rank);
    FullyShardedDataParallel<SlabsImpl> model(
        std::make_shared<SlabsImpl>(n),
        FullyShardedDataParallelOptions(
            std::shared_ptr<Communicator>(&comm, [](Communicator*) {})));
    comm.barrier();  // host ordering: every rank's model built before any load starts
    shard[rank] = memory_allocated(rank);
    reset_peak_memory_stats(rank);
    const auto begin = std::chrono::steady_clock::now();
    load_safetensors(*model, dir);
    seconds[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    added[rank] = max_memory_allocated(rank) - shard[rank];
  });
  for (int rank = 0; rank < world_size; ++rank) {
    std::printf(
        "fsdp load_safetensors W=%d rank=%d: read %lld bytes in %.3f s (%.2f GB/s), holds %lld "
        "MiB of shards, load adds %lld bytes (tracking allocator peak)\n",
        world_size, rank, static_cast<long long>(shard[rank]), seconds[rank],
        shard[rank] / seconds[rank] / 1e9, static_cast<long long>(shard[rank] >> 20),
        static_cast<long long>(added[rank]));
  }
  std::fflush(stdout);
}

void run_python(const std::string& python, const std::string& script, const std::string& dir,
                int world_size) {
  for (const char* mode : {"load_file", "safe_open"}) {
    for (int rank = 0; rank < world_size; ++rank) {
      const std::string command = python + " " + script + " " + dir + " " + mode + " " +
                                  std::to_string(world_size) + " " + std::to_string(rank);
      if (std::system(command.c_str()) != 0) {
        std::printf("failed: %s\n", command.c_str());
      }
    }
  }
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/tmp/fsdp_safetensors_benchmark";
  const char* prefix = std::getenv("FSDP_TORCH_PREFIX");
  const std::string home = std::getenv("HOME") ? std::getenv("HOME") : "/root";
  const std::string python =
      argc > 2
          ? argv[2]
          : (prefix ? std::string(prefix) : home + "/.cache/fsdp/torch-2.11.0") + "/bin/python3";
  const double gb = argc > 3 ? std::atof(argv[3]) : 1.07;
  const int n = std::max(1, static_cast<int>(gb * 1e9 / (fsdp::kRows * fsdp::kRows * 4) + 0.5));
  // The script beside this binary's sources (bazel run's working directory is the
  // runfiles tree's workspace root; from elsewhere pass nothing and run from the repo).
  std::string script = "benchmarks/peer/safetensors_load.py";
  if (const char* workspace = std::getenv("BUILD_WORKSPACE_DIRECTORY")) {
    script = std::string(workspace) + "/" + script;
  }
  std::printf("safetensors_benchmark: %d tensors of %lld x %lld F32 (%.2f GB) in %s\n", n,
              static_cast<long long>(fsdp::kRows), static_cast<long long>(fsdp::kRows),
              n * fsdp::kRows * fsdp::kRows * 4 / 1e9, dir.c_str());
  fsdp::write_folder(dir, n);
  for (int world_size : {1, 2, 4}) {
    fsdp::run_fsdp(dir, n, world_size);
    fsdp::run_python(python, script, dir, world_size);
  }
  return 0;
}
