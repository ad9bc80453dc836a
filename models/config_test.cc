#include "models/config.h"

#include <cmath>
#include <string>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace fsdp::models {
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
    parse_decoder_config(text, "cfg.json");
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(DecoderConfigTest, ReadsTransformers5Config) {
  const DecoderConfig c = parse_decoder_config(config_json(), "cfg.json");
  EXPECT_EQ(c.vocab_size, 97);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.intermediate_size, 64);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 8);  // hidden_size / heads
  EXPECT_EQ(c.max_position_embeddings, 64);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope.theta, 500000.0);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.dtype, "bfloat16");
  EXPECT_EQ(c.pad_token_id, -1);  // null
  EXPECT_EQ(parse_decoder_config(config_json(R"(, "pad_token_id": 3)"), "cfg.json").pad_token_id,
            3);
  EXPECT_EQ(error_of(config_json(R"(, "pad_token_id": 97)")),
            "cfg.json: \"pad_token_id\" = 97: expected null or a token id below vocab_size = 97 "
            "(transformers' embedding takes it as padding_idx)");
}

TEST(DecoderConfigTest, ReadsTransformers4SpellingAndDefaults) {
  const DecoderConfig c = parse_decoder_config(
      R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1000,
          "rope_scaling": null, "torch_dtype": "float16", "head_dim": 6})",
      "cfg.json");
  EXPECT_EQ(c.num_key_value_heads, 2);  // default: num_attention_heads
  EXPECT_EQ(c.head_dim, 6);             // given, not hidden_size / heads
  EXPECT_EQ(c.rope.theta, 1000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.dtype, "float16");
}

TEST(DecoderConfigTest, UnsupportedFieldsAreOneErrorNamingFieldAndValue) {
  EXPECT_EQ(error_of(config_json(R"(, "hidden_act": "gelu")")),
            "cfg.json: \"hidden_act\" = \"gelu\" is not supported: the MLP is SwiGLU "
            "(hidden_act \"silu\")");
  EXPECT_EQ(error_of(config_json(R"(, "attention_dropout": 0.1)")),
            "cfg.json: \"attention_dropout\" = 0.1 is not supported: fsdp's decoder has no "
            "attention dropout (0.0)");
  EXPECT_EQ(error_of(config_json(R"(, "attn_logit_softcapping": 50.0)")),
            "cfg.json: \"attn_logit_softcapping\" = 50.0 is not supported: the llama attention "
            "has no soft-cap");
}

// Item 3 of the families issue: each architecture feature the decoder lacks stops the run
// at its config with one line naming the field, its value and what is supported.
TEST(DecoderConfigTest, OtherArchitecturesAreRefusedByName) {
  const std::string families =
      "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, granite, olmo2, phi3, qwen3_moe, "
      "mixtral, olmoe, qwen2_moe, gpt_oss, deepseek_v3";
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "gpt_neox")")),
            "cfg.json: \"model_type\" = \"gpt_neox\" is not supported: fsdp's decoder builds " +
                families);
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "deepseek_v2")")),
            "cfg.json: \"model_type\" = \"deepseek_v2\" is not supported: DeepSeek-V2's "
            "routing (softmax scores, greedy or group-limited top-k, its load-balancing losses) "
            "is not implemented; fsdp's decoder builds " +
                families);
  EXPECT_EQ(error_of(config_json(R"(, "num_local_experts": 8)")),
            "cfg.json: \"num_local_experts\" = 8 is not supported: mixture-of-experts layers "
            "are built for the model types qwen3_moe, mixtral, olmoe, qwen2_moe, gpt_oss and "
            "deepseek_v3 only; a llama decoder has one dense MLP per layer");
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "gemma3", "text_config": {})")),
            "cfg.json: \"model_type\" = \"gemma3\" is not supported: a multimodal Gemma 3 "
            "folder (vision tower and text_config); fsdp's decoder builds its language model "
            "only from a \"gemma3_text\" folder (Gemma3ForCausalLM), and does not carry the "
            "vision tower");
  EXPECT_EQ(error_of(config_json(R"(, "vision_config": {"hidden_size": 8})")),
            "cfg.json: \"vision_config\" = {\"hidden_size\":8} is not supported: a multimodal "
            "folder; fsdp's decoder builds text models only");
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "qwen3", "layer_types":
                                    ["full_attention", "linear_attention"])")),
            "cfg.json: \"layer_types\"[1] = \"linear_attention\" is not supported: fsdp's "
            "decoder implements \"full_attention\" and \"sliding_attention\" layers");
  EXPECT_EQ(error_of(config_json(R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0})")),
            "cfg.json: \"rope_scaling.rope_type\" = \"dynamic\" is not supported: fsdp's "
            "decoder implements the rope types default, linear, llama3, yarn and longrope");
  EXPECT_EQ(error_of(config_json(
                R"(, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4})")),
            "cfg.json: \"rope_parameters.rope_type\" = \"proportional\" is not supported: fsdp's "
            "decoder implements the rope types default, linear, llama3, yarn and longrope");
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "phi3", "resid_pdrop": 0.1)")),
            "cfg.json: \"resid_pdrop\" = 0.1 is not supported: fsdp's decoder has no dropout "
            "(0.0)");
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "gemma3_text",
                                    "hidden_activation": "gelu_pytorch_tanh",
                                    "use_bidirectional_attention": true)")),
            "cfg.json: \"use_bidirectional_attention\" = true is not supported: fsdp's decoder "
            "is causal (use_bidirectional_attention false)");
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "mistral", "attention_bias": true)")),
            "cfg.json: \"attention_bias\" = true is not supported: the mistral attention has "
            "no biases");
}

