// A Hugging Face model folder in and out of an FSDP-wrapped CausalLM (decoder.h).
//
//   const std::string dir = "/models/tiny";
//   fsdp::models::DecoderConfig config = fsdp::models::load_decoder_config(dir + "/config.json");
//   auto net = std::make_shared<fsdp::models::CausalLMImpl>(   // no memory, no values
//       config, at::TensorOptions().device(c10::kMeta));       // fp32 master weights
//   fsdp::FullyShardedDataParallel<fsdp::models::CausalLMImpl> model(net, options);  // shards
//   fsdp::models::load_hf_weights(*model, dir);         // each rank reads its shards' bytes
//   fsdp::models::save_hf_folder(*model, dir, "/out/hf", 5'000'000'000);
//
// No process holds the whole model at any point: the model is built on the meta device
// (decoder.h), FSDP allocates each rank's shards, each rank reads only its shards' bytes,
// and saving gathers one unit at a time. LoRA adapters added before loading
// (fsdp::lora::apply_lora on the meta-built model) keep their values; save_lora_hf_folders
// writes the merged model and the adapter the same way.
//
// Names both ways: every family the decoder builds (config.h) names its tensors in the
// checkpoint as transformers' *ForCausalLM names its parameters, and the decoder's modules
// carry those names (decoder.h), so the mapping is the identity in both directions and no
// renaming happens (fsdp/state/safetensors_state_dict.h does the reading and writing),
// except for the mixture-of-experts families' experts, fused in the decoder and one by one
// in the checkpoint (each per-expert tensor a contiguous run of the fused one, read and
// written by the rank's overlap; Mixtral's block_sparse_moe named as the checkpoint does;
// the family from the folder's config.json); a
// folder whose names differ (a multimodal "gemma3" folder's model.language_model.*) is
// refused by its config. PyTorch / transformers: AutoModelForCausalLM.from_pretrained /
// save_pretrained(max_shard_size=...).
// Errors: c10::Error naming the file and the tensor (missing, unexpected, another shape
// or dtype, a malformed file).
#ifndef FSDP_MODELS_HF_CHECKPOINT_H_
#define FSDP_MODELS_HF_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include "fsdp/core/fully_sharded.h"
#include "fsdp/lora/lora.h"

