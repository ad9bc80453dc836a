#include "models/lora_targets.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fsdp::models {

std::vector<std::string> lora_target_modules(const DecoderConfig& config) {
  if (config.fused_projections) return {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  const bool dense_mlp = !config.is_moe() || config.shared_expert_intermediate_size > 0 ||
                         std::find(config.sparse_layers.begin(), config.sparse_layers.end(),
                                   false) != config.sparse_layers.end();
  if (!dense_mlp) return {"q_proj", "k_proj", "v_proj", "o_proj"};
  return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
}

std::vector<std::string> default_lora_targets(const DecoderConfig& config) {
  if (config.fused_projections) return {"qkv_proj"};
  // PEFT 0.21 maps mixtral to q_proj, v_proj, and has no entry for the other MoE families.
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
  const bool dense_mlp = modules.size() > 4;
  for (const std::string& target : targets) {
    if (names_experts(config, target, dense_mlp)) {
      return absl::StrCat("--lora_target_modules: \"", target, "\" names the routed experts of a ",
                          config.model_type,
                          " decoder; LoRA on the experts (PEFT's target_parameters) is not "
                          "supported yet: adapt some of ",
                          absl::StrJoin(modules, ", "),
                          dense_mlp ? " (gate_proj, up_proj, down_proj: the dense MLPs and the "
                                      "shared expert, not the experts)"
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
