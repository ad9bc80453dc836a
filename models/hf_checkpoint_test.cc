#include "models/hf_checkpoint.h"

#include <string>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp::models {
namespace {

TEST(ParseShardSizeTest, TransformersUnits) {
  EXPECT_EQ(parse_shard_size("20000"), 20000);
  EXPECT_EQ(parse_shard_size("20KB"), 20000);
  EXPECT_EQ(parse_shard_size("5MB"), 5000000);
  EXPECT_EQ(parse_shard_size("5GB"), 5000000000);
  EXPECT_EQ(parse_shard_size("1KiB"), 1024);
  EXPECT_EQ(parse_shard_size("3MiB"), 3 * 1048576);
  EXPECT_EQ(parse_shard_size("2GiB"), 2147483648);
}

TEST(ParseShardSizeTest, BadValuesNameTheFlag) {
  for (const std::string bad : {"", "0", "-5", "5TB", "GB", "1.5GB", "99999999999GiB"}) {
    try {
      parse_shard_size(bad);
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const c10::Error& e) {
      EXPECT_EQ(std::string(e.what_without_backtrace()),
                "--max_shard_size=" + bad +
                    ": expected a positive size in bytes, or with KB, MB, GB, KiB, MiB or GiB "
                    "(e.g. 5GB)");
    }
  }
}

}  // namespace
}  // namespace fsdp::models
