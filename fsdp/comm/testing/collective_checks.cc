#include "fsdp/comm/testing/collective_checks.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <gtest/gtest.h>

namespace fsdp::comm_internal {
namespace {

// Rank r's shard: [r*100 + 0, r*100 + 1, ...] as `dtype`.
at::Tensor shard_of(int rank, int64_t numel, c10::ScalarType dtype) {
  return (at::arange(numel, at::kDouble) + 100.0 * rank).to(dtype);
}

}  // namespace

void expect_collectives_match_closed_forms(Communicator& comm, c10::ScalarType dtype,
                                           c10::Device device) {
  SCOPED_TRACE(::testing::Message() << "rank " << comm.rank() << " of " << comm.world_size() << ", "
                                    << c10::toString(dtype) << " on " << device);
  comm.counters().reset();
  const int64_t w = comm.world_size();
  const int64_t n = 5;  // shard numel
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  // all-gather: rank k's shard at k * n.
  at::Tensor full = at::zeros({n * w}, dtype).to(device);
  comm.all_gather_into_tensor(full, shard_of(comm.rank(), n, dtype).to(device));
  full = full.cpu();
  for (int k = 0; k < w; ++k) {
    EXPECT_TRUE(at::equal(full.narrow(0, k * n, n), shard_of(k, n, dtype))) << "chunk " << k;
  }
  // reduce-scatter (sum): chunk r of sum_k (k + arange(n*w)).
  at::Tensor flat = (at::arange(n * w, at::kDouble) + comm.rank()).to(dtype).to(device);
  at::Tensor out = at::zeros({n}, dtype).to(device);
  comm.reduce_scatter_tensor(out, flat);
  out = out.cpu();
  at::Tensor expected = (at::arange(n, at::kDouble) + comm.rank() * n) * w + w * (w - 1) / 2;
  EXPECT_TRUE(at::equal(out, expected.to(dtype))) << out;
  // all-reduce (sum) of 7 elements.
  at::Tensor t = at::full({7}, comm.rank() + 1, at::kDouble).to(dtype).to(device);
  comm.all_reduce(t);
  t = t.cpu();
  EXPECT_TRUE(at::equal(t, at::full({7}, w * (w + 1) / 2, at::kDouble).to(dtype))) << t;
  // broadcast from the last rank.
  at::Tensor b = shard_of(comm.rank(), 3, dtype).to(device);
  comm.broadcast(b, w - 1);
  b = b.cpu();
  EXPECT_TRUE(at::equal(b, shard_of(w - 1, 3, dtype))) << b;
  comm.barrier();

  const CollectiveTraffic ag = comm.counters().get(CollectiveKind::kAllGather);
  EXPECT_EQ(ag.calls, 1);
  EXPECT_EQ(ag.bytes_sent, (w - 1) * n * element);
  EXPECT_EQ(ag.bytes_received, (w - 1) * n * element);
  EXPECT_EQ(comm.counters().get(CollectiveKind::kReduceScatter).bytes_sent, (w - 1) * n * element);
  EXPECT_EQ(comm.counters().get(CollectiveKind::kAllReduce).bytes_sent,
            2 * (w - 1) * ((7 + w - 1) / w) * element);
  const CollectiveTraffic bc = comm.counters().get(CollectiveKind::kBroadcast);
  EXPECT_EQ(bc.bytes_sent, comm.rank() == w - 1 ? (w - 1) * 3 * element : 0);
  EXPECT_EQ(bc.bytes_received, comm.rank() == w - 1 ? 0 : 3 * element);
  EXPECT_EQ(comm.counters().get(CollectiveKind::kBarrier).calls, 1);
  EXPECT_EQ(comm.counters().total().calls, 5);
}

void expect_average_divides_by_world_size(Communicator& comm, c10::Device device) {
  const double mean = (comm.world_size() - 1) / 2.0;
  const auto on_device = at::TensorOptions().device(device);
  at::Tensor flat = at::full({2 * comm.world_size()}, static_cast<double>(comm.rank()), on_device);
  at::Tensor out = at::empty({2}, on_device);
  comm.reduce_scatter_tensor(out, flat, ReduceOp::kAvg);
  EXPECT_TRUE(at::equal(out.cpu(), at::full({2}, mean))) << out;
  at::Tensor t = at::full({3}, static_cast<double>(comm.rank()), on_device);
  comm.all_reduce(t, ReduceOp::kAvg);
  EXPECT_TRUE(at::equal(t.cpu(), at::full({3}, mean))) << t;
}

void expect_hybrid_groups_of_four(Communicator& comm) {
  ASSERT_EQ(comm.world_size(), 4);
  const int64_t calls_before = comm.counters().total().calls;
  HybridGroups groups = comm.split_hybrid(2);
  ASSERT_NE(groups.shard_group, nullptr);
  ASSERT_NE(groups.replicate_group, nullptr);
  EXPECT_EQ(groups.shard_group->world_size(), 2);
  EXPECT_EQ(groups.shard_group->rank(), comm.rank() % 2);
  EXPECT_EQ(groups.replicate_group->rank(), comm.rank() / 2);
  at::Tensor t = at::full({1}, static_cast<double>(comm.rank()));
  groups.shard_group->all_reduce(t);
  EXPECT_EQ(t.item<float>(), comm.rank() < 2 ? 1 : 5);
  at::Tensor u = at::full({1}, static_cast<double>(comm.rank()));
  groups.replicate_group->all_reduce(u);
  EXPECT_EQ(u.item<float>(), comm.rank() % 2 == 0 ? 2 : 4);
  // A subgroup's traffic is counted on the subgroup only.
  EXPECT_EQ(comm.counters().total().calls, calls_before);
  EXPECT_EQ(groups.shard_group->counters().get(CollectiveKind::kAllReduce).calls, 1);
}

}  // namespace fsdp::comm_internal
