#include "models/config.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_join.h"
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp/formats/files.h"
#include "fsdp/formats/json.h"

namespace fsdp::models {
namespace {

using nlohmann::json;

const char* const kModelTypes[] = {"llama",       "mistral", "qwen2", "qwen3", "gemma2",
                                   "gemma3_text", "granite", "olmo2", "phi3"};

// Reads the fields of one JSON object of a config.json, each error naming the file and
// the field (`prefix` is the path of the object, e.g. "rope_parameters.").
class Fields {
 public:
  Fields(const json& object, std::string source, std::string prefix = "")
      : object_(object), source_(std::move(source)), prefix_(std::move(prefix)) {}

  // A positive integer; `fallback` when absent or null (0: required).
  int64_t positive(const char* name, int64_t fallback = 0) const {
    const json* value = find(name);
    if (value == nullptr) {
      TORCH_CHECK(fallback > 0, source_, ": the required field \"", prefix_, name,
                  "\" is missing; a config saved by transformers has it");
      return fallback;
    }
    TORCH_CHECK(value->is_number_integer() && value->get<int64_t>() > 0, source_, ": \"", prefix_,
                name, "\" = ", value->dump(), ": expected a positive integer");
    return value->get<int64_t>();
  }

  // A non-negative integer or null (0).
  int64_t count_or_null(const char* name, int64_t fallback) const {
    auto it = object_.find(name);
    if (it == object_.end()) return fallback;
    if (it->is_null()) return 0;
    TORCH_CHECK(it->is_number_integer() && it->get<int64_t>() >= 0, source_, ": \"", prefix_, name,
                "\" = ", it->dump(), ": expected a non-negative integer or null");
    return it->get<int64_t>();
  }

  double positive_number(const char* name, double fallback) const {
    const json* value = find(name);
    if (value == nullptr) return fallback;
    TORCH_CHECK(value->is_number() && value->get<double>() > 0, source_, ": \"", prefix_, name,
                "\" = ", value->dump(), ": expected a positive number");
    return value->get<double>();
  }

  bool boolean(const char* name, bool fallback) const {
    const json* value = find(name);
    if (value == nullptr) return fallback;
    TORCH_CHECK(value->is_boolean(), source_, ": \"", prefix_, name, "\" = ", value->dump(),
                ": expected true or false");
    return value->get<bool>();
  }

  std::string string(const char* name, const std::string& fallback) const {
    const json* value = find(name);
    if (value == nullptr) return fallback;
    TORCH_CHECK(value->is_string(), source_, ": \"", prefix_, name, "\" = ", value->dump(),
                ": expected a string");
    return value->get<std::string>();
  }

  // Absent, null or `supported`: else one error saying what is supported.
  void require(const char* name, const json& supported, const std::string& why) const {
    const json* value = find(name);
    TORCH_CHECK(value == nullptr || *value == supported, source_, ": \"", prefix_, name,
                "\" = ", value == nullptr ? "" : value->dump(), " is not supported: ", why);
  }

  // Absent or null: else one error naming the field and its value.
  void refuse(const char* name, const std::string& why) const {
    const json* value = find(name);
    TORCH_CHECK(value == nullptr, source_, ": \"", prefix_, name, "\" = ", value->dump(),
                " is not supported: ", why);
  }

  // The field, or nullptr when absent or null.
  const json* find(const char* name) const {
    auto it = object_.find(name);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }

  // The field as an object, or nullptr when absent or null.
  const json* object(const char* name) const {
    const json* value = find(name);
    TORCH_CHECK(value == nullptr || value->is_object(), source_, ": \"", prefix_, name,
                "\" = ", value == nullptr ? "" : value->dump(), ": expected an object or null");
    return value;
  }

