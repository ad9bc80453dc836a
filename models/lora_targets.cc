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
  return {"q_proj", "v_proj"};
}

std::string lora_targets_error(const DecoderConfig& config,
                               const std::vector<std::string>& targets) {
  const std::vector<std::string> modules = lora_target_modules(config);
  if (targets.empty()) {
    return absl::StrCat("--lora_target_modules: expected one or more of ",
                        absl::StrJoin(modules, ", "));
  }
  for (const std::string& target : targets) {
    if (std::find(modules.begin(), modules.end(), target) == modules.end()) {
      return absl::StrCat("--lora_target_modules: \"", target, "\" is not a module of a ",
                          config.model_type, " decoder; expected some of ",
                          absl::StrJoin(modules, ", "));
    }
  }
  return "";
}

}  // namespace fsdp::models
