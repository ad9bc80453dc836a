// What one rank of a decoder fine-tune holds, planned before any weight is read: the
// sharded parameters, gradients and optimizer state, the units gathered at the step's
// peak, the activations of a micro-batch, the process itself and the saving of the
// result, summed into the peak resident set the process will reach. The fine-tune trainer
// (examples/llama/finetune.cc) prints it and stops before loading when it exceeds the
// memory the process may use; `fsdp_plan --config` prints it from a config.json alone and
// finds the smallest world size that fits a memory per rank.
//
//   const DecoderConfig config = load_decoder_config(dir + "/config.json");
//   auto net = std::make_shared<CausalLMImpl>(config, at::TensorOptions().device(c10::kMeta));
//   FinetunePlan plan = plan_finetune(config, plan_units(*net),
//                                     FinetunePlanOptions().world_size(8).micro_batch(4));
//   plan.peak_bytes;   // the largest resident set of a rank
//
// Units: bytes. Threading: pure functions. Errors: c10::Error for bad options (as
// fsdp::plan_memory). PyTorch has no counterpart; `accelerate estimate-memory` answers
// roughly (weights x 4 for Adam, no sharding, no activations) what plan_finetune answers
// per rank.
#ifndef FSDP_MODELS_MEMORY_PLAN_H_
#define FSDP_MODELS_MEMORY_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>
#include <torch/arg.h>

#include "fsdp/core/memory_plan.h"
#include "models/config.h"
#include "models/decoder.h"

