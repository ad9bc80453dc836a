// decoder_activation_bytes against what autograd holds (the tracking allocator), for each
// kind of layer the families build, in fp32 and bf16, full and LoRA, with and without
// checkpointed layers, rows of one sequence or packed; plan_units and plan_finetune's sums.
#include "models/memory_plan.h"

#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>

#include "fsdp/core/tracking_allocator.h"
#include "fsdp/lora/lora.h"
#include "models/decoder.h"

namespace fsdp::models {
namespace {

// hidden 64, 4 heads of 16, intermediate 160, vocab 1000, 2 layers; `extra` adds or
// overrides keys.
DecoderConfig config_of(const std::string& extra) {
  return parse_decoder_config(
      R"({"hidden_size": 64, "intermediate_size": 160, "max_position_embeddings": 512,
          "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-05, "vocab_size": 1000)" +
          extra + "}",
      "plan.json");
}

struct Measured {
  int64_t saved = 0;  // held after forward and the loss, before backward
  int64_t peak = 0;   // the most held during forward and backward, less the parameters' gradients
  // Per layer, the zero rows its experts added (Note [Expert rows in multiples of 8]).
  std::vector<int64_t> expert_padded_rows;
};

// One forward, loss and backward of a CPU-built decoder under the tracking allocator.
// Packed: each row two examples, of context / 3 tokens and the rest (PackedRowsScope).
Measured measure(const DecoderConfig& config, at::ScalarType dtype, int64_t batch, int64_t context,
                 bool checkpoint_layers, const TrainedWeights& trained, bool packed,
                 bool router_aux_loss = false, DecoderUnits units = DecoderUnits::kLayer) {
  MemoryTracker tracker;
  at::manual_seed(0);
  auto net = std::make_shared<CausalLMImpl>(config, at::TensorOptions().dtype(dtype), units);
  for (DecoderLayer& layer : net->model->decoder_layers) {
    layer->checkpoint_activations = checkpoint_layers;
  }
  if (trained.lora_rank > 0) {
    lora::LoraConfig lora;
    // Adapters in `dtype` too: what FSDP's mixed precision computes with (gathered in
    // param_dtype), as in pure bf16.
    lora.r(trained.lora_rank).target_modules(trained.lora_targets).autocast_adapter_dtype(false);
    lora::apply_lora(*net, lora);
  }
  const at::Tensor ids = at::randint(config.vocab_size, {batch, context}, at::kLong);
  const at::Tensor targets = at::randint(config.vocab_size, {batch * context}, at::kLong);
  std::optional<PackedRowsScope> rows;
  if (packed) {
    const int64_t first = context / 3;
    const at::Tensor positions =
        at::cat({at::arange(first, at::kLong), at::arange(context - first, at::kLong)})
            .expand({batch, context})
            .contiguous();
    const at::Tensor segments = (at::arange(context, at::kLong) >= first)
                                    .to(at::kLong)
                                    .expand({batch, context})
                                    .contiguous();
    rows.emplace(*net, positions, segments);
  }
  const int64_t before = memory_allocated();
  reset_peak_memory_stats();
  at::Tensor loss = torch::nn::functional::cross_entropy(
      net->forward(ids).reshape({batch * context, -1}).to(at::kFloat), targets);
  if (router_aux_loss) loss = loss + 0.01 * net->aux_loss();
  Measured m;
  m.saved = memory_allocated() - before;
  for (const DecoderLayer& layer : net->model->decoder_layers) {
    m.expert_padded_rows.push_back(layer->moe ? layer->moe->experts->padded_rows : 0);
  }
  loss.backward();
  // The loss's gradients come first in backward, before any parameter's: with 2 x tokens
  // above the hidden size the peak is there, before any parameter has a gradient.
  m.peak = max_memory_allocated() - before;
  return m;
}

struct Case {
  const char* name;
  std::string json;
  at::ScalarType dtype;
  bool checkpoint_layers;
  TrainedWeights trained;
  bool packed = false;  // rows of two examples each
  bool router_aux_loss = false;
  DecoderUnits units = DecoderUnits::kLayer;  // kSublayer: checkpointed per sublayer
};

class ActivationBytesTest : public ::testing::TestWithParam<Case> {};

TEST_P(ActivationBytesTest, EqualsWhatAutogradHolds) {
  at::set_num_threads(1);
  const Case& c = GetParam();
  const DecoderConfig config = config_of(c.json);
  for (const int64_t context : {40, 64}) {
    const Measured m = measure(config, c.dtype, 2, context, c.checkpoint_layers, c.trained,
                               c.packed, c.router_aux_loss, c.units);
    const ActivationBytes planned =
        decoder_activation_bytes(config, 2, context, c.dtype, c.checkpoint_layers, c.trained,
                                 c.packed, c.router_aux_loss, c.units, m.expert_padded_rows);
    EXPECT_EQ(planned.saved_bytes, m.saved) << c.name << " context " << context;
    // Without the routing, the plan counts the most zero rows the experts can add.
    const ActivationBytes most =
        decoder_activation_bytes(config, 2, context, c.dtype, c.checkpoint_layers, c.trained,
                                 c.packed, c.router_aux_loss, c.units);
    EXPECT_GE(most.saved_bytes, planned.saved_bytes) << c.name;
    EXPECT_GE(most.peak_bytes, planned.peak_bytes) << c.name;
    const int64_t padded =
        std::accumulate(m.expert_padded_rows.begin(), m.expert_padded_rows.end(), int64_t{0});
    // Only a bf16 decoder with experts pads, and then some expert's count is not a
    // multiple of 8 (2 x 40 or 2 x 64 tokens, top-2, over 8 experts).
    EXPECT_EQ(padded > 0, config.is_moe() && c.dtype == at::kBFloat16) << c.name;
    EXPECT_EQ(most.saved_bytes > planned.saved_bytes, padded > 0 && !c.checkpoint_layers) << c.name;
    // Gemma 2's eager attention in fp32 allocates a 4-byte scalar in backward.
    EXPECT_NEAR(planned.peak_bytes, m.peak, 4) << c.name << " context " << context;
    // The parts units free (each layer's, the head's) are within what is held.
    EXPECT_EQ(static_cast<int64_t>(planned.layers.size()), config.num_hidden_layers);
    EXPECT_LE(std::accumulate(planned.layers.begin(), planned.layers.end(), planned.head),
              planned.peak_bytes)
        << c.name;
    // With sublayer units, each layer's feed-forward part is within it.
    ASSERT_EQ(planned.feed_forward.size(),
              c.units == DecoderUnits::kSublayer ? planned.layers.size() : 0u);
    for (size_t i = 0; i < planned.feed_forward.size(); ++i) {
      EXPECT_GT(planned.feed_forward[i], 0) << c.name;
      EXPECT_LT(planned.feed_forward[i], planned.layers[i]) << c.name;
    }
  }
}

// The mixture-of-experts families: 8 experts of width 32, top-2; Qwen3-MoE with a dense
// layer (layer 1), Qwen2-MoE with a shared expert.
const char* const kQwen3Moe = R"(, "model_type": "qwen3_moe", "head_dim": 16,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": true, "mlp_only_layers": [1])";
const char* const kQwen2Moe = R"(, "model_type": "qwen2_moe", "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2)";
const char* const kMixtral = R"(, "model_type": "mixtral", "intermediate_size": 32,
    "num_local_experts": 8, "num_experts_per_tok": 2)";
