#include "fsdp/core/options.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

namespace fsdp {
namespace {

TEST(ShardingStrategyTest, ParsesPyTorchNamesAndFlagSpellings) {
  EXPECT_EQ(parse_sharding_strategy("FULL_SHARD"), ShardingStrategy::kFullShard);
  EXPECT_EQ(parse_sharding_strategy("SHARD_GRAD_OP"), ShardingStrategy::kShardGradOp);
  EXPECT_EQ(parse_sharding_strategy("NO_SHARD"), ShardingStrategy::kNoShard);
  EXPECT_EQ(parse_sharding_strategy("HYBRID_SHARD"), ShardingStrategy::kHybridShard);
  EXPECT_EQ(parse_sharding_strategy("_HYBRID_SHARD_ZERO2"), ShardingStrategy::kHybridShardZero2);
  EXPECT_EQ(parse_sharding_strategy("full_shard"), ShardingStrategy::kFullShard);
  EXPECT_EQ(parse_sharding_strategy("shard_grad_op"), ShardingStrategy::kShardGradOp);
  EXPECT_EQ(parse_sharding_strategy("no_shard"), ShardingStrategy::kNoShard);
  EXPECT_EQ(parse_sharding_strategy("hybrid_shard"), ShardingStrategy::kHybridShard);
  EXPECT_EQ(parse_sharding_strategy("hybrid_shard_zero2"), ShardingStrategy::kHybridShardZero2);
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
        ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
    EXPECT_EQ(parse_sharding_strategy(sharding_strategy_name(strategy)), strategy)
        << sharding_strategy_name(strategy);
  }
}

TEST(ShardingStrategyTest, RejectsOtherNames) {
  for (const char* name : {"zero3", "", "Full_Shard", "full-shard", " full_shard", "FULL_SHARD ",
                           "HYBRID_SHARD_ZERO2", "_hybrid_shard_zero2", "unknown"}) {
    EXPECT_FALSE(parse_sharding_strategy(name).has_value()) << "'" << name << "'";
  }
}

TEST(ShardingStrategyTest, HybridAndReshardAfterForward) {
  // PyTorch: HYBRID_SHARD and _HYBRID_SHARD_ZERO2 replicate across groups; FULL_SHARD and
  // HYBRID_SHARD free the parameters after forward (RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES).
  EXPECT_FALSE(is_hybrid(ShardingStrategy::kFullShard));
  EXPECT_FALSE(is_hybrid(ShardingStrategy::kShardGradOp));
  EXPECT_FALSE(is_hybrid(ShardingStrategy::kNoShard));
  EXPECT_TRUE(is_hybrid(ShardingStrategy::kHybridShard));
  EXPECT_TRUE(is_hybrid(ShardingStrategy::kHybridShardZero2));
  EXPECT_TRUE(reshards_after_forward(ShardingStrategy::kFullShard));
  EXPECT_FALSE(reshards_after_forward(ShardingStrategy::kShardGradOp));
  EXPECT_FALSE(reshards_after_forward(ShardingStrategy::kNoShard));
  EXPECT_TRUE(reshards_after_forward(ShardingStrategy::kHybridShard));
  EXPECT_FALSE(reshards_after_forward(ShardingStrategy::kHybridShardZero2));
}

TEST(MixedPrecisionTest, DefaultsArePyTorchs) {
  const MixedPrecision mp;
  EXPECT_FALSE(mp.param_dtype().has_value());
  EXPECT_FALSE(mp.reduce_dtype().has_value());
  EXPECT_FALSE(mp.buffer_dtype().has_value());
  EXPECT_FALSE(mp.keep_low_precision_grads());
  EXPECT_FALSE(mp.cast_forward_inputs());
  EXPECT_TRUE(mp.cast_root_forward_inputs());
  // _module_classes_to_ignore = (_BatchNorm,): every BatchNorm stays in full precision.
  ASSERT_TRUE(mp.full_precision_modules());
  EXPECT_TRUE(mp.full_precision_modules()(*torch::nn::BatchNorm1d(4)));
  EXPECT_TRUE(mp.full_precision_modules()(*torch::nn::BatchNorm2d(4)));
  EXPECT_TRUE(mp.full_precision_modules()(*torch::nn::BatchNorm3d(4)));
  EXPECT_FALSE(mp.full_precision_modules()(*torch::nn::Linear(4, 4)));
}

TEST(OptionsTest, DefaultsArePyTorchs) {
  // CPUOffload(offload_params=False), and cpu_offload(true) reads as CPUOffload(true).
  EXPECT_FALSE(CPUOffload().offload_params());
  const CPUOffload from_bool = true;
  EXPECT_TRUE(from_bool.offload_params());
  // summon_full_params(recurse=True, writeback=True, rank0_only=False,
  // offload_to_cpu=False, with_grads=False).
  const SummonFullParamsOptions summon;
  EXPECT_TRUE(summon.recurse());
  EXPECT_TRUE(summon.writeback());
  EXPECT_FALSE(summon.rank0_only());
  EXPECT_FALSE(summon.offload_to_cpu());
  EXPECT_FALSE(summon.with_grads());
  // FullStateDictConfig(offload_to_cpu=False, rank0_only=False).
  EXPECT_FALSE(FullStateDictOptions().rank0_only());
  EXPECT_FALSE(FullStateDictOptions().offload_to_cpu());
  // A unit without overrides takes its root's settings.
  EXPECT_FALSE(UnitOptions().sharding_strategy().has_value());
  EXPECT_FALSE(UnitOptions().mixed_precision().has_value());
  EXPECT_FALSE(EnableWrapOptions().shard_on_construction());
}

}  // namespace
}  // namespace fsdp
