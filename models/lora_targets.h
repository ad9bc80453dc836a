// The modules of each family's decoder (decoder.h) that fsdp::lora::apply_lora can give
// adapters, checked before training so that a misspelt or absent target is one line
// rather than a run with nothing trained.
//
//   std::string error = fsdp::models::lora_targets_error(config, {"q_proj", "v_proj"});
//
// Every family but phi3 has the same seven projections: q_proj, k_proj, v_proj, o_proj
// (attention) and gate_proj, up_proj, down_proj (MLP); phi3 has its fused qkv_proj and
// gate_up_proj instead (with o_proj and down_proj); deepseek_v3's latent attention has
// q_a_proj, q_b_proj (or q_proj without q_lora_rank), kv_a_proj_with_mqa, kv_b_proj and
// o_proj. The mixture-of-experts families
// (config.is_moe()) have the MLP's three only where a dense MLP is (qwen2_moe's shared
// expert, deepseek_v3's shared experts and first_k_dense_replace layers, layers in
// mlp_only_layers or off decoder_sparse_step); their fused experts are
// no Linear and take none, nor does the router. The norms, embeddings and head take
// none. default_lora_targets returns PEFT's defaults
// (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING of PEFT 0.21): q_proj and v_proj
// (mixtral too), qkv_proj for phi3, and none for qwen3_moe, qwen2_moe, olmoe, gpt_oss and
// deepseek_v3, which
// PEFT does not map (its LoraConfig then asks for target_modules; lora_targets_error asks
// for --lora_target_modules). LoRA on the routed experts (PEFT's target_parameters on
// mlp.experts.gate_up_proj and down_proj) is not supported yet: a target naming them
// (experts, mlp.experts..., mixtral's w1/w2/w3, or gate_proj/up_proj/down_proj where the
// experts are the only MLPs) is refused saying so. Pure functions, no errors raised.
#ifndef FSDP_MODELS_LORA_TARGETS_H_
#define FSDP_MODELS_LORA_TARGETS_H_

#include <string>
#include <vector>

#include "models/config.h"

namespace fsdp::models {

// The LoraLinear module names of `config`'s decoder, in module order.
std::vector<std::string> lora_target_modules(const DecoderConfig& config);

// PEFT's default target modules for the family; empty where PEFT has none (qwen3_moe,
// qwen2_moe, olmoe, gpt_oss, deepseek_v3).
std::vector<std::string> default_lora_targets(const DecoderConfig& config);

// "" when every name of `targets` is one of lora_target_modules(config) and there is at
// least one; else one line naming the first bad name, the model_type and the choices (for
// a name of the routed experts: that expert LoRA is not supported yet; for no targets on
// an MoE family: that PEFT has no default for it).
std::string lora_targets_error(const DecoderConfig& config,
                               const std::vector<std::string>& targets);

}  // namespace fsdp::models

#endif  // FSDP_MODELS_LORA_TARGETS_H_