// The per-family options, in transformers 5.x spellings and the 4.x ones (hand-written).
// quantization_config as transformers 5.23 saves BitsAndBytesConfig(load_in_4bit=True,
// bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
// bnb_4bit_compute_dtype=torch.bfloat16), with `change` merged into it.
std::string bnb_4bit_json(const std::string& change = "") {
  return config_json(R"(, "quantization_config": {"_load_in_4bit": true, "_load_in_8bit": false,
    "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
    "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
    "llm_int8_enable_fp32_cpu_offload": false, "llm_int8_has_fp16_weight": false,
    "llm_int8_skip_modules": null, "llm_int8_threshold": 6.0, "load_in_4bit": true,
    "load_in_8bit": false, "quant_method": "bitsandbytes")" +
                     change + "}");
}

TEST(DecoderConfigTest, Bitsandbytes4BitNf4IsReadOtherQuantizationRefusedByName) {
  EXPECT_FALSE(parse_decoder_config(config_json(), "cfg.json").load_in_4bit);
  EXPECT_TRUE(parse_decoder_config(bnb_4bit_json(), "cfg.json").load_in_4bit);
  const std::string nf4 =
      " is not supported: fsdp reads bitsandbytes' 4-bit NF4 with double quantization "
      "(load_in_4bit true, bnb_4bit_quant_type \"nf4\", bnb_4bit_use_double_quant true)";
  EXPECT_EQ(error_of(config_json(R"(, "quantization_config": {"quant_method": "gptq"})")),
            "cfg.json: \"quantization_config\" = {\"quant_method\":\"gptq\"} is not supported: "
            "quantised weights other than bitsandbytes' (FP8, GPTQ, AWQ, ...) are not "
            "implemented; fsdp reads bitsandbytes' 4-bit NF4 with double quantization "
            "(load_in_4bit true, bnb_4bit_quant_type \"nf4\", bnb_4bit_use_double_quant true)");
  EXPECT_EQ(
      error_of(config_json(R"(, "quantization_config": {"quant_method": "gptq", "bits": 4})")),
      "cfg.json: \"quantization_config\" = {\"bits\":4,\"quant_method\":\"gptq\"} is not "
      "supported: quantised weights other than bitsandbytes' (FP8, GPTQ, AWQ, ...) are not "
      "implemented; fsdp reads bitsandbytes' 4-bit NF4 with double quantization "
      "(load_in_4bit true, bnb_4bit_quant_type \"nf4\", bnb_4bit_use_double_quant true)");
  EXPECT_EQ(error_of(bnb_4bit_json(R"(, "load_in_4bit": false, "load_in_8bit": true)")),
            "cfg.json: \"quantization_config.load_in_8bit\" = true is not supported: 8-bit "
            "weights (LLM.int8) are not implemented; fsdp reads bitsandbytes' 4-bit NF4 with "
            "double quantization (load_in_4bit true, bnb_4bit_quant_type \"nf4\", "
            "bnb_4bit_use_double_quant true)");
  EXPECT_EQ(error_of(config_json(R"(, "quantization_config": {"quant_method": "bitsandbytes"})")),
            "cfg.json: \"quantization_config.load_in_4bit\" = false (transformers' default)" + nf4);
  EXPECT_EQ(error_of(bnb_4bit_json(R"(, "bnb_4bit_quant_type": "fp4")")),
            "cfg.json: \"quantization_config.bnb_4bit_quant_type\" = \"fp4\"" + nf4);
  EXPECT_EQ(error_of(bnb_4bit_json(R"(, "bnb_4bit_use_double_quant": false)")),
            "cfg.json: \"quantization_config.bnb_4bit_use_double_quant\" = false" + nf4);
  EXPECT_EQ(error_of(bnb_4bit_json(R"(, "bnb_4bit_quant_storage": "bfloat16")")),
            "cfg.json: \"quantization_config.bnb_4bit_quant_storage\" = \"bfloat16\" is not "
            "supported: fsdp reads the 4-bit codes packed two to a byte (uint8)");
  // Any compute dtype of bitsandbytes' (transformers' default float32 too): it changes no
  // stored byte.
  EXPECT_TRUE(
      parse_decoder_config(bnb_4bit_json(R"(, "bnb_4bit_compute_dtype": "float32")"), "cfg.json")
          .load_in_4bit);
  EXPECT_EQ(error_of(bnb_4bit_json(R"(, "bnb_4bit_compute_dtype": "int8")")),
            "cfg.json: \"quantization_config.bnb_4bit_compute_dtype\" = \"int8\" is not a "
            "dtype bitsandbytes computes in: expected \"float32\", \"bfloat16\" or \"float16\"");
}

