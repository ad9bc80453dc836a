// The ranks' agreement on flags: the first difference is named the same way on every
// rank, and ranks that agree pass.
#include "examples/trainer/trainer.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include <c10/core/Device.h>
#include <gtest/gtest.h>

#include "examples/trainer/run_flags.h"
#include "fsdp/comm/fake.h"

namespace fsdp::examples {
namespace {

TEST(FlagDifferenceTest, TheFirstDifferentFlagIsNamedWithBothValues) {
  const std::vector<FlagValue> zero = {{"lr", "0.001"}, {"steps", "20"}};
  EXPECT_EQ(flag_difference({zero, zero, zero}), "");
  EXPECT_EQ(flag_difference({zero}), "");
  EXPECT_EQ(flag_difference({zero, zero, {{"lr", "0.001"}, {"steps", "40"}}}),
            "rank 2 was started with --steps=40 but rank 0 with --steps=20; start every rank "
            "with the same flags");
  EXPECT_EQ(flag_difference({zero, {{"lr", "0.002"}, {"steps", "40"}}}),
            "rank 1 was started with --lr=0.002 but rank 0 with --lr=0.001; start every rank "
            "with the same flags");
  EXPECT_EQ(flag_difference({zero, {{"lr", "0.001"}}}),
            "rank 1 runs a program with 1 flags but rank 0 one with 2; start every rank from "
            "the same binary");
  EXPECT_EQ(flag_difference({zero, {{"lr", "0.001"}, {"width", "20"}}}),
            "rank 1 has flag --width where rank 0 has --steps; start every rank from the same "
            "binary");
}

TEST(FlagDifferenceTest, TheProgramsFlagsAreItsOwnWithTheirValues) {
  absl::SetFlag(&FLAGS_steps, 17);
  const std::vector<FlagValue> flags = program_flags();
  EXPECT_NE(std::find(flags.begin(), flags.end(), FlagValue{"steps", "17"}), flags.end());
  EXPECT_NE(std::find(flags.begin(), flags.end(), FlagValue{"sharding_strategy", "full_shard"}),
            flags.end());
  for (const FlagValue& flag : flags) {
    EXPECT_NE(flag.name, "flagfile") << "absl's own";
    EXPECT_NE(flag.name, "world_size") << "how many ranks to start";
  }
  EXPECT_TRUE(
      std::is_sorted(flags.begin(), flags.end(),
                     [](const FlagValue& a, const FlagValue& b) { return a.name < b.name; }));
}

// Ranks as threads share the flags, so they agree: every rank passes (the difference on
// another rank is tests/trainer_inputs_test.sh's, with processes).
TEST(FlagDifferenceTest, RanksThatAgreePass) {
  FakeWorld::run(FakeWorld::create(3), [](Communicator& comm) {
    EXPECT_NO_THROW(check_same_flags(comm, c10::Device(c10::kCPU)));
  });
}

}  // namespace
}  // namespace fsdp::examples
