#include "models/hf_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include <c10/util/Exception.h>

#include "fsdp/formats/safetensors.h"
#include "fsdp/lora/adapter_file.h"
#include "fsdp/state/safetensors_state_dict.h"
#include "models/config.h"

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

// Note [Experts one by one in the checkpoint]
// The decoder holds a sparse layer's experts fused, as transformers 5.x does in memory
// (moe.h): mlp.experts.gate_up_proj [E, 2 I, H] and mlp.experts.down_proj [E, H, I]. The
// checkpoints on the Hub, and those transformers 5.x's save_pretrained writes (its
// conversion_mapping's WeightConverters run backwards), hold them one by one:
// mlp.experts.E.gate_proj.weight [I, H], up_proj, down_proj [H, I] (Mixtral:
// block_sparse_moe.experts.E.w1 (gate), w3 (up), w2 (down), and block_sparse_moe.gate
// for the router). Expert e's gate rows, then its up rows, are contiguous in the fused
// tensor's elements, as is its down matrix, so each per-expert tensor is one contiguous
// run of the fused parameter's elements: a SafetensorsSplit, read by each rank only where
// it overlaps the rank's shards and written back piece by piece from the gathered unit,
// bit for bit. No renaming table beyond this: every other name is the module's own.
struct ExpertNames {
  std::string block = "mlp", gate = "gate_proj", up = "up_proj", down = "down_proj";
};

// The names of `dir`'s experts (from its config.json; Qwen's when it has none).
ExpertNames expert_names(const std::string& dir) {
  const std::filesystem::path config = std::filesystem::path(dir) / "config.json";
  if (!std::filesystem::exists(config)) return {};
  if (!load_decoder_config(config.string()).block_sparse_moe_names) return {};
  return {"block_sparse_moe", "w1", "w3", "w2"};
}

// Mixtral: the block's name on disk.
SafetensorsRename rename_of(const ExpertNames& names) {
  if (names.block == "mlp") return nullptr;
  return [block = "." + names.block + "."](const std::string& fqn) {
    const size_t at = fqn.find(".mlp.");
    return at == std::string::npos ? fqn : fqn.substr(0, at) + block + fqn.substr(at + 5);
  };
}

SafetensorsSplit split_of(const ExpertNames& names) {
  return [names](const std::string& fqn, c10::IntArrayRef shape) {
    std::vector<SafetensorsPiece> pieces;
    static constexpr char kFused[] = ".mlp.experts.";
    const size_t at = fqn.rfind(kFused);
    if (at == std::string::npos || shape.size() != 3) return pieces;
    const std::string tensor = fqn.substr(at + sizeof(kFused) - 1);
    const std::string prefix = fqn.substr(0, at) + "." + names.block + ".experts.";
    const auto piece = [&](int64_t e, const std::string& name, int64_t rows) {
      pieces.push_back({prefix + std::to_string(e) + "." + name + ".weight", {rows, shape[2]}});
    };
    for (int64_t e = 0; e < shape[0]; ++e) {
      if (tensor == "gate_up_proj") {
        piece(e, names.gate, shape[1] / 2);
        piece(e, names.up, shape[1] / 2);
      } else if (tensor == "down_proj") {
        piece(e, names.down, shape[1]);
      }
    }
    return pieces;
  };
}

// Note [NF4 base weights in an HF folder]
// A LoraLinear whose base weight is stored in NF4 (lora::LoraLinearImpl::store_weight_nf4:
// the trainer's --quantize=nf4) holds five parameters where the folder holds one weight:
// "<module>.weight" (the codes), "<module>.weight_absmax", "..._nested_absmax",
// "..._nested_quant_map" and "..._nested_offset". Reading, each of them is derived from the
// folder's "<module>.weight" (LoadSafetensorsOptions::derive): every rank reads that weight
// whole, one weight at a time, quantizes it (lora::nf4_weight_entries, bit for bit
// bitsandbytes' quantize_4bit: the whole tensor's absmax mean enters the double
// quantization, so a rank cannot quantize its slice alone) and keeps the bytes of its
// shards. Writing, the codes entry is written as "<module>.weight" dequantized (fp32, then
// the folder's dtype: bitsandbytes' dequantize_4bit, plus the LoRA update when merging) and
// the other four are left out, so OUT/hf holds the weights the run computed with, in the
// folder's layout. (PEFT's merge_and_unload on a 4-bit base instead quantizes the merged
// weight again, to 4 bits.)
constexpr const char* kNf4Aux[] = {"weight_absmax", "weight_nested_absmax",
                                   "weight_nested_quant_map", "weight_nested_offset"};