namespace fsdp::models {

// Which of the decoder's weights train: all of them, or LoRA adapters on `lora_targets`
// (module names as lora_targets.h spells them) with every base weight frozen.
struct TrainedWeights {
  int64_t lora_rank = 0;                  // 0: full fine-tuning
  std::vector<std::string> lora_targets;  // (adapter dropout is not planned: use 0)
};

// The activation memory of one forward and backward of the decoder and its next-token
// cross-entropy (a micro-batch of `batch` windows of `context` tokens; `packed_rows`: rows
// of several examples, models::PackedRowsScope), as LibTorch 2.11's
// autograd on the CPU holds it (Note [The decoder's activations] in memory_plan.cc):
// `saved_bytes` is what forward leaves saved for backward, `peak_bytes` the most held at
// once (the loss's gradients at the start of backward, or a recomputed layer with
// `checkpoint_layers`). With `router_aux_loss`, a mixture-of-experts decoder's
// load-balancing loss (CausalLMImpl::aux_loss) is part of the loss. Exact for the decoder
// of decoder.h on the CPU, the sparse layers' MoE blocks included; a CUDA device's
// attention kernels keep what their backward needs in other shapes. `units`: the
// decoder's (with DecoderUnits::kSublayer and `checkpoint_layers` a layer saves its norms'
// tensors and each sublayer's input, not the layer's input only). In bf16 and fp16 the
// experts' zero rows (Note [Expert rows in multiples of 8] in moe.cc) depend on the routing:
// `expert_padded_rows`, one count per layer (ExpertsImpl::padded_rows; 0 for a dense layer),
// gives how many there were; empty: the most there can be, so the figures are an upper
// bound for a mixture-of-experts decoder in bf16 or fp16. Raises c10::Error when
// `expert_padded_rows` is neither empty nor one per layer.
struct ActivationBytes {
  int64_t per_layer = 0;  // the largest layer's saved bytes (not checkpointed)
  int64_t saved_bytes = 0;
  int64_t peak_bytes = 0;
  // Parts of peak_bytes that a unit's backward frees (PlanUnit::activation_bytes): each
  // layer's saved bytes, and the head's (its input when it trains, the logits' soft cap,
  // the log-softmax and, without checkpointing, the loss's gradients).
  std::vector<int64_t> layers;
  // With DecoderUnits::kSublayer (else empty): the part of each layer's bytes that its
  // feed-forward block's unit frees (the norms after attention, the MLP or MoE block, the
  // router's logits); its attention's unit frees the rest.
  std::vector<int64_t> feed_forward;
  int64_t head = 0;
};
ActivationBytes decoder_activation_bytes(const DecoderConfig& config, int64_t batch,
                                         int64_t context, at::ScalarType compute_dtype,
                                         bool checkpoint_layers, const TrainedWeights& trained,
                                         bool packed_rows = false, bool router_aux_loss = false,
                                         DecoderUnits units = DecoderUnits::kLayer,
                                         const std::vector<int64_t>& expert_padded_rows = {});

// The FSDP units of a decoder built by decoder.h (each layer a unit, or each layer's
// attention and feed-forward block, and the embeddings and the head when untied; the root
// holding the rest), with the elements each will train and freeze, as
// FullyShardedDataParallel will flatten them: the root first, then the units in forward
// order. Reads shapes only, so `net` may be on the meta device, with LoRA adapters
// applied or not. `units`: as if `net` had been built with them (to plan both ways from
// one model); none: as it was built.
std::vector<PlanUnit> plan_units(CausalLMImpl& net);
std::vector<PlanUnit> plan_units(CausalLMImpl& net, DecoderUnits units);

struct FinetunePlanOptions {
  TORCH_ARG(int64_t, world_size) = 1;
  TORCH_ARG(ShardingStrategy, sharding_strategy) = ShardingStrategy::kFullShard;
  TORCH_ARG(int64_t, hybrid_shard_group_size) = 0;
  // The dtype of the shards and optimizer state (the master weights).
  TORCH_ARG(c10::ScalarType, dtype) = c10::ScalarType::Float;
  // Mixed precision: the dtype units are gathered and computed in (none: dtype);
  // gradients are reduced in `dtype`.
  TORCH_ARG(c10::optional<c10::ScalarType>, param_dtype);
  // Windows of `context` tokens a rank runs at once (the global batch / world size /
  // gradient accumulation steps).
  TORCH_ARG(int64_t, micro_batch) = 1;
  TORCH_ARG(int64_t, context) = 128;
  TORCH_ARG(bool, activation_checkpointing) = false;
  // Rows of a conversation file (a mask and rotary angles per row; see
  // decoder_activation_bytes).
  TORCH_ARG(bool, packed_rows) = false;
  // Mixture-of-experts families: the loss adds the router's load-balancing loss
  // (examples/llama:finetune's --router_aux_loss_coef > 0).
  TORCH_ARG(bool, router_aux_loss) = false;
  // The decoder's units (decoder.h), as plan_units gave them: where each layer's
  // activations are freed, and what a checkpointed layer saves.
  TORCH_ARG(DecoderUnits, decoder_units) = DecoderUnits::kLayer;
  TORCH_ARG(bool, cpu_offload) = false;
  // The device the step runs on. CPU: the plan is the process's resident set. CUDA: the
  // GPU's memory (tensors, as torch.cuda.max_memory_allocated counts them, plus
  // runtime_bytes for the CUDA context); with cpu_offload the shards, their gradients and
  // AdamW's state are host memory, reported as FinetunePlan::host_bytes and left out of the
  // peak. The activations are the CPU kernels' either way (a CUDA device's attention
  // kernels keep what their backward needs in other shapes).
  TORCH_ARG(c10::DeviceType, device) = c10::DeviceType::CPU;
  TORCH_ARG(PlanBackend, backend) = PlanBackend::kGloo;
  TORCH_ARG(TrainedWeights, trained) = TrainedWeights();
  // The process before any weight is read (code, libraries, the communicator, the token
  // files): the trainer measures it; see kDefaultRuntimeBytes.
  TORCH_ARG(int64_t, runtime_bytes) = 0;
  // The dtype the HF folder is written back in (the save casts each gathered unit).
  TORCH_ARG(c10::ScalarType, save_dtype) = c10::ScalarType::Float;
};

// The resident set of the CPU trainer before it reads weights, measured on Debian
// bookworm with LibTorch 2.11 (examples/llama:finetune, Gloo, a rank of 2; libtorch_cuda
// is not loaded on the CPU, fsdp/base/torch_compat_cuda.h): what fsdp_plan assumes when it
// cannot measure. A CUDA process holds more (libtorch_cuda, about 235 MiB, and its context).
inline constexpr int64_t kDefaultRuntimeBytes = int64_t{128} << 20;  // 122-128 MiB measured
// What a GPU holds before the first tensor, for a plan on CUDA: the CUDA context, cuBLAS's
// workspace and NCCL's buffers, which torch.cuda.max_memory_allocated leaves out and
// nvidia-smi shows (about 0.5 GiB on an H100 with CUDA 12-13; an estimate, not measured
// by fsdp).
inline constexpr int64_t kDefaultCudaRuntimeBytes = int64_t{512} << 20;

// Resident-set overhead of the allocators over the tensors' bytes (small blocks in the C
// library's arenas, page rounding), with large blocks held no higher than the tensors'
// peak (the trainers install fsdp/core/caching_cpu_allocator.h); tests/memory_plan_test.sh
// holds the plan within 15% of the measured peak.
inline constexpr double kAllocatorOverhead = 0.05;

struct FinetunePlan {
  FinetunePlanOptions options;
  MemoryPlan step;  // the training step (fsdp::plan_memory), activations included
  ActivationBytes activations;
  int64_t parameters = 0;        // sharded flat parameters (trainable and frozen)
  int64_t gradients = 0;         // their sharded gradients
  int64_t optimizer_state = 0;   // AdamW's two moments of the trainable shards
  int64_t gathered_units = 0;    // units unsharded at the step's peak, their gradients and
                                 // the communication buffers
  int64_t activations_held = 0;  // activations at the step's peak (of activations.peak_bytes)
  int64_t saving = 0;            // above the shards, gradients and state while saving:
                                 // the largest unit gathered, cast and written
  int64_t runtime = 0;           // options.runtime_bytes
  int64_t peak_bytes = 0;        // the largest resident set (on CUDA: GPU memory): runtime
                                 // + the larger of the step's peak and saving's, with
                                 // kAllocatorOverhead
  int64_t host_bytes = 0;        // CUDA with cpu_offload: the host's offloaded state
  // Mixture-of-experts configs: one sparse layer's routed experts as its unit gathers them
  // (E x 3 x I x H elements in the compute dtype), all E of them though each token uses
  // num_experts_per_tok; part of gathered_units whenever a sparse layer is. 0: dense.
  int64_t experts_per_layer = 0;
  // "parameters 1.2 GiB + gradients ... = peak 5.1 GiB per rank" (one line).
  std::string summary() const;
};

// For a mixture-of-experts config, one line on what gathering a sparse layer costs, and
// the peak of `other`, the same plan with the other decoder_units (examples/llama:finetune's
// --moe_units): "mixture of experts: each sparse layer's unit gathers all 128 experts,
// 1.13 GiB in BFloat16, though each token uses 8 of them; --moe_units=sublayer (attention
// and experts units of their own) would peak at 4.10 GiB instead of 5.12 GiB"; "" for a
// dense config.
std::string experts_gathered_line(const DecoderConfig& config, const FinetunePlan& plan,
                                  const FinetunePlan& other);

// The plan of one rank (every rank's is the same). Throws c10::Error on bad options.
FinetunePlan plan_finetune(const DecoderConfig& config, const std::vector<PlanUnit>& units,
                           const FinetunePlanOptions& options);

// The windows one rank runs at once: global_batch / world_size / grad_accumulation_steps,
// at least 1.
int64_t micro_batch_of(int64_t global_batch, int64_t world_size, int64_t grad_accumulation_steps);

// The smallest world size in [first, last] whose plan (`options` at that world size, its
// micro-batch from micro_batch_of) peaks at `budget` bytes or less, among those the
// fine-tune trainer takes: global_batch a multiple of world size x grad_accumulation_steps,
// and a multiple of options.hybrid_shard_group_size() when set. 0 when none does; else
// `*plan` (if not null) gets the fitting plan.
int64_t smallest_world_size(const DecoderConfig& config, const std::vector<PlanUnit>& units,
                            const FinetunePlanOptions& options, int64_t global_batch,
                            int64_t grad_accumulation_steps, int64_t budget, int64_t first,
                            int64_t last, FinetunePlan* plan = nullptr);

// "1.5 GiB", "812 MiB", "4 KiB", "12 B".
std::string format_bytes(int64_t bytes);

}  // namespace fsdp::models

#endif  // FSDP_MODELS_MEMORY_PLAN_H_
