// Frozen and trainable parameters in one unit (Note [Frozen parameters in a unit] in
// internal/runtime.cc), on ranks as threads (the fake communicator): the two flat
// parameters of a unit, exact collective counts and bytes, gradients only for trainable
// elements, and parity with one process with the same parameters frozen, every strategy,
// W = 1, 2, 3.
#include <functional>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/testing/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::ElementsAre;

TEST(FrozenParamsTest, AMixedUnitHasATrainableAndAFrozenFlatParameter) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<FrozenLmImpl> model(make<FrozenLmImpl>(),
                                                 FullyShardedDataParallelOptions(comm));
    const auto& units = model->units();
    ASSERT_EQ(units.size(), 3u);
    const FullyShardedUnit& root = *units[0];
    const FullyShardedUnit& block = *units[1];
    EXPECT_THAT(fqns_of(*root.handle()), ElementsAre("embedding.weight"));
    EXPECT_THAT(fqns_of(*root.frozen_handles().at(0)),
                ElementsAre("final_norm.weight", "final_norm.bias"));
    EXPECT_THAT(fqns_of(*block.handle()),
                ElementsAre("blocks.0.up.bias", "blocks.0.down.weight", "blocks.0.down.bias"));
    EXPECT_THAT(fqns_of(*block.frozen_handles().at(0)),
                ElementsAre("blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.up.weight"));
    EXPECT_EQ(root.handle()->numel(), 88);
    EXPECT_EQ(root.frozen_handles().at(0)->numel(), 16);
    EXPECT_EQ(block.handle()->numel(), 152);
    EXPECT_EQ(block.frozen_handles().at(0)->numel(), 144);
    EXPECT_EQ(block.handles(),
              (std::vector<FlatParamHandle*>{block.handle(), block.frozen_handles().at(0)}));
    EXPECT_TRUE(block.handle()->sharded_flat_param().requires_grad());
    EXPECT_FALSE(block.frozen_handles().at(0)->sharded_flat_param().requires_grad());
    // The optimizer's list: the trainable flat parameters only.
    const std::vector<at::Tensor> params = model->parameters();
    ASSERT_EQ(params.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_TRUE(params[k].is_same(units[k]->handle()->sharded_flat_param()));
    }
  });
}

// One FULL_SHARD iteration at W = 2 and 3: the frozen flat parameters are all-gathered
// beside the trainable ones (n + m all-gathers in forward, (n - 1) + (m - 1) in
// backward: the root stays gathered; n = m = 3 here) but never reduce-scattered, and
// the gradients (the reduce-scatter's input and .grad) cover the trainable elements only.
TEST(FrozenParamsTest, OnlyTrainableElementsAreReducedAndHoldGradients) {
  for (int world_size : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << "W = " << world_size);
    on_ranks(world_size, [world_size](std::shared_ptr<Communicator> comm) {
      FullyShardedDataParallel<FrozenLmImpl> model(make<FrozenLmImpl>(),
                                                   FullyShardedDataParallelOptions(comm));
      const Batch batch = FrozenLmImpl::batch(0, 2);
      comm->counters().reset();
      FrozenLmImpl::loss(model->forward(batch.input), batch.target).backward();
      // Trainable shard numels: root ceil(88 / W), blocks ceil(152 / W).
      const int64_t root_shard = world_size == 2 ? 44 : 30;
      const int64_t block_shard = world_size == 2 ? 76 : 51;
      const CollectiveTraffic reduced = comm->counters().get(CollectiveKind::kReduceScatter);
      EXPECT_EQ(reduced.calls, 3);
      // Ring reduce-scatter: each rank sends (W - 1) chunks of its flat gradient.
      EXPECT_EQ(reduced.bytes_sent, (world_size - 1) * (root_shard + 2 * block_shard) * 4);
      EXPECT_EQ(comm->counters().get(CollectiveKind::kAllGather).calls, 6 + 4);
      EXPECT_EQ(comm->counters().get(CollectiveKind::kAllReduce).calls, 0);
      for (const auto& unit : model->units()) {
        const at::Tensor& grad = unit->handle()->sharded_flat_param().grad();
        ASSERT_TRUE(grad.defined()) << unit->fqn();
        EXPECT_EQ(grad.numel(), unit->is_root() ? root_shard : block_shard);
        EXPECT_FALSE(unit->frozen_handles().at(0)->sharded_flat_param().grad().defined());
        for (const at::Tensor& p : unit->frozen_handles().at(0)->original_params()) {
          EXPECT_FALSE(p.grad().defined());
          EXPECT_FALSE(p.requires_grad());
        }
        EXPECT_EQ(unit->frozen_handles().at(0)->state(), FlatParamState::kSharded);
        EXPECT_EQ(unit->handle()->state(), FlatParamState::kSharded);
      }
      EXPECT_EQ(model->training_state(), TrainingState::kIdle);
    });
  }
}

