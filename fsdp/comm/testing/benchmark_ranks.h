// For benchmarks that run as several ranks: the binary starts its own ranks when run
// without RANK in its environment, and ranks other than 0 report nothing.
#ifndef FSDP_COMM_TESTING_BENCHMARK_RANKS_H_
#define FSDP_COMM_TESTING_BENCHMARK_RANKS_H_

#include <optional>

namespace fsdp::comm_internal {

// In a process that is not a rank (no RANK variable): starts `world_size` copies of this
// binary with the same arguments (fsdp_run's launcher) and returns their exit status.
// In a rank: nullopt.
std::optional<int> launch_self_as_ranks(int world_size, int argc, char** argv);

// Runs the registered benchmarks on this rank (every rank runs them, so collectives
// match); only rank 0 reports. Then benchmark::Shutdown().
void run_benchmarks_on_rank(int rank);

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_TESTING_BENCHMARK_RANKS_H_