namespace fsdp::models {

// The dtype of the floating tensors of HF folder `dir` (headers only are read), the
// quantization state of a bitsandbytes 4-bit folder's weights (float32 whatever their dtype)
// left out: the dtype its weights dequantize to; DeepSeek-V3's e_score_correction_bias
// (float32 in every folder, and written so) left out too. Throws naming two tensors when
// they differ.
at::ScalarType hf_weights_dtype(const std::string& dir);

// A folder transformers saved after loading a model in bitsandbytes' 4-bit NF4 with double
// quantization (config.json's quantization_config: DecoderConfig::load_in_4bit; the Hub's
// "*-bnb-4bit" folders) holds the weights of some Linears in the layout of fsdp's NF4 base
// (Note [A bitsandbytes 4-bit folder] in hf_checkpoint.cc): those whose "<module>.weight" has
// "<module>.weight.quant_state.bitsandbytes__nf4" beside it (never lm_head; some folders
// leave some layers' projections unquantized). Stores the base weight of each such module of
// `model` (built on the meta device, not wrapped yet) in NF4
// (lora::LoraLinearImpl::store_weight_nf4), so that load_hf_weights reads the folder's bytes
// into it as they are. Returns their cleaned FQNs, sorted; none for a folder of float weights.
// Each module's quantization state is checked first (headers, the quant_state's JSON and the
// quant_map are read): the JSON's quant_type "nf4", blocksize 64, nested_blocksize 256,
// nested_dtype "float32", shape [out_features, in_features] of the module and dtype the
// folder's (hf_weights_dtype), every tensor's dtype and shape against them, the quant_map
// equal to the NF4 code table (fsdp/formats/nf4.h). PyTorch/transformers:
// AutoModelForCausalLM.from_pretrained of such a folder (bitsandbytes' Linear4bit, its
// Params4bit.from_prequantized). Errors: c10::Error naming the tensor, what it holds and
// what was expected: FP4, no double quantization, another blocksize, a quant_state that is
// not such JSON (or over 4096 bytes), a missing tensor or one of another dtype or shape, a
// 4-bit weight the model holds no LoraLinear of that name for.
std::vector<std::string> store_hf_nf4_weights(torch::nn::Module& model, const std::string& dir);

// Loads the weights of HF folder `dir` (model.safetensors, or the shards of
// model.safetensors.index.json) into `model`: each rank reads only the bytes of its own
// flat-parameter shards (fsdp::load_safetensors), straight into them, floating tensors
// converted to the model's dtype (a bf16 folder into fp32 master weights: exact), so a
// model built on the meta device gets its values with no full copy anywhere. LoRA
// adapters the model carries (fsdp::lora::apply_lora) are not looked for in the folder
// and keep their values. A LoraLinear holding its base in NF4
// (fsdp::lora::LoraLinearImpl::store_weight_nf4, on the meta device) gets the NF4 bytes of
// the folder's weight: from a bitsandbytes 4-bit folder (store_hf_nf4_weights), the folder's
// own bytes, checked as store_hf_nf4_weights checks them, each rank reading its shards' codes
// and absmax bytes and the small tensors whole (Note [A bitsandbytes 4-bit folder]); from a
// float weight, each rank reads that weight whole, one at a time, quantizes it as
// bitsandbytes does and keeps its shards' bytes (Note [NF4 base weights in an HF folder]
// in hf_checkpoint.cc). A 4-bit weight of the folder that the model does not hold in NF4 is
// an error saying to call store_hf_nf4_weights. A folder whose config.json ties the head to
// the embeddings (tie_word_embeddings) but still holds lm_head.weight (some conversions on
// the Hub) loads as transformers 5.x loads it when that head equals the embeddings (each
// rank compares the two, 1 M elements at a time), and is an error otherwise: a head of
// another shape, dtype or values, which transformers would load untied. No communication;
// every rank calls it.
void load_hf_weights(FullyShardedRoot& model, const std::string& dir);

// Writes the model as an HF folder `out_dir` that transformers' from_pretrained loads:
// the weights (split into files of at most `max_shard_size` bytes, with the index, as
// save_pretrained(max_shard_size=...)), the floating ones in the dtype `from_dir` holds
// (hf_weights_dtype: fp32 master weights go back as the bf16 folder they came from,
// rounded to nearest), and the other files of `from_dir` that describe the model, those of
// them it holds, copied byte for byte: config.json, generation_config.json and the files a
// tokenizer is saved as (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
// tokenizer.model, vocab.json, merges.txt, added_tokens.json, and the chat template's
// chat_template.jinja or chat_template.json), except that config.json loses its
// quantization_config (the weights are written dequantized); weight files an earlier save
// left there are removed first.
// Collective: the units are gathered one at a time; rank 0 writes.
void save_hf_folder(FullyShardedRoot& model, const std::string& from_dir,
                    const std::string& out_dir, int64_t max_shard_size);

// For a model with LoRA adapters (fsdp::lora::apply_lora with `config`): writes the model
// with every adapter merged into its base weight (fsdp::lora::merged_weight) as an HF
// folder `out_dir`, as save_hf_folder does (PEFT: merge_and_unload, then save_pretrained),
// and the adapters alone to `adapter_dir` as PEFT's save_pretrained does
// (fsdp::lora::save_adapter: PeftModel.from_pretrained loads it). Collective: the units
// are gathered one at a time, each unit's frozen base weights with its adapters, and rank
// 0 merges and writes that unit's tensors before the next is gathered (peak: one unit
// unsharded, plus a weight's merge in fp32); no process holds the whole model. The
// merged floating weights are written in the dtype of `from_dir`'s weights, rounded once.
// A base held in NF4 is written dequantized (plus its update), under the folder's name,
// in that dtype: a bitsandbytes 4-bit folder's weights come out in the dtype they
// dequantize to (bf16 usually), as an unquantized folder (PEFT's merge_and_unload on a
// 4-bit base instead quantizes the merged weight again).
void save_lora_hf_folders(FullyShardedRoot& model, const lora::LoraConfig& config,
                          const std::string& from_dir, const std::string& out_dir,
                          const std::string& adapter_dir, int64_t max_shard_size);

// Readies `out_dir` for a model's weights written by other means: makes it, removes weight
// files an earlier save left there, and copies the files of `from_dir` that describe the
// model, as save_hf_folder does. Call on one rank.
void prepare_hf_folder(const std::string& from_dir, const std::string& out_dir);

// A size as transformers' max_shard_size takes it: bytes ("20000"), or a number with KB,
// MB, GB (powers of 1000) or KiB, MiB, GiB (powers of 1024), in any case as transformers
// takes them: "20KB" is 20000, "2GiB" and "2gib" 2147483648; a final lowercase b ("5gb"),
// which transformers reads as bits, is refused. Throws c10::Error otherwise, naming `flag` (the
// flag or option the text was given for, e.g.
// "--max_memory_per_rank") and the value: "--max_memory_per_rank=5TB: ...".
int64_t parse_shard_size(const std::string& text, std::string_view flag = "--max_shard_size");

}  // namespace fsdp::models

#endif  // FSDP_MODELS_HF_CHECKPOINT_H_
