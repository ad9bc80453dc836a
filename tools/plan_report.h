// What `fsdp_plan` prints: a wrap plan's units with their shards at a world size, and
// the per-rank model-state memory and wire traffic each sharding strategy implies
// (REFERENCE §3-5). Kept apart from main() so the numbers are unit-tested.
#ifndef FSDP_TOOLS_PLAN_REPORT_H_
#define FSDP_TOOLS_PLAN_REPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/wrap/plan.h"

namespace fsdp::tools {

// Predicted per-rank figures for one sharding strategy, fp32 parameters and gradients,
// Adam (two fp32 states per element), one training step (forward + backward).
struct StrategyCost {
  std::string strategy;            // "FULL_SHARD", "SHARD_GRAD_OP" or "NO_SHARD"
  int64_t model_state_bytes = 0;   // peak: sharded states + unsharded working set
  double wire_bytes_per_step = 0;  // bytes this rank sends (ring collectives)
};

struct PlanReport {
  WrapPlan plan;
  int64_t world_size = 1;
  std::vector<StrategyCost> costs;  // FULL_SHARD, SHARD_GRAD_OP, NO_SHARD
};

// Model state (bytes), with s_i = shard_numel(numel_i, W), P_i = s_i * W over units with
// parameters:
//   FULL_SHARD     16 sum s_i + 4 max P_i (largest unit unsharded) + 4 max P_i (its grad)
//   SHARD_GRAD_OP  16 sum s_i + 4 sum P_i (all kept unsharded after forward) + 4 max P_i
//   NO_SHARD       16 sum numel_i
// Wire bytes per step (ring: an all-gather or reduce-scatter of a flat parameter sends
// (W - 1) s_i elements per rank; an all-reduce of N elements sends 2 (W - 1) N / W):
//   FULL_SHARD     4 (W - 1) (sum s_i [forward all-gathers] + sum over non-root s_i
//                  [backward all-gathers; the root is not resharded after forward]
//                  + sum s_i [reduce-scatters])
//   SHARD_GRAD_OP  4 (W - 1) (sum s_i + sum s_i)
//   NO_SHARD       4 * 2 (W - 1) sum numel_i / W
// Throws c10::Error if world_size < 1.
PlanReport make_report(WrapPlan plan, int64_t world_size);

// One JSON object: {"total_numel": N, "world_size": W, "units": [{"fqn": "", "numel": n,
// "shard_numel": s, "padding": p}, ...], "per_rank": {"FULL_SHARD":
// {"model_state_bytes": b, "wire_bytes_per_step": w}, ...}}, units in pre-order.
std::string to_json(const PlanReport& report);

// A human-readable table of the same, with byte figures also in MiB.
std::string to_table(const PlanReport& report, const std::string& title);

}  // namespace fsdp::tools

#endif  // FSDP_TOOLS_PLAN_REPORT_H_
