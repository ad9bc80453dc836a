// For benchmarks that run as several ranks: the binary starts its own ranks when run
// without RANK in its environment, and ranks other than 0 report nothing.
#ifndef FSDP_COMM_INTERNAL_BENCHMARK_RANKS_H_
#define FSDP_COMM_INTERNAL_BENCHMARK_RANKS_H_

#include <optional>
#include <vector>

#include <benchmark/benchmark.h>

namespace fsdp::comm_internal {

// In a process that is not a rank (no RANK variable): starts `world_size` copies of this
// binary with the same arguments (fsdp_run's launcher) and returns their exit status.
// In a rank: nullopt.
std::optional<int> launch_self_as_ranks(int world_size, int argc, char** argv);

// Discards the reports of ranks other than 0.
class NullReporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_INTERNAL_BENCHMARK_RANKS_H_
