// The Communicator contract, checked on the in-process fake backend: closed-form results
// for every collective and dtype, exact traffic counters, validation before traffic,
// subgroups, and failures that name the collective and the missing peer.
#include "fsdp/comm/fake.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/comm/testing/collective_checks.h"

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

class FakeCollectivesTest : public ::testing::TestWithParam<std::tuple<int, c10::ScalarType>> {};

TEST_P(FakeCollectivesTest, ResultsAndCountersMatchClosedForms) {
  const auto [world_size, dtype] = GetParam();
  FakeWorld::run(FakeWorld::create(world_size), [dtype = dtype](Communicator& comm) {
    comm_internal::expect_collectives_match_closed_forms(comm, dtype);
    comm.counters().reset();
    EXPECT_EQ(comm.counters().total().bytes_sent, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndDtypes, FakeCollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(c10::kFloat, c10::kBFloat16,
                                                              c10::kHalf, c10::kLong)));

TEST(FakeCommunicatorTest, AverageDividesByWorldSize) {
  FakeWorld::run(FakeWorld::create(4), [](Communicator& comm) {
    comm_internal::expect_average_divides_by_world_size(comm);
  });
}

TEST(FakeCommunicatorTest, AsyncWorksCompleteInOrder) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    at::Tensor a = at::ones({4}), b = at::ones({4});
    WorkHandle first = comm.all_reduce_async(a);
    WorkHandle second = comm.all_reduce_async(b);
    second->wait();
    first->wait(std::chrono::milliseconds(10));
    EXPECT_TRUE(first->is_completed());
    EXPECT_TRUE(at::equal(a, at::full({4}, 2.0)));
  });
}

TEST(FakeCommunicatorTest, MismatchedArgumentsAreRejectedBeforeTraffic) {
  auto world = FakeWorld::create(2);
  std::shared_ptr<Communicator> comm = world->communicator(0);
  EXPECT_THAT([&] { comm->all_gather_into_tensor(at::zeros({9}), at::zeros({5})); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("all_gather_into_tensor: output must hold world_size x input numel "
                            "elements, got output [9] Float on cpu and input [5] Float on cpu")));
  EXPECT_THAT([&] { comm->all_gather_into_tensor(at::zeros({10}, at::kHalf), at::zeros({5})); },
              ThrowsMessage<c10::Error>(HasSubstr("same dtype and device, got output [10] "
                                                  "Half on cpu and input [5] Float on cpu")));
  EXPECT_THAT([&] { comm->reduce_scatter_tensor(at::zeros({4}), at::zeros({7})); },
              ThrowsMessage<c10::Error>(HasSubstr("got output [4] Float on cpu and input [7]")));
  EXPECT_THAT([&] { comm->all_reduce(at::zeros({3}, at::kLong), ReduceOp::kAvg); },
              ThrowsMessage<c10::Error>(HasSubstr("kAvg needs a floating-point dtype")));
  EXPECT_THAT([&] { comm->all_reduce(at::zeros({3}, at::kBool)); },
              ThrowsMessage<c10::Error>(HasSubstr("unsupported dtype Bool")));
  EXPECT_THAT([&] { comm->broadcast(at::zeros({3}), 2); },
              ThrowsMessage<c10::Error>(HasSubstr("root must be in [0, 2), got 2")));
  EXPECT_THAT(
      [&] {
        comm->all_reduce(at::zeros({3, 4}).t());
      },
      ThrowsMessage<c10::Error>(HasSubstr("expected a contiguous tensor")));
  // CPU and CUDA buffers only (CUDA ones are tested in fsdp/core:cuda_parity_test).
  float values[3] = {};
  const CommBuffer on_meta{values, 3, c10::kFloat, c10::Device(c10::kMeta)};
  EXPECT_THAT([&] { comm->all_reduce_async(on_meta); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("all_reduce: the fake backend cannot move a buffer on meta")));
  // Nothing was sent.
  EXPECT_EQ(comm->counters().total().calls, 0);
}