// The same model trained with FSDP and in one process, with the same parameters frozen:
// the losses every step and every parameter at the end (the frozen ones unchanged).
TEST(FrozenParamsTest, ParityWithOneProcessEveryStrategy) {
  for (int world_size : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "W = " << world_size);
    on_ranks(world_size, [](std::shared_ptr<Communicator> comm) {
      expect_parity_for_all_strategies<FrozenLmImpl>(comm);
    });
  }
}

TEST(FrozenParamsTest, ParityWithOneProcessHybridStrategies) {
  for (int world_size : {2, 3}) {
    on_ranks(world_size, [world_size](std::shared_ptr<Communicator> comm) {
      const Reference want = reference<FrozenLmImpl>(world_size, /*adam=*/true);
      for (ShardingStrategy strategy :
           {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
        for (int group : {1, world_size}) {
          SCOPED_TRACE(::testing::Message() << sharding_strategy_name(strategy)
                                            << " W = " << world_size << " F = " << group);
          expect_parity_on<FrozenLmImpl>(comm, want,
                                         FullyShardedDataParallelOptions(comm)
                                             .sharding_strategy(strategy)
                                             .hybrid_shard_group_size(group),
                                         /*adam=*/true);
        }
      }
    });
  }
}

// no_sync accumulates the trainable gradients only; the next backward reduces their sum.
TEST(FrozenParamsTest, NoSyncAndSummonCoverBothFlatParameters) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    auto net = make<FrozenLmImpl>();
    const at::Tensor final_weight = net->final_norm->weight.detach().clone();
    FullyShardedDataParallel<FrozenLmImpl> model(net, FullyShardedDataParallelOptions(comm));
    const Batch batch = FrozenLmImpl::batch(0, 2);
    {
      auto scope = model->no_sync();
      FrozenLmImpl::loss(model->forward(batch.input), batch.target).backward();
    }
    for (const auto& unit : model->units()) {
      EXPECT_TRUE(unit->handle()->has_accumulated_grad());
      EXPECT_FALSE(unit->frozen_handles().at(0)->has_accumulated_grad());
    }
    comm->counters().reset();
    FrozenLmImpl::loss(model->forward(batch.input), batch.target).backward();
    EXPECT_EQ(comm->counters().get(CollectiveKind::kReduceScatter).calls, 3);
    auto summon = model->summon_full_params(SummonFullParamsOptions().writeback(false));
    EXPECT_TRUE(at::equal(net->final_norm->weight, final_weight));
    EXPECT_EQ(model->units()[1]->frozen_handles().at(0)->state(), FlatParamState::kUnsharded);
  });
}

// A frozen embedding unit fed token ids (as in LoRA) is outside autograd (Note [Units
// outside autograd] in internal/runtime.cc): it reshards right after its forward and is
// not gathered again in backward, so backward all-gathers the head unit only; and an
// evaluation forward (NoGradGuard) leaves no unit but the root gathered.
struct FrozenEmbeddingLmImpl : torch::nn::Module {
  FrozenEmbeddingLmImpl() {
    embedding = register_module("embedding",
                                Unit<torch::nn::EmbeddingImpl>(torch::nn::Embedding(16, 8).ptr()));
    head = register_module("head", Unit<torch::nn::LinearImpl>(torch::nn::Linear(8, 4).ptr()));
    for (auto& p : embedding->parameters()) p.requires_grad_(false);
  }
  at::Tensor forward(const at::Tensor& ids) { return head(embedding(ids)); }
  Unit<torch::nn::EmbeddingImpl> embedding{nullptr};
  Unit<torch::nn::LinearImpl> head{nullptr};
};
TORCH_MODULE(FrozenEmbeddingLm);

