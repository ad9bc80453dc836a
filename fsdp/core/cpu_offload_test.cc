// CPU offload (FullyShardedDataParallelOptions::cpu_offload) on a CPU compute device,
// ranks as threads (the fake communicator): the offload path makes separate host
// allocations there and runs the same arithmetic, so training with and without offload
// gives bit-identical losses, gradients, gradient norms and parameters, for every
// strategy at W = 1, 2, 3 (HYBRID at W = 4 with shard groups of 2), SGD and Adam, a frozen
// unit, mixed precision, no_sync and gradient accumulation, and clip_grad_norm_.
// cuda_offload_test.cc counts the device memory it saves on cuda:0.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/base/names.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/testing/parity_testing.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// What one training run produced, per step and at the end.
struct TrainingRun {
  std::vector<at::Tensor> losses;
  std::vector<at::Tensor> grads;             // every flat shard's .grad, per step, in unit order
  std::vector<at::Tensor> norms;             // clip_grad_norm_'s totals, when clipping
  std::map<std::string, at::Tensor> params;  // cleaned FQN -> final full value
};

template <typename Net>
using Check = std::function<void(FullyShardedDataParallelImpl<Net>&)>;

// kSteps steps of Net on this rank's share of the batch; `check` runs after each
// backward (before the optimizer step), `clip` > 0 clips to that norm.
template <typename Net>
TrainingRun train(const std::shared_ptr<Communicator>& comm,
                  const FullyShardedDataParallelOptions& options, bool adam,
                  const Check<Net>& check = nullptr, double clip = 0,
                  const std::function<void(Net&)>& freeze = nullptr) {
  std::shared_ptr<Net> net = make<Net>();
  if (freeze) freeze(*net);
  FullyShardedDataParallel<Net> model(net, options);
  auto optimizer = make_optimizer(model->parameters(), adam);
  TrainingRun run;
  const int w = comm->world_size();
  for (int step = 0; step < kSteps; ++step) {
    model->module()->step = step;
    const Batch batch = Net::batch(step, kBatchPerRank * w);
    optimizer->zero_grad();
    const int64_t first = comm->rank() * kBatchPerRank;
    at::Tensor loss = Net::loss(model->forward(batch.input.narrow(0, first, kBatchPerRank)),
                                batch.target.narrow(0, first, kBatchPerRank));
    loss.backward();
    if (clip > 0) run.norms.push_back(model->clip_grad_norm_(clip));
    if (check) check(*model);
    for (const auto& unit : model->units()) {
      if (unit->handle() != nullptr && unit->handle()->sharded_flat_param().grad().defined()) {
        run.grads.push_back(unit->handle()->sharded_flat_param().grad().clone());
      }
    }
    optimizer->step();
    run.losses.push_back(loss.detach().clone());
  }
  auto summon = model->summon_full_params(SummonFullParamsOptions().writeback(false));
  for (const auto& item : model->named_parameters()) {
    run.params[clean_tensor_name(item.key())] = item.value().detach().clone();
  }
  return run;
}

void expect_identical(const TrainingRun& got, const TrainingRun& want) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (size_t i = 0; i < want.losses.size(); ++i) {
    EXPECT_TRUE(at::equal(got.losses[i], want.losses[i])) << "loss of step " << i;
  }
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < want.grads.size(); ++i) {
    EXPECT_TRUE(at::equal(got.grads[i], want.grads[i])) << "gradient #" << i;
  }
  ASSERT_EQ(got.norms.size(), want.norms.size());
  for (size_t i = 0; i < want.norms.size(); ++i) {
    EXPECT_TRUE(at::equal(got.norms[i], want.norms[i])) << "norm of step " << i;
  }
  ASSERT_EQ(got.params.size(), want.params.size());
  for (const auto& [fqn, value] : want.params) {
    EXPECT_TRUE(at::equal(got.params.at(fqn), value)) << fqn;
  }
}

