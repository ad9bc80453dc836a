// The readers of Llama and the families built like it: a SwiGLU MLP and RMSNorm before
// each sublayer (OLMo 2: after it). See config_families.h.
#include <string>

#include <c10/util/Exception.h>

#include "models/internal/config_families.h"

namespace fsdp::models_internal {

using models::DecoderConfig;
using models::LayerType;
using models::NormStyle;

void read_swiglu_family(const ConfigFields& fields, const DecoderConfig& config,
                        const std::string& swiglu) {
  fields.require("hidden_act", "silu", swiglu + " (hidden_act \"silu\")");
  fields.refuse("attn_logit_softcapping",
                "the " + config.model_type + " attention has no soft-cap");
  fields.refuse("final_logit_softcapping", "the " + config.model_type + " head has no soft-cap");
}

namespace {

void refuse_attention_bias(const ConfigFields& fields, const DecoderConfig& config) {
  fields.require("attention_bias", false, "the " + config.model_type + " attention has no biases");
}

FamilyDefaults with_positions(int64_t max_position_embeddings) {
  FamilyDefaults defaults;
  defaults.max_position_embeddings = max_position_embeddings;
  return defaults;
}

// Mistral and Phi-3: every layer slides when sliding_window is set (default 4096), and
// layer_types is not read. See Note [Sliding windows].
void slide_every_layer(const ConfigFields& fields, DecoderConfig& config) {
  config.sliding_window = fields.count_or_null("sliding_window", 4096);
  config.layer_types.assign(config.num_hidden_layers,
                            config.sliding_window > 0 ? LayerType::kSliding : LayerType::kFull);
}

// Qwen2 and Qwen3: no layer slides unless use_sliding_window; then the layers from
// max_window_layers on (or as layer_types says). See Note [Sliding windows].
void read_qwen_layer_types(const ConfigFields& fields, DecoderConfig& config) {
  const bool use = fields.boolean("use_sliding_window", false);
  config.sliding_window = use ? fields.count_or_null("sliding_window", 4096) : 0;
  const int64_t first = fields.count_or_null("max_window_layers", 28);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    config.layer_types.push_back(config.sliding_window > 0 && i >= first ? LayerType::kSliding
                                                                         : LayerType::kFull);
  }
  read_layer_types_list(fields, config);
}

}  // namespace

void read_llama_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_family(fields, config);
  config.mlp_bias = fields.boolean("mlp_bias", false);
  read_attention_bias(fields, config);
  read_shared_fields(fields, FamilyDefaults(), config);
  config.layer_types.assign(config.num_hidden_layers, LayerType::kFull);
}

void read_granite_config(const ConfigFields& fields, DecoderConfig& config) {
  read_llama_config(fields, config);
  config.attention_scale = fields.positive_number("attention_multiplier", 1.0);
  config.embedding_multiplier = fields.positive_number("embedding_multiplier", 1.0);
  config.residual_multiplier = fields.positive_number("residual_multiplier", 1.0);
  config.logits_scaling = fields.positive_number("logits_scaling", 1.0);
}

void read_mistral_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_family(fields, config);
  refuse_mlp_bias(fields, config);
  refuse_attention_bias(fields, config);
  read_shared_fields(fields, with_positions(131072), config);
  slide_every_layer(fields, config);
}

void read_phi3_config(const ConfigFields& fields, DecoderConfig& config) {
  read_mistral_config(fields, config);
  config.fused_projections = true;
}

void read_qwen2_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_family(fields, config);
  refuse_mlp_bias(fields, config);
  config.qkv_bias = true;  // Qwen2Attention: q, k, v with bias, o without
  read_shared_fields(fields, with_positions(32768), config);
  read_qwen_layer_types(fields, config);
}

void read_qwen3_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_family(fields, config);
  refuse_mlp_bias(fields, config);
  read_attention_bias(fields, config);
  config.qk_norm = true;
  FamilyDefaults defaults = with_positions(32768);
  defaults.head_dim = 128;
  read_shared_fields(fields, defaults, config);
  read_qwen_layer_types(fields, config);
}

void read_olmo2_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_family(fields, config);
  refuse_mlp_bias(fields, config);
  read_attention_bias(fields, config);
  config.qk_norm_full_width = config.post_norms = true;
  config.norm_style = NormStyle::kOlmo;
  FamilyDefaults defaults;
  defaults.rms_norm_eps = 1e-5;
  read_shared_fields(fields, defaults, config);
  config.layer_types.assign(config.num_hidden_layers, LayerType::kFull);
}

}  // namespace fsdp::models_internal
