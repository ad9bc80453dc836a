// The Communicator contract, checked on the in-process fake backend: closed-form results
// for every collective and dtype, exact traffic counters, validation before traffic,
// subgroups, and failures that name the collective and the missing peer.
#include "fsdp/comm/fake.h"

#include <atomic>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

namespace fsdp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Rank r's shard: [r*100 + 0, r*100 + 1, ...] as `dtype`.
at::Tensor shard_of(int rank, int64_t numel, c10::ScalarType dtype) {
  return (at::arange(numel, at::kDouble) + 100.0 * rank).to(dtype);
}

class FakeCollectivesTest
    : public ::testing::TestWithParam<std::tuple<int, c10::ScalarType>> {};

TEST_P(FakeCollectivesTest, ResultsAndCountersMatchClosedForms) {
  const auto [world_size, dtype] = GetParam();
  const int64_t n = 5;  // shard numel
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  FakeWorld::run(FakeWorld::create(world_size), [&, world_size = world_size,
                                                 dtype = dtype](Communicator& comm) {
    const int w = world_size;
    // all-gather: rank k's shard at k * n.
    at::Tensor full = at::zeros({n * w}, dtype);
    comm.all_gather_into_tensor(full, shard_of(comm.rank(), n, dtype));
    for (int k = 0; k < w; ++k) {
      EXPECT_TRUE(at::equal(full.narrow(0, k * n, n), shard_of(k, n, dtype)));
    }
    // reduce-scatter (sum): chunk r of sum_k (k*100 + arange(n*w)).
    at::Tensor flat = (at::arange(n * w, at::kDouble) + comm.rank()).to(dtype);
    at::Tensor out = at::zeros({n}, dtype);
    comm.reduce_scatter_tensor(out, flat);
    at::Tensor expected = (at::arange(n, at::kDouble) + comm.rank() * n) * w + w * (w - 1) / 2;
    EXPECT_TRUE(at::equal(out, expected.to(dtype)));
    // all-reduce (sum) of 7 elements, not a multiple of most world sizes.
    at::Tensor t = at::full({7}, comm.rank() + 1, at::kDouble).to(dtype);
    comm.all_reduce(t);
    EXPECT_TRUE(at::equal(t, at::full({7}, w * (w + 1) / 2, at::kDouble).to(dtype)));
    // broadcast from the last rank.
    at::Tensor b = shard_of(comm.rank(), 3, dtype);
    comm.broadcast(b, w - 1);
    EXPECT_TRUE(at::equal(b, shard_of(w - 1, 3, dtype)));
    comm.barrier();

    const CollectiveTraffic ag = comm.counters().get(CollectiveKind::kAllGather);
    EXPECT_EQ(ag.calls, 1);
    EXPECT_EQ(ag.bytes_sent, (w - 1) * n * element);
    EXPECT_EQ(ag.bytes_received, (w - 1) * n * element);
    EXPECT_EQ(comm.counters().get(CollectiveKind::kReduceScatter).bytes_sent,
              (w - 1) * n * element);
    EXPECT_EQ(comm.counters().get(CollectiveKind::kAllReduce).bytes_sent,
              2 * (w - 1) * ((7 + w - 1) / w) * element);
    const CollectiveTraffic bc = comm.counters().get(CollectiveKind::kBroadcast);
    EXPECT_EQ(bc.bytes_sent, comm.rank() == w - 1 ? (w - 1) * 3 * element : 0);
    EXPECT_EQ(bc.bytes_received, comm.rank() == w - 1 ? 0 : 3 * element);
    EXPECT_EQ(comm.counters().get(CollectiveKind::kBarrier).calls, 1);
    EXPECT_EQ(comm.counters().total().calls, 5);
    comm.counters().reset();
    EXPECT_EQ(comm.counters().total().bytes_sent, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(
    WorldSizesAndDtypes, FakeCollectivesTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values(c10::kFloat, c10::kBFloat16, c10::kHalf, c10::kLong)));

TEST(FakeCommunicatorTest, AverageDividesByWorldSize) {
  FakeWorld::run(FakeWorld::create(4), [](Communicator& comm) {
    at::Tensor flat = at::full({8}, static_cast<double>(comm.rank()), at::kFloat);
    at::Tensor out = at::empty({2}, at::kFloat);
    comm.reduce_scatter_tensor(out, flat, ReduceOp::kAvg);
    EXPECT_TRUE(at::equal(out, at::full({2}, 1.5, at::kFloat)));
    at::Tensor t = at::full({3}, static_cast<double>(comm.rank()), at::kFloat);
    comm.all_reduce(t, ReduceOp::kAvg);
    EXPECT_TRUE(at::equal(t, at::full({3}, 1.5, at::kFloat)));
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
              ThrowsMessage<c10::Error>(HasSubstr(
                  "all_gather_into_tensor: output must hold world_size x input numel "
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
  EXPECT_THAT([&] { comm->all_reduce(at::zeros({3, 4}).t()); },
              ThrowsMessage<c10::Error>(HasSubstr("expected a contiguous tensor")));
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
        EXPECT_THAT(e.what(), HasSubstr("all_reduce #2 failed on rank " +
                                        std::to_string(comm.rank()) +
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
    HybridGroups groups = comm.split_hybrid(2);
    ASSERT_NE(groups.shard_group, nullptr);
    ASSERT_NE(groups.replicate_group, nullptr);
    EXPECT_EQ(groups.shard_group->world_size(), 2);
    EXPECT_EQ(groups.shard_group->rank(), comm.rank() % 2);
    EXPECT_EQ(groups.replicate_group->rank(), comm.rank() / 2);
    // Shard groups {0,1}, {2,3}; replicate groups {0,2}, {1,3}.
    at::Tensor t = at::full({1}, static_cast<double>(comm.rank()));
    groups.shard_group->all_reduce(t);
    EXPECT_EQ(t.item<float>(), comm.rank() < 2 ? 1 : 5);
    at::Tensor u = at::full({1}, static_cast<double>(comm.rank()));
    groups.replicate_group->all_reduce(u);
    EXPECT_EQ(u.item<float>(), comm.rank() % 2 == 0 ? 2 : 4);
    // Subgroup traffic is counted on the subgroup only.
    EXPECT_EQ(comm.counters().total().calls, 0);
    // Non-members get nullptr; bad lists are errors.
    std::shared_ptr<Communicator> odd = comm.new_subgroup({1, 3});
    EXPECT_EQ(odd == nullptr, comm.rank() % 2 == 0);
    EXPECT_THROW(comm.new_subgroup({2, 1}), c10::Error);
    EXPECT_THROW(comm.split_hybrid(3), c10::Error);
  });
}

}  // namespace
}  // namespace fsdp
