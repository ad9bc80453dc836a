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

// The fused experts and the router are no Linear: an all-sparse MoE decoder adapts its
// attention only; a dense MLP somewhere (a shared expert, a dense layer) brings the three.
TEST(LoraTargetsTest, MixtureOfExpertsAdaptsItsDenseMlpsOnly) {
  DecoderConfig config;
  config.model_type = "mixtral";
  config.num_experts = 4;
  config.sparse_layers = {true, true};
  EXPECT_EQ(lora_target_modules(config),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  EXPECT_EQ(lora_targets_error(config, {"gate_proj"}),
            "--lora_target_modules: \"gate_proj\" is not a module of a mixtral decoder; expected "
            "some of q_proj, k_proj, v_proj, o_proj");
  config.sparse_layers = {true, false};  // mlp_only_layers [1]
  EXPECT_EQ(lora_target_modules(config).size(), 7u);
  config.sparse_layers = {true, true};
  config.shared_expert_intermediate_size = 8;  // qwen2_moe
  EXPECT_EQ(lora_target_modules(config).size(), 7u);
}

}  // namespace
}  // namespace fsdp::models