TEST(FakeCommunicatorTest, InjectedFailureReachesTheFailingRankAndTimesOutItsPeers) {
  auto world = FakeWorld::create(3, std::chrono::milliseconds(200));
  world->inject_failure(/*rank=*/1, /*sequence=*/2);
  std::atomic<int> failures{0};
  FakeWorld::run(world, [&](Communicator& comm) {
    comm.barrier();
    comm.barrier();
    try {
      at::Tensor t = at::ones({4});
      comm.all_reduce(t);
      ADD_FAILURE() << "rank " << comm.rank() << " did not fail";
    } catch (const CommError& e) {
      ++failures;
      EXPECT_EQ(e.collective(), "all_reduce");
      EXPECT_EQ(e.sequence(), 2);
      EXPECT_EQ(e.rank(), comm.rank());
      if (comm.rank() == 1) {
        EXPECT_THAT(e.what(), HasSubstr("injected failure"));
      } else {
        EXPECT_EQ(e.peer(), 1);
        EXPECT_THAT(e.what(),
                    HasSubstr("all_reduce #2 failed on rank " + std::to_string(comm.rank()) +
                              " (peer rank 1): rank(s) 1 did not reach it within "
                              "200 ms"));
      }
    }
    // Broken from now on: the next call repeats the first error.
    EXPECT_THAT([&] { comm.barrier(); },
                ThrowsMessage<CommError>(HasSubstr("broken by an earlier failure")));
  });
  EXPECT_EQ(failures, 3);
}

TEST(CommErrorTest, IsAC10ErrorWithTheSameMessage) {
  const std::string expected =
      "all_reduce #59 in group [0, 2] failed on rank 0 (peer rank 3): reset by peer";
  try {
    throw CommError("all_reduce", 59, /*rank=*/0, /*peer=*/3, "reset by peer", {0, 2});
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what()), expected);
    EXPECT_EQ(std::string(e.what_without_backtrace()), expected);
    const auto* comm_error = dynamic_cast<const CommError*>(&e);
    ASSERT_NE(comm_error, nullptr);
    EXPECT_EQ(comm_error->peer(), 3);
    EXPECT_EQ(comm_error->group(), std::vector<int>({0, 2}));
  }
}

TEST(FakeCommunicatorTest, DifferentCollectivesAtOnePointAreNamed) {
  auto world = FakeWorld::create(2, std::chrono::milliseconds(500));
  std::atomic<int> failures{0};
  FakeWorld::run(world, [&](Communicator& comm) {
    try {
      if (comm.rank() == 0) {
        comm.all_reduce(at::ones({4}));
      } else {
        comm.broadcast(at::ones({4}), 0);
      }
    } catch (const CommError& e) {
      ++failures;
      EXPECT_THAT(e.what(), HasSubstr("every rank must issue the same collectives"));
    }
  });
  EXPECT_EQ(failures, 2);
}

TEST(FakeCommunicatorTest, SubgroupsAndHybridSplit) {
  FakeWorld::run(FakeWorld::create(4), [](Communicator& comm) {
    comm_internal::expect_hybrid_groups_of_four(comm);
    // Non-members get nullptr; bad lists are errors.
    std::shared_ptr<Communicator> odd = comm.new_subgroup({1, 3});
    EXPECT_EQ(odd == nullptr, comm.rank() % 2 == 0);
    EXPECT_THROW(comm.new_subgroup({2, 1}), c10::Error);
    EXPECT_THROW(comm.split_hybrid(3), c10::Error);
  });
}

TEST(FakeCommunicatorTest, SubgroupsKnowTheirGlobalRanks) {
  FakeWorld::run(FakeWorld::create(4), [](Communicator& comm) {
    EXPECT_EQ(comm.global_rank(), comm.rank());
    EXPECT_EQ(comm.global_ranks(), (std::vector<int>{0, 1, 2, 3}));
    std::shared_ptr<Communicator> upper = comm.new_subgroup({1, 2, 3});
    if (upper == nullptr) return;
    EXPECT_EQ(upper->global_ranks(), (std::vector<int>{1, 2, 3}));
    EXPECT_EQ(upper->global_rank(), comm.rank());
    // Ranks 0 and 2 of {1, 2, 3}: global ranks 1 and 3.
    std::shared_ptr<Communicator> ends = upper->new_subgroup({0, 2});
    EXPECT_EQ(ends == nullptr, comm.rank() == 2);
    if (ends == nullptr) return;
    EXPECT_EQ(ends->rank(), comm.rank() == 1 ? 0 : 1);
    EXPECT_EQ(ends->global_rank(), comm.rank());
    EXPECT_EQ(ends->global_ranks(), (std::vector<int>{1, 3}));
  });
}

