// The readers of the mixture-of-experts families: each family's attention and layer as
// its dense relative's (Qwen3, Mistral, OLMo 2 with norms before the sublayers, Qwen2;
// gpt-oss its own), and the router and experts' fields. See config_families.h and moe.h.
#include <algorithm>
#include <cmath>
#include <string>

#include <c10/util/Exception.h>

#include "models/internal/config_families.h"

namespace fsdp::models_internal {

using models::DecoderConfig;
using models::LayerType;
using nlohmann::json;

namespace {

// A SwiGLU family (config_families.h) whose MLP and experts have no biases.
void read_swiglu_moe_family(const ConfigFields& fields, const DecoderConfig& config) {
  read_swiglu_family(fields, config, "the MLP and experts are SwiGLU");
  fields.require("mlp_bias", false,
                 "the " + config.model_type + " MLP has no biases (mlp_bias false)");
}

FamilyDefaults with_positions(int64_t max_position_embeddings) {
  FamilyDefaults defaults;
  defaults.max_position_embeddings = max_position_embeddings;
  return defaults;
}

// The MoE families' layers attend fully: a sliding window is refused by name.
void full_attention_only(const ConfigFields& fields, DecoderConfig& config) {
  fields.require("use_sliding_window", false,
                 "sliding windows are not implemented for the Qwen mixture-of-experts families; "
                 "use_sliding_window false");
  config.layer_types.assign(config.num_hidden_layers, LayerType::kFull);
}

// num_experts, or num_local_experts (transformers 5 writes qwen3_moe's and mixtral's
// under that name, 4.x and the Hub's qwen3_moe configs under num_experts): equal when
// both are given.
int64_t read_num_experts(const ConfigFields& fields, int64_t fallback) {
  const bool local = fields.find("num_local_experts") != nullptr;
  const bool plain = fields.find("num_experts") != nullptr;
  const int64_t experts = fields.positive(local ? "num_local_experts" : "num_experts", fallback);
  if (local && plain) {
    const int64_t other = fields.positive("num_experts");
    TORCH_CHECK(other == experts, fields.source(), ": \"num_experts\" = ", other,
                " and \"num_local_experts\" = ", experts,
                " differ; expected one count of experts (transformers reads them as one field)");
  }
  return experts;
}

// A non-negative number; `fallback` when absent or null.
double non_negative(const ConfigFields& fields, const char* name, double fallback) {
  const json* value = fields.find(name);
  if (value == nullptr) return fallback;
  TORCH_CHECK(value->is_number() && value->get<double>() >= 0, fields.source(), ": \"", name,
              "\" = ", value->dump(), ": expected a non-negative number");
  return value->get<double>();
}

// What the families' transformers config classes give the router when config.json does not.
struct MoeDefaults {
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  double router_aux_loss_coef = 0.001;
};

// The experts, the router and the load-balancing loss's weight; every layer sparse.
void read_router(const ConfigFields& fields, const MoeDefaults& defaults, DecoderConfig& config) {
  config.num_experts = read_num_experts(fields, defaults.num_experts);
  config.num_experts_per_tok = fields.positive("num_experts_per_tok", defaults.num_experts_per_tok);
  TORCH_CHECK(config.num_experts_per_tok <= config.num_experts, fields.source(),
              ": \"num_experts_per_tok\" = ", config.num_experts_per_tok,
              ": expected at most the number of experts, ", config.num_experts);
  config.router_aux_loss_coef =
      non_negative(fields, "router_aux_loss_coef", defaults.router_aux_loss_coef);
  config.output_router_logits = fields.boolean("output_router_logits", false);
  config.sparse_layers.assign(config.num_hidden_layers, true);
}

// Qwen2-MoE and Qwen3-MoE: experts of moe_intermediate_size, norm_topk_prob, and the
// dense layers: those in mlp_only_layers and those whose index + 1 decoder_sparse_step
// does not divide (transformers' Qwen3MoeDecoderLayer).
void read_qwen_moe(const ConfigFields& fields, const MoeDefaults& defaults,
                   int64_t moe_intermediate_size, DecoderConfig& config) {
  read_router(fields, defaults, config);
  config.moe_intermediate_size = fields.positive("moe_intermediate_size", moe_intermediate_size);
  config.norm_topk_prob = fields.boolean("norm_topk_prob", false);
  const int64_t step = fields.positive("decoder_sparse_step", 1);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    config.sparse_layers[i] = (i + 1) % step == 0;
  }
  if (const json* dense = fields.find("mlp_only_layers")) {
    TORCH_CHECK(dense->is_array(), fields.source(), ": \"mlp_only_layers\" = ", dense->dump(),
                ": expected a list of layer indices");
    for (const json& layer : *dense) {
      TORCH_CHECK(layer.is_number_integer() && layer.get<int64_t>() >= 0 &&
                      layer.get<int64_t>() < config.num_hidden_layers,
                  fields.source(), ": \"mlp_only_layers\" = ", dense->dump(),
                  ": expected layer indices below num_hidden_layers = ", config.num_hidden_layers);
      config.sparse_layers[layer.get<int64_t>()] = false;
    }
  }
}

}  // namespace

