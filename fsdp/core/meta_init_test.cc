// Initialisation where no process holds the whole model (issue 36, item 1): a model whose
// code creates its tensors on c10::kMeta, wrapped with any policy and strategy, holds only
// its shards; init_parameters fills them with exactly a one-process build's values
// (non-persistent buffers recomputed, tied weights one parameter, nothing left unwritten),
// and construction peaks at the shards plus one unit. See Note [Initialisation on the meta
// device] in fully_sharded.cc.
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include "fsdp/base/names.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/testing/meta_model.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/core/tracking_allocator.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Full parameters (cleaned FQNs, each tied parameter once) and buffers of a wrapped model.
std::map<std::string, at::Tensor> full_state(FullyShardedRoot& model) {
  std::map<std::string, at::Tensor> state;
  auto summon = model.summon_full_params(SummonFullParamsOptions().writeback(false));
  for (const auto& item : model.root_module().named_parameters()) {
    state[clean_tensor_name(item.key())] = item.value().detach().clone();
  }
  for (const auto& item : model.root_module().named_buffers()) {
    state[clean_tensor_name(item.key())] = item.value().clone();
  }
  return state;
}

std::map<std::string, at::Tensor> plain_state(const torch::nn::Module& module) {
  std::map<std::string, at::Tensor> state;
  for (const auto& item : module.named_parameters()) state[item.key()] = item.value().detach();
  for (const auto& item : module.named_buffers()) state[item.key()] = item.value();
  return state;
}

void expect_equal_states(const std::map<std::string, at::Tensor>& got,
                         const std::map<std::string, at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [fqn, value] : want) {
    ASSERT_TRUE(got.count(fqn)) << fqn;
    EXPECT_FALSE(got.at(fqn).is_meta()) << fqn;
    EXPECT_TRUE(at::equal(got.at(fqn), value)) << fqn;
  }
}

// Every strategy (HYBRID_SHARD with one rank per shard group), W = 1..3: the shards a
// meta-built model gets from init_parameters are a one-process build's, buffers included.
TEST(MetaInitTest, ShardsEqualAOneProcessBuildForEveryStrategy) {
  const std::map<std::string, at::Tensor> want = plain_state(*build_on_cpu());
  for (int world_size = 1; world_size <= 3; ++world_size) {
    on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      for (ShardingStrategy strategy :
           {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
            ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
        SCOPED_TRACE(::testing::Message()
                     << "W = " << world_size << ", " << sharding_strategy_name(strategy));
        auto lm = build_on_meta();
        FullyShardedDataParallel<MetaLmImpl> model(lm, meta_layer_policy(comm, strategy));
        std::vector<std::string> fqns;
        for (const auto& unit : model->units()) fqns.push_back(unit->fqn());
        EXPECT_THAT(fqns, ElementsAre("", "layers.0", "layers.1", "layers.2"));
        // Only shards exist; the original parameters hold no memory.
        for (const auto& unit : model->units()) {
          EXPECT_FALSE(unit->handle()->sharded_flat_param().is_meta());
          if (strategy == ShardingStrategy::kFullShard && world_size > 1) {
            for (const at::Tensor& p : unit->handle()->original_params()) {
              EXPECT_EQ(p.storage().nbytes(), 0u);
            }
          }
        }
        // Before init: NaN, never whatever the allocator returned (padding: zeros).
        for (const auto& unit : model->units()) {
          const FlatParamHandle& h = *unit->handle();
          const int64_t real =
              std::max<int64_t>(0, std::min(h.shard_numel(), h.numel() - h.shard_offset()));
          EXPECT_EQ(at::isnan(h.sharded_flat_param()).sum().item<int64_t>(), real);
        }
        EXPECT_TRUE(
            at::isnan(lm->layers[0]->as<MetaBlockImpl>()->rope->inv_freq).all().item<bool>());
        init_from_seed(*model);
        expect_equal_states(full_state(*model), want);
      }
    });
  }
}

