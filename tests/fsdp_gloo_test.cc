// FullyShardedDataParallel with real processes over Gloo on loopback (W = 2, 3): the
// parity models of fsdp/core against single-process training, every strategy, SGD and
// Adam.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/internal/multiprocess.h"
#include "fsdp/comm/rendezvous.h"
#include "fsdp/core/internal/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models

template <typename Net>
void expect_parity_for_all_strategies(const std::shared_ptr<Communicator>& comm) {
  for (bool adam : {false, true}) {
    const Reference want = reference<Net>(comm->world_size(), adam);
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard,
                                      ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(::testing::Message() << sharding_strategy_name(strategy)
                                        << (adam ? ", Adam" : ", SGD"));
      expect_parity_on<Net>(
          comm, want, FullyShardedDataParallelOptions(comm).sharding_strategy(strategy), adam);
    }
  }
}

TEST(DISABLED_FsdpWorker, Parity) {
  std::shared_ptr<Communicator> comm =
      init_from_environment(RendezvousOptions().timeout(std::chrono::seconds(60)));
  expect_parity_for_all_strategies<NestedImpl>(comm);
  expect_parity_for_all_strategies<TinyLmImpl>(comm);
  expect_parity_for_all_strategies<SkipImpl>(comm);
}

void expect_all_ranks_pass(int world_size) {
  const auto ranks = comm_internal::run_test_as_ranks(world_size, "DISABLED_FsdpWorker.Parity",
                                                      std::chrono::seconds(240));
  for (const auto& rank : ranks) {
    ASSERT_EQ(rank.exit_code, 0) << comm_internal::describe(ranks);
    ASSERT_THAT(rank.output, ::testing::HasSubstr("[  PASSED  ] 1 test"));
  }
}

TEST(FsdpGlooTest, ParityOnTwoRanks) { expect_all_ranks_pass(2); }
TEST(FsdpGlooTest, ParityOnThreeRanks) { expect_all_ranks_pass(3); }

}  // namespace
}  // namespace fsdp
