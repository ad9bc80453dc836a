#include "examples/llama/config.h"

#include <algorithm>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "fsdp/formats/files.h"
#include "fsdp/formats/json.h"

namespace fsdp::llama {
namespace {

using nlohmann::json;

// Reads the fields of one config.json, each error naming the file and the field.
class Fields {
 public:
  Fields(const json& object, std::string source) : object_(object), source_(std::move(source)) {}

  // A positive integer; `fallback` when absent or null (0: required).
  int64_t positive(const char* name, int64_t fallback = 0) const {
    const json* value = find(name);
    if (value == nullptr) {
      TORCH_CHECK(fallback > 0, source_, ": the required field \"", name,
                  "\" is missing; a LlamaConfig saved by transformers has it");
      return fallback;
    }
    TORCH_CHECK(value->is_number_integer() && value->get<int64_t>() > 0, source_, ": \"", name,
                "\" = ", value->dump(), ": expected a positive integer");
    return value->get<int64_t>();
  }

  double positive_number(const char* name, double fallback) const {
    const json* value = find(name);
    if (value == nullptr) return fallback;
    TORCH_CHECK(value->is_number() && value->get<double>() > 0, source_, ": \"", name,
                "\" = ", value->dump(), ": expected a positive number");
    return value->get<double>();
  }

  bool boolean(const char* name, bool fallback) const {
    const json* value = find(name);
    if (value == nullptr) return fallback;
    TORCH_CHECK(value->is_boolean(), source_, ": \"", name, "\" = ", value->dump(),
                ": expected true or false");
    return value->get<bool>();
  }

  // Absent, null or `supported`: else one error saying what examples/llama supports.
  void require(const char* name, const json& supported, const char* why) const {
    const json* value = find(name);
    TORCH_CHECK(value == nullptr || *value == supported, source_, ": \"", name,
                "\" = ", value == nullptr ? "" : value->dump(), " is not supported: ", why);
  }

  // The field, or nullptr when absent or null.
  const json* find(const char* name) const {
    auto it = object_.find(name);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }

  const std::string& source() const { return source_; }

 private:
  const json& object_;
  std::string source_;
};

// "default" rope (no scaling): rope_parameters (transformers 5) or rope_scaling (4.x) may
// say so explicitly; any other type changes the rotary frequencies.
double read_rope_theta(const Fields& fields) {
  double theta = fields.positive_number("rope_theta", 10000.0);
  for (const char* name : {"rope_parameters", "rope_scaling"}) {
    const json* rope = fields.find(name);
    if (rope == nullptr) continue;
    TORCH_CHECK(rope->is_object(), fields.source(), ": \"", name, "\" = ", rope->dump(),
                ": expected an object or null");
    for (const char* key : {"rope_type", "type"}) {
      auto type = rope->find(key);
      TORCH_CHECK(type == rope->end() || type->is_null() || *type == "default", fields.source(),
                  ": \"", name, "\" = ", rope->dump(), " is not supported: ", name, ".", key, " = ",
                  type->dump(),
                  "; examples/llama implements the original rotary embedding only (rope type "
                  "\"default\", no scaling)");
    }
    auto base = rope->find("rope_theta");
    if (base != rope->end() && !base->is_null()) {
      TORCH_CHECK(base->is_number() && base->get<double>() > 0, fields.source(), ": \"", name,
                  ".rope_theta\" = ", base->dump(), ": expected a positive number");
      theta = base->get<double>();
    }
  }
  return theta;
}

}  // namespace

LlamaConfig parse_llama_config(const std::string& json_text, const std::string& source) {
  const json object = parse_untrusted_json(
      json_text, source, "expected the config.json of a Hugging Face model folder");
  TORCH_CHECK(object.is_object(), source, ": expected a JSON object, found ", object.type_name());
  const Fields fields(object, source);
  const json* model_type = fields.find("model_type");
  TORCH_CHECK(model_type != nullptr, source,
              ": the field \"model_type\" is missing; expected \"llama\" (a LlamaConfig saved "
              "by transformers)");
  fields.require("model_type", "llama",
                 "examples/llama builds LlamaForCausalLM only (model_type \"llama\")");
  fields.require("hidden_act", "silu", "the Llama MLP is SwiGLU (hidden_act \"silu\")");
  fields.require("attention_bias", false,
                 "the attention projections have no bias here (attention_bias false)");
  fields.require("mlp_bias", false, "the MLP projections have no bias here (mlp_bias false)");
  const json* dropout = fields.find("attention_dropout");
  TORCH_CHECK(dropout == nullptr || (dropout->is_number() && dropout->get<double>() == 0.0), source,
              ": \"attention_dropout\" = ", dropout == nullptr ? "" : dropout->dump(),
              " is not supported: examples/llama has no attention dropout (0.0)");

  LlamaConfig config;
  config.vocab_size = fields.positive("vocab_size");
  config.hidden_size = fields.positive("hidden_size");
  config.intermediate_size = fields.positive("intermediate_size");
  config.num_hidden_layers = fields.positive("num_hidden_layers");
  config.num_attention_heads = fields.positive("num_attention_heads");
  config.num_key_value_heads = fields.positive("num_key_value_heads", config.num_attention_heads);
  TORCH_CHECK(config.num_attention_heads % config.num_key_value_heads == 0, source,
              ": \"num_key_value_heads\" = ", config.num_key_value_heads,
              " does not divide \"num_attention_heads\" = ", config.num_attention_heads,
              "; grouped-query attention shares each key/value head among an equal number "
              "of query heads");
  TORCH_CHECK(
      fields.find("head_dim") != nullptr || config.hidden_size % config.num_attention_heads == 0,
      source, ": \"hidden_size\" = ", config.hidden_size,
      " is not a multiple of \"num_attention_heads\" = ", config.num_attention_heads,
      " and there is no \"head_dim\"; give head_dim");
  config.head_dim = fields.positive(
      "head_dim", config.hidden_size / std::max<int64_t>(1, config.num_attention_heads));
  TORCH_CHECK(config.head_dim % 2 == 0, source, ": \"head_dim\" = ", config.head_dim,
              ": expected an even number (rotary embeddings rotate pairs of dimensions)");
  config.max_position_embeddings = fields.positive("max_position_embeddings", 2048);
  config.rms_norm_eps = fields.positive_number("rms_norm_eps", 1e-6);
  config.rope_theta = read_rope_theta(fields);
  config.tie_word_embeddings = fields.boolean("tie_word_embeddings", false);
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

LlamaConfig load_llama_config(const std::string& path) {
  std::string text;
  try {
    text = read_regular_file(path, "config.json", kMaxJsonBytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.what_without_backtrace(),
                "; --from must be a Hugging Face model folder holding config.json");
  }
  return parse_llama_config(text, path);
}

}  // namespace fsdp::llama