TEST(FrozenParamsTest, AUnitOutsideAutogradReshardsAfterForwardAndSkipsBackward) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<FrozenEmbeddingLmImpl> model(std::make_shared<FrozenEmbeddingLmImpl>(),
                                                          FullyShardedDataParallelOptions(comm));
    ASSERT_EQ(model->units().size(), 3u);  // the root (no parameters), embedding, head
    const FullyShardedUnit& embedding = *model->units()[1];
    const FullyShardedUnit& head = *model->units()[2];
    ASSERT_FALSE(embedding.handle()->sharded_flat_param().requires_grad());
    const at::Tensor ids = at::arange(6, at::kLong).reshape({2, 3});
    const auto all_gathers = [&] { return comm->counters().get(CollectiveKind::kAllGather).calls; };
    for (int iteration = 0; iteration < 2; ++iteration) {
      const at::Tensor loss = model->forward(ids).sum();
      EXPECT_FALSE(embedding.handle()->is_unsharded());
      EXPECT_FALSE(head.handle()->is_unsharded());
      const int64_t before = all_gathers();
      loss.backward();
      EXPECT_EQ(all_gathers() - before, 1) << "iteration " << iteration;  // the head only
    }
    torch::NoGradGuard no_grad;
    const int64_t before = all_gathers();
    model->forward(ids);
    EXPECT_EQ(all_gathers() - before, 2);
    EXPECT_FALSE(embedding.handle()->is_unsharded());
    EXPECT_FALSE(head.handle()->is_unsharded());
  });
}

// A unit whose parameters are all frozen, between trainable ones (block 1 here, as a LoRA
// model's output head): it reshards once its input's gradient is complete, before the
// backward of the unit that made that input (Note [Frozen units reshard after their
// backward] in internal/runtime.cc), and training matches one process in every strategy.
struct FrozenBlockLmImpl : TinyLmImpl {  // TinyLm's modules, batches and loss
  FrozenBlockLmImpl() {
    for (at::Tensor& p : blocks[1]->parameters()) p.set_requires_grad(false);
  }
  at::Tensor forward(at::Tensor tokens) {
    at::Tensor x = blocks[0]->as<UnitImpl<BlockImpl>>()->forward(embedding(tokens));
    if (on_block1_input_grad)
      x.register_hook([this](const at::Tensor&) { on_block1_input_grad(); });
    x = blocks[1]->as<UnitImpl<BlockImpl>>()->forward(x);
    return at::matmul(x, embedding->weight.t());
  }
  std::function<void()> on_block1_input_grad;  // test probe, run in backward
};

TEST(FrozenParamsTest, AFrozenUnitReshardsOnceItsInputsGradientIsComplete) {
  for (BackwardPrefetch prefetch : {BackwardPrefetch::kBackwardPre, BackwardPrefetch::kNone}) {
    on_ranks(2, [prefetch](std::shared_ptr<Communicator> comm) {
      auto net = make<FrozenBlockLmImpl>();
      FullyShardedDataParallel<FrozenBlockLmImpl> model(
          net, FullyShardedDataParallelOptions(comm).backward_prefetch(prefetch));
      ASSERT_EQ(model->units().size(), 3u);
      const FullyShardedUnit& block0 = *model->units()[1];
      const FullyShardedUnit& block1 = *model->units()[2];
      ASSERT_EQ(block1.fqn(), "blocks.1");
      ASSERT_FALSE(block1.handle()->sharded_flat_param().requires_grad());
      int probes = 0;
      net->on_block1_input_grad = [&] {
        ++probes;
        EXPECT_FALSE(block1.handle()->is_unsharded());
        EXPECT_TRUE(block0.handle()->is_unsharded());  // its pre-backward hook ran first
      };
      for (int iteration = 0; iteration < 2; ++iteration) {
        const Batch batch = FrozenBlockLmImpl::batch(iteration, 2);
        comm->counters().reset();
        FrozenBlockLmImpl::loss(model->forward(batch.input), batch.target).backward();
        EXPECT_EQ(probes, iteration + 1);
        // Forward: the root and both blocks; backward: both blocks again.
        EXPECT_EQ(comm->counters().get(CollectiveKind::kAllGather).calls, 3 + 2);
        EXPECT_EQ(comm->counters().get(CollectiveKind::kReduceScatter).calls, 2);
        EXPECT_FALSE(block1.handle()->sharded_flat_param().grad().defined());
      }
    });
  }
}

TEST(FrozenParamsTest, AFrozenUnitBetweenTrainableOnesTrainsAsOneProcess) {
  for (int world_size : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "W = " << world_size);
    on_ranks(world_size, [](std::shared_ptr<Communicator> comm) {
      expect_parity_for_all_strategies<FrozenBlockLmImpl>(comm);
    });
  }
}

}  // namespace
}  // namespace fsdp
