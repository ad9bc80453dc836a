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

PlanReport make_report(WrapPlan plan, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  const int64_t w = world_size;
  int64_t sum_shard = 0, sum_padded = 0, max_padded = 0, sum_numel = 0, non_root_shard = 0;
  for (const PlannedUnit& unit : plan.units) {
    if (unit.numel == 0) continue;
    const int64_t s = shard_numel(unit.numel, w);
    sum_shard += s;
    sum_padded += padded_numel(unit.numel, w);
    max_padded = std::max(max_padded, s * w);
    sum_numel += unit.numel;
    if (!unit.fqn.empty()) non_root_shard += s;
  }
  PlanReport report{std::move(plan), world_size, {}};
  report.costs = {
      {"FULL_SHARD", 16 * sum_shard + 8 * max_padded,
       4.0 * (w - 1) * (2 * sum_shard + non_root_shard)},
      {"SHARD_GRAD_OP", 16 * sum_shard + 4 * sum_padded + 4 * max_padded,
       4.0 * (w - 1) * 2 * sum_shard},
      {"NO_SHARD", 16 * sum_numel, 8.0 * (w - 1) * sum_numel / w},
  };
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
    costs.push_back(absl::StrFormat(
        "%s: {\"model_state_bytes\": %d, \"wire_bytes_per_step\": %.0f}",
        json_string(cost.strategy), cost.model_state_bytes, cost.wire_bytes_per_step));
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
                  "Per rank, one step, fp32 parameters and gradients with Adam: model state "
                  "= 16 bytes per sharded element\n+ the unsharded working set (largest unit "
                  "and its gradient; all units for SHARD_GRAD_OP); wire = bytes sent.\n");
  absl::StrAppendFormat(&out, "%-14s %20s %12s %20s %12s\n", "strategy", "model_state_bytes", "MiB",
                        "wire_bytes_per_step", "MiB");
  for (const StrategyCost& cost : report.costs) {
    absl::StrAppendFormat(&out, "%-14s %20d %12.2f %20.0f %12.2f\n", cost.strategy,
                          cost.model_state_bytes, mib(cost.model_state_bytes),
                          cost.wire_bytes_per_step, mib(cost.wire_bytes_per_step));
  }
  return out;
}

}  // namespace fsdp::tools