// gpt-oss: sinks, biases, a sliding layer (window 8) and a full one, YaRN, clamped SwiGLU.
const char* const kGptOss = R"(, "model_type": "gpt_oss", "head_dim": 16, "intermediate_size": 32,
    "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8)";

// DeepSeek-V3: latent attention (q_lora_rank 24, kv_lora_rank 32, 4 heads of 16 + 8 rotated,
// values of 12), YaRN with mscale_all_dim; a dense layer, then 8 experts of width 32 in 4
// groups, top-2, a shared expert.
const char* const kDeepSeek = R"(, "model_type": "deepseek_v3", "num_key_value_heads": 4,
    "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
    "topk_group": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
    "rope_theta": 10000.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 128})";

const TrainedWeights kFull;
const TrainedWeights kLoraQv{8, {"q_proj", "v_proj"}};
const TrainedWeights kLoraAll{
    4, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}};

INSTANTIATE_TEST_SUITE_P(
    Families, ActivationBytesTest,
    ::testing::Values(
        Case{"llama", R"(, "model_type": "llama")", at::kFloat, false, kFull},
        Case{"llama_mha", R"(, "model_type": "llama", "num_key_value_heads": 4)", at::kFloat, false,
             kFull},
        Case{"llama_bf16", R"(, "model_type": "llama")", at::kBFloat16, false, kFull},
        Case{"llama_checkpointed", R"(, "model_type": "llama")", at::kFloat, true, kFull},
        Case{"llama_lora_qv", R"(, "model_type": "llama")", at::kFloat, false, kLoraQv},
        Case{"llama_lora_all_bf16", R"(, "model_type": "llama")", at::kBFloat16, false, kLoraAll},
        Case{"qwen3", R"(, "model_type": "qwen3", "head_dim": 16)", at::kFloat, false, kFull},
        Case{"gemma2", R"(, "model_type": "gemma2", "sliding_window": 8,
              "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh")",
             at::kFloat, false, kFull},
        Case{"gemma2_bf16", R"(, "model_type": "gemma2", "sliding_window": 8,
              "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh")",
             at::kBFloat16, false, kFull},
        Case{"olmo2", R"(, "model_type": "olmo2")", at::kFloat, false, kFull},
        Case{"phi3", R"(, "model_type": "phi3")", at::kFloat, false, kFull},
        Case{"phi3_lora", R"(, "model_type": "phi3")", at::kFloat, false,
             TrainedWeights{8, {"qkv_proj"}}},
        Case{"llama_packed", R"(, "model_type": "llama")", at::kFloat, false, kFull, true},
        Case{"llama_packed_bf16", R"(, "model_type": "llama")", at::kBFloat16, false, kFull, true},
        Case{"llama_packed_checkpointed", R"(, "model_type": "llama")", at::kFloat, true, kFull,
             true},
        Case{"gemma2_packed", R"(, "model_type": "gemma2", "sliding_window": 8,
              "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh")",
             at::kFloat, false, kFull, true},
        Case{"gemma3_packed",
             R"(, "model_type": "gemma3_text", "sliding_window": 8,
              "query_pre_attn_scalar": 16, "head_dim": 16, "sliding_window_pattern": 2)",
             at::kFloat, false, kFull, true},
        Case{"gemma3", R"(, "model_type": "gemma3_text", "sliding_window": 8,
              "query_pre_attn_scalar": 16, "head_dim": 16, "sliding_window_pattern": 2)",
             at::kFloat, false, kFull},
        Case{"qwen3_moe", kQwen3Moe, at::kFloat, false, kFull},
        Case{"qwen3_moe_aux", kQwen3Moe, at::kFloat, false, kFull, false, true},
        Case{"qwen3_moe_aux_bf16", kQwen3Moe, at::kBFloat16, false, kFull, false, true},
        // A real vocabulary's loss gradients outweigh a recomputed sparse layer's backward,
        // which the plan counts by its saved bytes only (Note [The decoder's activations]).
        Case{"qwen3_moe_aux_checkpointed", std::string(kQwen3Moe) + R"(, "vocab_size": 4000)",
             at::kFloat, true, kFull, false, true},
        Case{"qwen3_moe_lora_attention", kQwen3Moe, at::kFloat, false,
             TrainedWeights{4, {"q_proj", "k_proj", "v_proj", "o_proj"}}, false, true},
        Case{"qwen2_moe", kQwen2Moe, at::kFloat, false, kFull, false, true},
        Case{"qwen2_moe_lora_all", kQwen2Moe, at::kFloat, false, kLoraAll},
        Case{"mixtral_bf16", kMixtral, at::kBFloat16, false, kFull, false, true},
        Case{"gpt_oss", kGptOss, at::kFloat, false, kFull, false, true},
        Case{"gpt_oss_bf16", kGptOss, at::kBFloat16, false, kFull},
        Case{"gpt_oss_packed", kGptOss, at::kFloat, false, kFull, true, true},
        Case{"gpt_oss_checkpointed", std::string(kGptOss) + R"(, "vocab_size": 4000)", at::kFloat,
             true, kFull, false, true},
        Case{"gpt_oss_lora_attention", kGptOss, at::kFloat, false,
             TrainedWeights{4, {"q_proj", "k_proj", "v_proj", "o_proj"}}, false, true},
        Case{"deepseek_v3", kDeepSeek, at::kFloat, false, kFull},
        Case{"deepseek_v3_bf16", kDeepSeek, at::kBFloat16, false, kFull},
        Case{"deepseek_v3_q_proj", std::string(kDeepSeek) + R"(, "q_lora_rank": null)", at::kFloat,
             false, kFull},
        Case{"deepseek_v3_packed", kDeepSeek, at::kFloat, false, kFull, true},
        Case{"deepseek_v3_checkpointed", std::string(kDeepSeek) + R"(, "vocab_size": 4000)",
             at::kFloat, true, kFull},
        Case{"deepseek_v3_lora_all", kDeepSeek, at::kFloat, false,
             TrainedWeights{4,
                            {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                             "gate_proj", "up_proj", "down_proj"}}},
        Case{"deepseek_v3_lora_kv_bf16", kDeepSeek, at::kBFloat16, false,
             TrainedWeights{8, {"kv_b_proj", "o_proj"}}},
        // Sublayer units (DecoderUnits::kSublayer): the same operations unchecked; checkpointed,
        // each sublayer's input and the norms outside the checkpoints.
        Case{"qwen3_moe_aux_sublayer", kQwen3Moe, at::kFloat, false, kFull, false, true,
             DecoderUnits::kSublayer},
        Case{"qwen3_moe_aux_checkpointed_sublayer",
             std::string(kQwen3Moe) + R"(, "vocab_size": 4000)", at::kFloat, true, kFull, false,
             true, DecoderUnits::kSublayer},
        Case{"qwen3_moe_bf16_checkpointed_sublayer",
             std::string(kQwen3Moe) + R"(, "vocab_size": 4000)", at::kBFloat16, true, kFull, false,
             true, DecoderUnits::kSublayer},
        Case{"qwen2_moe_lora_all_checkpointed_sublayer",
             std::string(kQwen2Moe) + R"(, "vocab_size": 4000)", at::kFloat, true, kLoraAll, false,
             false, DecoderUnits::kSublayer},
        Case{"gpt_oss_packed_checkpointed_sublayer",
             std::string(kGptOss) + R"(, "vocab_size": 4000)", at::kFloat, true, kFull, true, true,
             DecoderUnits::kSublayer},
        Case{"gemma2_checkpointed_sublayer", R"(, "model_type": "gemma2", "sliding_window": 8,
              "query_pre_attn_scalar": 16, "hidden_activation": "gelu_pytorch_tanh",
              "vocab_size": 4000)",
             at::kFloat, true, kFull, false, false, DecoderUnits::kSublayer},
        Case{"deepseek_v3_checkpointed_sublayer",
             std::string(kDeepSeek) + R"(, "vocab_size": 4000)", at::kFloat, true, kFull, false,
             false, DecoderUnits::kSublayer},
        Case{"olmo2_checkpointed_sublayer", R"(, "model_type": "olmo2")", at::kFloat, true, kFull,
             false, false, DecoderUnits::kSublayer}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// A LoRA model over a bf16 base (fp32 adapters, PEFT's default): plan_units counts the