TEST(DecoderConfigTest, Llama3AndYarnRope) {
  DecoderConfig c = parse_decoder_config(
      config_json(R"(, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
          "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}, "attention_bias": true, "mlp_bias": true)"),
      "cfg.json");
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_EQ(c.rope.theta, 5e5);
  EXPECT_EQ(c.rope.factor, 8.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 16);
  EXPECT_TRUE(c.qkv_bias && c.o_bias && c.mlp_bias);
  EXPECT_FALSE(c.has_sliding_layers());
  // 4.x: rope_scaling with "type", rope_theta beside it; yarn's defaults.
  c = parse_decoder_config(config_json(R"(, "rope_parameters": null, "rope_theta": 1e6,
          "rope_scaling": {"type": "yarn", "factor": 4.0})"),
                           "cfg.json");
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.rope.factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 64);  // max_position_embeddings
  EXPECT_EQ(c.rope.beta_fast, 32.0);
  EXPECT_EQ(c.rope.beta_slow, 1.0);
}

TEST(DecoderConfigTest, QwenSlidingWindowAsTransformersReadsIt) {
  const std::string qwen = R"(, "model_type": "qwen2", "num_hidden_layers": 3,
      "sliding_window": 8, "max_window_layers": 1)";
  DecoderConfig c = parse_decoder_config(config_json(qwen), "cfg.json");
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_EQ(c.sliding_window, 0);  // use_sliding_window absent: false
  EXPECT_FALSE(c.has_sliding_layers());
  c = parse_decoder_config(config_json(qwen + R"(, "use_sliding_window": true)"), "cfg.json");
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.layer_types,
            (std::vector<LayerType>{LayerType::kFull, LayerType::kSliding, LayerType::kSliding}));
  c = parse_decoder_config(
      config_json(qwen + R"(, "model_type": "qwen3", "head_dim": 16, "use_sliding_window": true,
          "layer_types": ["sliding_attention", "full_attention", "full_attention"])"),
      "cfg.json");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.layer_types,
            (std::vector<LayerType>{LayerType::kSliding, LayerType::kFull, LayerType::kFull}));
  c = parse_decoder_config(config_json(R"(, "model_type": "mistral", "sliding_window": 5)"),
                           "cfg.json");
  EXPECT_EQ(c.sliding_window, 5);
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{LayerType::kSliding, LayerType::kSliding}));
}

TEST(DecoderConfigTest, GemmaFamilies) {
  const std::string gemma = R"(, "hidden_activation": "gelu_pytorch_tanh",
      "num_hidden_layers": 4, "sliding_window": 6, "query_pre_attn_scalar": 16)";
  DecoderConfig c =
      parse_decoder_config(config_json(gemma + R"(, "model_type": "gemma2")"), "cfg.json");
  EXPECT_TRUE(c.gemma);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.attention_scale, 0.25);
  EXPECT_EQ(c.attn_logit_softcapping, 50.0);  // Gemma2Config's defaults
  EXPECT_EQ(c.final_logit_softcapping, 30.0);
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{LayerType::kSliding, LayerType::kFull,
                                                   LayerType::kSliding, LayerType::kFull}));
  // Gemma 3 in 4.x spelling: sliding_window_pattern, rope_theta + rope_scaling for the full
  // layers, rope_local_base_freq for the sliding ones.
  c = parse_decoder_config(
      config_json(gemma + R"(, "model_type": "gemma3_text", "rope_parameters": null,
          "sliding_window_pattern": 3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0})"),
      "cfg.json");
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.attn_logit_softcapping, 0.0);
  EXPECT_EQ(c.final_logit_softcapping, 0.0);
  EXPECT_EQ(c.layer_types, (std::vector<LayerType>{LayerType::kSliding, LayerType::kSliding,
                                                   LayerType::kFull, LayerType::kSliding}));
  EXPECT_EQ(c.rope.type, "linear");
  EXPECT_EQ(c.rope.factor, 8.0);
  EXPECT_EQ(c.rope.theta, 1e6);
  EXPECT_EQ(c.sliding_rope.type, "default");
  EXPECT_EQ(c.sliding_rope.theta, 1e4);
  // 5.x: rope_parameters nested per layer type.
  c = parse_decoder_config(
      config_json(gemma + R"(, "model_type": "gemma3_text", "rope_parameters": {
          "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2e5},
          "sliding_attention": {"rope_type": "default", "rope_theta": 3e3}})"),
      "cfg.json");
  EXPECT_EQ(c.rope.factor, 2.0);
  EXPECT_EQ(c.rope.theta, 2e5);
  EXPECT_EQ(c.sliding_rope.theta, 3e3);
  EXPECT_EQ(c.layer_types, std::vector<LayerType>(4, LayerType::kSliding));  // pattern 6
}

