// For benchmarks that run as several ranks: the binary starts its own ranks when run
// without RANK in its environment, and ranks other than 0 report nothing.
#ifndef FSDP_COMM_TESTING_BENCHMARK_RANKS_H_
#define FSDP_COMM_TESTING_BENCHMARK_RANKS_H_

#include <functional>
#include <optional>

#include "fsdp/comm/communicator.h"

namespace fsdp::comm_internal {

// In a process that is not a rank (no RANK variable): starts `world_size` copies of this
// binary with the same arguments (fsdp_run's launcher) and returns their exit status.
// In a rank: nullopt.
std::optional<int> launch_self_as_ranks(int world_size, int argc, char** argv);

// Runs the registered benchmarks on this rank (every rank runs them, so collectives
// match); only rank 0 reports. Then benchmark::Shutdown().
void run_benchmarks_on_rank(int rank);

// The whole main() of a benchmark that runs as `world_size` ranks. Outside a rank: starts
// them (launch_self_as_ranks) and returns their exit status. In a rank:
// benchmark::Initialize, then `connect` (joins the ranks, so that nothing timed waits
// for them, and registers what it needs; returns this rank's communicator),
// run_benchmarks_on_rank, a barrier, and `finish` (when given) on every rank with its
// rank, e.g. rank 0 prints a summary of the runs. Returns 0.
int benchmark_main(int world_size, int argc, char** argv,
                   const std::function<Communicator&()>& connect,
                   const std::function<void(int rank)>& finish = nullptr);

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_TESTING_BENCHMARK_RANKS_H_
