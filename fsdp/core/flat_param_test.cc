#include "fsdp/core/flat_param.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "fsdp/comm/fake.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

MATCHER_P3(Covers, fqn, start, end, "") {
  return arg.fqn == fqn && arg.start == start && arg.end == end;
}

std::vector<FlatParamInfo> three_weights() {
  return {{"0.weight", {10, 10}, 100, 0},
          {"2.weight", {10, 10}, 100, 100},
          {"4.weight", {10, 10}, 100, 200}};
}

TEST(ShardParamInfosTest, ReferenceExamples) {
  const auto infos = three_weights();
  EXPECT_THAT(shard_param_infos(infos, 0, 50), ElementsAre(Covers("0.weight", 0, 50)));
  EXPECT_THAT(shard_param_infos(infos, 50, 149),
              ElementsAre(Covers("0.weight", 50, 99), Covers("2.weight", 0, 49)));
  EXPECT_THAT(shard_param_infos(infos, 99, 199),
              ElementsAre(Covers("0.weight", 99, 99), Covers("2.weight", 0, 99)));
  EXPECT_THAT(shard_param_infos(infos, 100, 1000),
              ElementsAre(Covers("2.weight", 0, 99), Covers("4.weight", 0, 99)));
  EXPECT_THAT(shard_param_infos(infos, 299, 299), ElementsAre(Covers("4.weight", 99, 99)));
  EXPECT_TRUE(shard_param_infos(infos, 300, 310).empty());  // padding only
}

// Parameters with recognisable values: param i holds 1000 i + arange(numel).
std::vector<NamedParam> make_params(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<NamedParam> params;
  for (size_t i = 0; i < shapes.size(); ++i) {
    at::Tensor p = at::ones(shapes[i]);
    p = (at::arange(p.numel(), at::kFloat) + 1000.0 * i).view(shapes[i]);
    p.set_requires_grad(true);
    params.push_back({"p" + std::to_string(i), p});
  }
  return params;
}

class FlatParamHandleTest : public ::testing::TestWithParam<int> {};