  const std::string& source() const { return source_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const json& object_;
  std::string source_;
  std::string prefix_;
};

// The whole text of a config.json as a JSON object, parsed with its nesting bounded
// (fsdp/formats/json.h). The one place a config file is parsed.
json parse_json_object(const std::string& json_text, const std::string& source) {
  json object = parse_untrusted_json(json_text, source,
                                     "expected the config.json of a Hugging Face model folder");
  TORCH_CHECK(object.is_object(), source, ": expected a JSON object, found ", object.type_name());
  return object;
}

// Refuses model types and fields of architectures the decoder does not build.
void refuse_other_architectures(const Fields& fields, const std::string& model_type) {
  const std::string supported = "fsdp's decoder builds " + supported_model_types();
  if (model_type == "mixtral" || model_type == "qwen2_moe" || model_type == "qwen3_moe" ||
      model_type == "deepseek_v2" || model_type == "deepseek_v3") {
    TORCH_CHECK(false, fields.source(), ": \"model_type\" = \"", model_type,
                "\" is not supported: mixture-of-experts models are not implemented; ", supported);
  }
  TORCH_CHECK(model_type != "gemma3", fields.source(),
              ": \"model_type\" = \"gemma3\" is not supported: a multimodal Gemma 3 folder (vision "
              "tower and text_config); fsdp's decoder builds its language model only from a "
              "\"gemma3_text\" folder (Gemma3ForCausalLM), and does not carry the vision tower");
  TORCH_CHECK(std::find(std::begin(kModelTypes), std::end(kModelTypes), model_type) !=
                  std::end(kModelTypes),
              fields.source(), ": \"model_type\" = \"", model_type,
              "\" is not supported: ", supported);
  fields.refuse("quantization_config",
                "quantised weights (FP8, GPTQ, AWQ, bitsandbytes, ...) are not implemented; "
                "fsdp's decoder trains float32, bfloat16 or float16 weights");
  fields.refuse("text_config", "a multimodal folder; fsdp's decoder builds text models only");
  fields.refuse("vision_config", "a multimodal folder; fsdp's decoder builds text models only");
  for (const char* experts : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    const json* value = fields.find(experts);
    TORCH_CHECK(value == nullptr || (value->is_number_integer() && value->get<int64_t>() == 0),
                fields.source(), ": \"", experts, "\" = ", value == nullptr ? "" : value->dump(),
                " is not supported: mixture-of-experts layers are not implemented; fsdp's "
                "decoder has one dense MLP per layer");
  }
  fields.require("use_bidirectional_attention", false,
                 "fsdp's decoder is causal (use_bidirectional_attention false)");
}

// A list of positive numbers (longrope's factors).
std::vector<double> positive_numbers(const Fields& fields, const char* name) {
  const json* value = fields.find(name);
  TORCH_CHECK(value != nullptr, fields.source(), ": the field \"", fields.prefix(), name,
              "\" is missing; rope type \"longrope\" needs it");
  TORCH_CHECK(value->is_array() && !value->empty(), fields.source(), ": \"", fields.prefix(), name,
              "\" = ", value->dump(), ": expected a list of positive numbers");
  std::vector<double> numbers;
  for (const json& number : *value) {
    TORCH_CHECK(number.is_number() && number.get<double>() > 0, fields.source(), ": \"",
                fields.prefix(), name, "\" = ", value->dump(),
                ": expected a list of positive numbers");
    numbers.push_back(number.get<double>());
  }
  return numbers;
}

// One rope_parameters / rope_scaling entry; `defaults` gives rope_theta and
// partial_rotary_factor when the entry has none. `top_original`: a top-level
// original_max_position_embeddings (0: none), which wins, as in transformers.
RopeConfig read_rope(const json& entry, const RopeConfig& defaults, int64_t max_position_embeddings,
                     int64_t top_original, const Fields& top, const std::string& name) {
  TORCH_CHECK(entry.is_object(), top.source(), ": \"", name, "\" = ", entry.dump(),
              ": expected an object or null");
  const Fields fields(entry, top.source(), name + ".");
  RopeConfig rope;
  rope.type = fields.string("rope_type", fields.string("type", "default"));
  TORCH_CHECK(rope.type == "default" || rope.type == "linear" || rope.type == "llama3" ||
                  rope.type == "yarn" || rope.type == "longrope",
              top.source(), ": \"", name, ".rope_type\" = \"", rope.type,
              "\" is not supported: fsdp's decoder implements the rope types default, linear, "
              "llama3, yarn and longrope");
  rope.theta = fields.positive_number("rope_theta", defaults.theta);
  rope.partial_rotary_factor =
      fields.positive_number("partial_rotary_factor", defaults.partial_rotary_factor);
  TORCH_CHECK(rope.partial_rotary_factor <= 1.0, top.source(), ": \"", name,
              ".partial_rotary_factor\" = ", rope.partial_rotary_factor,
              ": expected a fraction of the head in (0, 1]");
  if (rope.type == "default") return rope;
  rope.original_max_position_embeddings =
      top_original > 0
          ? top_original
          : fields.positive("original_max_position_embeddings", max_position_embeddings);
  if ((rope.type == "yarn" || rope.type == "longrope") && fields.find("factor") == nullptr) {
    rope.factor = double(max_position_embeddings) / double(rope.original_max_position_embeddings);
  } else {
    rope.factor = fields.positive_number("factor", 0.0);
    TORCH_CHECK(rope.factor > 0, top.source(), ": the field \"", name,
                ".factor\" is missing; rope type \"", rope.type, "\" needs it");
  }
  if (rope.type == "llama3") {
    rope.low_freq_factor = fields.positive_number("low_freq_factor", 0.0);
    rope.high_freq_factor = fields.positive_number("high_freq_factor", 0.0);
    TORCH_CHECK(rope.low_freq_factor > 0 && rope.high_freq_factor > rope.low_freq_factor,
                top.source(), ": \"", name, "\" = ", entry.dump(),
                ": rope type \"llama3\" needs low_freq_factor and a larger high_freq_factor");
  }
  if (rope.type == "yarn") {
    rope.beta_fast = fields.positive_number("beta_fast", 32.0);
    rope.beta_slow = fields.positive_number("beta_slow", 1.0);
    rope.attention_factor = fields.positive_number("attention_factor", 0.0);
    rope.mscale = fields.positive_number("mscale", 0.0);
    rope.mscale_all_dim = fields.positive_number("mscale_all_dim", 0.0);
  }
  if (rope.type == "longrope") {
    rope.long_factor = positive_numbers(fields, "long_factor");
    rope.short_factor = positive_numbers(fields, "short_factor");
    rope.attention_factor = fields.positive_number("attention_factor", 0.0);
    if (rope.attention_factor == 0) {
      rope.attention_factor =
          rope.factor <= 1.0
              ? 1.0
              : std::sqrt(1 + std::log(rope.factor) /
                                  std::log(double(rope.original_max_position_embeddings)));
    }
  }
  return rope;
}

// The RoPE of full-attention layers and (gemma3_text) of sliding ones. See Note [RoPE
// spellings].
void read_ropes(const Fields& fields, DecoderConfig& config) {
  const bool gemma3 = config.model_type == "gemma3_text";
  const json* scaling = fields.object("rope_scaling");
  const json* parameters = fields.object("rope_parameters");
  RopeConfig defaults, local_defaults;
  defaults.theta = fields.positive_number("rope_theta", gemma3 ? 1e6 : 10000.0);
  local_defaults.theta = fields.positive_number("rope_local_base_freq", 10000.0);
  defaults.partial_rotary_factor = local_defaults.partial_rotary_factor =
      fields.positive_number("partial_rotary_factor", 1.0);
  const int64_t top_original = fields.count_or_null("original_max_position_embeddings", 0);
  const bool nested = parameters != nullptr && (parameters->contains("full_attention") ||
                                                parameters->contains("sliding_attention"));
  if (nested) {
    TORCH_CHECK(gemma3, fields.source(), ": \"rope_parameters\" = ", parameters->dump(),
                " is not supported: RoPE parameters per layer type are read for gemma3_text only");
    for (const auto& [key, value] : parameters->items()) {
      TORCH_CHECK(key == "full_attention" || key == "sliding_attention", fields.source(),
                  ": \"rope_parameters.", key,
                  "\" is not supported: expected full_attention "
                  "and sliding_attention entries");
      (void)value;
    }
  }
  const auto entry = [&](const char* key) -> json {
    if (!nested) return json::object();
    auto it = parameters->find(key);
    return it == parameters->end() || it->is_null() ? json::object() : *it;
  };
  if (gemma3) {
    json full = nested ? entry("full_attention") : (parameters ? *parameters : json::object());
    if (scaling != nullptr) full.update(*scaling);  // 4.x: rope_scaling applies to full layers
    config.rope = read_rope(full, defaults, config.max_position_embeddings, top_original, fields,
                            nested ? "rope_parameters.full_attention" : "rope_scaling");
    config.sliding_rope =
        read_rope(entry("sliding_attention"), local_defaults, config.max_position_embeddings,
                  top_original, fields, "rope_parameters.sliding_attention");
  } else {
    // transformers: rope_scaling, when given, wins over rope_parameters.
    const char* name = scaling != nullptr ? "rope_scaling" : "rope_parameters";
    const json* rope = scaling != nullptr ? scaling : parameters;
    config.rope = read_rope(rope != nullptr ? *rope : json::object(), defaults,
                            config.max_position_embeddings, top_original, fields, name);
    config.sliding_rope = config.rope;
  }
  TORCH_CHECK(config.rope.partial_rotary_factor == config.sliding_rope.partial_rotary_factor,
              fields.source(), ": the full and sliding layers' partial_rotary_factor differ (",
              config.rope.partial_rotary_factor, ", ", config.sliding_rope.partial_rotary_factor,
              "); fsdp's decoder rotates the same dimensions in every layer");
  config.rotary_dim = int64_t(double(config.head_dim) * config.rope.partial_rotary_factor);
  TORCH_CHECK(config.rotary_dim > 0 && config.rotary_dim % 2 == 0, fields.source(),
              ": partial_rotary_factor ", config.rope.partial_rotary_factor, " of head_dim ",
              config.head_dim, " rotates ", config.rotary_dim,
              " dimensions: expected a positive even number");
  for (const RopeConfig* rope : {&config.rope, &config.sliding_rope}) {
    if (rope->type != "longrope") continue;
    TORCH_CHECK(int64_t(rope->long_factor.size()) == config.rotary_dim / 2 &&
                    int64_t(rope->short_factor.size()) == config.rotary_dim / 2,
                fields.source(), ": longrope's long_factor and short_factor have ",
                rope->long_factor.size(), " and ", rope->short_factor.size(),
                " entries: expected one per rotated pair, ", config.rotary_dim / 2);
  }
}

// Which layers attend through a sliding window, and its width. See Note [Sliding windows].
void read_layer_types(const Fields& fields, DecoderConfig& config) {
  const std::string& type = config.model_type;
  const int64_t layers = config.num_hidden_layers;
  const json* given = fields.find("layer_types");
  if (type == "llama" || type == "granite" || type == "olmo2") {
    config.layer_types.assign(layers, LayerType::kFull);
    return;
  }
  if (type == "mistral" || type == "phi3") {
    config.sliding_window = fields.count_or_null("sliding_window", 4096);
    config.layer_types.assign(layers,
                              config.sliding_window > 0 ? LayerType::kSliding : LayerType::kFull);
    return;
  }
  if (type == "qwen2" || type == "qwen3") {
    const bool use = fields.boolean("use_sliding_window", false);
    config.sliding_window = use ? fields.count_or_null("sliding_window", 4096) : 0;
    const int64_t first = fields.count_or_null("max_window_layers", 28);
    for (int64_t i = 0; i < layers; ++i) {
      config.layer_types.push_back(config.sliding_window > 0 && i >= first ? LayerType::kSliding
                                                                           : LayerType::kFull);
    }
  } else {  // gemma2, gemma3_text
    config.sliding_window = fields.count_or_null("sliding_window", 4096);
    const int64_t pattern =
        type == "gemma2" ? 2 : fields.positive("sliding_window_pattern", /*fallback=*/6);
    for (int64_t i = 0; i < layers; ++i) {
      config.layer_types.push_back((i + 1) % pattern != 0 ? LayerType::kSliding : LayerType::kFull);
    }
  }
  if (given == nullptr) return;
  TORCH_CHECK(given->is_array() && int64_t(given->size()) == layers, fields.source(),
              ": \"layer_types\" = ", given->dump(), ": expected a list of ", layers,
              " layer types (num_hidden_layers)");
  for (int64_t i = 0; i < layers; ++i) {
    const json& layer = (*given)[i];
    TORCH_CHECK(layer == "full_attention" || layer == "sliding_attention", fields.source(),
                ": \"layer_types\"[", i, "] = ", layer.dump(),
                " is not supported: fsdp's decoder implements \"full_attention\" and "
                "\"sliding_attention\" layers");
    config.layer_types[i] = layer == "sliding_attention" ? LayerType::kSliding : LayerType::kFull;
  }
}

}  // namespace

// Note [RoPE spellings]
// transformers 5 writes "rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}; 4.x
// wrote a top-level "rope_theta" and "rope_scaling" (null, or {"type" or "rope_type", "factor",
// ...}). transformers 5 still reads both, rope_scaling first, rope_theta filling in a missing
// base; we do the same. Gemma 3 has two rotary embeddings: 5.x nests rope_parameters as
// {"full_attention": {...}, "sliding_attention": {...}}; 4.x gave the full layers' base as
// rope_theta (default 1e6) with rope_scaling (the 4 B and larger checkpoints scale them
// linearly by 8) and the sliding layers' as rope_local_base_freq (default 1e4, unscaled).
// For llama3 and yarn a missing original_max_position_embeddings is max_position_embeddings,
// and yarn's missing factor is max_position_embeddings / original_max_position_embeddings,
// as transformers' standardize_rope_params and _compute_yarn_parameters do.
//
// Note [Sliding windows]
// A sliding layer's query at position i sees keys i - sliding_window + 1 .. i
// (transformers' sliding_window_overlay: kv_idx > q_idx - sliding_window). Which layers
// slide is each family's rule in transformers' config classes: Mistral every layer when
// sliding_window is not null; Qwen2/Qwen3 none unless use_sliding_window, then layers
// max_window_layers.. (and sliding_window is read only then); Gemma 2 every other layer
// starting with the first, Gemma 3 all but every sliding_window_pattern-th (4.x; default 6).
// An explicit layer_types list (5.x) overrides the rule, except for Llama and Mistral,
// whose transformers classes do not read it.

DecoderConfig parse_decoder_config(const std::string& json_text, const std::string& source) {
  const json object = parse_json_object(json_text, source);
  const Fields fields(object, source);
  const json* model_type = fields.find("model_type");
  TORCH_CHECK(model_type != nullptr && model_type->is_string(), source,
              ": the field \"model_type\" is missing; expected one of ", supported_model_types(),
              " (a config saved by transformers)");
  DecoderConfig config;
  config.model_type = model_type->get<std::string>();
  refuse_other_architectures(fields, config.model_type);
  const std::string& type = config.model_type;
  config.gemma = type == "gemma2" || type == "gemma3_text";
  if (config.gemma) {
    fields.require("hidden_activation", "gelu_pytorch_tanh",
                   "the Gemma MLP is GeLU-tanh gated (hidden_activation \"gelu_pytorch_tanh\")");
  } else {
    fields.require("hidden_act", "silu", "the MLP is SwiGLU (hidden_act \"silu\")");
  }
  const json* dropout = fields.find("attention_dropout");
  TORCH_CHECK(dropout == nullptr || (dropout->is_number() && dropout->get<double>() == 0.0), source,
              ": \"attention_dropout\" = ", dropout == nullptr ? "" : dropout->dump(),
              " is not supported: fsdp's decoder has no attention dropout (0.0)");
  if (type == "llama" || type == "granite") {
    config.mlp_bias = fields.boolean("mlp_bias", false);
  } else {
    fields.require("mlp_bias", false, "the " + type + " MLP has no biases (mlp_bias false)");
  }
  if (type == "qwen2") {
    config.qkv_bias = true;  // Qwen2Attention: q, k, v with bias, o without
  } else if (type == "mistral" || type == "phi3") {
    fields.require("attention_bias", false, "the " + type + " attention has no biases");
  } else {
    config.qkv_bias = config.o_bias = fields.boolean("attention_bias", false);
  }
  config.qk_norm = type == "qwen3" || type == "gemma3_text";
  config.fused_projections = type == "phi3";
  for (const char* dropout : {"resid_pdrop", "embd_pdrop"}) {
    const json* value = fields.find(dropout);
    TORCH_CHECK(value == nullptr || (value->is_number() && value->get<double>() == 0.0), source,
                ": \"", dropout, "\" = ", value == nullptr ? "" : value->dump(),
                " is not supported: fsdp's decoder has no dropout (0.0)");
  }
  config.qk_norm_full_width = config.post_norms = type == "olmo2";
  config.norm_style = config.gemma      ? NormStyle::kGemma
                      : type == "olmo2" ? NormStyle::kOlmo
                                        : NormStyle::kLlama;

  config.vocab_size = fields.positive("vocab_size");
  config.hidden_size = fields.positive("hidden_size");
  config.intermediate_size = fields.positive("intermediate_size");
  config.num_hidden_layers = fields.positive("num_hidden_layers");
  // A per-layer list is built from this count before any weight is read: bound it (the
  // deepest released decoders have a few hundred layers).
  constexpr int64_t kMaxLayers = 100000;
  TORCH_CHECK(config.num_hidden_layers <= kMaxLayers, source,
              ": \"num_hidden_layers\" = ", config.num_hidden_layers, ": expected at most ",
              kMaxLayers);
  config.num_attention_heads = fields.positive("num_attention_heads");
  config.num_key_value_heads = fields.positive("num_key_value_heads", config.num_attention_heads);
  TORCH_CHECK(config.num_attention_heads % config.num_key_value_heads == 0, source,
              ": \"num_key_value_heads\" = ", config.num_key_value_heads,
              " does not divide \"num_attention_heads\" = ", config.num_attention_heads,
              "; grouped-query attention shares each key/value head among an equal number "
              "of query heads");
  const int64_t family_head_dim = type == "qwen3" ? 128 : config.gemma ? 256 : 0;
  TORCH_CHECK(family_head_dim > 0 || fields.find("head_dim") != nullptr ||
                  config.hidden_size % config.num_attention_heads == 0,
              source, ": \"hidden_size\" = ", config.hidden_size,
              " is not a multiple of \"num_attention_heads\" = ", config.num_attention_heads,
              " and there is no \"head_dim\"; give head_dim");
  config.head_dim = fields.positive(
      "head_dim",
      family_head_dim > 0 ? family_head_dim : config.hidden_size / config.num_attention_heads);
  TORCH_CHECK(config.head_dim % 2 == 0, source, ": \"head_dim\" = ", config.head_dim,
              ": expected an even number (rotary embeddings rotate pairs of dimensions)");
  const int64_t default_positions = type == "llama" || type == "granite" || type == "olmo2" ? 2048
                                    : type == "gemma2"                                      ? 8192
                                    : type == "qwen2" || type == "qwen3"                    ? 32768
                                                                         : 131072;
  config.max_position_embeddings = fields.positive("max_position_embeddings", default_positions);
  config.rms_norm_eps = fields.positive_number("rms_norm_eps", type == "olmo2" ? 1e-5 : 1e-6);
  config.tie_word_embeddings = fields.boolean("tie_word_embeddings", config.gemma);
  if (const json* pad = fields.find("pad_token_id"); pad != nullptr) {
    TORCH_CHECK(pad->is_number_integer() && pad->get<int64_t>() >= -config.vocab_size &&
                    pad->get<int64_t>() < config.vocab_size,
                source, ": \"pad_token_id\" = ", pad->dump(),
                ": expected null or a token id below vocab_size = ", config.vocab_size,
                " (transformers' embedding takes it as padding_idx)");
    config.pad_token_id = (pad->get<int64_t>() + config.vocab_size) % config.vocab_size;
  }
  if (config.gemma) {
    config.attention_scale = 1.0 / std::sqrt(fields.positive_number("query_pre_attn_scalar", 256));
    const bool gemma2 = type == "gemma2";
    for (auto [name, cap, fallback] :
         {std::tuple{"attn_logit_softcapping", &config.attn_logit_softcapping, 50.0},
          std::tuple{"final_logit_softcapping", &config.final_logit_softcapping, 30.0}}) {
      auto it = object.find(name);
      if (it == object.end()) {
        *cap = gemma2 ? fallback : 0.0;
      } else {
        *cap = fields.positive_number(name, 0.0);
      }
    }
  } else {
    config.attention_scale = type == "granite" ? fields.positive_number("attention_multiplier", 1.0)
                                               : 1.0 / std::sqrt(double(config.head_dim));
    fields.refuse("attn_logit_softcapping", "the " + type + " attention has no soft-cap");
    fields.refuse("final_logit_softcapping", "the " + type + " head has no soft-cap");
  }
  if (type == "granite") {
    config.embedding_multiplier = fields.positive_number("embedding_multiplier", 1.0);
    config.residual_multiplier = fields.positive_number("residual_multiplier", 1.0);
    config.logits_scaling = fields.positive_number("logits_scaling", 1.0);
  }
  read_ropes(fields, config);
  read_layer_types(fields, config);
  for (const char* name : {"dtype", "torch_dtype"}) {
    const json* dtype = fields.find(name);
    if (dtype == nullptr) continue;
    TORCH_CHECK(dtype->is_string(), source, ": \"", name, "\" = ", dtype->dump(),
                ": expected a dtype name such as \"float32\" or \"bfloat16\"");
    config.dtype = dtype->get<std::string>();
    break;
  }
  return config;
}

DecoderConfig load_decoder_config(const std::string& path) {
  std::string text;
  try {
    text = read_regular_file(path, "config.json", kMaxJsonBytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.what_without_backtrace(),
                "; --from must be a Hugging Face model folder holding config.json");
  }
  return parse_decoder_config(text, path);
}

std::string supported_model_types() {
  return absl::StrJoin(std::begin(kModelTypes), std::end(kModelTypes), ", ");
}

bool DecoderConfig::has_sliding_layers() const {
  return sliding_window > 0 && std::find(layer_types.begin(), layer_types.end(),
                                         LayerType::kSliding) != layer_types.end();
}

}  // namespace fsdp::models