void read_qwen3_moe_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_moe_family(fields, config);
  read_attention_bias(fields, config);
  config.qk_norm = true;
  FamilyDefaults defaults = with_positions(32768);
  defaults.head_dim = 128;
  read_shared_fields(fields, defaults, config);
  full_attention_only(fields, config);
  read_qwen_moe(fields, {128, 8, 0.001}, 768, config);
}

void read_mixtral_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_moe_family(fields, config);
  fields.require("attention_bias", false, "the mixtral attention has no biases");
  fields.require_zero("router_jitter_noise",
                      "fsdp's router does not jitter its inputs (router_jitter_noise 0.0)");
  FamilyDefaults defaults = with_positions(4096 * 32);
  defaults.rms_norm_eps = 1e-5;
  defaults.rope_theta = 1e6;
  read_shared_fields(fields, defaults, config);
  // MistralConfig's rule, with MixtralConfig's default: no window unless sliding_window.
  config.sliding_window = fields.count_or_null("sliding_window", 0);
  config.layer_types.assign(config.num_hidden_layers,
                            config.sliding_window > 0 ? LayerType::kSliding : LayerType::kFull);
  read_router(fields, {8, 2, 0.001}, config);
  config.moe_intermediate_size = config.intermediate_size;
  config.norm_topk_prob = config.router_weights_fp32 = config.block_sparse_moe_names = true;
}

void read_olmoe_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_moe_family(fields, config);
  read_attention_bias(fields, config);
  fields.refuse("clip_qkv", "fsdp's attention does not clip queries, keys and values");
  config.qk_norm_full_width = true;  // over the whole q_proj / k_proj output, Llama's norm
  FamilyDefaults defaults = with_positions(4096);
  defaults.rms_norm_eps = 1e-5;
  read_shared_fields(fields, defaults, config);
  config.layer_types.assign(config.num_hidden_layers, LayerType::kFull);
  read_router(fields, {64, 8, 0.01}, config);
  config.moe_intermediate_size = config.intermediate_size;
  config.norm_topk_prob = fields.boolean("norm_topk_prob", false);
}

void read_qwen2_moe_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_moe_family(fields, config);
  config.qkv_bias = fields.boolean("qkv_bias", true);  // o_proj never has one
  read_shared_fields(fields, with_positions(32768), config);
  full_attention_only(fields, config);
  read_qwen_moe(fields, {60, 4, 0.001}, 1408, config);
  config.shared_expert_intermediate_size = fields.positive("shared_expert_intermediate_size", 5632);
}

// GptOssConfig: its defaults, layer_types alternating (sliding first) unless given, and
// YaRN (factor 32 over 4096 positions, not truncated) when config.json gives no RoPE.
// hidden_act is not read: transformers' gpt-oss uses none but its clamped SwiGLU.
void read_gpt_oss_config(const ConfigFields& fields, DecoderConfig& config) {
  config.qkv_bias = config.o_bias = fields.boolean("attention_bias", true);
  config.attention_sinks = true;
  config.norm_style = models::NormStyle::kOlmo;  // (w * x).to(dtype), as GptOssRMSNorm
  FamilyDefaults defaults = with_positions(131072);
  defaults.head_dim = 64;
  defaults.rms_norm_eps = 1e-5;
  defaults.rope_theta = 150000.0;
  if (fields.find("rope_parameters") == nullptr && fields.find("rope_scaling") == nullptr) {
    json object = fields.json_object();
    object["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 32.0},
                                 {"beta_fast", 32.0},   {"beta_slow", 1.0},
                                 {"truncate", false},   {"original_max_position_embeddings", 4096}};
    read_shared_fields(ConfigFields(object, fields.source()), defaults, config);
  } else {
    read_shared_fields(fields, defaults, config);
  }
  config.sliding_window = fields.count_or_null("sliding_window", 128);
  config.layer_types.resize(config.num_hidden_layers);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    config.layer_types[i] = i % 2 == 0 ? LayerType::kSliding : LayerType::kFull;
  }
  read_layer_types_list(fields, config);
  read_router(fields, {128, 4, 0.001}, config);
  config.moe_intermediate_size = config.intermediate_size;
  config.router_bias_topk_softmax = config.experts_transposed = true;
  config.swiglu_limit = fields.positive_number("swiglu_limit", 7.0);
  config.swiglu_alpha = fields.positive_number("swiglu_alpha", 1.702);
}