// A subgroup's errors name global ranks and the group (Note [Communication errors]).
TEST(FakeCommunicatorTest, SubgroupErrorsNameGlobalRanksAndTheGroup) {
  auto world = FakeWorld::create(4, std::chrono::milliseconds(200));
  std::atomic<int> failures{0};
  FakeWorld::run(world, [&](Communicator& comm) {
    const HybridGroups groups = comm.split_hybrid(2);
    if (comm.rank() == 3) return;  // never reaches the replicate group's all-reduce
    try {
      groups.replicate_group->all_reduce(at::ones({4}));
      EXPECT_NE(comm.rank(), 1) << "rank 1 did not fail";
    } catch (const CommError& e) {
      ++failures;
      EXPECT_EQ(comm.rank(), 1);
      EXPECT_EQ(e.rank(), 1);
      EXPECT_EQ(e.peer(), 3);
      EXPECT_EQ(e.group(), (std::vector<int>{1, 3}));
      EXPECT_THAT(e.what(), HasSubstr("all_reduce #0 in group [1, 3] failed on rank 1 (peer "
                                      "rank 3): rank(s) 3 did not reach it within 200 ms"));
    }
  });
  EXPECT_EQ(failures, 1);
}

// calls() names the rank, kind, group, thread and device of every collective of the
// world and its subgroups; a host group's collectives (here from another thread) are a
// world of their own and not among them.
TEST(FakeCommunicatorTest, CallsRecordTheIssuingThreadAndHostGroupsAreWorldsOfTheirOwn) {
  auto world = FakeWorld::create(2);
  std::vector<std::thread::id> threads(2);
  FakeWorld::run(world, [&](Communicator& comm) {
    threads[comm.rank()] = std::this_thread::get_id();
    comm.barrier();
    std::shared_ptr<Communicator> alone = comm.new_subgroup({comm.rank()});
    alone->all_reduce(at::ones({2}, at::kLong));
    std::shared_ptr<Communicator> host = comm.new_host_subgroup({0, 1});
    ASSERT_NE(host, nullptr);
    EXPECT_EQ(host->backend_name(), "fake");
    EXPECT_EQ(host->global_ranks(), (std::vector<int>{0, 1}));
    at::Tensor t = at::full({3}, comm.rank() + 1.0);
    std::thread([&] { host->all_reduce(t); }).join();  // another thread, another world
    EXPECT_TRUE(t.equal(at::full({3}, 3.0)));
    EXPECT_EQ(comm.new_host_subgroup({1}) == nullptr, comm.rank() == 0);
    EXPECT_THROW(comm.new_host_subgroup({1, 0}), c10::Error);
  });
  const std::vector<FakeWorld::Call> calls = world->calls();
  ASSERT_EQ(calls.size(), 4u);
  for (int rank = 0; rank < 2; ++rank) {
    int barriers = 0, all_reduces = 0;
    for (const FakeWorld::Call& call : calls) {
      if (call.rank != rank) continue;
      EXPECT_EQ(call.thread, threads[rank]);
      EXPECT_EQ(call.device, c10::Device(c10::kCPU));
      if (call.kind == CollectiveKind::kBarrier) {
        ++barriers;
        EXPECT_TRUE(call.group.empty());
      } else {
        ++all_reduces;
        EXPECT_EQ(call.kind, CollectiveKind::kAllReduce);
        EXPECT_EQ(call.group, std::vector<int>{rank});
      }
    }
    EXPECT_EQ(barriers, 1) << "rank " << rank;
    EXPECT_EQ(all_reduces, 1) << "rank " << rank;
  }
}

}  // namespace
}  // namespace fsdp
