// The readers of Gemma 2 and Gemma 3's language model. See config_families.h.
#include <cmath>
#include <tuple>

#include "models/internal/config_families.h"

namespace fsdp::models_internal {

using models::Activation;
using models::DecoderConfig;
using models::LayerType;
using models::NormStyle;

namespace {

// What both Gemmas are: GeLU-tanh MLP, (1 + w) RMSNorm, sandwich norms, embeddings
// scaled by sqrt(hidden_size), tied embeddings, head_dim 256.
FamilyDefaults read_gemma_switches(const ConfigFields& fields, DecoderConfig& config) {
  fields.require("hidden_activation", "gelu_pytorch_tanh",
                 "the Gemma MLP is GeLU-tanh gated (hidden_activation \"gelu_pytorch_tanh\")");
  refuse_mlp_bias(fields, config);
  read_attention_bias(fields, config);
  config.gemma = true;
  config.activation = Activation::kGeluTanh;
  config.norm_style = NormStyle::kGemma;
  config.sandwich_norms = config.scale_embeddings = true;
  FamilyDefaults defaults;
  defaults.head_dim = 256;
  defaults.tie_word_embeddings = true;
  return defaults;
}

// The attention's scale (query_pre_attn_scalar^-0.5) and the soft-caps; a cap absent
// from config.json is the family's (`attention_cap`, `final_cap`), a null one none.
void read_gemma_scales(const ConfigFields& fields, double attention_cap, double final_cap,
                       DecoderConfig& config) {
  config.attention_scale = 1.0 / std::sqrt(fields.positive_number("query_pre_attn_scalar", 256));
  for (auto [name, cap, fallback] :
       {std::tuple{"attn_logit_softcapping", &config.attn_logit_softcapping, attention_cap},
        std::tuple{"final_logit_softcapping", &config.final_logit_softcapping, final_cap}}) {
    *cap = fields.has(name) ? fields.positive_number(name, 0.0) : fallback;
  }
}

// All layers slide but every `pattern`-th (or as layer_types says). See Note [Sliding
// windows].
void read_gemma_layer_types(const ConfigFields& fields, int64_t pattern, DecoderConfig& config) {
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    config.layer_types.push_back((i + 1) % pattern != 0 ? LayerType::kSliding : LayerType::kFull);
  }
  read_layer_types_list(fields, config);
}

}  // namespace

void read_gemma2_config(const ConfigFields& fields, DecoderConfig& config) {
  FamilyDefaults defaults = read_gemma_switches(fields, config);
  defaults.max_position_embeddings = 8192;
  read_shared_fields(fields, defaults, config);
  read_gemma_scales(fields, /*attention_cap=*/50.0, /*final_cap=*/30.0, config);
  config.sliding_window = fields.count_or_null("sliding_window", 4096);
  read_gemma_layer_types(fields, /*pattern=*/2, config);
}

void read_gemma3_text_config(const ConfigFields& fields, DecoderConfig& config) {
  FamilyDefaults defaults = read_gemma_switches(fields, config);
  config.qk_norm = true;
  config.rope_per_layer_type = true;
  defaults.max_position_embeddings = 131072;
  defaults.rope_theta = 1e6;
  read_shared_fields(fields, defaults, config);
  read_gemma_scales(fields, /*attention_cap=*/0.0, /*final_cap=*/0.0, config);
  config.sliding_window = fields.count_or_null("sliding_window", 4096);
  read_gemma_layer_types(fields, fields.positive("sliding_window_pattern", /*fallback=*/6), config);
}

}  // namespace fsdp::models_internal
