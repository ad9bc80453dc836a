// What every family's config reader (config_families.h) reads config.json with: one
// JSON object's fields, each checked as it is read, and the fields all families share
// (sizes, heads, RoPE, layer types, dtype). Not a public API. Errors: c10::Error, one line
// naming the file, the field and its value, and what is expected.
#ifndef FSDP_MODELS_INTERNAL_CONFIG_FIELDS_H_
#define FSDP_MODELS_INTERNAL_CONFIG_FIELDS_H_

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "models/config.h"

namespace fsdp::models_internal {

// Reads the fields of one JSON object of a config.json, each error naming the file and
// the field (`prefix` is the path of the object, e.g. "rope_parameters.").
class ConfigFields {
 public:
  ConfigFields(const nlohmann::json& object, std::string source, std::string prefix = "");

  // A positive integer; `fallback` when absent or null (0: required).
  int64_t positive(const char* name, int64_t fallback = 0) const;
  // A non-negative integer or null (0); `fallback` when absent.
  int64_t count_or_null(const char* name, int64_t fallback) const;
  double positive_number(const char* name, double fallback) const;
  bool boolean(const char* name, bool fallback) const;
  std::string string(const char* name, const std::string& fallback) const;

  // Absent, null or `supported`: else one error saying what is supported.
  void require(const char* name, const nlohmann::json& supported, const std::string& why) const;
  // Absent or null: else one error naming the field and its value.
  void refuse(const char* name, const std::string& why) const;
  // Absent, null or a number equal to 0: else "<why> (0.0)" (dropout probabilities).
  void require_zero(const char* name, const std::string& why) const;

  // The field, or nullptr when absent or null.
  const nlohmann::json* find(const char* name) const;
  // The field as an object, or nullptr when absent or null.
  const nlohmann::json* object(const char* name) const;
  // Whether the object has the field at all (null included).
  bool has(const char* name) const;

  const nlohmann::json& json_object() const { return object_; }
  const std::string& source() const { return source_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const nlohmann::json& object_;
  std::string source_;
  std::string prefix_;
};

// What a family's transformers config class gives the shared fields when config.json
// does not.
struct FamilyDefaults {
  int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  double rope_theta = 10000.0;  // of the full-attention layers
};

// The fields every family has, read after the family's switches are set (the RoPE
// reader needs rope_per_layer_type): dropouts (refused), sizes and heads, head_dim,
// positions, the norms' eps, tied embeddings, the padding token, RoPE (Note [RoPE
// spellings]), attention_scale = head_dim^-0.5 (a family may set another after) and the
// dtype. Layer types are the family's (see below).
void read_shared_fields(const ConfigFields& fields, const FamilyDefaults& defaults,
                        models::DecoderConfig& config);

// The attention's biases as attention_bias says (q, k, v and o alike; default none).
void read_attention_bias(const ConfigFields& fields, models::DecoderConfig& config);

// mlp_bias absent, null or false: "the <model_type> MLP has no biases".
void refuse_mlp_bias(const ConfigFields& fields, const models::DecoderConfig& config);

// An explicit "layer_types" list (transformers 5) over the family's rule, when given.
// See Note [Sliding windows].
void read_layer_types_list(const ConfigFields& fields, models::DecoderConfig& config);

}  // namespace fsdp::models_internal

#endif  // FSDP_MODELS_INTERNAL_CONFIG_FIELDS_H_
