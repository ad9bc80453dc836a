// The GPT trainer's command line, checked before any rank starts or any file is touched.
//
//   fsdp::examples::TrainerFlags flags = ...;  // from absl flags (train.cc)
//   std::string error = fsdp::examples::flag_error(flags, fsdp::examples::this_machine());
//   if (!error.empty()) { std::cerr << "train: " << error << "\n"; return 2; }
//
// Each error is one line naming the flag, the value, what is allowed and why.
#ifndef FSDP_EXAMPLES_GPT_FLAGS_H_
#define FSDP_EXAMPLES_GPT_FLAGS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

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

struct TrainerFlags : LeverFlags {
  int world_size = 2;           // ranks this process starts (self-launch); 0: launched
  int launched_world_size = 0;  // WORLD_SIZE of fsdp_run/torchrun/...; 0: self-launch
  std::string policy = "transformer";
  // The trainer's defaults (train.cc).
  int64_t layers = 4, width = 128, heads = 4, context = 128, batch_size = 32, steps = 1200;
  double lr = 3e-3;
  int64_t warmup_steps = 50, log_interval = 10, eval_interval = 200, eval_batches = 8;
  int64_t sample_length = 300, checkpoint_interval = 200, timeout_s = 300;
  int64_t vocab_size = 256;  // an upper bound before the corpus is read (bytes)
  double peak_tflops = 0;    // 0: the table of mfu.cc
};

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

// "" if the flags are usable on `machine`, else one line saying why not. On CUDA (after
// resolve_device) a self-launched run needs a device per rank, and the host-memory bound
// below is not checked (device memory is what runs out; the caching allocator says so).
std::string flag_error(const TrainerFlags& flags, const MachineLimits& machine);

// The trainer's path flags.
struct PathFlags {
  std::string out_dir;         // metrics.csv, model.pt, memory_rank<R>.csv, .lock
  std::string checkpoint_dir;  // "": OUT_DIR/checkpoints
  std::string data_dir;        // the fortune files
};

// "" if --data_dir is a folder holding at least one fortune file and every fortune file
// in it can be opened, and --out_dir (and --checkpoint_dir, if given) is a folder that can
// be written, or that can be made; else one line naming the flag, the value, what is
// expected and what was found. A fortune file is an entry without an extension that is
// (or links to) a regular file; one whose type cannot be read (a dangling or looping link)
// counts as unreadable. An output folder is checked by making a uniquely named folder in
// it (or in its nearest existing ancestor) and removing it at once: nothing is left
// behind, root is not waved through as by access(), and ranks checking at once do not
// race.
std::string path_flag_error(const PathFlags& flags);

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

// The GPT binaries' shared flag parsing (train.cc and benchmarks/peer/gpt_fsdp.cc).

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

// A flag and the value it takes.
struct FlagValue {
  std::string name;
  std::string value;
  bool operator==(const FlagValue& other) const {
    return name == other.name && value == other.value;
  }
};

// The CUDA defaults of the flags for which `specified(name)` is false (not given on the
// command line), in the order to apply them: --world_size: one rank per device; --width
// 768, --layers 12, --heads 12, --context 256 (GPT-2 small's shape, with this corpus's
// context); --lr 6e-4 (GPT-3's 125M model, Brown et al. 2020, table 2.1); --batch_size 64
// sequences rounded up to a multiple of the world size (the launcher's, else --world_size
// as given or defaulted here); --checkpoint_interval 600 (a checkpoint is 1.5 GB at this
// size). `flags` holds the values as parsed. Pure.
std::vector<FlagValue> cuda_defaults(const TrainerFlags& flags, int cuda_devices,
                                     const std::function<bool(const std::string&)>& specified);

// Bytes one rank needs at least: AdamW model state (16 bytes a parameter, unsharded as a
// bound) and the attention scores and probabilities every layer keeps for backward
// (layers x micro-batch per rank x heads x context^2 x 8 bytes; one layer with
// activation checkpointing).
double lower_bound_bytes_per_rank(const TrainerFlags& flags);

}  // namespace fsdp::examples

#endif  // FSDP_EXAMPLES_GPT_FLAGS_H_