TEST(DecoderConfigTest, GraniteMultipliersAndOlmo2Norms) {
  DecoderConfig c =
      parse_decoder_config(config_json(R"(, "model_type": "granite", "embedding_multiplier": 12.0,
          "attention_multiplier": 0.015625, "residual_multiplier": 0.22, "logits_scaling": 8.0)"),
                           "cfg.json");
  EXPECT_EQ(c.embedding_multiplier, 12.0);
  EXPECT_EQ(c.attention_scale, 0.015625);
  EXPECT_EQ(c.residual_multiplier, 0.22);
  EXPECT_EQ(c.logits_scaling, 8.0);
  EXPECT_EQ(c.norm_style, NormStyle::kLlama);
  c = parse_decoder_config(config_json(R"(, "model_type": "olmo2")"), "cfg.json");
  EXPECT_TRUE(c.qk_norm_full_width && c.post_norms);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.norm_style, NormStyle::kOlmo);
  EXPECT_EQ(c.attention_scale, 1.0 / std::sqrt(8.0));
  EXPECT_EQ(c.embedding_multiplier, 1.0);
}

// Each family's reader sets the switches the decoder reads (the decoder never compares
// family names).
TEST(DecoderConfigTest, EachFamilySetsTheDecodersSwitches) {
  struct Family {
    const char* model_type;
    Activation activation;
    NormStyle norm_style;
    bool sandwich_norms, scale_embeddings, rope_per_layer_type, post_norms;
  };
  const Family families[] = {
      {"llama", Activation::kSilu, NormStyle::kLlama, false, false, false, false},
      {"mistral", Activation::kSilu, NormStyle::kLlama, false, false, false, false},
      {"qwen2", Activation::kSilu, NormStyle::kLlama, false, false, false, false},
      {"qwen3", Activation::kSilu, NormStyle::kLlama, false, false, false, false},
      {"gemma2", Activation::kGeluTanh, NormStyle::kGemma, true, true, false, false},
      {"gemma3_text", Activation::kGeluTanh, NormStyle::kGemma, true, true, true, false},
      {"granite", Activation::kSilu, NormStyle::kLlama, false, false, false, false},
      {"olmo2", Activation::kSilu, NormStyle::kOlmo, false, false, false, true},
      {"phi3", Activation::kSilu, NormStyle::kLlama, false, false, false, false},
  };
  for (const Family& f : families) {
    const DecoderConfig c = parse_decoder_config(
        config_json(std::string(R"(, "hidden_activation": "gelu_pytorch_tanh", "model_type": ")") +
                    f.model_type + "\""),
        "cfg.json");
    EXPECT_EQ(c.model_type, f.model_type);
    EXPECT_EQ(c.activation, f.activation) << f.model_type;
    EXPECT_EQ(c.norm_style, f.norm_style) << f.model_type;
    EXPECT_EQ(c.sandwich_norms, f.sandwich_norms) << f.model_type;
    EXPECT_EQ(c.scale_embeddings, f.scale_embeddings) << f.model_type;
    EXPECT_EQ(c.rope_per_layer_type, f.rope_per_layer_type) << f.model_type;
    EXPECT_EQ(c.post_norms, f.post_norms) << f.model_type;
  }
}

TEST(DecoderConfigTest, Phi3FusedProjectionsPartialRotaryLongrope) {
  // 4.x spelling: rope_scaling with "type" and a top-level original_max_position_embeddings.
  const DecoderConfig c = parse_decoder_config(
      config_json(R"(, "model_type": "phi3", "rope_parameters": null, "rope_theta": 1e4,
          "partial_rotary_factor": 0.5, "original_max_position_embeddings": 16,
          "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5],
                           "long_factor": [2.0, 3.0]}, "sliding_window": null)"),
      "cfg.json");
  EXPECT_TRUE(c.fused_projections);
  EXPECT_EQ(c.rotary_dim, 4);  // head_dim 8 x 0.5
  EXPECT_EQ(c.rope.type, "longrope");
  EXPECT_EQ(c.rope.original_max_position_embeddings, 16);
  EXPECT_EQ(c.rope.factor, 4.0);  // max_position_embeddings / original
  EXPECT_EQ(c.rope.attention_factor, std::sqrt(1 + std::log(4.0) / std::log(16.0)));
  EXPECT_EQ(c.rope.long_factor, (std::vector<double>{2.0, 3.0}));
  EXPECT_EQ(c.rope.short_factor, (std::vector<double>{1.0, 1.5}));
  EXPECT_FALSE(c.has_sliding_layers());
  EXPECT_EQ(error_of(config_json(R"(, "model_type": "phi3", "rope_parameters": {"rope_type":
          "longrope", "short_factor": [1.0], "long_factor": [2.0, 3.0, 4.0, 5.0]})")),
            "cfg.json: longrope's long_factor and short_factor have 4 and 1 entries: expected "
            "one per rotated pair, 4");
  EXPECT_EQ(error_of(config_json(R"(, "partial_rotary_factor": 0.25, "head_dim": 6)")),
            "cfg.json: partial_rotary_factor 0.25 of head_dim 6 rotates 1 dimensions: expected "
            "a positive even number");
}

