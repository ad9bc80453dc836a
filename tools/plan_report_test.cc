#include "tools/plan_report.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace fsdp::tools {
namespace {

using ::testing::HasSubstr;

WrapPlan three_units() {
  WrapPlan plan;
  plan.units = {{0, "", 9, 9}, {1, "a", 120, 120}, {2, "b", 0, 0}};
  plan.total_numel = 129;
  return plan;
}

TEST(PlanReportTest, StrategyCostsFollowTheFormulas) {
  const PlanReport report = make_report(three_units(), 2);
  // s = (5, 60), P = (10, 120); "b" has no parameters.
  ASSERT_EQ(report.costs.size(), 3u);
  EXPECT_EQ(report.costs[0].strategy, "FULL_SHARD");
  EXPECT_EQ(report.costs[0].model_state_bytes, 16 * 65 + 8 * 120);
  EXPECT_EQ(report.costs[0].wire_bytes_per_step, 4.0 * (65 + 60 + 65));
  EXPECT_EQ(report.costs[1].strategy, "SHARD_GRAD_OP");
  EXPECT_EQ(report.costs[1].model_state_bytes, 16 * 65 + 4 * 130 + 4 * 120);
  EXPECT_EQ(report.costs[1].wire_bytes_per_step, 4.0 * 2 * 65);
  EXPECT_EQ(report.costs[2].strategy, "NO_SHARD");
  EXPECT_EQ(report.costs[2].model_state_bytes, 16 * 129);
  EXPECT_EQ(report.costs[2].wire_bytes_per_step, 8.0 * 129 / 2);
}

TEST(PlanReportTest, OneRankSendsNothing) {
  const PlanReport report = make_report(three_units(), 1);
  for (const StrategyCost& cost : report.costs) EXPECT_EQ(cost.wire_bytes_per_step, 0);
  EXPECT_EQ(report.costs[0].model_state_bytes, 16 * 129 + 8 * 120);
  EXPECT_THROW(make_report(three_units(), 0), c10::Error);
}

TEST(PlanReportTest, JsonHasUnitsInOrderWithShards) {
  EXPECT_EQ(to_json(make_report(three_units(), 2)),
            "{\"total_numel\": 129, \"world_size\": 2, \"units\": ["
            "{\"fqn\": \"\", \"numel\": 9, \"shard_numel\": 5, \"padding\": 1}, "
            "{\"fqn\": \"a\", \"numel\": 120, \"shard_numel\": 60, \"padding\": 0}, "
            "{\"fqn\": \"b\", \"numel\": 0, \"shard_numel\": 0, \"padding\": 0}], "
            "\"per_rank\": {\"FULL_SHARD\": {\"model_state_bytes\": 2000, "
            "\"wire_bytes_per_step\": 760}, \"SHARD_GRAD_OP\": {\"model_state_bytes\": 2040, "
            "\"wire_bytes_per_step\": 520}, \"NO_SHARD\": {\"model_state_bytes\": 2064, "
            "\"wire_bytes_per_step\": 516}}}\n");
}

TEST(PlanReportTest, TableNamesTheRootAndTheStrategies) {
  const std::string table = to_table(make_report(three_units(), 2), "title");
  EXPECT_THAT(table, HasSubstr("(root)"));
  EXPECT_THAT(table, HasSubstr("total_numel 129 in 3 units, world_size 2"));
  EXPECT_THAT(table, HasSubstr("SHARD_GRAD_OP"));
}

}  // namespace
}  // namespace fsdp::tools
