// The umbrella header compiles on its own and declares the public API.
#include "fsdp/fsdp.h"

#include <chrono>
#include <type_traits>

#include <gtest/gtest.h>

namespace {

TEST(UmbrellaHeaderTest, DeclaresThePublicApi) {
  static_assert(std::is_base_of_v<c10::Error, fsdp::CommError>, "CommError must be a c10::Error");
  // One timeout type in options.
  static_assert(std::is_same_v<std::decay_t<decltype(fsdp::GlooOptions().timeout())>,
                               std::chrono::milliseconds>);
  static_assert(std::is_same_v<std::decay_t<decltype(fsdp::LaunchOptions().grace_period())>,
                               std::chrono::milliseconds>);
  static_assert(std::is_same_v<std::decay_t<decltype(fsdp::NcclOptions().timeout())>,
                               std::chrono::milliseconds>);
  EXPECT_EQ(fsdp::shard_numel(9, 2), 5);
  EXPECT_EQ(fsdp::clean_tensor_name("_fsdp_wrapped_module.fc.weight"), "fc.weight");
}

}  // namespace