// Tied weights stay one parameter (the root flattens embed.weight once; head.weight is
// the same tensor) with the whole gradient: a meta-built model trains bit-identically to
// the same model built on the CPU and wrapped the same way; ignored modules and frozen
// parameters too.
TEST(MetaInitTest, TrainsExactlyLikeAModelBuiltOnTheCpu) {
  for (int world_size = 2; world_size <= 3; ++world_size) {
    on_ranks(world_size, [&](std::shared_ptr<Communicator> comm) {
      const auto train = [&](bool meta) {
        std::shared_ptr<MetaLmImpl> lm = meta ? build_on_meta() : build_on_cpu();
        lm->layers[1]->as<MetaBlockImpl>()->up->weight.set_requires_grad(false);  // frozen
        auto options = meta_layer_policy(comm, ShardingStrategy::kFullShard)
                           .ignored_modules({lm->extra.get()});
        FullyShardedDataParallel<MetaLmImpl> model(lm, options);
        if (meta) init_from_seed(*model);
        std::vector<std::string> root_fqns;
        for (const FlatParamInfo& info : model->units()[0]->handle()->param_infos()) {
          root_fqns.push_back(info.fqn);
        }
        EXPECT_THAT(root_fqns, ElementsAre("embed.weight", "norm.weight"));
        EXPECT_TRUE(lm->head->weight.is_same(lm->embed->weight));
        EXPECT_EQ(model->units()[2]->frozen_handles().size(), 1u);
        EXPECT_FALSE(lm->extra->weight.is_meta());
        torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
        std::vector<float> losses;
        for (int step = 0; step < 2; ++step) {
          sgd.zero_grad();
          at::Tensor loss = MetaLmImpl::loss(
              *model, MetaLmImpl::tokens(step, 2 * world_size).narrow(0, 2 * comm->rank(), 2));
          loss.backward();
          sgd.step();
          losses.push_back(loss.item<float>());
        }
        return std::make_pair(losses, full_state(*model));
      };
      const auto cpu = train(false);
      const auto meta = train(true);
      EXPECT_EQ(meta.first, cpu.first);
      expect_equal_states(meta.second, cpu.second);
    });
  }
}

// The three ways a meta initialisation goes wrong, each an error naming the tensor:
// a buffer computed in the constructor not recomputed, a parameter init did not write,
// sync_module_states (nothing to broadcast).
TEST(MetaInitTest, WhatInitLeavesUnwrittenIsNamed) {
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    const auto options = meta_layer_policy(comm, ShardingStrategy::kFullShard);
    {
      FullyShardedDataParallel<MetaLmImpl> model(build_on_meta(), options);
      EXPECT_THAT(
          [&] {
            model->init_parameters([](torch::nn::Module& m) {
              if (m.as<RopeImpl>() == nullptr) reset_parameters_of(m);
            });
          },
          ThrowsMessage<c10::Error>(HasSubstr(
              "init_parameters: buffer 'layers.0.rope.inv_freq' was built on the meta device "
              "and the init function did not compute it on its module "
              "(fsdp::core_testing::RopeImpl)")));
    }
    {
      FullyShardedDataParallel<MetaLmImpl> model(build_on_meta(), options);
      EXPECT_THAT(
          [&] {
            model->init_parameters([](torch::nn::Module& m) {
              if (m.as<RmsNormImpl>() == nullptr) reset_parameters_of(m);
            });
          },
          ThrowsMessage<c10::Error>(HasSubstr(
              "init_parameters: parameter 'layers.0.norm1.weight' holds NaN after the init "
              "function ran on its module (fsdp::core_testing::RmsNormImpl)")));
    }
    EXPECT_THAT(
        [&] {
          FullyShardedDataParallel<MetaLmImpl>(
              build_on_meta(), FullyShardedDataParallelOptions(options).sync_module_states(true));
        },
        ThrowsMessage<c10::Error>(HasSubstr("sync_module_states with 'embed.weight' on the meta "
                                            "device: it has no values to broadcast yet")));
  });
}

// The peak of wrapping a meta-built model and initialising it, per rank: its shards and
// buffers, plus at most one unit's full parameters; a model built on the CPU holds all of
// it first.
TEST(MetaInitTest, ConstructionPeaksAtTheShardsPlusOneUnit) {
  constexpr int kWorld = 2;
  int64_t whole = 0;
  for (const at::Tensor& p : core_testing::unique_parameters(*build_on_cpu())) {
    whole += p.numel() * 4;
  }
  MemoryTracker tracker;
  on_ranks(kWorld, [&](std::shared_ptr<Communicator> comm) {
    MemoryTagGuard tag(comm->rank());
    const int64_t before = memory_allocated(comm->rank());
    reset_peak_memory_stats(comm->rank());
    FullyShardedDataParallel<MetaLmImpl> model(
        build_on_meta(), meta_layer_policy(comm, ShardingStrategy::kFullShard));
    init_from_seed(*model);
    const int64_t peak = max_memory_allocated(comm->rank()) - before;
    int64_t shards = 0, largest_unit = 0;
    for (const auto& unit : model->units()) {
      shards += unit->handle()->shard_numel() * 4;
      largest_unit = std::max(largest_unit, unit->handle()->padded_numel() * 4);
    }
    int64_t buffers = 0;
    for (const at::Tensor& b : model->buffers()) buffers += b.numel() * 4;
    std::cout << "rank " << comm->rank() << ": construction and init peak " << peak
              << " bytes; shards " << shards << ", buffers " << buffers << ", largest unit "
              << largest_unit << ", whole model " << whole << std::endl;
    EXPECT_EQ(memory_allocated(comm->rank()) - before, shards + buffers);
    EXPECT_GE(peak, shards + buffers);
    EXPECT_LE(peak, shards + buffers + largest_unit) << "whole model: " << whole;
    EXPECT_LT(peak, whole);
  });
}

}  // namespace
}  // namespace fsdp