// adapters as the trainable fp32 elements and the base as frozen bf16 elements, unit by
// unit, every parameter once.
TEST(PlanUnitsTest, ABf16BaseIsFrozenElementsOfItsOwnDtype) {
  const DecoderConfig config = config_of(R"(, "model_type": "llama")");
  auto net = std::make_shared<CausalLMImpl>(
      config, at::TensorOptions().device(c10::kMeta).dtype(at::kBFloat16));
  lora::LoraConfig lora;
  lora.r(4).target_modules({"q_proj", "v_proj"});
  lora::apply_lora(*net, lora);
  const std::vector<PlanUnit> units = plan_units(*net);
  int64_t trainable = 0, bf16 = 0, total = 0;
  for (const at::Tensor& p : net->parameters()) {
    total += p.numel();
    if (p.requires_grad()) {
      EXPECT_EQ(p.scalar_type(), at::kFloat);
      trainable += p.numel();
    } else {
      EXPECT_EQ(p.scalar_type(), at::kBFloat16);
      bf16 += p.numel();
    }
  }
  // Per layer: q_proj's adapter 4 x 64 + 64 x 4, v_proj's 4 x 64 + 32 x 4.
  EXPECT_EQ(trainable, 2 * (512 + 384));
  int64_t planned_trainable = 0, planned_bf16 = 0;
  for (const PlanUnit& unit : units) {
    EXPECT_EQ(unit.frozen_numel, 0) << unit.fqn;
    planned_trainable += unit.trainable_numel;
    for (const PlanFrozen& other : unit.frozen_other_dtypes) {
      EXPECT_EQ(other.dtype, at::kBFloat16) << unit.fqn;
      planned_bf16 += other.numel;
    }
  }
  EXPECT_EQ(planned_trainable, trainable);
  EXPECT_EQ(planned_bf16, bf16);
  EXPECT_EQ(planned_trainable + planned_bf16, total);
}

