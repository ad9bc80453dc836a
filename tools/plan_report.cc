#include "tools/plan_report.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <c10/util/Exception.h>

#include "fsdp/base/shard_geometry.h"

namespace fsdp::tools {
namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      absl::StrAppend(&out, "\\", std::string(1, c));
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
    } else {
      out.push_back(c);
    }
  }
  return out + "\"";
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

}  // namespace

PlanReport make_report(WrapPlan plan, int64_t world_size, const MemoryPlanOptions& options) {
  TORCH_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  std::vector<PlanUnit> units;
  for (const PlannedUnit& unit : plan.units) {
    units.push_back({unit.fqn, unit.numel, 0, unit.fqn.empty()});
  }
  std::vector<ShardingStrategy> strategies = {
      ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard};
  if (options.hybrid_shard_group_size() > 0) {
    strategies.push_back(ShardingStrategy::kHybridShard);
  }
  PlanReport report{std::move(plan), world_size, {}};
  for (ShardingStrategy strategy : strategies) {
    MemoryPlanOptions planned = options;
    planned.world_size(world_size).sharding_strategy(strategy);
    MemoryPlan memory = plan_memory(units, planned);
    report.costs.push_back({sharding_strategy_name(strategy), memory.peak_bytes,
                            static_cast<double>(memory.bytes_sent()), std::move(memory)});
  }
  return report;
}

std::string to_json(const PlanReport& report) {
  std::vector<std::string> units;
  for (const PlannedUnit& unit : report.plan.units) {
    units.push_back(absl::StrFormat(
        "{\"fqn\": %s, \"numel\": %d, \"shard_numel\": %d, \"padding\": %d}", json_string(unit.fqn),
        unit.numel, shard_numel(unit.numel, report.world_size),
        shard_padding(unit.numel, report.world_size)));
  }
  std::vector<std::string> costs;
  for (const StrategyCost& cost : report.costs) {
    std::vector<std::string> terms, at_peak, traffic;
    for (int t = 0; t < kNumPlanTerms; ++t) {
      const char* name = plan_term_name(static_cast<PlanTerm>(t));
      terms.push_back(absl::StrFormat("\"%s\": %d", name, cost.plan.max_bytes[t]));
      at_peak.push_back(absl::StrFormat("\"%s\": %d", name, cost.plan.at_peak_bytes[t]));
    }
    for (int k = 0; k < kNumCollectiveKinds; ++k) {
      const CollectiveTraffic& t = cost.plan.traffic[k];
      if (t.calls == 0) continue;
      traffic.push_back(
          absl::StrFormat("\"%s\": {\"calls\": %d, \"bytes_sent\": %d, \"bytes_received\": %d}",
                          collective_name(static_cast<CollectiveKind>(k)), t.calls, t.bytes_sent,
                          t.bytes_received));
    }
    costs.push_back(absl::StrFormat(
        "%s: {\"model_state_bytes\": %d, \"wire_bytes_per_step\": %.0f, \"terms\": {%s}, "
        "\"at_peak\": {%s}, \"traffic\": {%s}}",
        json_string(cost.strategy), cost.model_state_bytes, cost.wire_bytes_per_step,
        absl::StrJoin(terms, ", "), absl::StrJoin(at_peak, ", "), absl::StrJoin(traffic, ", ")));
  }
  return absl::StrCat("{\"total_numel\": ", report.plan.total_numel,
                      ", \"world_size\": ", report.world_size, ", \"units\": [",
                      absl::StrJoin(units, ", "), "], \"per_rank\": {", absl::StrJoin(costs, ", "),
                      "}}\n");
}

std::string to_table(const PlanReport& report, const std::string& title) {
  std::string out = absl::StrCat(title, "\n\n");
  absl::StrAppendFormat(&out, "%4s  %-40s %14s %14s %8s\n", "unit", "fqn", "numel", "shard_numel",
                        "padding");
  int index = 0;
  for (const PlannedUnit& unit : report.plan.units) {
    absl::StrAppendFormat(&out, "%4d  %-40s %14d %14d %8d\n", index++,
                          unit.fqn.empty() ? "(root)" : unit.fqn, unit.numel,
                          shard_numel(unit.numel, report.world_size),
                          shard_padding(unit.numel, report.world_size));
  }
  absl::StrAppendFormat(&out, "\ntotal_numel %d in %d units, world_size %d\n\n",
                        report.plan.total_numel, report.plan.units.size(), report.world_size);
  absl::StrAppend(&out,
                  "Per rank, one step (forward, backward, optimizer step): peak = the plan's "
                  "peak of tracked memory\n(fsdp/core/memory_plan.h); wire = bytes sent.\n");
  absl::StrAppendFormat(&out, "%-14s %20s %12s %20s %12s\n", "strategy", "peak_bytes", "MiB",
                        "wire_bytes_per_step", "MiB");
  for (const StrategyCost& cost : report.costs) {
    absl::StrAppendFormat(&out, "%-14s %20d %12.2f %20.0f %12.2f\n", cost.strategy,
                          cost.model_state_bytes, mib(cost.model_state_bytes),
                          cost.wire_bytes_per_step, mib(cost.wire_bytes_per_step));
  }
  for (const StrategyCost& cost : report.costs) {
    absl::StrAppend(&out, "\n", memory_plan_table(cost.plan));
  }
  return out;
}

}  // namespace fsdp::tools
