#include "fsdp/base/shard_geometry.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp {
namespace {

TEST(ShardTest, ReferenceExamples) {
  EXPECT_EQ(shard_numel(120, 8), 15);
  EXPECT_EQ(shard_padding(120, 8), 0);
  EXPECT_EQ(shard_numel(9, 2), 5);
  EXPECT_EQ(shard_padding(9, 2), 1);
  EXPECT_EQ(shard_numel(12, 16), 1);
  EXPECT_EQ(shard_padding(12, 16), 4);
  EXPECT_EQ(shard_numel(0, 4), 0);
  EXPECT_THROW(shard_numel(5, 0), c10::Error);
  EXPECT_THROW(shard_numel(-1, 2), c10::Error);
}

TEST(ShardTest, PaddedNumelAndRanges) {
  EXPECT_EQ(padded_numel(9, 2), 10);
  EXPECT_EQ(padded_numel(13, 1), 13);
  EXPECT_EQ(ceil_div(0, 3), 0);
  EXPECT_EQ(ceil_div(7, 3), 3);
  const ShardRange first = shard_range(9, 2, 0);
  EXPECT_EQ(first.begin, 0);
  EXPECT_EQ(first.end, 5);
  const ShardRange last = shard_range(9, 2, 1);
  EXPECT_EQ(last.begin, 5);
  EXPECT_EQ(last.end, 10);
  EXPECT_EQ(last.numel(), 5);
  const ShardRange whole = shard_range(13, 1, 0);
  EXPECT_EQ(whole.begin, 0);
  EXPECT_EQ(whole.numel(), 13);
  EXPECT_THROW(shard_range(9, 2, 2), c10::Error);
  EXPECT_THROW(shard_range(9, 2, -1), c10::Error);
}

}  // namespace
}  // namespace fsdp