TEST(DecoderConfigTest, BadValuesNameTheField) {
  EXPECT_EQ(error_of(config_json(R"(, "num_key_value_heads": 3)")),
            "cfg.json: \"num_key_value_heads\" = 3 does not divide \"num_attention_heads\" = 4; "
            "grouped-query attention shares each key/value head among an equal number of "
            "query heads");
  EXPECT_EQ(error_of(config_json(R"(, "num_hidden_layers": 1000000000)")),
            "cfg.json: \"num_hidden_layers\" = 1000000000: expected at most 100000");
  EXPECT_EQ(error_of(config_json(R"(, "vocab_size": 0)")),
            "cfg.json: \"vocab_size\" = 0: expected a positive integer");
  EXPECT_EQ(error_of(config_json(R"(, "hidden_size": "32")")),
            "cfg.json: \"hidden_size\" = \"32\": expected a positive integer");
  EXPECT_EQ(error_of(config_json(R"(, "head_dim": 7)")),
            "cfg.json: \"head_dim\" = 7: expected an even number (rotary embeddings rotate "
            "pairs of dimensions)");
  EXPECT_EQ(error_of(R"({"model_type": "llama", "vocab_size": 5})"),
            "cfg.json: the required field \"hidden_size\" is missing; a config saved by "
            "transformers has it");
  EXPECT_EQ(error_of(R"({"vocab_size": 5})"),
            "cfg.json: the field \"model_type\" is missing; expected one of llama, mistral, "
            "qwen2, qwen3, gemma2, gemma3_text, granite, olmo2, phi3, qwen3_moe, mixtral, "
            "olmoe, qwen2_moe, gpt_oss, deepseek_v3 (a config saved by transformers)");
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

TEST(DecoderConfigTest, MissingFileSaysWhatToPass) {
  try {
    load_decoder_config("/nonexistent/config.json");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "cannot open config.json '/nonexistent/config.json': No such file or directory; "
              "expected the config.json of a Hugging Face model folder, as save_pretrained "
              "writes it");
  }
}

// The mixture-of-experts families, each from the config.json transformers 5.23 wrote for
// a tiny model (tests/families.py's MoE variants), with fields changed to show each rule.
std::string qwen3_moe_json(const std::string& extra = "") {
  return R"({"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "decoder_sparse_step": 1, "dtype": "float32", "head_dim": 8,
    "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 48,
    "max_position_embeddings": 64, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 16, "norm_topk_prob": true, "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2,
    "num_local_experts": 4, "output_router_logits": false, "pad_token_id": null,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "sliding_window": null, "tie_word_embeddings": false,
    "use_sliding_window": false, "vocab_size": 128)" +
         extra + "}";
}

TEST(DecoderConfigTest, Qwen3MoeRoutesEveryLayerButTheDenseOnes) {
  const DecoderConfig c = parse_decoder_config(qwen3_moe_json(), "cfg.json");
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.num_experts, 4);  // 5.x's num_local_experts
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 16);
  EXPECT_EQ(c.intermediate_size, 48);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.router_weights_fp32);
  EXPECT_FALSE(c.block_sparse_moe_names);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  EXPECT_EQ(c.router_aux_loss_coef, 0.001);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.sparse_layers, std::vector<bool>({true, true, true}));
  // decoder_sparse_step 2: layers 1, 3, ... sparse; mlp_only_layers dense.
  EXPECT_EQ(parse_decoder_config(qwen3_moe_json(R"(, "decoder_sparse_step": 2)"), "cfg.json")
                .sparse_layers,
            std::vector<bool>({false, true, false}));
  EXPECT_EQ(parse_decoder_config(qwen3_moe_json(R"(, "mlp_only_layers": [0, 2])"), "cfg.json")
                .sparse_layers,
            std::vector<bool>({false, true, false}));
  // The Hub's 4.x spelling num_experts; both must agree.
  EXPECT_EQ(parse_decoder_config(qwen3_moe_json(R"(, "num_local_experts": null, "num_experts": 6)"),
                                 "cfg.json")
                .num_experts,
            6);
  EXPECT_EQ(error_of(qwen3_moe_json(R"(, "num_experts": 6)")),
            "cfg.json: \"num_experts\" = 6 and \"num_local_experts\" = 4 differ; expected one "
            "count of experts (transformers reads them as one field)");
  EXPECT_EQ(error_of(qwen3_moe_json(R"(, "num_experts_per_tok": 5)")),
            "cfg.json: \"num_experts_per_tok\" = 5: expected at most the number of experts, 4");
  EXPECT_EQ(error_of(qwen3_moe_json(R"(, "mlp_only_layers": [3])")),
            "cfg.json: \"mlp_only_layers\" = [3]: expected layer indices below "
            "num_hidden_layers = 3");
  EXPECT_EQ(error_of(qwen3_moe_json(R"(, "use_sliding_window": true)")),
            "cfg.json: \"use_sliding_window\" = true is not supported: sliding windows are not "
            "implemented for the Qwen mixture-of-experts families; use_sliding_window false");
  EXPECT_EQ(error_of(qwen3_moe_json(R"(, "n_routed_experts": 8)")),
            "cfg.json: \"n_routed_experts\" = 8 is not supported: n_routed_experts counts the "
            "experts of model type deepseek_v3 only; a qwen3_moe decoder counts its experts in "
            "num_experts or num_local_experts");
}

