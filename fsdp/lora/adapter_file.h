// PEFT's adapter files for LoRA adapters made by lora.h: adapter_model.safetensors (the
// adapter tensors under PEFT's names) and adapter_config.json, as PEFT 0.21's
// PeftModel.save_pretrained writes them, so that peft.PeftModel.from_pretrained(base,
// directory) loads them onto the base model.
//
//   fsdp::StateDict full = fsdp::full_state_dict(*model, {});  // every rank
//   if (rank == 0) fsdp::lora::save_adapter(full, lora_config, "out/adapter");
//
// Threading: none of its own. Errors: c10::Error naming the file.
#ifndef FSDP_LORA_ADAPTER_FILE_H_
#define FSDP_LORA_ADAPTER_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/lora/lora.h"

namespace fsdp::lora {

// adapter_config.json for `config` (PEFT 0.21's LoraConfig fields), pretty-printed.
std::string adapter_config_json(const LoraConfig& config);

// Writes `directory`/adapter_model.safetensors (adapter_state_dict's entries, metadata
// {"format": "pt"}) and `directory`/adapter_config.json, creating the directory; each
// file crash-safely (fsdp/formats/atomic_file.h: a temporary file fsync'ed, then renamed).
// Tensors on any device are copied to the CPU. Throws on I/O errors naming the file.
void save_adapter(const StateDict& state_dict, const LoraConfig& config,
                  const std::string& directory);

// Writes the merged model (merged_state_dict(state_dict, config): base weights with the
// adapters folded in, the keys of the model without adapters) to `directory` as
// transformers' save_pretrained writes weights: model.safetensors, or
// model-0000k-of-0000n.safetensors files of at most `max_shard_size` bytes with
// model.safetensors.index.json (fsdp/formats/safetensors.h), each file atomically. Every
// entry is written under its own key, so drop a tied duplicate (e.g. lm_head.weight
// tied to model.embed_tokens.weight) from `state_dict` first, as transformers does.
// Returns the file names written. PEFT: merge_and_unload() then save_pretrained().
std::vector<std::string> save_merged(const StateDict& state_dict, const LoraConfig& config,
                                     const std::string& directory,
                                     int64_t max_shard_size = 50'000'000'000);

}  // namespace fsdp::lora

#endif  // FSDP_LORA_ADAPTER_FILE_H_
