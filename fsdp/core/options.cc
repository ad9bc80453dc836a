#include "fsdp/core/options.h"

#include "absl/strings/ascii.h"
#include "absl/strings/strip.h"
#include <torch/nn/modules/batchnorm.h>

namespace fsdp {

const char* sharding_strategy_name(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2:
      return "_HYBRID_SHARD_ZERO2";
  }
  return "unknown";
}

c10::optional<ShardingStrategy> parse_sharding_strategy(absl::string_view name) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
        ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
    const absl::string_view upper = sharding_strategy_name(strategy);
    if (name == upper || name == absl::AsciiStrToLower(absl::StripPrefix(upper, "_"))) {
      return strategy;
    }
  }
  return c10::nullopt;
}

bool is_hybrid(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kHybridShard ||
         strategy == ShardingStrategy::kHybridShardZero2;
}

bool reshards_after_forward(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard;
}

bool is_batch_norm(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module) != nullptr;
}

}  // namespace fsdp