// After backward with offload: every shard and its gradient on the host, each flat
// parameter's handle offloading; NO_SHARD computes on a device copy, not on the shard.
template <typename Net>
void expect_offloaded(FullyShardedDataParallelImpl<Net>& model) {
  for (const auto& unit : model.units()) {
    const FlatParamHandle* handle = unit->handle();
    if (handle == nullptr) continue;
    EXPECT_TRUE(handle->offloads_params()) << "unit '" << unit->fqn() << "'";
    EXPECT_TRUE(handle->sharded_flat_param().device().is_cpu());
    EXPECT_EQ(handle->state(), FlatParamState::kSharded) << "unit '" << unit->fqn() << "'";
    const at::Tensor& grad = handle->sharded_flat_param().grad();
    if (handle->sharded_flat_param().requires_grad()) {
      ASSERT_TRUE(grad.defined()) << "unit '" << unit->fqn() << "'";
      EXPECT_TRUE(grad.device().is_cpu());
      EXPECT_EQ(grad.numel(), handle->shard_numel());
    }
  }
}

FullyShardedDataParallelOptions options_for(const std::shared_ptr<Communicator>& comm,
                                            ShardingStrategy strategy) {
  FullyShardedDataParallelOptions options(comm);
  options.sharding_strategy(strategy);
  if (is_hybrid(strategy)) options.hybrid_shard_group_size(comm->world_size() == 4 ? 2 : 1);
  return options;
}

template <typename Net>
void expect_offload_identical(const std::shared_ptr<Communicator>& comm, ShardingStrategy strategy,
                              bool adam) {
  SCOPED_TRACE(::testing::Message()
               << sharding_strategy_name(strategy) << (adam ? ", Adam" : ", SGD")
               << ", W = " << comm->world_size());
  const FullyShardedDataParallelOptions options = options_for(comm, strategy);
  FullyShardedDataParallelOptions offload = options;
  offload.cpu_offload(CPUOffload(/*offload_params=*/true));
  const TrainingRun want = train<Net>(comm, options, adam);
  const TrainingRun got = train<Net>(comm, offload, adam, expect_offloaded<Net>);
  expect_identical(got, want);
}

class OffloadParityTest : public ::testing::TestWithParam<int> {};

TEST_P(OffloadParityTest, EveryStrategyTrainsBitIdenticallyWithAndWithoutOffload) {
  const int w = GetParam();
  on_ranks(w, [](std::shared_ptr<Communicator> comm) {
    for (bool adam : {false, true}) {
      for (ShardingStrategy strategy :
           {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
            ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
            ShardingStrategy::kHybridShardZero2}) {
        expect_offload_identical<NestedImpl>(comm, strategy, adam);
      }
      // Tied embedding in the root, a vocabulary W does not divide (padding).
      expect_offload_identical<TinyLmImpl>(comm, ShardingStrategy::kFullShard, adam);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, OffloadParityTest, ::testing::Values(1, 2, 3));

TEST(OffloadParity, HybridShardGroupsOfTwoAtW4) {
  on_ranks(4, [](std::shared_ptr<Communicator> comm) {
    for (ShardingStrategy strategy :
         {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
      expect_offload_identical<NestedImpl>(comm, strategy, /*adam=*/true);
    }
  });
}

TEST(OffloadParity, OffloadedTrainingMatchesTheSingleProcessReference) {
  for (bool adam : {false, true}) {
    const Reference want = reference<TinyLmImpl>(2, adam);
    on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
      expect_parity_on<TinyLmImpl>(
          comm, want, FullyShardedDataParallelOptions(comm).cpu_offload(CPUOffload(true)), adam);
    });
  }
}

TEST(OffloadParity, NoShardComputesOnADeviceCopyNotOnTheHostShard) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    for (bool offload : {false, true}) {
      FullyShardedDataParallel<NestedImpl> model(make<NestedImpl>(),
                                                 FullyShardedDataParallelOptions(comm)
                                                     .sharding_strategy(ShardingStrategy::kNoShard)
                                                     .cpu_offload(CPUOffload(offload)));
      const FlatParamHandle& handle = *model->units()[1]->handle();
      EXPECT_EQ(handle.state(), offload ? FlatParamState::kSharded : FlatParamState::kUnsharded);
      auto summon = model->summon_full_params(SummonFullParamsOptions().writeback(false));
      EXPECT_EQ(handle.original_params()[0].is_alias_of(handle.sharded_flat_param()), !offload);
    }
  });
}

