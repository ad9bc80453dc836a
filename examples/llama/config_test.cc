#include "examples/llama/config.h"

#include <string>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp::llama {
namespace {

// A config.json as transformers 5 writes it for a small LlamaConfig, with `extra` fields
// appended (JSON keeps the last of duplicate keys).
std::string config_json(const std::string& extra = "") {
  return R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 1, "dtype": "bfloat16", "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
    "intermediate_size": 64, "max_position_embeddings": 64, "mlp_bias": false,
    "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": null, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "tie_word_embeddings": true, "use_cache": true, "vocab_size": 97)" +
         extra + "}";
}

std::string error_of(const std::string& text) {
  try {
    parse_llama_config(text, "cfg.json");
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(LlamaConfigTest, ReadsTransformers5Config) {
  const LlamaConfig c = parse_llama_config(config_json(), "cfg.json");
  EXPECT_EQ(c.vocab_size, 97);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.intermediate_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 8);  // hidden_size / heads
  EXPECT_EQ(c.max_position_embeddings, 64);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.dtype, "bfloat16");
}

TEST(LlamaConfigTest, ReadsTransformers4SpellingAndDefaults) {
  const LlamaConfig c = parse_llama_config(
      R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1000,
          "rope_scaling": null, "torch_dtype": "float16", "head_dim": 6})",
      "cfg.json");
  EXPECT_EQ(c.num_key_value_heads, 2);  // default: num_attention_heads
  EXPECT_EQ(c.head_dim, 6);             // given, not hidden_size / heads
  EXPECT_EQ(c.rope_theta, 1000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.dtype, "float16");
}

TEST(LlamaConfigTest, UnsupportedFieldsAreOneErrorNamingFieldAndValue) {
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "mistral")")),
            "cfg.json: \"model_type\" = \"mistral\" is not supported: examples/llama builds "
            "LlamaForCausalLM only (model_type \"llama\")");
  EXPECT_EQ(error_of(config_json(R"(, "hidden_act": "gelu")")),
            "cfg.json: \"hidden_act\" = \"gelu\" is not supported: the Llama MLP is SwiGLU "
            "(hidden_act \"silu\")");
  EXPECT_EQ(error_of(config_json(R"(, "attention_bias": true)")),
            "cfg.json: \"attention_bias\" = true is not supported: the attention projections "
            "have no bias here (attention_bias false)");
  EXPECT_EQ(error_of(config_json(R"(, "mlp_bias": true)")),
            "cfg.json: \"mlp_bias\" = true is not supported: the MLP projections have no bias "
            "here (mlp_bias false)");
  EXPECT_EQ(error_of(config_json(R"(, "attention_dropout": 0.1)")),
            "cfg.json: \"attention_dropout\" = 0.1 is not supported: examples/llama has no "
            "attention dropout (0.0)");
  EXPECT_EQ(error_of(config_json(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0})")),
            "cfg.json: \"rope_scaling\" = {\"factor\":8.0,\"rope_type\":\"llama3\"} is not "
            "supported: rope_scaling.rope_type = \"llama3\"; examples/llama implements the "
            "original rotary embedding only (rope type \"default\", no scaling)");
  EXPECT_EQ(
      error_of(config_json(R"(, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4})")),
      "cfg.json: \"rope_parameters\" = {\"rope_theta\":10000.0,\"rope_type\":\"yarn\"} is "
      "not supported: rope_parameters.rope_type = \"yarn\"; examples/llama implements "
      "the original rotary embedding only (rope type \"default\", no scaling)");
}

TEST(LlamaConfigTest, BadValuesNameTheField) {
  EXPECT_EQ(error_of(config_json(R"(, "num_key_value_heads": 3)")),
            "cfg.json: \"num_key_value_heads\" = 3 does not divide \"num_attention_heads\" = 4; "
            "grouped-query attention shares each key/value head among an equal number of "
            "query heads");
  EXPECT_EQ(error_of(config_json(R"(, "vocab_size": 0)")),
            "cfg.json: \"vocab_size\" = 0: expected a positive integer");
  EXPECT_EQ(error_of(config_json(R"(, "hidden_size": "32")")),
            "cfg.json: \"hidden_size\" = \"32\": expected a positive integer");
  EXPECT_EQ(error_of(config_json(R"(, "head_dim": 7)")),
            "cfg.json: \"head_dim\" = 7: expected an even number (rotary embeddings rotate "
            "pairs of dimensions)");
  EXPECT_EQ(error_of(R"({"model_type": "llama", "vocab_size": 5})"),
            "cfg.json: the required field \"hidden_size\" is missing; a LlamaConfig saved by "
            "transformers has it");
  EXPECT_EQ(error_of(R"({"vocab_size": 5})"),
            "cfg.json: the field \"model_type\" is missing; expected \"llama\" (a LlamaConfig "
            "saved by transformers)");
  EXPECT_EQ(error_of("{\"model_type\": \"llama\","),
            "cfg.json is not valid JSON: [json.exception.parse_error.101] parse error at line 1, "
            "column 24: syntax error while parsing object key - unexpected end of input; "
            "expected string literal; expected the config.json of a Hugging Face model folder");
  // Nesting is bounded (fsdp/formats/json.h) before anything recurses over the value.
  EXPECT_EQ(error_of("{\"x\": " + std::string(2000, '[') + std::string(2000, ']') + "}"),
            "cfg.json nests arrays and objects deeper than 1000 levels, which fsdp does not "
            "read; expected the config.json of a Hugging Face model folder");
  EXPECT_EQ(error_of("[1, 2]"), "cfg.json: expected a JSON object, found array");
}

TEST(LlamaConfigTest, MissingFileSaysWhatToPass) {
  try {
    load_llama_config("/nonexistent/config.json");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "cannot open config.json '/nonexistent/config.json': No such file or directory; "
              "--from must be a Hugging Face model folder holding config.json");
  }
}

}  // namespace
}  // namespace fsdp::llama
