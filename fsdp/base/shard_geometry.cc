#include "fsdp/base/shard_geometry.h"

#include <c10/util/Exception.h>

namespace fsdp {

int64_t ceil_div(int64_t numerator, int64_t denominator) {
  TORCH_INTERNAL_ASSERT(numerator >= 0 && denominator >= 1, "ceil_div(", numerator, ", ",
                        denominator, ")");
  return (numerator + denominator - 1) / denominator;
}

int64_t shard_numel(int64_t numel, int64_t world_size) {
  TORCH_CHECK(numel >= 0, "shard_numel: numel must be >= 0, got ", numel);
  TORCH_CHECK(world_size >= 1, "shard_numel: world_size must be >= 1, got ", world_size);
  return ceil_div(numel, world_size);
}

int64_t padded_numel(int64_t numel, int64_t world_size) {
  return shard_numel(numel, world_size) * world_size;
}

int64_t shard_padding(int64_t numel, int64_t world_size) {
  return padded_numel(numel, world_size) - numel;
}

ShardRange shard_range(int64_t numel, int64_t world_size, int64_t rank) {
  const int64_t chunk = shard_numel(numel, world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "shard_range: rank must be in [0, ", world_size,
              "), got ", rank);
  return {rank * chunk, (rank + 1) * chunk};
}

}  // namespace fsdp
