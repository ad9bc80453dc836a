// Shard geometry of a flat parameter: how `numel` elements split over `world_size` ranks.
//
// Rank r owns chunk r of ceil(numel / world_size) elements of the flat parameter padded
// to shard_numel * world_size elements (PyTorch's FlatParamHandle._get_shard):
//
//   fsdp::shard_numel(9, 2);               // 5
//   fsdp::shard_padding(9, 2);             // 1 (padded_numel 10)
//   fsdp::shard_range(9, 2, /*rank=*/1);   // [5, 10): 4 real elements, then the padding
//
// Counts are elements, not bytes. Threading: pure functions. Errors: c10::Error for a
// negative numel, world_size < 1 or a rank outside [0, world_size).
#ifndef FSDP_BASE_SHARD_GEOMETRY_H_
#define FSDP_BASE_SHARD_GEOMETRY_H_

#include <cstdint>

namespace fsdp {

// ceil(numerator / denominator) for numerator >= 0 and denominator >= 1.
int64_t ceil_div(int64_t numerator, int64_t denominator);

// Elements of each rank's shard: ceil(numel / world_size). Examples: (120, 8) -> 15;
// (9, 2) -> 5; (12, 16) -> 1; (0, 4) -> 0.
int64_t shard_numel(int64_t numel, int64_t world_size);
// Elements of the padded flat parameter: shard_numel * world_size.
int64_t padded_numel(int64_t numel, int64_t world_size);
// Padding at the end of the flat parameter: padded_numel - numel. Examples: (120, 8) -> 0;
// (9, 2) -> 1; (12, 16) -> 4.
int64_t shard_padding(int64_t numel, int64_t world_size);

// A half-open range [begin, end) of elements of the padded flat parameter.
struct ShardRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t numel() const { return end - begin; }
};

// Rank `rank`'s shard: [rank * shard_numel, (rank + 1) * shard_numel). The last ranks'
// ranges may reach into the padding (or lie wholly in it).
ShardRange shard_range(int64_t numel, int64_t world_size, int64_t rank);

}  // namespace fsdp

#endif  // FSDP_BASE_SHARD_GEOMETRY_H_