TEST(DecoderConfigTest, MixtralOlmoeQwen2MoeSetTheirSwitches) {
  const DecoderConfig mixtral = parse_decoder_config(
      R"({"model_type": "mixtral", "hidden_act": "silu", "hidden_size": 32,
          "intermediate_size": 16, "max_position_embeddings": 64, "num_attention_heads": 4,
          "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
          "num_local_experts": 4, "head_dim": null, "router_aux_loss_coef": 0.02,
          "router_jitter_noise": 0.0, "sliding_window": null, "vocab_size": 128})",
      "cfg.json");
  EXPECT_EQ(mixtral.num_experts, 4);
  EXPECT_EQ(mixtral.moe_intermediate_size, 16);  // intermediate_size
  EXPECT_TRUE(mixtral.norm_topk_prob && mixtral.router_weights_fp32);
  EXPECT_TRUE(mixtral.block_sparse_moe_names);
  EXPECT_EQ(mixtral.router_aux_loss_coef, 0.02);
  EXPECT_EQ(mixtral.rope.theta, 1e6);  // MixtralConfig's default
  EXPECT_EQ(mixtral.rms_norm_eps, 1e-5);
  EXPECT_FALSE(mixtral.has_sliding_layers());
  EXPECT_EQ(error_of(R"({"model_type": "mixtral", "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
          "router_jitter_noise": 0.1})"),
            "cfg.json: \"router_jitter_noise\" = 0.1 is not supported: fsdp's router does not "
            "jitter its inputs (router_jitter_noise 0.0)");

  const std::string olmoe = R"({"model_type": "olmoe", "hidden_act": "silu", "hidden_size": 32,
      "intermediate_size": 16, "num_attention_heads": 4, "num_experts": 4,
      "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
      "norm_topk_prob": true, "vocab_size": 128)";
  const DecoderConfig o = parse_decoder_config(olmoe + "}", "cfg.json");
  EXPECT_TRUE(o.qk_norm_full_width);
  EXPECT_FALSE(o.post_norms);  // norms before the sublayers, as Llama
  EXPECT_EQ(o.norm_style, NormStyle::kLlama);
  EXPECT_TRUE(o.norm_topk_prob);
  EXPECT_EQ(o.router_aux_loss_coef, 0.01);  // OlmoeConfig's default
  EXPECT_EQ(o.max_position_embeddings, 4096);
  EXPECT_EQ(error_of(olmoe + R"(, "clip_qkv": 8.0})"),
            "cfg.json: \"clip_qkv\" = 8.0 is not supported: fsdp's attention does not clip "
            "queries, keys and values");

  const DecoderConfig q = parse_decoder_config(
      R"({"model_type": "qwen2_moe", "hidden_act": "silu", "hidden_size": 32,
          "intermediate_size": 48, "moe_intermediate_size": 16,
          "shared_expert_intermediate_size": 24, "num_attention_heads": 4, "num_experts": 4,
          "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
          "mlp_only_layers": [1], "layer_types": ["full_attention", "full_attention"],
          "vocab_size": 128})",
      "cfg.json");
  EXPECT_TRUE(q.qkv_bias);  // qkv_bias's default
  EXPECT_FALSE(q.o_bias);
  EXPECT_EQ(q.shared_expert_intermediate_size, 24);
  EXPECT_EQ(q.moe_intermediate_size, 16);
  EXPECT_EQ(q.sparse_layers, std::vector<bool>({true, false}));
  EXPECT_FALSE(q.norm_topk_prob);
}

// gpt-oss's config.json as transformers 5.23 saves a GptOssConfig (defaults for the rest).
std::string gpt_oss_json(const std::string& extra = "") {
  return R"({"architectures": ["GptOssForCausalLM"], "attention_bias": true,
    "attention_dropout": 0.0, "dtype": "bfloat16", "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 32, "intermediate_size": 16, "layer_types": ["sliding_attention",
    "full_attention", "sliding_attention"], "max_position_embeddings": 64,
    "model_type": "gpt_oss", "num_attention_heads": 4, "num_experts_per_tok": 2,
    "num_hidden_layers": 3, "num_key_value_heads": 2, "num_local_experts": 4,
    "output_router_logits": false, "rms_norm_eps": 1e-05, "rope_parameters": {"beta_fast": 32.0,
    "beta_slow": 1.0, "factor": 4.0, "original_max_position_embeddings": 16,
    "rope_theta": 150000.0, "rope_type": "yarn", "truncate": false}, "router_aux_loss_coef": 0.9,
    "sliding_window": 8, "swiglu_limit": 7.0, "tie_word_embeddings": false, "vocab_size": 128)" +
         extra + "}";
}

