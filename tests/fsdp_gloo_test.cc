// FullyShardedDataParallel with real processes over Gloo on loopback (W = 2, 3): the
// parity models of fsdp/core against single-process training, every strategy, SGD and
// Adam.
#include <csignal>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/rendezvous.h"
#include "fsdp/comm/testing/multiprocess.h"
#include "fsdp/core/testing/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models

TEST(DISABLED_FsdpWorker, Parity) {
  std::shared_ptr<Communicator> comm = init_from_environment(
      RendezvousOptions().timeout(std::chrono::seconds(60)).backend(Backend::kGloo));
  expect_parity_for_all_strategies<NestedImpl>(comm);
  expect_parity_for_all_strategies<TinyLmImpl>(comm);
  expect_parity_for_all_strategies<SkipImpl>(comm);
}

void expect_all_ranks_pass(int world_size) {
  comm_internal::expect_ranks_passed(comm_internal::run_test_as_ranks(
      world_size, "DISABLED_FsdpWorker.Parity", std::chrono::seconds(240)));
}

TEST(FsdpGlooTest, ParityOnTwoRanks) { expect_all_ranks_pass(2); }
TEST(FsdpGlooTest, ParityOnThreeRanks) { expect_all_ranks_pass(3); }

// Issue 14 (pytorch#64629): rank 0 skips unit l2 in its first iteration, rank 1 runs it
// (SkipImpl runs l2 on odd steps; each rank starts at its own step). Gloo used to
// terminate rank 0 (an exception on its transport thread) or time out naming nothing;
// the first iteration's size checks make both ranks raise the same error.
TEST(DISABLED_FsdpWorker, RanksRunningDifferentUnits) {
  std::shared_ptr<Communicator> comm = init_from_environment(
      RendezvousOptions().timeout(std::chrono::seconds(30)).backend(Backend::kGloo));
  const bool validate = std::getenv("FSDP_TEST_VALIDATE") != nullptr;
  FullyShardedDataParallel<SkipImpl> model(
      make<SkipImpl>(), FullyShardedDataParallelOptions(comm).validate_execution_order(validate));
  model->module()->step = comm->rank();
  try {
    model->forward(inputs(0, 2)).sum().backward();
    ADD_FAILURE() << "ranks running different units trained without an error";
  } catch (const c10::Error& e) {  // CommError included
    std::cout << "error: " << e.what_without_backtrace() << std::endl;
  }
}

void expect_both_ranks_name_the_difference(bool validate) {
  const auto ranks = comm_internal::run_test_as_ranks(
      2, "DISABLED_FsdpWorker.RanksRunningDifferentUnits", std::chrono::seconds(120),
      [validate](int /*rank*/, Environment& env) {
        if (validate) env["FSDP_TEST_VALIDATE"] = "1";
      });
  for (int rank : {0, 1}) {
    EXPECT_EQ(ranks[rank].exit_code, 0) << comm_internal::describe(ranks);
    EXPECT_THAT(ranks[rank].output,
                ::testing::ContainsRegex("error: .* failed on rank " + std::to_string(rank) +
                                         ": rank 0 runs [a-z_]+ of [0-9]+ elements, rank 1 runs "
                                         "[a-z_]+ of [0-9]+ elements: the ranks are not running "
                                         "the same units in the same order"))
        << comm_internal::describe(ranks);
    std::cout << "rank " << rank << ": "
              << ranks[rank].output.substr(ranks[rank].output.find("error: ")).substr(0, 300)
              << std::endl;
  }
}

// Gap 2 of the issue-14 review: the ranks agree in the first iteration (both skip l2),
// then diverge in the second (rank 0 skips l2 again, rank 1 runs it), when the first
// iteration's size checks are off again.
TEST(DISABLED_FsdpWorker, RanksDivergingAfterTheFirstIteration) {
  std::shared_ptr<Communicator> comm =
      init_from_environment(RendezvousOptions().timeout(std::chrono::seconds(30)));
  const bool validate = std::getenv("FSDP_TEST_VALIDATE") != nullptr;
  FullyShardedDataParallel<SkipImpl> model(
      make<SkipImpl>(), FullyShardedDataParallelOptions(comm).validate_execution_order(validate));
  model->module()->step = 0;
  model->forward(inputs(0, 2)).sum().backward();
  std::cout << "first iteration done" << std::endl;
  model->module()->step = comm->rank() == 0 ? 2 : 1;
  try {
    model->forward(inputs(1, 2)).sum().backward();
    ADD_FAILURE() << "ranks running different units trained without an error";
  } catch (const c10::Error& e) {  // CommError included
    std::cout << "error: " << e.what_without_backtrace() << std::endl;
  }
}

