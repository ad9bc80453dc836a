#include "models/lora_targets.h"

#include <gtest/gtest.h>

namespace fsdp::models {
namespace {

TEST(LoraTargetsTest, EveryProjectionAndNothingElse) {
  DecoderConfig config;
  config.model_type = "qwen3";
  EXPECT_EQ(lora_target_modules(config),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"}));
  EXPECT_EQ(default_lora_targets(config), (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(lora_targets_error(config, {"q_proj", "down_proj"}), "");
  EXPECT_EQ(lora_targets_error(config, {"q_proj", "q_norm"}),
            "--lora_target_modules: \"q_norm\" is not a module of a qwen3 decoder; expected "
            "some of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj");
  EXPECT_EQ(lora_targets_error(config, {}),
            "--lora_target_modules: expected one or more of q_proj, k_proj, v_proj, o_proj, "
            "gate_proj, up_proj, down_proj");
  config.fused_projections = true;  // phi3
  EXPECT_EQ(lora_target_modules(config),
            (std::vector<std::string>{"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}));
  EXPECT_EQ(default_lora_targets(config), (std::vector<std::string>{"qkv_proj"}));
  EXPECT_EQ(lora_targets_error(config, {"q_proj"}),
            "--lora_target_modules: \"q_proj\" is not a module of a qwen3 decoder; expected "
            "some of qkv_proj, o_proj, gate_up_proj, down_proj");
}

// The fused experts and the router (gate) are no Linear: an all-sparse MoE decoder adapts
// its attention only; a dense MLP somewhere (a shared expert, a dense layer) brings the
// three.
TEST(LoraTargetsTest, MixtureOfExpertsAdaptsItsDenseMlpsOnly) {
  DecoderConfig config;
  config.model_type = "mixtral";
  config.num_experts = 4;
  config.sparse_layers = {true, true};
  EXPECT_EQ(lora_target_modules(config),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  EXPECT_EQ(lora_targets_error(config, {"gate"}),
            "--lora_target_modules: \"gate\" is not a module of a mixtral decoder; expected "
            "some of q_proj, k_proj, v_proj, o_proj");
  config.sparse_layers = {true, false};  // mlp_only_layers [1]
  EXPECT_EQ(lora_target_modules(config).size(), 7u);
  config.sparse_layers = {true, true};
  config.shared_expert_intermediate_size = 8;  // qwen2_moe
  EXPECT_EQ(lora_target_modules(config).size(), 7u);
}

// PEFT 0.21's defaults: mixtral q_proj, v_proj; none for qwen3_moe, qwen2_moe, olmoe, gpt_oss (its
// LoraConfig asks for target_modules, and so does the message). The experts are refused.
TEST(LoraTargetsTest, MixtureOfExpertsDefaultsAndExpertsRefused) {
  DecoderConfig config;
  config.model_type = "mixtral";
  config.num_experts = 4;
  config.sparse_layers = {true, true};
  EXPECT_EQ(default_lora_targets(config), (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(lora_targets_error(config, {"q_proj", "w1"}),
            "--lora_target_modules: \"w1\" names the routed experts of a mixtral decoder; LoRA on "
            "the experts (PEFT's target_parameters) is not supported yet: adapt some of q_proj, "
            "k_proj, v_proj, o_proj");
  EXPECT_EQ(lora_targets_error(config, {"down_proj"}),
            "--lora_target_modules: \"down_proj\" names the routed experts of a mixtral decoder; "
            "LoRA on the experts (PEFT's target_parameters) is not supported yet: adapt some of "
            "q_proj, k_proj, v_proj, o_proj");
  for (const char* model_type : {"qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss"}) {
    config.model_type = model_type;
    EXPECT_EQ(default_lora_targets(config), std::vector<std::string>{}) << model_type;
  }
  config.model_type = "gpt_oss";  // gate_up_proj is its experts' fused tensor; router not a target
  EXPECT_EQ(lora_targets_error(config, {"q_proj", "gate_up_proj"}),
            "--lora_target_modules: \"gate_up_proj\" names the routed experts of a gpt_oss "
            "decoder; LoRA on the experts (PEFT's target_parameters) is not supported yet: adapt "
            "some of q_proj, k_proj, v_proj, o_proj");
  EXPECT_EQ(lora_targets_error(config, {"router"}),
            "--lora_target_modules: \"router\" is not a module of a gpt_oss decoder; expected "
            "some of q_proj, k_proj, v_proj, o_proj");
  config.model_type = "qwen3_moe";
  EXPECT_EQ(lora_targets_error(config, {}),
            "--lora_target_modules: PEFT has no default target modules for qwen3_moe (LoraConfig "
            "asks for target_modules); name one or more of q_proj, k_proj, v_proj, o_proj");
  config.sparse_layers = {true, false};  // a dense layer: gate_proj is its MLP's
  EXPECT_EQ(lora_targets_error(config, {"q_proj", "gate_proj", "o_proj"}), "");
  EXPECT_EQ(
      lora_targets_error(config, {"q_proj", "experts"}),
      "--lora_target_modules: \"experts\" names the routed experts of a qwen3_moe decoder; LoRA "
      "on the experts (PEFT's target_parameters) is not supported yet: adapt some of q_proj, "
      "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (gate_proj, up_proj, down_proj: the "
      "dense MLPs and the shared experts, not the routed experts)");
  EXPECT_NE(lora_targets_error(config, {"mlp.experts.gate_up_proj"}).find("LoRA on the experts"),
            std::string::npos);
  // deepseek_v3: latent attention's projections, the dense layers' and shared experts' MLP;
  // PEFT has no default for it.
  DecoderConfig deepseek = config;
  deepseek.model_type = "deepseek_v3";
  deepseek.kv_lora_rank = 16;
  deepseek.q_lora_rank = 8;
  deepseek.sparse_layers = {true, true};
  deepseek.shared_expert_intermediate_size = 16;
  EXPECT_EQ(default_lora_targets(deepseek), std::vector<std::string>{});
  EXPECT_EQ(lora_target_modules(deepseek),
            (std::vector<std::string>{"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                      "o_proj", "gate_proj", "up_proj", "down_proj"}));
  deepseek.q_lora_rank = 0;
  EXPECT_EQ(lora_targets_error(deepseek, {"q_proj", "kv_b_proj"}), "");
  EXPECT_EQ(lora_targets_error(deepseek, {"k_proj"}),
            "--lora_target_modules: \"k_proj\" is not a module of a deepseek_v3 decoder; expected "
            "some of q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj, up_proj, down_proj");
  config.model_type = "llama";  // a dense family: a module of that name is only unknown
  config.num_experts = 0;
  EXPECT_EQ(lora_targets_error(config, {"experts"}),
            "--lora_target_modules: \"experts\" is not a module of a llama decoder; expected "
            "some of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj");
}

}  // namespace
}  // namespace fsdp::models