// DeepseekV3Config (DeepSeek-V3, Kimi K2): multi-head latent attention and grouped sigmoid
// routing (config.h). transformers sets head_dim to qk_rope_head_dim whatever config.json
// says, and reads none of DeepSeek's remote-code routing fields (scoring_func, topk_method,
// moe_layer_freq, aux_loss_alpha, seq_aux): V3's values are accepted, others refused, since
// transformers would compute V3's routing for them. transformers' DeepseekV3 has no
// load-balancing loss (router_aux_loss_coef 0); num_nextn_predict_layers counts the
// multi-token prediction layers, which transformers does not build (mtp_layers: their
// tensors are skipped on reading).
void read_deepseek_v3_config(const ConfigFields& fields, DecoderConfig& config) {
  read_swiglu_moe_family(fields, config);
  read_attention_bias(fields, config);
  fields.require("scoring_func", "sigmoid",
                 "transformers' DeepseekV3 scores the experts with a sigmoid");
  fields.require("topk_method", "noaux_tc",
                 "transformers' DeepseekV3 routes as DeepSeek-V3's noaux_tc (group-limited top-k "
                 "with e_score_correction_bias)");
  fields.require("moe_layer_freq", 1,
                 "transformers' DeepseekV3 makes every layer from first_k_dense_replace on sparse");
  config.qk_nope_head_dim = fields.positive("qk_nope_head_dim", 128);
  const int64_t rope_dim = fields.positive("qk_rope_head_dim", 64);
  json object = fields.json_object();
  object["head_dim"] = rope_dim;
  const ConfigFields with_head_dim(object, fields.source());
  FamilyDefaults defaults = with_positions(4096);
  read_shared_fields(with_head_dim, defaults, config);
  TORCH_CHECK(config.num_key_value_heads == config.num_attention_heads, fields.source(),
              ": \"num_key_value_heads\" = ", config.num_key_value_heads,
              " is not supported: multi-head latent attention expands keys and values for every "
              "head (num_key_value_heads equal to num_attention_heads = ",
              config.num_attention_heads, ")");
  TORCH_CHECK(config.rope.type == "default" || config.rope.type == "yarn", fields.source(),
              ": rope type \"", config.rope.type,
              "\" is not supported for deepseek_v3: its attention scale is implemented for the "
              "rope types default and yarn (DeepSeek-V3's and Kimi K2's)");
  TORCH_CHECK(config.rotary_dim == config.head_dim, fields.source(),
              ": \"partial_rotary_factor\" = ", config.rope.partial_rotary_factor,
              " is not supported: deepseek_v3 rotates the whole qk_rope_head_dim part");
  config.layer_types.assign(config.num_hidden_layers, LayerType::kFull);
  config.q_lora_rank = fields.count_or_null("q_lora_rank", 1536);
  config.kv_lora_rank = fields.positive("kv_lora_rank", 512);
  config.v_head_dim = fields.positive("v_head_dim", 128);
  config.rope_interleave = fields.boolean("rope_interleave", true);
  // transformers' yarn_apply_mscale: qk_head_dim^-0.5, times mscale^2 under YaRN.
  config.attention_scale = 1.0 / std::sqrt(double(config.qk_head_dim()));
  if (config.rope.type == "yarn" && config.rope.mscale_all_dim > 0 && config.rope.factor > 1) {
    const double mscale = 0.1 * config.rope.mscale_all_dim * std::log(config.rope.factor) + 1.0;
    config.attention_scale *= mscale * mscale;
  }

  const bool local = fields.find("num_local_experts") != nullptr;  // transformers' alias
  config.num_experts = fields.positive(local ? "num_local_experts" : "n_routed_experts", 256);
  if (local && fields.find("n_routed_experts") != nullptr) {
    TORCH_CHECK(fields.positive("n_routed_experts") == config.num_experts, fields.source(),
                ": \"n_routed_experts\" and \"num_local_experts\" differ; expected one count "
                "of experts (transformers reads them as one field)");
  }
  fields.refuse("num_experts", "deepseek_v3 counts its experts in n_routed_experts");
  config.num_experts_per_tok = fields.positive("num_experts_per_tok", 8);
  config.moe_intermediate_size = fields.positive("moe_intermediate_size", 2048);
  config.norm_topk_prob = fields.boolean("norm_topk_prob", true);
  config.router_sigmoid_groups = config.router_weights_fp32 = true;
  config.routed_scaling_factor = fields.positive_number("routed_scaling_factor", 2.5);
  config.n_group = fields.positive("n_group", 8);
  config.topk_group = fields.positive("topk_group", 4);
  const int64_t per_group = config.num_experts / config.n_group;
  TORCH_CHECK(config.num_experts % config.n_group == 0 && per_group >= 2, fields.source(),
              ": \"n_group\" = ", config.n_group, " does not split ", config.num_experts,
              " experts into equal groups of two or more (a group scores its two best)");
  TORCH_CHECK(config.topk_group <= config.n_group &&
                  config.num_experts_per_tok <= config.topk_group * per_group,
              fields.source(), ": \"topk_group\" = ", config.topk_group,
              ": expected at most n_group = ", config.n_group, " groups, holding at least ",
              "num_experts_per_tok = ", config.num_experts_per_tok, " experts");
  config.shared_expert_intermediate_size =
      fields.positive("n_shared_experts", 1) * config.moe_intermediate_size;
  config.shared_experts_ungated = true;
  config.output_router_logits = fields.boolean("output_router_logits", false);
  config.mtp_layers = fields.count_or_null("num_nextn_predict_layers", 1);
  const int64_t dense = fields.count_or_null("first_k_dense_replace", 3);
  config.sparse_layers.resize(config.num_hidden_layers);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) config.sparse_layers[i] = i >= dense;
}

}  // namespace fsdp::models_internal
