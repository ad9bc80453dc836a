#include "models/hf_checkpoint.h"

#include <filesystem>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include <c10/util/Exception.h>

#include "fsdp/formats/safetensors.h"
#include "fsdp/lora/adapter_file.h"
#include "fsdp/state/safetensors_state_dict.h"

namespace fsdp::models {
namespace {

// The files of an HF folder that describe the model besides its weights.
void copy_model_files(const std::string& from_dir, const std::string& out_dir) {
  for (const char* name : {"config.json", "generation_config.json", "tokenizer.json",
                           "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"}) {
    const std::filesystem::path from = std::filesystem::path(from_dir) / name;
    if (!std::filesystem::exists(from)) continue;
    std::filesystem::copy_file(from, std::filesystem::path(out_dir) / name,
                               std::filesystem::copy_options::overwrite_existing);
  }
}

// Removes the weight files a previous save left in `out_dir` (other shard counts would
// stay beside the new files, and a stale index would win over a new model.safetensors).
void remove_old_weights(const std::string& out_dir) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(out_dir, error)) {
    const std::string name = entry.path().filename().string();
    if (absl::EndsWith(name, ".safetensors") || name == kSafetensorsIndexName) {
      std::filesystem::remove(entry.path());
    }
  }
}

}  // namespace

at::ScalarType hf_weights_dtype(const std::string& dir) {
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(dir);
  std::string first;
  at::ScalarType dtype = at::kFloat;
  for (const std::string& name : checkpoint.names()) {
    const at::ScalarType found = checkpoint.info(name).dtype;
    if (!c10::isFloatingType(found)) continue;
    if (first.empty()) {
      first = name;
      dtype = found;
    }
    TORCH_CHECK(found == dtype, dir, ": tensor ", name, " is ", found, " but ", first, " is ",
                dtype, "; fsdp's decoder trains one dtype (convert the folder first)");
  }
  return dtype;
}

void load_hf_weights(FullyShardedRoot& model, const std::string& dir) {
  load_safetensors(model, dir,
                   LoadSafetensorsOptions().skip(lora::is_adapter_key).cast_floating(true));
}

void save_hf_folder(FullyShardedRoot& model, const std::string& from_dir,
                    const std::string& out_dir, int64_t max_shard_size) {
  TORCH_CHECK(max_shard_size > 0, "max_shard_size must be positive, got ", max_shard_size);
  if (model.communicator().rank() == 0) prepare_hf_folder(from_dir, out_dir);
  save_safetensors(
      model, out_dir,
      SaveSafetensorsOptions().max_shard_size(max_shard_size).dtype(hf_weights_dtype(from_dir)));
}

// Note [Merging LoRA adapters one unit at a time]
// save_safetensors gathers a unit's flat parameters together (the frozen one, holding
// the base weights, with the trainable one, holding the adapters), skips the adapter
// entries, and hands each base weight with its unit's gathered entries to the transform
// below, which returns weight + B A x scaling when the unit holds that module's lora_A
// and lora_B. The adapters are copied on rank 0 as they go by (r (in + out) elements per
// module), so the adapter file needs no second gather. The merged values are those of
// fsdp::lora::merged_state_dict over a full state dict, computed one weight at a time.
void save_lora_hf_folders(FullyShardedRoot& model, const lora::LoraConfig& config,
                          const std::string& from_dir, const std::string& out_dir,
                          const std::string& adapter_dir, int64_t max_shard_size) {
  TORCH_CHECK(max_shard_size > 0, "max_shard_size must be positive, got ", max_shard_size);
  const bool lead = model.communicator().rank() == 0;
  if (lead) prepare_hf_folder(from_dir, out_dir);
  lora::StateDict adapters;  // rank 0: copies, in module order
  const auto merge = [&](const std::string& fqn, const at::Tensor& value,
                         const torch::OrderedDict<std::string, at::Tensor>& unit) {
    static constexpr char kWeight[] = ".weight";
    if (!absl::EndsWith(fqn, kWeight)) return value;
    const std::string module = fqn.substr(0, fqn.size() - (sizeof(kWeight) - 1));
    const at::Tensor* a = unit.find(module + ".lora_A.weight");
    const at::Tensor* b = unit.find(module + ".lora_B.weight");
    if (a == nullptr) return value;
    TORCH_INTERNAL_ASSERT(b != nullptr, "'", module, "' has lora_A but no lora_B in its unit");
    adapters.insert(module + ".lora_A.weight", a->clone());
    adapters.insert(module + ".lora_B.weight", b->clone());
    return lora::merged_weight(module, value, *a, *b, config);
  };
  save_safetensors(model, out_dir,
                   SaveSafetensorsOptions()
                       .max_shard_size(max_shard_size)
                       .dtype(hf_weights_dtype(from_dir))
                       .skip(lora::is_adapter_key)
                       .transform(merge));
  if (lead) lora::save_adapter(adapters, config, adapter_dir);
}

void prepare_hf_folder(const std::string& from_dir, const std::string& out_dir) {
  std::filesystem::create_directories(out_dir);
  remove_old_weights(out_dir);
  copy_model_files(from_dir, out_dir);
}

int64_t parse_shard_size(const std::string& text, std::string_view flag) {
  static const std::pair<const char*, int64_t> kUnits[] = {
      {"KiB", int64_t{1} << 10}, {"MiB", int64_t{1} << 20},
      {"GiB", int64_t{1} << 30}, {"KB", 1000},
      {"MB", 1000 * 1000},       {"GB", 1000 * 1000 * 1000},
  };
  std::string number = text;
  int64_t unit = 1;
  for (const auto& [suffix, bytes] : kUnits) {
    if (absl::EndsWith(text, suffix)) {
      number = text.substr(0, text.size() - std::string(suffix).size());
      unit = bytes;
      break;
    }
  }
  int64_t value = 0;
  TORCH_CHECK(absl::SimpleAtoi(number, &value) && value > 0 && value <= INT64_MAX / unit, flag, "=",
              text,
              ": expected a positive size in bytes, or with KB, MB, GB, KiB, MiB or GiB "
              "(e.g. 5GB)");
  return value * unit;
}

}  // namespace fsdp::models
