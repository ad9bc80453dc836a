// The trainers' shared flag checks and their meaning (examples/gpt:train and
// examples/llama:finetune, and benchmarks/peer/gpt_fsdp): the memory levers (LeverFlags;
// lever_flags.h defines them as command-line flags), what the machine allows, the compute
// device and mixed precision they resolve to, and the FSDP options they make.
//
//   const MachineLimits machine = this_machine();
//   std::string error = lever_flag_error(levers, world, self_launched, batch_size, machine);
//   if (error.empty()) error = output_dir_error("out_dir", out_dir, "metrics.csv goes there");
//   FullyShardedDataParallelOptions options = lever_options(comm, levers);
//
// Each error is one line naming the flag, the value, what is allowed and why. Pure
// functions unless they say otherwise; PyTorch: none (a trainer's command line).
#ifndef FSDP_EXAMPLES_TRAINER_LEVERS_H_
#define FSDP_EXAMPLES_TRAINER_LEVERS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include "fsdp/comm/communicator.h"
#include "fsdp/comm/launcher.h"
#include "fsdp/core/flat_param.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/options.h"

namespace fsdp::examples {

// The memory levers both trainers take (examples/gpt/train and examples/llama/finetune),
// under the same flag names with the same meaning (lever_flags.h defines the flags). See
// Note [The compute device] for device and mixed_precision.
struct LeverFlags {
  std::string device = "auto";  // auto, cpu or cuda
  // auto (bf16 on CUDA or for a 16-bit checkpoint, else none), bf16, pure_bf16 or none.
  std::string mixed_precision = "auto";
  bool cpu_offload = false;  // CPUOffload(offload_params=true)
  std::string sharding_strategy = "full_shard";
  int hybrid_shard_group_size = 0;        // 0: the ranks of one host (LOCAL_WORLD_SIZE)
  bool activation_checkpointing = false;  // each unit recomputes its forward in backward
  int64_t grad_accumulation_steps = 1;    // micro-batches per optimizer step
};

// "--name=value: expected what": the one line of every flag error.
template <typename T>
std::string bad_flag(const char* name, const T& value, const std::string& expected) {
  return absl::StrCat("--", name, "=", value, ": expected ", expected);
}

// What the machine allows.
struct MachineLimits {
  int cores = 1;
  int max_ranks = kMaxRanksPerCore;  // fsdp::max_ranks_per_node()
  int64_t available_bytes = 0;       // MemAvailable
  int cuda_devices = 0;              // fsdp::cuda_device_count()
  std::string why_no_cuda;           // the CUDA runtime's words when cuda_devices is 0
};

MachineLimits this_machine();

// /proc/meminfo's MemAvailable in bytes, or -1.
int64_t available_memory_bytes();

// "" if the levers are usable for a run of `world` (>= 1) ranks and a global batch of
// `batch_size` sequences on `machine`, else one line naming the flag, the value and what
// is allowed: device and mixed_precision values (cuda needs a visible device, and a
// `self_launched` run a device per rank), the strategy (hybrid included) and its group
// size (a divisor of `world`), grad_accumulation_steps >= 1, and the batch a positive
// multiple of world x grad_accumulation_steps (each rank's share split into equal
// micro-batches). Both trainers' flag checks call it.
std::string lever_flag_error(const LeverFlags& flags, int world, bool self_launched,
                             int64_t batch_size, const MachineLimits& machine);

// "" if `dir` can take a run's output, else one line naming --`flag`=`dir`: it, or
// else its nearest existing ancestor, must be a folder in which a folder can be made
// (`holds` says what goes there, for the message). That is tried by making a uniquely
// named folder and removing it at once: nothing is left behind, root is not waved
// through as by access(), and ranks checking at once do not race.
std::string output_dir_error(const char* flag, const std::string& dir, const char* holds);

// Note [The compute device]
// --device=auto trains on CUDA when this process sees a CUDA device (fsdp::
// cuda_device_count() > 0), else on the CPU; cpu and cuda force one (cuda without a device
// is a flag error naming the CUDA runtime's reason). On CUDA, rank r uses cuda:LOCAL_RANK
// (torchrun's convention) through FullyShardedDataParallelOptions::device_id, the ranks
// talk over NCCL, and --mixed_precision=auto means bf16. Flags the user did not set take
// the CUDA defaults of cuda_defaults below (a GPT-2-small-sized model); flags given
// always win, and the CPU defaults are TrainerFlags' own.

// "cpu" or "cuda": what --device=`requested` (auto, cpu, cuda) means with
// `cuda_devices` usable CUDA devices. Pure; call after flag_error accepted the flag.
std::string resolve_device(const std::string& requested, int cuda_devices);

// "bf16", "pure_bf16" or "none": what --mixed_precision=`requested` (auto, bf16,
// pure_bf16, none) means on `device` ("cpu" or "cuda") for weights of dtype `weights`
// (the checkpoint's; fp32 for a model the trainer initialises). auto is bf16 on CUDA or
// for 16-bit weights (bf16, fp16), else none. bf16 is FSDP's MixedPrecision with
// param_dtype bf16 (the all-gathers, forward and backward) and reduce_dtype fp32 (the
// gradient reduction); the sharded master parameters and AdamW's state stay fp32.
// pure_bf16: the parameters, their gradients and AdamW's state all in bf16 (no master
// copy: updates below bf16's resolution are lost). none: fp32 throughout. Pure.
std::string resolve_mixed_precision(const std::string& requested, const std::string& device,
                                    at::ScalarType weights = at::kFloat);

// "" if --`flag`=`value` names a sharding strategy the binary takes, by PyTorch's names:
// full_shard, shard_grad_op, no_shard and, with `allow_hybrid`, hybrid_shard and
// hybrid_shard_zero2; else the one-line flag error.
std::string sharding_strategy_error(const char* flag, const std::string& value, bool allow_hybrid);

// The strategy --`flag`=`value` names. Throws c10::Error with sharding_strategy_error's
// line if it names none the binary takes.
ShardingStrategy sharding_strategy_flag(const char* flag, const std::string& value,
                                        bool allow_hybrid);

// The compute device of --device once resolved ("cpu" or "cuda"): the CPU, or
// cuda:LOCAL_RANK (torchrun's convention; Note [The compute device]).
c10::Device compute_device(const std::string& device);

// FSDP's mixed precision for --mixed_precision once resolved ("none", "pure_bf16" or
// "bf16"): param_dtype bf16 (all-gathers, forward, backward) with reduce_dtype fp32 (the
// gradient reduction) for bf16, the sharded master parameters staying fp32; none
// otherwise (pure_bf16 is the model's own dtype: model_dtype).
c10::optional<MixedPrecision> mixed_precision_flag(const std::string& value);

// The dtype the trainer builds the model's parameters in for --mixed_precision once
// resolved: bf16 for pure_bf16, else fp32 (the master parameters).
at::ScalarType model_dtype(const std::string& mixed_precision);

// Ranks per shard group of the hybrid strategies: `flag` when positive, else the ranks of
// this host (LOCAL_WORLD_SIZE); 0 for the other strategies.
int hybrid_group_size(ShardingStrategy strategy, int flag);

// The FSDP options of the levers once resolved (device cpu or cuda, mixed_precision bf16,
// pure_bf16 or none): the strategy (hybrid with hybrid_group_size), device_id (the
// compute device), cpu_offload and mixed_precision. Throws c10::Error with the flag's
// line for a strategy it does not take.
FullyShardedDataParallelOptions lever_options(std::shared_ptr<Communicator> comm,
                                              const LeverFlags& flags);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_TRAINER_LEVERS_H_
