// Runs one of the current test binary's tests as W real processes on loopback, each with
// the environment fsdp_run gives its ranks (testonly).
//
//   std::vector<RankOutcome> ranks =
//       run_test_as_ranks(3, "DISABLED_GlooWorker.Collectives", std::chrono::seconds(60));
//
// The children run `/proc/self/exe --gtest_filter=TEST --gtest_also_run_disabled_tests`;
// worker tests are DISABLED_ so a plain run of the binary lists them as disabled instead
// of running them without peers.
#ifndef FSDP_COMM_TESTING_MULTIPROCESS_H_
#define FSDP_COMM_TESTING_MULTIPROCESS_H_

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "fsdp/comm/launcher.h"

namespace fsdp::comm_internal {

struct RankOutcome {
  int exit_code = -1;   // if exited normally, else -1
  int term_signal = 0;  // if killed by a signal, else 0
  std::string output;   // stdout and stderr, interleaved
  double seconds = 0;   // wall time from start to exit
};

// Starts `world_size` ranks (fresh free MASTER_PORT) and waits for all of them; ranks
// still running after `deadline` are killed (SIGKILL, reported as such). `customize`
// may edit each rank's environment before it starts.
std::vector<RankOutcome> run_test_as_ranks(
    int world_size, const std::string& test_name, std::chrono::seconds deadline,
    const std::function<void(int rank, Environment& env)>& customize = nullptr);

// "rank R: exited 0 after 1.2 s" / "killed by signal 9", then its output; for messages.
std::string describe(const std::vector<RankOutcome>& ranks);

// ASSERTs (GoogleTest) that every rank exited with status 0 and passed its worker test
// ("[  PASSED  ] 1 test"); a failure shows describe(ranks).
void expect_ranks_passed(const std::vector<RankOutcome>& ranks);

}  // namespace fsdp::comm_internal

#endif  // FSDP_COMM_TESTING_MULTIPROCESS_H_
