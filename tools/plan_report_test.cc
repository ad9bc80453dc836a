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

TEST(PlanReportTest, StrategyCostsAreTheMemoryPlans) {
  const PlanReport report = make_report(three_units(), 2);
  // s = (5, 60), P = (10, 120); "b" has no parameters. fp32, Adam, BACKWARD_PRE.
  ASSERT_EQ(report.costs.size(), 3u);
  EXPECT_EQ(report.costs[0].strategy, "FULL_SHARD");
  // Backward of "a": 16 bytes x 65 sharded minus the gradients not reduced yet (4 x 65),
  // the root (10) and "a" (120) unsharded with their gradients (9, 120).
  EXPECT_EQ(report.costs[0].model_state_bytes, 4 * (65 + 130 + 10 + 9 + 120 + 120));
  EXPECT_EQ(report.costs[0].wire_bytes_per_step, 4.0 * (65 + 60 + 65));
  EXPECT_EQ(report.costs[1].strategy, "SHARD_GRAD_OP");
  EXPECT_EQ(report.costs[1].wire_bytes_per_step, 4.0 * 2 * 65);
  EXPECT_EQ(report.costs[2].strategy, "NO_SHARD");
  // The optimizer step: 16 bytes x 129 and Adam's two temporaries of the largest (120).
  EXPECT_EQ(report.costs[2].model_state_bytes, 16 * 129 + 2 * 4 * 120);
  // All-reduces of 9 and 120 elements: 2 (W - 1) ceil(n / W) x 4 bytes.
  EXPECT_EQ(report.costs[2].wire_bytes_per_step, 8.0 * (5 + 60));
  for (const StrategyCost& cost : report.costs) {
    EXPECT_EQ(cost.model_state_bytes, cost.plan.peak_bytes);
    EXPECT_EQ(cost.plan.options.world_size(), 2);
  }
}

TEST(PlanReportTest, HybridAndOptionsReachThePlan) {
  const PlanReport report = make_report(
      three_units(), 4,
      MemoryPlanOptions().hybrid_shard_group_size(2).optimizer(OptimizerSpec::sgd(false)));
  ASSERT_EQ(report.costs.size(), 4u);
  EXPECT_EQ(report.costs[3].strategy, "HYBRID_SHARD");
  EXPECT_EQ(report.costs[3].plan.term_bytes(PlanTerm::kOptimizerState), 0);
  // F = 2: all-gathers 5 + 60 + 60, reduce-scatters 5 + 60; R = 2: all-reduces of the
  // shards, 2 ceil(5 / 2) + 2 ceil(60 / 2).
  EXPECT_EQ(report.costs[3].wire_bytes_per_step, 4.0 * (125 + 65 + 6 + 60));
  EXPECT_THROW(make_report(three_units(), 3, MemoryPlanOptions().hybrid_shard_group_size(2)),
               c10::Error);
}

TEST(PlanReportTest, OneRankSendsNothing) {
  const PlanReport report = make_report(three_units(), 1);
  for (const StrategyCost& cost : report.costs) EXPECT_EQ(cost.wire_bytes_per_step, 0);
  EXPECT_EQ(report.costs[0].model_state_bytes, 16 * 129 + 2 * 4 * 120);
  EXPECT_THROW(make_report(three_units(), 0), c10::Error);
}

TEST(PlanReportTest, JsonHasUnitsInOrderWithShardsAndThePlans) {
  const std::string json = to_json(make_report(three_units(), 2));
  EXPECT_THAT(json,
              HasSubstr("{\"total_numel\": 129, \"world_size\": 2, \"units\": ["
                        "{\"fqn\": \"\", \"numel\": 9, \"shard_numel\": 5, \"padding\": 1}, "
                        "{\"fqn\": \"a\", \"numel\": 120, \"shard_numel\": 60, \"padding\": 0}, "
                        "{\"fqn\": \"b\", \"numel\": 0, \"shard_numel\": 0, \"padding\": 0}], "
                        "\"per_rank\": {\"FULL_SHARD\": {\"model_state_bytes\": 1816, "
                        "\"wire_bytes_per_step\": 760, \"terms\": {\"sharded_parameters\": 260, "));
  EXPECT_THAT(json, HasSubstr("\"traffic\": {\"all_gather_into_tensor\": {\"calls\": 3, "
                              "\"bytes_sent\": 500, \"bytes_received\": 500}, "
                              "\"reduce_scatter_tensor\": {\"calls\": 2, \"bytes_sent\": 260, "
                              "\"bytes_received\": 260}}}, \"SHARD_GRAD_OP\""));
}

TEST(PlanReportTest, TableNamesTheRootAndTheStrategies) {
  const std::string table = to_table(make_report(three_units(), 2), "title");
  EXPECT_THAT(table, HasSubstr("(root)"));
  EXPECT_THAT(table, HasSubstr("total_numel 129 in 3 units, world_size 2"));
  EXPECT_THAT(table, HasSubstr("SHARD_GRAD_OP"));
  EXPECT_THAT(table, HasSubstr("optimizer_state"));
  EXPECT_THAT(table, HasSubstr("(activations not planned)"));
}

}  // namespace
}  // namespace fsdp::tools
