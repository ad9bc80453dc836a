#include "fsdp/comm/testing/benchmark_ranks.h"

#include <cstdlib>
#include <vector>

#include <benchmark/benchmark.h>

#include "fsdp/comm/launcher.h"

namespace fsdp::comm_internal {

std::optional<int> launch_self_as_ranks(int world_size, int argc, char** argv) {
  if (std::getenv("RANK") != nullptr) return std::nullopt;
  return launch_self(world_size, argc, argv);
}

namespace {

// Discards the reports of ranks other than 0.
class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

void run_benchmarks_on_rank(int rank) {
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    NullReporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
}

int benchmark_main(int world_size, int argc, char** argv,
                   const std::function<Communicator&()>& connect,
                   const std::function<void(int rank)>& finish) {
  if (std::optional<int> status = launch_self_as_ranks(world_size, argc, argv)) return *status;
  benchmark::Initialize(&argc, argv);
  Communicator& comm = connect();
  run_benchmarks_on_rank(comm.rank());
  comm.barrier();  // host ordering: no rank finishes while a peer still measures
  if (finish) finish(comm.rank());
  return 0;
}

}  // namespace fsdp::comm_internal
