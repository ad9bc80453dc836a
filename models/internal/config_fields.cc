#include "models/internal/config_fields.h"

#include <cmath>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

namespace fsdp::models_internal {

using models::DecoderConfig;
using models::LayerType;
using models::RopeConfig;
using nlohmann::json;

ConfigFields::ConfigFields(const json& object, std::string source, std::string prefix)
    : object_(object), source_(std::move(source)), prefix_(std::move(prefix)) {}

int64_t ConfigFields::positive(const char* name, int64_t fallback) const {
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

int64_t ConfigFields::count_or_null(const char* name, int64_t fallback) const {
  auto it = object_.find(name);
  if (it == object_.end()) return fallback;
  if (it->is_null()) return 0;
  TORCH_CHECK(it->is_number_integer() && it->get<int64_t>() >= 0, source_, ": \"", prefix_, name,
              "\" = ", it->dump(), ": expected a non-negative integer or null");
  return it->get<int64_t>();
}

double ConfigFields::positive_number(const char* name, double fallback) const {
  const json* value = find(name);
  if (value == nullptr) return fallback;
  TORCH_CHECK(value->is_number() && value->get<double>() > 0, source_, ": \"", prefix_, name,
              "\" = ", value->dump(), ": expected a positive number");
  return value->get<double>();
}

bool ConfigFields::boolean(const char* name, bool fallback) const {
  const json* value = find(name);
  if (value == nullptr) return fallback;
  TORCH_CHECK(value->is_boolean(), source_, ": \"", prefix_, name, "\" = ", value->dump(),
              ": expected true or false");
  return value->get<bool>();
}

std::string ConfigFields::string(const char* name, const std::string& fallback) const {
  const json* value = find(name);
  if (value == nullptr) return fallback;
  TORCH_CHECK(value->is_string(), source_, ": \"", prefix_, name, "\" = ", value->dump(),
              ": expected a string");
  return value->get<std::string>();
}

void ConfigFields::require(const char* name, const json& supported, const std::string& why) const {
  const json* value = find(name);
  TORCH_CHECK(value == nullptr || *value == supported, source_, ": \"", prefix_, name,
              "\" = ", value == nullptr ? "" : value->dump(), " is not supported: ", why);
}

void ConfigFields::refuse(const char* name, const std::string& why) const {
  const json* value = find(name);
  TORCH_CHECK(value == nullptr, source_, ": \"", prefix_, name, "\" = ", value->dump(),
              " is not supported: ", why);
}

void ConfigFields::require_zero(const char* name, const std::string& why) const {
  const json* value = find(name);
  TORCH_CHECK(value == nullptr || (value->is_number() && value->get<double>() == 0.0), source_,
              ": \"", prefix_, name, "\" = ", value == nullptr ? "" : value->dump(),
              " is not supported: ", why);
}

const json* ConfigFields::find(const char* name) const {
  auto it = object_.find(name);
  return it == object_.end() || it->is_null() ? nullptr : &*it;
}

const json* ConfigFields::object(const char* name) const {
  const json* value = find(name);
  TORCH_CHECK(value == nullptr || value->is_object(), source_, ": \"", prefix_, name,
              "\" = ", value == nullptr ? "" : value->dump(), ": expected an object or null");
  return value;
}

bool ConfigFields::has(const char* name) const { return object_.contains(name); }

namespace {

// A list of positive numbers (longrope's factors).
std::vector<double> positive_numbers(const ConfigFields& fields, const char* name) {
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
                     int64_t top_original, const ConfigFields& top, const std::string& name) {
  TORCH_CHECK(entry.is_object(), top.source(), ": \"", name, "\" = ", entry.dump(),
              ": expected an object or null");
  const ConfigFields fields(entry, top.source(), name + ".");
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
    rope.truncate = fields.boolean("truncate", true);
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

// The RoPE of full-attention layers and (rope_per_layer_type) of sliding ones; the
// full layers' rope_theta defaults to `theta`. See Note [RoPE spellings].
void read_ropes(const ConfigFields& fields, double theta, DecoderConfig& config) {
  const bool per_layer_type = config.rope_per_layer_type;
  const json* scaling = fields.object("rope_scaling");
  const json* parameters = fields.object("rope_parameters");
  RopeConfig defaults, local_defaults;
  defaults.theta = fields.positive_number("rope_theta", theta);
  local_defaults.theta = fields.positive_number("rope_local_base_freq", 10000.0);
  defaults.partial_rotary_factor = local_defaults.partial_rotary_factor =
      fields.positive_number("partial_rotary_factor", 1.0);
  const int64_t top_original = fields.count_or_null("original_max_position_embeddings", 0);
  const bool nested = parameters != nullptr && (parameters->contains("full_attention") ||
                                                parameters->contains("sliding_attention"));
  if (nested) {
    TORCH_CHECK(per_layer_type, fields.source(), ": \"rope_parameters\" = ", parameters->dump(),
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
  if (per_layer_type) {
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

// num_hidden_layers .. head_dim: the model's sizes, checked against each other.
void read_sizes(const ConfigFields& fields, const FamilyDefaults& defaults, DecoderConfig& config) {
  const std::string& source = fields.source();
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
  TORCH_CHECK(defaults.head_dim > 0 || fields.find("head_dim") != nullptr ||
                  config.hidden_size % config.num_attention_heads == 0,
              source, ": \"hidden_size\" = ", config.hidden_size,
              " is not a multiple of \"num_attention_heads\" = ", config.num_attention_heads,
              " and there is no \"head_dim\"; give head_dim");
  config.head_dim = fields.positive(
      "head_dim",
      defaults.head_dim > 0 ? defaults.head_dim : config.hidden_size / config.num_attention_heads);
  TORCH_CHECK(config.head_dim % 2 == 0, source, ": \"head_dim\" = ", config.head_dim,
              ": expected an even number (rotary embeddings rotate pairs of dimensions)");
}

// The embedding's padding_idx from pad_token_id (negative ids count from the end).
void read_pad_token(const ConfigFields& fields, DecoderConfig& config) {
  const json* pad = fields.find("pad_token_id");
  if (pad == nullptr) return;
  TORCH_CHECK(pad->is_number_integer() && pad->get<int64_t>() >= -config.vocab_size &&
                  pad->get<int64_t>() < config.vocab_size,
              fields.source(), ": \"pad_token_id\" = ", pad->dump(),
              ": expected null or a token id below vocab_size = ", config.vocab_size,
              " (transformers' embedding takes it as padding_idx)");
  config.pad_token_id = (pad->get<int64_t>() + config.vocab_size) % config.vocab_size;
}

// "dtype", or 4.x's "torch_dtype".
void read_dtype(const ConfigFields& fields, DecoderConfig& config) {
  for (const char* name : {"dtype", "torch_dtype"}) {
    const json* dtype = fields.find(name);
    if (dtype == nullptr) continue;
    TORCH_CHECK(dtype->is_string(), fields.source(), ": \"", name, "\" = ", dtype->dump(),
                ": expected a dtype name such as \"float32\" or \"bfloat16\"");
    config.dtype = dtype->get<std::string>();
    return;
  }
}

}  // namespace

// Note [RoPE spellings]
// transformers 5 writes "rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}; 4.x
// wrote a top-level "rope_theta" and "rope_scaling" (null, or {"type" or "rope_type",
// "factor", ...}). transformers 5 still reads both, rope_scaling first, rope_theta filling
// in a missing base; we do the same. Gemma 3 has two rotary embeddings: 5.x nests
// rope_parameters as {"full_attention": {...}, "sliding_attention": {...}}; 4.x gave the
// full layers' base as rope_theta (default 1e6) with rope_scaling (the 4 B and larger
// checkpoints scale them linearly by 8) and the sliding layers' as rope_local_base_freq
// (default 1e4, unscaled). For llama3 and yarn a missing original_max_position_embeddings
// is max_position_embeddings, and yarn's missing factor is max_position_embeddings /
// original_max_position_embeddings, as transformers' standardize_rope_params and
// _compute_yarn_parameters do.
void read_shared_fields(const ConfigFields& fields, const FamilyDefaults& defaults,
                        DecoderConfig& config) {
  fields.require_zero("attention_dropout", "fsdp's decoder has no attention dropout (0.0)");
  for (const char* dropout : {"resid_pdrop", "embd_pdrop"}) {
    fields.require_zero(dropout, "fsdp's decoder has no dropout (0.0)");
  }
  read_sizes(fields, defaults, config);
  config.max_position_embeddings =
      fields.positive("max_position_embeddings", defaults.max_position_embeddings);
  config.rms_norm_eps = fields.positive_number("rms_norm_eps", defaults.rms_norm_eps);
  config.tie_word_embeddings = fields.boolean("tie_word_embeddings", defaults.tie_word_embeddings);
  read_pad_token(fields, config);
  config.attention_scale = 1.0 / std::sqrt(double(config.head_dim));
  read_ropes(fields, defaults.rope_theta, config);
  read_dtype(fields, config);
}

void read_attention_bias(const ConfigFields& fields, DecoderConfig& config) {
  config.qkv_bias = config.o_bias = fields.boolean("attention_bias", false);
}

void refuse_mlp_bias(const ConfigFields& fields, const DecoderConfig& config) {
  fields.require("mlp_bias", false,
                 "the " + config.model_type + " MLP has no biases (mlp_bias false)");
}

// Note [Sliding windows]
// A sliding layer's query at position i sees keys i - sliding_window + 1 .. i
// (transformers' sliding_window_overlay: kv_idx > q_idx - sliding_window). Which layers
// slide is each family's rule in transformers' config classes (config_families.h):
// Mistral every layer when sliding_window is not null; Qwen2/Qwen3 none unless
// use_sliding_window, then layers max_window_layers.. (and sliding_window is read only
// then); Gemma 2 every other layer starting with the first, Gemma 3 all but every
// sliding_window_pattern-th (4.x; default 6). An explicit layer_types list (5.x)
// overrides the rule, except for Llama and Mistral, whose transformers classes do not
// read it.
void read_layer_types_list(const ConfigFields& fields, DecoderConfig& config) {
  const json* given = fields.find("layer_types");
  if (given == nullptr) return;
  const int64_t layers = config.num_hidden_layers;
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

}  // namespace fsdp::models_internal
