#include "tools/decoder_plan.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp/lora/lora.h"
#include "models/decoder.h"
#include "models/lora_targets.h"

namespace fsdp::tools {

DecoderPlanReport make_decoder_report(const models::DecoderConfig& config,
                                      const std::string& source,
                                      models::FinetunePlanOptions options,
                                      const DecoderWeights& weights, int64_t global_batch,
                                      int64_t grad_accumulation_steps, int64_t memory_per_rank) {
  TORCH_CHECK(global_batch >= 1 && grad_accumulation_steps >= 1,
              "expected a batch and gradient accumulation steps of at least 1, got ", global_batch,
              " and ", grad_accumulation_steps);
  models::TrainedWeights trained = options.trained();
  // A bitsandbytes 4-bit config.json: its folder holds the projections in NF4 (planned as
  // all of them: which ones a folder skips is in its tensors, not in the config).
  const bool nf4 = weights.nf4 || config.load_in_4bit;
  TORCH_CHECK(!nf4 || trained.lora_rank > 0,
              "NF4 freezes the base weights in 4 bits (QLoRA): give a LoRA rank too");
  DecoderPlanReport report;
  report.source = source;
  report.config = config;
  report.global_batch = global_batch;
  report.grad_accumulation_steps = grad_accumulation_steps;
  // The frozen base as the trainer builds it, the folder's dtype being the one it is
  // written back in (options.save_dtype()).
  report.base_dtype = trained.lora_rank > 0 && !weights.lora_fp32_base
                          ? models::lora_base_dtype(options.dtype(), options.save_dtype(),
                                                    options.param_dtype() == at::kBFloat16)
                          : options.dtype();
  // The decoder on the meta device: shapes only, as the trainer builds it.
  auto net = std::make_shared<models::CausalLMImpl>(
      config, at::TensorOptions().device(c10::kMeta).dtype(report.base_dtype),
      options.decoder_units());
  if (trained.lora_rank > 0) {
    if (trained.lora_targets.empty()) trained.lora_targets = models::default_lora_targets(config);
    const std::string error = models::lora_targets_error(config, trained.lora_targets);
    TORCH_CHECK(error.empty(), error);
    lora::LoraConfig lora;
    // The adapters in fp32 (PEFT's default) unless everything is bf16 (pure_bf16).
    lora.r(trained.lora_rank)
        .target_modules(trained.lora_targets)
        .autocast_adapter_dtype(options.dtype() == at::kFloat);
    lora::apply_lora(*net, lora);
    options.trained(trained);
  }
  // The model's parameters (adapters included) before any is packed into NF4's bytes.
  for (const at::Tensor& p : net->parameters()) {
    report.numel += p.numel();
    if (p.requires_grad()) report.trainable += p.numel();
  }
  if (nf4) report.nf4_modules = models::store_projections_nf4(*net);
  const std::vector<PlanUnit> units = models::plan_units(*net);
  report.units = static_cast<int64_t>(units.size());
  options.micro_batch(
      models::micro_batch_of(global_batch, options.world_size(), grad_accumulation_steps));
  report.plan = models::plan_finetune(config, units, options);
  if (config.is_moe()) {
    const models::DecoderUnits other = options.decoder_units() == models::DecoderUnits::kLayer
                                           ? models::DecoderUnits::kSublayer
                                           : models::DecoderUnits::kLayer;
    report.other_units_plan =
        models::plan_finetune(config, models::plan_units(*net, other),
                              models::FinetunePlanOptions(options).decoder_units(other));
  }
  report.memory_per_rank = memory_per_rank;
  if (memory_per_rank > 0) {
    report.smallest_world_size = models::smallest_world_size(
        config, units, options, global_batch, grad_accumulation_steps, memory_per_rank, 1,
        kMaxPlannedWorldSize, &report.smallest_plan);
  }
  return report;
}

std::string to_table(const DecoderPlanReport& r) {
  const models::FinetunePlan& p = r.plan;
  const models::FinetunePlanOptions& o = p.options;
  std::string out = absl::StrFormat(
      "%s (%s): %d parameters (%d trainable), %d layers, %d FSDP units\n"
      "world size %d, %s, %s master weights%s%s, micro-batch %d x %d tokens (batch %d, %d "
      "accumulation steps)%s%s, AdamW, on the %s\n",
      r.source, r.config.model_type, r.numel, r.trainable, r.config.num_hidden_layers, r.units,
      o.world_size(), sharding_strategy_name(p.step.effective_strategy), c10::toString(o.dtype()),
      o.param_dtype() ? absl::StrCat(", ", c10::toString(*o.param_dtype()), " compute") : "",
      o.trained().lora_rank == 0 ? ""
      : r.nf4_modules > 0        ? absl::StrFormat(", frozen base %s with %d projections in NF4",
                                                   c10::toString(r.base_dtype), r.nf4_modules)
                                 : absl::StrCat(", frozen base ", c10::toString(r.base_dtype)),
      o.micro_batch(), o.context(), r.global_batch, r.grad_accumulation_steps,
      o.activation_checkpointing() ? ", activation checkpointing" : "",
      o.cpu_offload() ? ", CPU offload" : "", o.device() == c10::DeviceType::CPU ? "CPU" : "GPU");
  const std::vector<std::pair<const char*, int64_t>> rows = {
      {"sharded parameters", p.parameters},   {"sharded gradients", p.gradients},
      {"optimizer state", p.optimizer_state}, {"gathered units", p.gathered_units},
      {"activations", p.activations_held},    {"runtime (assumed)", p.runtime},
      {"peak per rank", p.peak_bytes},        {"saving, above the shards", p.saving},
      {"host (offloaded)", p.host_bytes}};
  for (const auto& [what, bytes] : rows) {
    out += absl::StrFormat("  %-26s %14d B  %s\n", what, bytes, models::format_bytes(bytes));
  }
  out += absl::StrCat("the step's peak: ", p.step.peak_event, "\n");
  if (r.config.is_moe()) {
    out += models::experts_gathered_line(r.config, p, r.other_units_plan) + "\n";
  }
  out += absl::StrCat("memory plan: ", p.summary(), "\n");
  if (r.memory_per_rank > 0) {
    out += r.smallest_world_size > 0
               ? absl::StrFormat(
                     "smallest world size with a peak of at most %s per rank: %d "
                     "(peak %s)\n",
                     models::format_bytes(r.memory_per_rank), r.smallest_world_size,
                     models::format_bytes(r.smallest_plan.peak_bytes))
               : absl::StrFormat("no world size up to %d fits %s per rank\n", kMaxPlannedWorldSize,
                                 models::format_bytes(r.memory_per_rank));
  }
  return out;
}

std::string to_json(const DecoderPlanReport& r) {
  const models::FinetunePlan& p = r.plan;
  nlohmann::json json = {{"config", r.source},
                         {"model_type", r.config.model_type},
                         {"parameters", r.numel},
                         {"trainable", r.trainable},
                         {"units", r.units},
                         {"world_size", p.options.world_size()},
                         {"sharding_strategy", sharding_strategy_name(p.step.effective_strategy)},
                         {"micro_batch", p.options.micro_batch()},
                         {"context", p.options.context()},
                         {"bytes",
                          {{"sharded_parameters", p.parameters},
                           {"sharded_gradients", p.gradients},
                           {"optimizer_state", p.optimizer_state},
                           {"gathered_units", p.gathered_units},
                           {"activations", p.activations_held},
                           {"runtime", p.runtime},
                           {"saving", p.saving},
                           {"peak", p.peak_bytes},
                           {"host", p.host_bytes},
                           {"experts_per_layer", p.experts_per_layer}}}};
  if (r.memory_per_rank > 0) {
    json["memory_per_rank"] = r.memory_per_rank;
    json["smallest_world_size"] = r.smallest_world_size;
    if (r.smallest_world_size > 0) json["smallest_world_size_peak"] = r.smallest_plan.peak_bytes;
  }
  return json.dump(2) + "\n";
}

}  // namespace fsdp::tools
