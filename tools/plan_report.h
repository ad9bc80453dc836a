// What `fsdp_plan` prints: a wrap plan's units with their shards at a world size, and
// each sharding strategy's per-rank plan of one step (fsdp/core/memory_plan.h, the formula
// the runtime checks itself against; REFERENCE §3-5a). Kept apart from main() so the
// numbers are unit-tested.
#ifndef FSDP_TOOLS_PLAN_REPORT_H_
#define FSDP_TOOLS_PLAN_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/core/memory_plan.h"
#include "fsdp/wrap/plan.h"

namespace fsdp::tools {

// One sharding strategy's per-rank plan of one step (forward, backward, optimizer step).
struct StrategyCost {
  std::string strategy;            // "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"
  int64_t model_state_bytes = 0;   // the plan's peak (MemoryPlan::peak_bytes)
  double wire_bytes_per_step = 0;  // bytes this rank sends (MemoryPlan::bytes_sent)
  MemoryPlan plan;
};

struct PlanReport {
  WrapPlan plan;
  int64_t world_size = 1;
  // FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, then HYBRID_SHARD if the options give a shard
  // group size.
  std::vector<StrategyCost> costs;
};

// plan_memory (fsdp/core/memory_plan.h) of the plan's units (every parameter trainable,
// the root "" gathered first) at `world_size` for each strategy, with `options`' dtypes,
// optimizer, prefetching, offload and shard group size (its world size and strategy are
// replaced). Throws c10::Error if world_size < 1 or the shard group size does not divide
// it.
PlanReport make_report(WrapPlan plan, int64_t world_size, const MemoryPlanOptions& options = {});

// One JSON object: {"total_numel": N, "world_size": W, "units": [{"fqn": "", "numel": n,
// "shard_numel": s, "padding": p}, ...], "per_rank": {"FULL_SHARD":
// {"model_state_bytes": b, "wire_bytes_per_step": w, "terms": {"sharded_parameters": b,
// ...}, "at_peak": {...}, "traffic": {"all_gather_into_tensor": {"calls": n,
// "bytes_sent": b, "bytes_received": b}, ...}}, ...}}, units in pre-order; terms are each
// term's maximum over the step (memory_plan.h).
std::string to_json(const PlanReport& report);

// A human-readable table of the same, with byte figures also in MiB: the units, a summary
// line per strategy, and each strategy's plan (memory_plan_table).
std::string to_table(const PlanReport& report, const std::string& title);

}  // namespace fsdp::tools

#endif  // FSDP_TOOLS_PLAN_REPORT_H_
