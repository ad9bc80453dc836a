// The memory levers' command-line flags, defined once for both trainers
// (examples/gpt/train and examples/llama/finetune), which take them under the same names
// with the same meaning (levers.h: LeverFlags, lever_flag_error, lever_options):
//
//   --device=auto|cpu|cuda            Note [The compute device] (levers.h)
//   --mixed_precision=auto|bf16|pure_bf16|none
//   --cpu_offload                     CPUOffload(offload_params=true)
//   --sharding_strategy=full_shard|shard_grad_op|no_shard|hybrid_shard|hybrid_shard_zero2
//   --hybrid_shard_group_size=N       0: the ranks of one host
//   --activation_checkpointing        each unit recomputes its forward in backward
//   --grad_accumulation_steps=N       micro-batches per optimizer step, no_sync between
//
//   const fsdp::examples::LeverFlags levers = fsdp::examples::lever_flags_from_command_line();
#ifndef FSDP_EXAMPLES_TRAINER_LEVER_FLAGS_H_
#define FSDP_EXAMPLES_TRAINER_LEVER_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include <c10/core/ScalarType.h>

#include "examples/trainer/levers.h"

ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, mixed_precision);
ABSL_DECLARE_FLAG(bool, cpu_offload);
ABSL_DECLARE_FLAG(std::string, sharding_strategy);
ABSL_DECLARE_FLAG(int, hybrid_shard_group_size);
ABSL_DECLARE_FLAG(bool, activation_checkpointing);
ABSL_DECLARE_FLAG(int64_t, grad_accumulation_steps);

namespace fsdp::examples {

// The flags' values (after absl::ParseCommandLine).
LeverFlags lever_flags_from_command_line();

// Sets --device to cpu or cuda and --mixed_precision to bf16, pure_bf16 or none, as
// resolve_device and resolve_mixed_precision (levers.h) say for `cuda_devices` visible
// devices and checkpoint weights of dtype `weights`. Call after the flags were checked,
// before the ranks start (a self-launched rank resolves them again to the same values).
void resolve_lever_flags(int cuda_devices, at::ScalarType weights = at::kFloat);

// Whether flag `name` was given on the command line (or in a --flagfile).
bool specified_on_command_line(const std::string& name);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_TRAINER_LEVER_FLAGS_H_