// The module and the parameter of an entry of an NF4 module ("weight" or one of kNf4Aux),
// if it is one.
std::optional<std::pair<std::string, std::string>> nf4_entry(
    const std::map<std::string, std::vector<int64_t>>& modules, const std::string& fqn) {
  const size_t dot = fqn.rfind('.');
  if (dot == std::string::npos || !modules.count(fqn.substr(0, dot))) return std::nullopt;
  const std::string name = fqn.substr(dot + 1);
  if (name != "weight" &&
      std::find(std::begin(kNf4Aux), std::end(kNf4Aux), name) == std::end(kNf4Aux)) {
    return std::nullopt;
  }
  return std::make_pair(fqn.substr(0, dot), name);
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
  const ExpertNames names = expert_names(dir);  // See Note [Experts one by one in the checkpoint]
  const SafetensorsRename rename = rename_of(names);
  // See Note [NF4 base weights in an HF folder]: the last weight quantized, by source name.
  const auto modules = lora::nf4_modules(model.root_module());
  auto quantized = std::make_shared<std::pair<std::string, lora::StateDict>>();
  const SafetensorsDerive derive =
      [&modules, rename, quantized](const std::string& fqn) -> c10::optional<SafetensorsDerived> {
    const auto entry = nf4_entry(modules, fqn);
    if (!entry) return c10::nullopt;
    const std::string weight = entry->first + ".weight";
    const std::string source = rename ? rename(weight) : weight;
    return SafetensorsDerived{source, [=](const at::Tensor& value) {
                                if (quantized->first != source) {
                                  quantized->first = source;
                                  quantized->second = lora::StateDict();
                                  for (auto& [name, t] : lora::nf4_weight_entries(value)) {
                                    quantized->second.insert(name, t);
                                  }
                                }
                                return quantized->second[entry->second];
                              }};
  };
  load_safetensors(model, dir,
                   LoadSafetensorsOptions()
                       .skip(lora::is_adapter_key)
                       .cast_floating(true)
                       .rename(rename)
                       .split(split_of(names))
                       .derive(modules.empty() ? nullptr : derive));
}

void save_hf_folder(FullyShardedRoot& model, const std::string& from_dir,
                    const std::string& out_dir, int64_t max_shard_size) {
  TORCH_CHECK(max_shard_size > 0, "max_shard_size must be positive, got ", max_shard_size);
  if (model.communicator().rank() == 0) prepare_hf_folder(from_dir, out_dir);
  const ExpertNames names = expert_names(from_dir);
  save_safetensors(model, out_dir,
                   SaveSafetensorsOptions()
                       .max_shard_size(max_shard_size)
                       .dtype(hf_weights_dtype(from_dir))
                       .rename(rename_of(names))
                       .split(split_of(names)));
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
  const auto modules =
      lora::nf4_modules(model.root_module());  // See Note [NF4 base weights in an HF folder]
  const auto merge = [&](const std::string& fqn, const at::Tensor& stored,
                         const torch::OrderedDict<std::string, at::Tensor>& unit) {
    static constexpr char kWeight[] = ".weight";
    if (!absl::EndsWith(fqn, kWeight)) return stored;
    const std::string module = fqn.substr(0, fqn.size() - (sizeof(kWeight) - 1));
    at::Tensor value = stored;
    if (const auto nf4 = modules.find(module); nf4 != modules.end()) {
      const auto aux = [&](const char* name) { return unit[module + "." + name]; };
      value = lora::dequantize_nf4_entries(nf4->second, at::kFloat, stored, aux(kNf4Aux[0]),
                                           aux(kNf4Aux[1]), aux(kNf4Aux[2]), aux(kNf4Aux[3]));
    }
    const at::Tensor* a = unit.find(module + ".lora_A.weight");
    const at::Tensor* b = unit.find(module + ".lora_B.weight");
    if (a == nullptr) return value;
    TORCH_INTERNAL_ASSERT(b != nullptr, "'", module, "' has lora_A but no lora_B in its unit");
    adapters.insert(module + ".lora_A.weight", a->clone());
    adapters.insert(module + ".lora_B.weight", b->clone());
    return lora::merged_weight(module, value, *a, *b, config);
  };
  save_safetensors(
      model, out_dir,
      SaveSafetensorsOptions()
          .max_shard_size(max_shard_size)
          .dtype(hf_weights_dtype(from_dir))
          .skip([&modules](const std::string& fqn) {
            const auto nf4 = nf4_entry(modules, fqn);
            return lora::is_adapter_key(fqn) || (nf4 && nf4->second != "weight");
          })
          .transform(merge)
          .written_as([&modules](const std::string& fqn) -> c10::optional<SafetensorsWrittenAs> {
            const auto nf4 = nf4_entry(modules, fqn);
            if (!nf4 || nf4->second != "weight") return c10::nullopt;
            return SafetensorsWrittenAs{modules.at(nf4->first), at::kFloat};
          })
          .rename(rename_of(expert_names(from_dir)))
          .split(split_of(expert_names(from_dir))));
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