TEST(DecoderConfigTest, GptOssSetsItsSwitches) {
  const DecoderConfig c = parse_decoder_config(gpt_oss_json(), "cfg.json");
  EXPECT_TRUE(c.attention_sinks && c.qkv_bias && c.o_bias);
  EXPECT_EQ(c.norm_style, NormStyle::kOlmo);
  EXPECT_EQ(c.layer_types,
            std::vector<LayerType>({LayerType::kSliding, LayerType::kFull, LayerType::kSliding}));
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_FALSE(c.rope.truncate);
  EXPECT_EQ(c.rope.factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position_embeddings, 16);
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 16);  // intermediate_size
  EXPECT_EQ(c.sparse_layers, std::vector<bool>(3, true));
  EXPECT_TRUE(c.router_bias_topk_softmax && c.experts_transposed);
  EXPECT_FALSE(c.norm_topk_prob || c.router_weights_fp32 || c.block_sparse_moe_names);
  EXPECT_EQ(c.swiglu_limit, 7.0);
  EXPECT_EQ(c.swiglu_alpha, 1.702);
  EXPECT_EQ(c.router_aux_loss_coef, 0.9);
  // GptOssConfig's defaults: layers alternate from a sliding one, YaRN over 4096 positions.
  const DecoderConfig d = parse_decoder_config(
      R"({"model_type": "gpt_oss", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 2, "num_attention_heads": 2})",
      "cfg.json");
  EXPECT_EQ(d.layer_types, std::vector<LayerType>({LayerType::kSliding, LayerType::kFull}));
  EXPECT_EQ(d.sliding_window, 128);
  EXPECT_EQ(d.head_dim, 64);
  EXPECT_EQ(d.num_experts, 128);
  EXPECT_EQ(d.num_experts_per_tok, 4);
  EXPECT_TRUE(d.qkv_bias && d.o_bias);
  EXPECT_EQ(d.rope.type, "yarn");
  EXPECT_EQ(d.rope.theta, 150000.0);
  EXPECT_EQ(d.rope.factor, 32.0);
  EXPECT_EQ(d.rope.original_max_position_embeddings, 4096);
  EXPECT_FALSE(d.rope.truncate);
  EXPECT_EQ(d.max_position_embeddings, 131072);
}

TEST(DecoderConfigTest, GptOssRefusalsNameTheField) {
  // openai/gpt-oss-20b's quantization_config: MXFP4 experts.
  const std::string mxfp4 =
      "cfg.json: \"quantization_config.quant_method\" = \"mxfp4\" is not supported: MXFP4 "
      "experts (gpt-oss as openai/gpt-oss-20b ships) are not implemented; fsdp reads gpt-oss in "
      "its bf16 layout: a *-BF16 folder (such as unsloth/gpt-oss-20b-BF16), or the folder "
      "transformers' save_pretrained writes after from_pretrained(..., "
      "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16)";
  EXPECT_EQ(error_of(gpt_oss_json(R"(, "quantization_config": {"modules_to_not_convert":
      ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
      "quant_method": "mxfp4"})")),
            mxfp4);
  EXPECT_EQ(error_of(gpt_oss_json(R"(, "layer_types": ["sliding_attention", "full_attention"])")),
            "cfg.json: \"layer_types\" = [\"sliding_attention\",\"full_attention\"]: expected "
            "a list of 3 layer types (num_hidden_layers)");
  EXPECT_EQ(error_of(gpt_oss_json(R"(, "swiglu_limit": -1.0)")),
            "cfg.json: \"swiglu_limit\" = -1.0: expected a positive number");
  EXPECT_EQ(error_of(gpt_oss_json(R"(, "attention_dropout": 0.1)")),
            "cfg.json: \"attention_dropout\" = 0.1 is not supported: fsdp's decoder has no "
            "attention dropout (0.0)");
  EXPECT_EQ(error_of(gpt_oss_json(R"(, "num_experts_per_tok": 5)")),
            "cfg.json: \"num_experts_per_tok\" = 5: expected at most the number of experts, 4");
  EXPECT_EQ(error_of(gpt_oss_json(R"(, "rope_parameters": {"rope_type": "dynamic",
      "factor": 2.0})")),
            "cfg.json: \"rope_parameters.rope_type\" = \"dynamic\" is not supported: fsdp's "
            "decoder implements the rope types default, linear, llama3, yarn and longrope");
}

// deepseek-ai/DeepSeek-V3's config.json as the Hub has it (transformers 4.x spellings, its
// remote code's fields, FP8 weights), less auto_map; `quantization` replaces its
// quantization_config (empty: none) and `extra` adds or overrides fields.
std::string deepseek_v3_json(const std::string& quantization, const std::string& extra = "") {
  return R"({"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32,
    "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096, "type": "yarn"}, "rope_theta": 10000,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
    "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true,
    "v_head_dim": 128, "vocab_size": 129280)" +
         quantization + extra + "}";
}

constexpr char kDeepSeekFp8[] = R"(, "quantization_config": {"activation_scheme": "dynamic",
    "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]})";