// Sublayer units: each layer's self_attn and mlp, in forward order, the layers' norms in the
// root; the same elements either way, and a net built with layer units planned as if split
// gives what a split net gives.
TEST(PlanUnitsTest, SublayerUnitsSplitEachLayerInTwo) {
  const DecoderConfig config = config_of(kQwen3Moe);  // 2 layers, layer 1 dense; untied
  auto layered = std::make_shared<CausalLMImpl>(config, at::TensorOptions().device(c10::kMeta));
  auto split = std::make_shared<CausalLMImpl>(config, at::TensorOptions().device(c10::kMeta),
                                              DecoderUnits::kSublayer);
  const std::vector<PlanUnit> units = plan_units(*split);
  std::vector<std::string> fqns;
  for (const PlanUnit& unit : units) fqns.push_back(unit.fqn);
  EXPECT_EQ(fqns, (std::vector<std::string>{"", "model.embed_tokens", "model.layers.0.self_attn",
                                            "model.layers.0.mlp", "model.layers.1.self_attn",
                                            "model.layers.1.mlp", "lm_head"}));
  // Attention: q 64 x 64, k and v 32 x 64, o 64 x 64, q_norm and k_norm 16 each; layer 0's
  // MoE block: router 8 x 64 and 8 experts x 3 x 32 x 64; layer 1's MLP 3 x 160 x 64; the
  // root: 2 norms of 64 per layer and the final norm.
  const int64_t attention = 64 * 64 * 2 + 32 * 64 * 2 + 2 * 16;
  EXPECT_EQ(units[2].trainable_numel, attention);
  EXPECT_EQ(units[3].trainable_numel, 8 * 64 + 8 * 3 * 32 * 64);
  EXPECT_EQ(units[5].trainable_numel, 3 * 160 * 64);
  EXPECT_EQ(units[0].trainable_numel, 2 * 2 * 64 + 64);
  const std::vector<PlanUnit> layer_units = plan_units(*layered);
  ASSERT_EQ(layer_units.size(), 5u);
  EXPECT_EQ(layer_units[2].fqn, "model.layers.0");
  EXPECT_EQ(layer_units[2].trainable_numel,
            units[2].trainable_numel + units[3].trainable_numel + 2 * 64);
  const std::vector<PlanUnit> as_if = plan_units(*layered, DecoderUnits::kSublayer);
  ASSERT_EQ(as_if.size(), units.size());
  for (size_t i = 0; i < units.size(); ++i) {
    EXPECT_EQ(as_if[i].fqn, units[i].fqn);
    EXPECT_EQ(as_if[i].trainable_numel, units[i].trainable_numel) << units[i].fqn;
  }
  const std::vector<PlanUnit> back = plan_units(*split, DecoderUnits::kLayer);
  ASSERT_EQ(back.size(), layer_units.size());
  for (size_t i = 0; i < back.size(); ++i) {
    EXPECT_EQ(back[i].fqn, layer_units[i].fqn);
    EXPECT_EQ(back[i].trainable_numel, layer_units[i].trainable_numel) << back[i].fqn;
  }
  // Each sublayer unit frees its part of its layer's activations, together the layer's.
  FinetunePlanOptions options;
  options.world_size(2).micro_batch(2).context(16).decoder_units(DecoderUnits::kSublayer);
  const FinetunePlan plan = plan_finetune(config, units, options);
  const ActivationBytes& a = plan.activations;
  ASSERT_EQ(a.feed_forward.size(), 2u);
  EXPECT_EQ(plan.step.peak_bytes > 0, true);
  const FinetunePlan layer_plan = plan_finetune(
      config, layer_units, FinetunePlanOptions(options).decoder_units(DecoderUnits::kLayer));
  EXPECT_EQ(layer_plan.activations.layers, a.layers);  // unchecked: the same operations
}

