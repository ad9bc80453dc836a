#include "models/lora_targets.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::models {

namespace {

// Whether a gated MLP of gate_proj, up_proj, down_proj is somewhere in the decoder: every
// layer of a dense family, a mixture of experts' dense layers or shared expert.
bool has_dense_mlp(const DecoderConfig& config) {
  return !config.is_moe() || config.shared_expert_intermediate_size > 0 ||
         std::find(config.sparse_layers.begin(), config.sparse_layers.end(), false) !=
             config.sparse_layers.end();
}

}  // namespace

std::vector<std::string> lora_target_modules(const DecoderConfig& config) {
  if (config.fused_projections) return {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  std::vector<std::string> modules = {"q_proj", "k_proj", "v_proj", "o_proj"};
  if (config.latent_attention()) {
    modules = {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
    const std::vector<std::string> queries = config.q_lora_rank > 0
                                                 ? std::vector<std::string>{"q_a_proj", "q_b_proj"}
                                                 : std::vector<std::string>{"q_proj"};
    modules.insert(modules.begin(), queries.begin(), queries.end());
  }
  if (has_dense_mlp(config)) modules.insert(modules.end(), {"gate_proj", "up_proj", "down_proj"});
  return modules;
}

std::vector<std::string> default_lora_targets(const DecoderConfig& config) {
  if (config.fused_projections) return {"qkv_proj"};
  // PEFT 0.21 maps mixtral to q_proj, v_proj, and has no entry for the other MoE families
  // (deepseek_v3 included).
  if (config.is_moe() && config.model_type != "mixtral") return {};
  return {"q_proj", "v_proj"};
}

namespace {

// Whether `target` asks for the routed experts: a name of the fused experts (experts,
// mlp.experts, experts.gate_up_proj, ...), Mixtral's per-expert w1, w2, w3, or a gated
// MLP's name in a decoder whose only MLPs are experts.
bool names_experts(const DecoderConfig& config, const std::string& target, bool dense_mlp) {
  if (!config.is_moe()) return false;
  if (target.find("experts") != std::string::npos) return true;
  if (target == "w1" || target == "w2" || target == "w3" || target == "gate_up_proj") return true;
  return !dense_mlp && (target == "gate_proj" || target == "up_proj" || target == "down_proj");
}

}  // namespace

std::string lora_targets_error(const DecoderConfig& config,
                               const std::vector<std::string>& targets) {
  const std::vector<std::string> modules = lora_target_modules(config);
  if (targets.empty() && config.is_moe()) {
    return absl::StrCat("--lora_target_modules: PEFT has no default target modules for ",
                        config.model_type,
                        " (LoraConfig asks for target_modules); name one or more of ",
                        absl::StrJoin(modules, ", "));
  }
  if (targets.empty()) {
    return absl::StrCat("--lora_target_modules: expected one or more of ",
                        absl::StrJoin(modules, ", "));
  }
  const bool dense_mlp = has_dense_mlp(config);
  for (const std::string& target : targets) {
    if (names_experts(config, target, dense_mlp)) {
      return absl::StrCat("--lora_target_modules: \"", target, "\" names the routed experts of a ",
                          config.model_type,
                          " decoder; LoRA on the experts (PEFT's target_parameters) is not "
                          "supported yet: adapt some of ",
                          absl::StrJoin(modules, ", "),
                          dense_mlp ? " (gate_proj, up_proj, down_proj: the dense MLPs and the "
                                      "shared experts, not the routed experts)"
                                    : "");
    }
    if (std::find(modules.begin(), modules.end(), target) == modules.end()) {
      return absl::StrCat("--lora_target_modules: \"", target, "\" is not a module of a ",
                          config.model_type, " decoder; expected some of ",
                          absl::StrJoin(modules, ", "));
    }
  }
  return "";
}

}  // namespace fsdp::models