TEST(DecoderConfigTest, DeepSeekV3SetsItsSwitches) {
  const DecoderConfig c = parse_decoder_config(deepseek_v3_json(""), "cfg.json");
  EXPECT_TRUE(c.latent_attention());
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.head_dim, 64);  // qk_rope_head_dim, as transformers sets it
  EXPECT_EQ(c.rotary_dim, 64);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_TRUE(c.rope_interleave);  // DeepseekV3Config's default
  EXPECT_FALSE(c.qkv_bias || c.o_bias);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.mscale_all_dim, 1.0);
  // 192^-0.5 x (0.1 ln 40 + 1)^2, transformers' yarn_apply_mscale.
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(c.attention_scale, mscale * mscale / std::sqrt(192.0));
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_TRUE(c.router_sigmoid_groups && c.norm_topk_prob && c.router_weights_fp32);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.shared_expert_intermediate_size, 2048);
  EXPECT_TRUE(c.shared_experts_ungated);
  EXPECT_EQ(c.router_aux_loss_coef, 0.0);  // no load-balancing loss
  EXPECT_EQ(c.mtp_layers, 1);              // num_nextn_predict_layers: skipped on reading
  std::vector<bool> sparse(61, true);
  sparse[0] = sparse[1] = sparse[2] = false;
  EXPECT_EQ(c.sparse_layers, sparse);
  EXPECT_EQ(c.layer_types, std::vector<LayerType>(61, LayerType::kFull));
  // A config.json as transformers 5.23 writes a small DeepseekV3Config: rope_parameters,
  // head_dim, q_lora_rank null (one q_proj), rope_interleave false, default RoPE: scale
  // qk_head_dim^-0.5.
  const DecoderConfig small = parse_decoder_config(
      R"({"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": null, "kv_lora_rank": 16,
          "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
          "rope_interleave": false, "n_routed_experts": 8, "num_experts_per_tok": 2,
          "n_group": 4, "topk_group": 2, "moe_intermediate_size": 16, "n_shared_experts": 2,
          "first_k_dense_replace": 1, "attention_bias": true,
          "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}})",
      "cfg.json");
  EXPECT_EQ(small.q_lora_rank, 0);
  EXPECT_FALSE(small.rope_interleave);
  EXPECT_TRUE(small.qkv_bias && small.o_bias);
  EXPECT_DOUBLE_EQ(small.attention_scale, 0.25);
  EXPECT_EQ(small.shared_expert_intermediate_size, 32);
  EXPECT_EQ(small.sparse_layers, std::vector<bool>({false, true, true}));
}

TEST(DecoderConfigTest, DeepSeekV3RefusalsNameTheField) {
  // The Hub's DeepSeek-V3 (and Kimi K2): FP8 weights with a scale per 128 x 128 block.
  EXPECT_EQ(error_of(deepseek_v3_json(kDeepSeekFp8)),
            "cfg.json: \"quantization_config.quant_method\" = \"fp8\" is not supported: FP8 "
            "block-scaled weights (weight_block_size [128,128]; DeepSeek-V3 and Kimi K2 as the "
            "Hub ships them) are not implemented; fsdp reads the bf16 layout: a *-BF16 folder, "
            "or the folder transformers' save_pretrained writes after from_pretrained(..., "
            "quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16)");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "num_key_value_heads": 64)")),
            "cfg.json: \"num_key_value_heads\" = 64 is not supported: multi-head latent "
            "attention expands keys and values for every head (num_key_value_heads equal to "
            "num_attention_heads = 128)");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "scoring_func": "softmax")")),
            "cfg.json: \"scoring_func\" = \"softmax\" is not supported: transformers' DeepseekV3 "
            "scores the experts with a sigmoid");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "topk_method": "greedy")")),
            "cfg.json: \"topk_method\" = \"greedy\" is not supported: transformers' DeepseekV3 "
            "routes as DeepSeek-V3's noaux_tc (group-limited top-k with "
            "e_score_correction_bias)");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "moe_layer_freq": 2)")),
            "cfg.json: \"moe_layer_freq\" = 2 is not supported: transformers' DeepseekV3 makes "
            "every layer from first_k_dense_replace on sparse");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "n_group": 3)")),
            "cfg.json: \"n_group\" = 3 does not split 256 experts into equal groups of two or "
            "more (a group scores its two best)");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "topk_group": 9)")),
            "cfg.json: \"topk_group\" = 9: expected at most n_group = 8 groups, holding at least "
            "num_experts_per_tok = 8 experts");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "num_experts": 256)")),
            "cfg.json: \"num_experts\" = 256 is not supported: deepseek_v3 counts its experts in "
            "n_routed_experts");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "rope_scaling": {"type": "linear",
      "factor": 2.0})")),
            "cfg.json: rope type \"linear\" is not supported for deepseek_v3: its attention "
            "scale is implemented for the rope types default and yarn (DeepSeek-V3's and Kimi "
            "K2's)");
  EXPECT_EQ(error_of(deepseek_v3_json("", R"(, "hidden_act": "gelu")")),
            "cfg.json: \"hidden_act\" = \"gelu\" is not supported: the MLP and experts are "
            "SwiGLU (hidden_act \"silu\")");
}

}  // namespace
}  // namespace fsdp::models