// deepseek-ai/DeepSeek-V3's config.json (the Hub's, less its FP8 quantization_config and
// auto_map): 671,026,404,352 parameters, the 671 B of its paper (the multi-token prediction
// layer, which transformers does not build, left out). Per layer: latent attention
// 187,107,328 (q_a 7168 x 1536, q_b 1536 x 128 x 192, kv_a 7168 x 576, kv_b 512 x 128 x 256,
// o 128 x 128 x 7168, two latent norms) and norms 14,336; a dense MLP 3 x 7168 x 18432; a
// sparse one 256 experts and a shared expert of 3 x 2048 x 7168 each and the router's
// 256 x 7168 (its e_score_correction_bias is a buffer).
TEST(PlanUnitsTest, DeepSeekV3HasItsParameterCount) {
  const DecoderConfig config = parse_decoder_config(
      R"({"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
          "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0,
          "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
          "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
          "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
          "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
          "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
          "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
          "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
          "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
          "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
          "seq_aux": true, "tie_word_embeddings": false, "topk_group": 4,
          "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
          "use_cache": true, "v_head_dim": 128, "vocab_size": 129280})",
      "deepseek_v3.json");
  auto net = std::make_shared<CausalLMImpl>(
      config, at::TensorOptions().device(c10::kMeta).dtype(at::kBFloat16));
  const std::vector<PlanUnit> units = plan_units(*net);
  int64_t total = 0;
  for (const PlanUnit& unit : units) total += unit.trainable_numel + unit.frozen_numel;
  EXPECT_EQ(total, int64_t{671'026'404'352});
  const auto layer = [&](int64_t i) {
    for (const PlanUnit& unit : units) {
      if (unit.fqn == "model.layers." + std::to_string(i)) return unit.trainable_numel;
    }
    return int64_t{-1};
  };
  const int64_t attention = 187'107'328 + 14'336;
  EXPECT_EQ(layer(2), attention + 3 * int64_t{7168} * 18432);
  EXPECT_EQ(layer(3), attention + 257 * 3 * int64_t{2048} * 7168 + 256 * 7168);
  int64_t buffers = 0;
  for (const at::Tensor& b : net->buffers()) buffers += b.numel();
  EXPECT_EQ(buffers, 58 * 256);
}

// A sparse layer's experts as its unit gathers them: 8 experts x 3 x 32 x 64 elements in the
// compute dtype, named in one line; none for a dense config.
TEST(PlanFinetuneTest, SaysWhatGatheringASparseLayersExpertsCosts) {
  const DecoderConfig moe = config_of(kQwen3Moe);
  auto net = std::make_shared<CausalLMImpl>(moe, at::TensorOptions().device(c10::kMeta));
  const std::vector<PlanUnit> units = plan_units(*net);
  const FinetunePlan fp32 = plan_finetune(moe, units, FinetunePlanOptions().world_size(2));
  EXPECT_EQ(fp32.experts_per_layer, 8 * 3 * 32 * 64 * 4);
  const FinetunePlan split =
      plan_finetune(moe, plan_units(*net, DecoderUnits::kSublayer),
                    FinetunePlanOptions().world_size(2).decoder_units(DecoderUnits::kSublayer));
  // Here both peak at 5 MiB as printed: said to be the same, not compared.
  ASSERT_EQ(format_bytes(split.peak_bytes), format_bytes(fp32.peak_bytes));
  EXPECT_EQ(experts_gathered_line(moe, fp32, split),
            absl::StrCat("mixture of experts: each sparse layer's unit gathers all 8 experts, 192 "
                         "KiB in Float, though each token uses 2 of them; --moe_units=sublayer "
                         "(attention and experts units of their own) would peak at ",
                         format_bytes(split.peak_bytes), " as well"));
  EXPECT_EQ(experts_gathered_line(moe, split, fp32),
            absl::StrCat("mixture of experts: each sparse layer's feed-forward unit gathers all 8 "
                         "experts, 192 KiB in Float, though each token uses 2 of them; peak ",
                         format_bytes(split.peak_bytes), ", as with --moe_units=layer"));
  // Peaks that differ as printed (the other plan at W = 1 here) are compared.
  const FinetunePlan one = plan_finetune(moe, units, FinetunePlanOptions().world_size(1));
  ASSERT_NE(format_bytes(one.peak_bytes), format_bytes(fp32.peak_bytes));
  EXPECT_EQ(
      experts_gathered_line(moe, fp32, one),
      absl::StrCat("mixture of experts: each sparse layer's unit gathers all 8 experts, 192 "
                   "KiB in Float, though each token uses 2 of them; --moe_units=sublayer "
                   "(attention and experts units of their own) would peak at ",
                   format_bytes(one.peak_bytes), " instead of ", format_bytes(fp32.peak_bytes)));
  EXPECT_EQ(experts_gathered_line(moe, split, one),
            absl::StrCat("mixture of experts: each sparse layer's feed-forward unit gathers all 8 "
                         "experts, 192 KiB in Float, though each token uses 2 of them; peak ",
                         format_bytes(split.peak_bytes), " instead of ",
                         format_bytes(one.peak_bytes), " with --moe_units=layer"));
  const FinetunePlan bf16 =
      plan_finetune(moe, units, FinetunePlanOptions().world_size(2).param_dtype(at::kBFloat16));
  EXPECT_EQ(bf16.experts_per_layer, 8 * 3 * 32 * 64 * 2);
  EXPECT_GE(bf16.gathered_units, bf16.experts_per_layer);
  const DecoderConfig dense = config_of(R"(, "model_type": "llama")");
  auto dense_net = std::make_shared<CausalLMImpl>(dense, at::TensorOptions().device(c10::kMeta));
  const FinetunePlan plan = plan_finetune(dense, plan_units(*dense_net), FinetunePlanOptions());
  EXPECT_EQ(plan.experts_per_layer, 0);
  EXPECT_EQ(experts_gathered_line(dense, plan, plan), "");
}

}  // namespace
}  // namespace fsdp::models