// ---- Frozen parameters: a unit whose parameters are all frozen.

TEST(OffloadFrozen, AFrozenUnitStaysUnchangedAndTrainsTheRestIdentically) {
  const auto freeze_l1 = [](NestedImpl& net) {
    for (at::Tensor& p : net.l1->parameters()) p.set_requires_grad(false);
  };
  for (int w : {1, 2, 3}) {
    on_ranks(w, [&](std::shared_ptr<Communicator> comm) {
      for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
        SCOPED_TRACE(::testing::Message() << sharding_strategy_name(strategy) << ", W = " << w);
        const FullyShardedDataParallelOptions options = options_for(comm, strategy);
        FullyShardedDataParallelOptions offload = options;
        offload.cpu_offload(true);
        const Check<NestedImpl> frozen_has_no_grad =
            [](FullyShardedDataParallelImpl<NestedImpl>& m) {
              expect_offloaded(m);
              EXPECT_FALSE(m.units()[1]->handle()->sharded_flat_param().grad().defined());
            };
        const TrainingRun want =
            train<NestedImpl>(comm, options, /*adam=*/true, nullptr, 0, freeze_l1);
        const TrainingRun got =
            train<NestedImpl>(comm, offload, /*adam=*/true, frozen_has_no_grad, 0, freeze_l1);
        expect_identical(got, want);
        const auto initial = make<NestedImpl>();
        EXPECT_TRUE(at::equal(got.params.at("l1.weight"), initial->l1->module()->weight));
        EXPECT_FALSE(at::equal(got.params.at("l2.weight"), initial->l2->module()->weight));
      }
    });
  }
}

// Units mixing frozen and trainable parameters (a trainable and a frozen flat parameter
// each): both offloaded, the frozen one never given a gradient, training bit-identical.
TEST(OffloadFrozen, UnitsMixingFrozenAndTrainableParametersTrainIdentically) {
  for (int w : {1, 2, 3}) {
    on_ranks(w, [&](std::shared_ptr<Communicator> comm) {
      for (ShardingStrategy strategy :
           {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
            ShardingStrategy::kNoShard}) {
        SCOPED_TRACE(::testing::Message() << sharding_strategy_name(strategy) << ", W = " << w);
        const FullyShardedDataParallelOptions options = options_for(comm, strategy);
        FullyShardedDataParallelOptions offload = options;
        offload.cpu_offload(true);
        const Check<FrozenLmImpl> frozen_offloaded =
            [](FullyShardedDataParallelImpl<FrozenLmImpl>& m) {
              expect_offloaded(m);
              int mixed = 0;
              for (const auto& unit : m.units()) {
                if (unit->frozen_handles().empty()) continue;
                ASSERT_EQ(unit->frozen_handles().size(), 1u);
                const FlatParamHandle* frozen = unit->frozen_handles().front();
                ++mixed;
                EXPECT_TRUE(frozen->offloads_params()) << "unit '" << unit->fqn() << "'";
                EXPECT_TRUE(frozen->sharded_flat_param().device().is_cpu());
                EXPECT_FALSE(frozen->sharded_flat_param().grad().defined());
              }
              EXPECT_EQ(mixed, 3);  // the root and both blocks
            };
        const TrainingRun want = train<FrozenLmImpl>(comm, options, /*adam=*/true);
        const TrainingRun got = train<FrozenLmImpl>(comm, offload, /*adam=*/true, frozen_offloaded);
        expect_identical(got, want);
      }
    });
  }
}

