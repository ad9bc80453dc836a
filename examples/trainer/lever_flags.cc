#include "examples/trainer/lever_flags.h"

#include "absl/flags/flag.h"
#include "absl/flags/internal/private_handle_accessor.h"
#include "absl/flags/reflection.h"

ABSL_FLAG(std::string, device, "auto",
          "auto: CUDA when this process sees a CUDA device, else the CPU; cpu (Gloo); cuda "
          "(rank r on cuda:LOCAL_RANK, NCCL, one rank per device)");
ABSL_FLAG(std::string, mixed_precision, "auto",
          "auto (bf16 on CUDA or for a 16-bit checkpoint, else none), bf16, pure_bf16 or "
          "none; bf16: parameters all-gathered and run in bfloat16 (param_dtype), gradients "
          "reduced in float32 (reduce_dtype), fp32 master shards and AdamW state; pure_bf16: "
          "parameters, gradients and AdamW state all bfloat16; none: float32 throughout");
ABSL_FLAG(bool, cpu_offload, false,
          "keep the parameter shards, their gradients and the AdamW state in (pinned, on CUDA) "
          "host memory and step the optimizer on the CPU (PyTorch's "
          "CPUOffload(offload_params=True)); the device holds only the units in flight");
ABSL_FLAG(std::string, sharding_strategy, "full_shard",
          "full_shard, shard_grad_op, no_shard, hybrid_shard or hybrid_shard_zero2");
ABSL_FLAG(int, hybrid_shard_group_size, 0,
          "ranks per shard group for the hybrid strategies (0: the ranks on this host, "
          "LOCAL_WORLD_SIZE)");
ABSL_FLAG(bool, activation_checkpointing, false,
          "each FSDP unit (transformer block) keeps only its inputs for backward and "
          "recomputes its forward there (fsdp::checkpoint): activation memory of one block "
          "instead of every block's, for about one more forward per step");
ABSL_FLAG(int64_t, grad_accumulation_steps, 1,
          "micro-batches per optimizer step: each rank's share of --batch_size is split into "
          "this many equal micro-batches run one after another, gradients accumulated "
          "without communication (no_sync) until the last; the loss is the big batch's");

namespace fsdp::examples {

LeverFlags lever_flags_from_command_line() {
  LeverFlags f;
  f.device = absl::GetFlag(FLAGS_device);
  f.mixed_precision = absl::GetFlag(FLAGS_mixed_precision);
  f.cpu_offload = absl::GetFlag(FLAGS_cpu_offload);
  f.sharding_strategy = absl::GetFlag(FLAGS_sharding_strategy);
  f.hybrid_shard_group_size = absl::GetFlag(FLAGS_hybrid_shard_group_size);
  f.activation_checkpointing = absl::GetFlag(FLAGS_activation_checkpointing);
  f.grad_accumulation_steps = absl::GetFlag(FLAGS_grad_accumulation_steps);
  return f;
}

void resolve_lever_flags(int cuda_devices, at::ScalarType weights) {
  absl::SetFlag(&FLAGS_device, resolve_device(absl::GetFlag(FLAGS_device), cuda_devices));
  absl::SetFlag(&FLAGS_mixed_precision,
                resolve_mixed_precision(absl::GetFlag(FLAGS_mixed_precision),
                                        absl::GetFlag(FLAGS_device), weights));
}

bool specified_on_command_line(const std::string& name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  // Abseil 20220623 has no public IsSpecifiedOnCommandLine; this is how its own usage code
  // asks.
  return flag != nullptr &&
         absl::flags_internal::PrivateHandleAccessor::IsSpecifiedOnCommandLine(*flag);
}

}  // namespace fsdp::examples
