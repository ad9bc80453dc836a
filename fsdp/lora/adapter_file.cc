#include "fsdp/lora/adapter_file.h"

#include <filesystem>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"
#include <c10/util/Exception.h>

#include "fsdp/formats/atomic_file.h"
#include "fsdp/formats/safetensors.h"

namespace fsdp::lora {

std::string adapter_config_json(const LoraConfig& config) {
  using json = nlohmann::ordered_json;
  // The fields PEFT 0.21's LoraConfig.save_pretrained writes for this kind of adapter
  // (peft.LoraConfig defaults elsewhere); PEFT fills in the ones left out.
  json target =
      config.target_modules().empty() ? json(config.target_regex()) : json(config.target_modules());
  const auto or_null = [](const std::string& value) {
    return value.empty() ? json(nullptr) : json(value);
  };
  json out = {
      {"alpha_pattern", json::object()},
      {"base_model_name_or_path", or_null(config.base_model_name_or_path())},
      {"bias", "none"},
      {"exclude_modules", nullptr},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"lora_alpha", config.lora_alpha()},
      {"lora_bias", false},
      {"lora_dropout", config.lora_dropout()},
      {"modules_to_save", nullptr},
      {"peft_type", "LORA"},
      {"r", config.r()},
      {"rank_pattern", json::object()},
      {"revision", nullptr},
      {"target_modules", std::move(target)},
      {"task_type", or_null(config.task_type())},
      {"use_dora", false},
      {"use_rslora", false},
  };
  return out.dump(2) + "\n";
}

void save_adapter(const StateDict& state_dict, const LoraConfig& config,
                  const std::string& directory) {
  const StateDict adapter = adapter_state_dict(state_dict);
  std::error_code error;
  std::filesystem::create_directories(directory, error);
  TORCH_CHECK(!error, "save_adapter: cannot create the directory '", directory,
              "': ", error.message());
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& item : adapter) tensors.emplace_back(item.key(), item.value());
  save_safetensors_file(directory + "/adapter_model.safetensors", tensors);
  write_file_atomically(directory + "/adapter_config.json", adapter_config_json(config));
}

std::vector<std::string> save_merged(const StateDict& state_dict, const LoraConfig& config,
                                     const std::string& directory, int64_t max_shard_size) {
  const StateDict merged = merged_state_dict(state_dict, config);
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& item : merged) {
    specs.push_back({item.key(), item.value().scalar_type(), item.value().sizes().vec()});
  }
  SafetensorsFolderWriter writer(directory, std::move(specs),
                                 SafetensorsWriteOptions().max_shard_size(max_shard_size));
  for (const auto& item : merged) writer.write(item.key(), item.value());
  return writer.commit();
}

}  // namespace fsdp::lora