// ---- Mixed precision, gradient clipping, no_sync and accumulation.

TEST(OffloadFeatures, MixedPrecisionIsBitIdentical) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard,
                                      ShardingStrategy::kHybridShard}) {
      SCOPED_TRACE(sharding_strategy_name(strategy));
      FullyShardedDataParallelOptions options = options_for(comm, strategy);
      options.mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
      FullyShardedDataParallelOptions offload = options;
      offload.cpu_offload(true);
      const TrainingRun want = train<TinyLmImpl>(comm, options, /*adam=*/true);
      const TrainingRun got =
          train<TinyLmImpl>(comm, offload, /*adam=*/true, expect_offloaded<TinyLmImpl>);
      expect_identical(got, want);
    }
  });
}

TEST(OffloadFeatures, ClipGradNormIsBitIdentical) {
  for (int w : {1, 2, 3}) {
    on_ranks(w, [&](std::shared_ptr<Communicator> comm) {
      for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
        for (double clip : {0.05, 1e3}) {  // clips; does not clip
          SCOPED_TRACE(::testing::Message() << sharding_strategy_name(strategy) << ", W = " << w
                                            << ", max_norm " << clip);
          const FullyShardedDataParallelOptions options = options_for(comm, strategy);
          FullyShardedDataParallelOptions offload = options;
          offload.cpu_offload(true);
          const TrainingRun want = train<NestedImpl>(comm, options, /*adam=*/false, nullptr, clip);
          const TrainingRun got =
              train<NestedImpl>(comm, offload, /*adam=*/false, expect_offloaded<NestedImpl>, clip);
          ASSERT_EQ(got.norms.size(), static_cast<size_t>(kSteps));
          EXPECT_GT(got.norms[0].item<float>(), 0.05f);  // the small max_norm does clip
          expect_identical(got, want);
        }
      }
    });
  }
}

// One no_sync micro-batch, then a synced one, then a second backward without zeroing:
// the host gradient accumulates exactly as the device one does.
TEST(OffloadFeatures, NoSyncAndAccumulatedGradientsAreBitIdentical) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(sharding_strategy_name(strategy));
      std::vector<std::vector<at::Tensor>> grads;
      for (bool offload : {false, true}) {
        FullyShardedDataParallel<NestedImpl> model(
            make<NestedImpl>(), options_for(comm, strategy).cpu_offload(CPUOffload(offload)));
        const at::Tensor x = inputs(comm->rank(), kBatchPerRank);
        {
          auto scope = model->no_sync();
          model->forward(x).pow(2).mean().backward();
        }
        model->forward(x * 2).pow(2).mean().backward();
        model->forward(x * 3).pow(2).mean().backward();
        std::vector<at::Tensor> mine;
        for (const auto& unit : model->units()) {
          mine.push_back(unit->handle()->sharded_flat_param().grad().clone());
        }
        grads.push_back(mine);
      }
      ASSERT_EQ(grads[0].size(), grads[1].size());
      for (size_t i = 0; i < grads[0].size(); ++i) {
        EXPECT_TRUE(at::equal(grads[1][i], grads[0][i])) << "unit #" << i;
      }
    }
  });
}

TEST(OffloadErrors, AUnitShardedOnConstructionWithoutOffloadIsNamed) {
  on_ranks(1, [](std::shared_ptr<Communicator> comm) {
    const FullyShardedDataParallelOptions scope_options(comm);
    std::shared_ptr<NestedImpl> net;
    {
      EnableWrap scope(scope_options, EnableWrapOptions().shard_on_construction(true));
      net = make<NestedImpl>();
    }
    EXPECT_THAT(
        [&] {
          FullyShardedDataParallel<NestedImpl> model(
              net, FullyShardedDataParallelOptions(comm).cpu_offload(true));
        },
        ThrowsMessage<c10::Error>(HasSubstr("with cpu_offload off, but this root has it on")));
  });
}

}  // namespace
}  // namespace fsdp