TEST_P(FlatParamHandleTest, ShardsUnshardsReshardsAndReducesGradients) {
  const int w = GetParam();
  FakeWorld::run(FakeWorld::create(w), [w](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    // 9 + 4 = 13 elements: padding for W = 2, 3.
    std::vector<NamedParam> params = make_params({{3, 3}, {4}});
    const at::Tensor expected0 = params[0].param.detach().clone();
    FlatParamHandle handle(params, self, ShardingStrategy::kFullShard);
    const int64_t shard = (13 + w - 1) / w;
    EXPECT_EQ(handle.numel(), 13);
    EXPECT_EQ(handle.shard_numel(), shard);
    EXPECT_EQ(handle.padding(), shard * w - 13);
    EXPECT_EQ(handle.sharded_flat_param().numel(), shard);
    // This rank's shard metadata covers flat elements [rank x shard, (rank + 1) x shard).
    const std::vector<FlatParamInfo> infos = {{"p0", {3, 3}, 9, 0}, {"p1", {4}, 4, 9}};
    const std::vector<ShardParamInfo> local = handle.local_shard_param_infos();
    const std::vector<ShardParamInfo> want = shard_param_infos(
        infos, comm.rank() * shard, (comm.rank() + 1) * shard - 1);
    ASSERT_EQ(local.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(local[i].fqn, want[i].fqn);
      EXPECT_EQ(local[i].start, want[i].start);
      EXPECT_EQ(local[i].end, want[i].end);
    }
    EXPECT_TRUE(handle.sharded_flat_param().requires_grad());
    EXPECT_TRUE(handle.sharded_flat_param().is_leaf());
    // Sharded from the start; unsharded, the original parameters are views with their
    // old values and shapes.
    EXPECT_FALSE(handle.is_unsharded());
    EXPECT_EQ(params[0].param.storage().nbytes(), 0u);
    handle.unshard();
    EXPECT_TRUE(at::equal(handle.original_params()[0], expected0));
    EXPECT_EQ(params[1].param.sizes(), c10::IntArrayRef({4}));

    handle.reshard();
    EXPECT_FALSE(handle.is_unsharded());
    EXPECT_EQ(params[0].param.storage().nbytes(), 0u);  // memory freed
    // Edit the shard, unshard: the views see the gathered values.
    handle.sharded_flat_param().detach().add_(1.0);
    handle.unshard();
    EXPECT_TRUE(at::equal(params[0].param, expected0 + 1.0));
    EXPECT_TRUE(at::equal(handle.full_flat_param().narrow(0, 0, 9), (expected0 + 1).view({-1})));

    // Gradients: rank r contributes r + 1 everywhere; the average is (W + 1) / 2.
    const double value = comm.rank() + 1.0;
    handle.reduce_grad({at::full({3, 3}, value), at::Tensor()});
    handle.reduce_grad({at::full({3, 3}, value), at::full({4}, value)});
    const at::Tensor grad = handle.sharded_flat_param().grad();
    ASSERT_TRUE(grad.defined());
    for (int64_t i = 0; i < shard; ++i) {
      const int64_t flat = comm.rank() * shard + i;
      const double mean = (w + 1) / 2.0;
      const double want = flat < 9 ? 2 * mean : flat < 13 ? mean : 0.0;
      EXPECT_DOUBLE_EQ(grad[i].item<double>(), want) << "flat element " << flat;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FlatParamHandleTest, ::testing::Values(1, 2, 3));

TEST(FlatParamHandleNoShardTest, KeepsEverythingAndAllReduces) {
  FakeWorld::run(FakeWorld::create(2), [](Communicator& comm) {
    std::shared_ptr<Communicator> self(&comm, [](Communicator*) {});
    std::vector<NamedParam> params = make_params({{5}});
    FlatParamHandle handle(params, self, ShardingStrategy::kNoShard);
    EXPECT_EQ(handle.shard_numel(), 5);
    EXPECT_EQ(handle.padding(), 0);
    handle.reshard();  // no-op
    EXPECT_TRUE(handle.is_unsharded());
    // The optimizer's in-place update is what the module sees.
    handle.sharded_flat_param().detach().mul_(2.0);
    EXPECT_EQ(params[0].param[1].item<float>(), 2.0f);
    handle.reduce_grad({at::full({5}, comm.rank() * 2.0)});
    EXPECT_TRUE(at::equal(handle.sharded_flat_param().grad(), at::full({5}, 1.0)));
    EXPECT_EQ(comm.counters().get(CollectiveKind::kAllReduce).calls, 1);
    EXPECT_EQ(comm.counters().get(CollectiveKind::kAllGather).calls, 0);
  });
}

TEST(FlatParamHandleErrorsTest, BadInputIsNamed) {
  auto world = FakeWorld::create(1);
  std::shared_ptr<Communicator> comm = world->communicator(0);
  EXPECT_THAT([&] { FlatParamHandle({}, comm, ShardingStrategy::kFullShard); },
              ThrowsMessage<c10::Error>(HasSubstr("expected at least one parameter")));
  at::Tensor w = at::ones({2});
  EXPECT_THAT([&] { FlatParamHandle({{"a.weight", w}, {"b.weight", w}}, comm,
                                    ShardingStrategy::kFullShard); },
              ThrowsMessage<c10::Error>(HasSubstr("'b.weight' is the same tensor as "
                                                  "'a.weight'")));
  EXPECT_THAT([&] { FlatParamHandle({{"a", at::ones({2})}, {"b", at::ones({2}, at::kDouble)}},
                                    comm, ShardingStrategy::kFullShard); },
              ThrowsMessage<c10::Error>(HasSubstr("need one dtype and device")));
  FlatParamHandle handle({{"a", at::ones({2})}}, comm, ShardingStrategy::kFullShard);
  EXPECT_THAT([&] { handle.reduce_grad({at::ones({3})}); },
              ThrowsMessage<c10::Error>(HasSubstr("gradient of 'a' has 3 elements, expected 2")));
}

}  // namespace
}  // namespace fsdp
