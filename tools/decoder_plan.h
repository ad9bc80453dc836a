// fsdp_plan --config: the memory plan of a decoder fine-tune (models/memory_plan.h) from a
// Hugging Face config.json alone, before any weight is downloaded, for a world size,
// sharding strategy, precision, batch, context and the trainer's memory levers; and the
// smallest world size whose plan fits a memory per rank. The figures are those
// examples/llama:finetune prints before loading (its "memory plan:" line), except the
// runtime term, which the trainer measures and this assumes (kDefaultRuntimeBytes unless
// given). PyTorch: `accelerate estimate-memory` (weights x 4 for Adam, no sharding, no
// activations). Errors: c10::Error for a config the decoder refuses (config.h) or bad
// options.
#ifndef FSDP_TOOLS_DECODER_PLAN_H_
#define FSDP_TOOLS_DECODER_PLAN_H_

#include <cstdint>
#include <string>

#include "models/config.h"
#include "models/memory_plan.h"

namespace fsdp::tools {

// The largest world size the smallest-world-size search tries.
inline constexpr int64_t kMaxPlannedWorldSize = 65536;

// How the trainer builds the model's weights (examples/llama:finetune's flags).
struct DecoderWeights {
  // --lora_base_dtype=float32: a LoRA run's frozen base in the master dtype; false: in
  // the config's 16-bit dtype under bf16 mixed precision (Note [The frozen base of a LoRA
  // run] in examples/llama/finetune.cc), the adapters in fp32.
  bool lora_fp32_base = false;
  // --quantize=nf4: every layer's projections in NF4 (models::store_projections_nf4), as
  // for a bitsandbytes 4-bit config (DecoderConfig::load_in_4bit) without it.
  bool nf4 = false;
};

struct DecoderPlanReport {
  std::string source;  // the config.json's path
  models::DecoderConfig config;
  int64_t numel = 0;        // parameters, adapters included
  int64_t trainable = 0;    // of which train
  int64_t units = 0;        // FSDP units (the root, one or two per layer: options.decoder_units)
  int64_t nf4_modules = 0;  // projections stored in NF4
  c10::ScalarType base_dtype = c10::ScalarType::Float;  // the frozen weights' (LoRA)
  int64_t global_batch = 0, grad_accumulation_steps = 1;
  models::FinetunePlan plan;
  // A mixture-of-experts config: the same plan with the other decoder_units (what
  // experts_gathered_line compares).
  models::FinetunePlan other_units_plan;
  // With a memory per rank (> 0): the smallest world size whose plan's peak fits it (the
  // micro-batch shrinking with it; models::smallest_world_size), 0 when none up to
  // kMaxPlannedWorldSize does.
  int64_t memory_per_rank = 0;
  int64_t smallest_world_size = 0;
  models::FinetunePlan smallest_plan;
};

// The plan of `config` (read from `source`), its weights built as `weights` says (a LoRA
// run's frozen base in options.save_dtype(), the folder's dtype, where the trainer keeps
// it). `options.micro_batch` is derived (models::micro_batch_of); `options.trained().lora_targets`
// empty with a LoRA rank: the family's default (lora_targets.h). The smallest world size is
// searched among those the trainer takes (models::smallest_world_size). Throws c10::Error
// for NF4 (or a 4-bit config) without LoRA: a 4-bit base cannot train.
DecoderPlanReport make_decoder_report(const models::DecoderConfig& config,
                                      const std::string& source,
                                      models::FinetunePlanOptions options,
                                      const DecoderWeights& weights, int64_t global_batch,
                                      int64_t grad_accumulation_steps, int64_t memory_per_rank);

std::string to_table(const DecoderPlanReport& report);
std::string to_json(const DecoderPlanReport& report);

}  // namespace fsdp::tools

#endif  // FSDP_TOOLS_DECODER_PLAN_H_