TEST(FsdpGlooTest, RanksRunningDifferentUnitsStopWithTheSameError) {
  expect_both_ranks_name_the_difference(/*validate=*/false);
}
TEST(FsdpGlooTest, RanksRunningDifferentUnitsStopWithTheSameErrorUnderValidation) {
  expect_both_ranks_name_the_difference(/*validate=*/true);
}

// The line of `output` that starts with `prefix` (without its newline), or "".
std::string line_starting(const std::string& output, const std::string& prefix) {
  size_t at = output.find(prefix);
  if (at == std::string::npos) return "";
  return output.substr(at, output.find('\n', at) - at);
}

// Without validation the size checks end with the first iteration (in every step they
// would cost far more than 2% of it; see Note [First-iteration size checks]), so Gloo
// still terminates rank 0, which receives the longer message, but the terminate handler
// of make_gloo_communicator names the collective and the cause first. Before, rank 0 said
// only "terminate called after throwing an instance of 'gloo::EnforceNotMet'" and Gloo's
// enforcement. Rank 1 fails in a later collective, naming rank 0. Rank 1 all-gathers l2's
// shard (63 parameters padded to 64, 32 floats per rank) where rank 0 all-gathers l1's
// (40 parameters, 20 per rank), each shard in one message.
TEST(FsdpGlooTest, RanksDivergingAfterTheFirstIterationTerminateNamingTheCause) {
  const auto ranks = comm_internal::run_test_as_ranks(
      2, "DISABLED_FsdpWorker.RanksDivergingAfterTheFirstIteration", std::chrono::seconds(120));
  EXPECT_EQ(ranks[0].term_signal, SIGABRT) << comm_internal::describe(ranks);
  EXPECT_EQ(line_starting(ranks[0].output, "fsdp: Gloo terminates"),
            "fsdp: Gloo terminates rank 0 in all_gather_into_tensor #8: a peer sent a message of "
            "128 bytes where this rank expected 80: the ranks are not running the same units in "
            "the same order (FullyShardedDataParallelOptions::validate_execution_order "
            "size-checks every collective, making this a CommError on every rank)")
      << comm_internal::describe(ranks);
  EXPECT_EQ(ranks[1].exit_code, 0) << comm_internal::describe(ranks);
  EXPECT_THAT(ranks[1].output,
              ::testing::ContainsRegex("error: [a-z_]+ #[0-9]+ failed on rank 1 \\(peer rank 0\\)"))
      << comm_internal::describe(ranks);
}

// With validate_execution_order the size checks stay on in every iteration: the failed
// size check makes both ranks compare their collective schedules (on by default,
// FullyShardedDataParallelOptions::schedule_check_every), so both raise the same
// description of the divergence, naming the step and what each rank ran (before: rank 0
// terminated as above).
TEST(FsdpGlooTest, RanksDivergingAfterTheFirstIterationStopWithTheSameErrorUnderValidation) {
  const auto ranks = comm_internal::run_test_as_ranks(
      2, "DISABLED_FsdpWorker.RanksDivergingAfterTheFirstIteration", std::chrono::seconds(120),
      [](int /*rank*/, Environment& env) { env["FSDP_TEST_VALIDATE"] = "1"; });
  for (int rank : {0, 1}) {
    EXPECT_EQ(ranks[rank].exit_code, 0) << comm_internal::describe(ranks);
    EXPECT_THAT(line_starting(ranks[rank].output, "error: "),
                ::testing::StartsWith(
                    "error: schedule_check #1 failed on rank " + std::to_string(rank) +
                    " (peer rank " + std::to_string(1 - rank) +
                    "): the ranks ran different collectives in step 2, first at its collective "
                    "#2: rank 0 ran all_gather_into_tensor of 20 Float in the world, rank 1 ran "
                    "all_gather_into_tensor of 32 Float in the world"))
        << comm_internal::describe(ranks);
  }
}

}  // namespace
}  // namespace fsdp
