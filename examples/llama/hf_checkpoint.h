// A Hugging Face model folder in and out of an FSDP-wrapped LlamaForCausalLM (model.h).
//
//   fsdp::llama::LlamaConfig config = fsdp::llama::load_llama_config(dir + "/config.json");
//   fsdp::FullyShardedDataParallel<fsdp::llama::LlamaForCausalLMImpl> model(
//       std::make_shared<fsdp::llama::LlamaForCausalLMImpl>(config), options);
//   fsdp::llama::HfWeights read = fsdp::llama::load_hf_weights(*model, dir);   // every rank
//
// The folder's tensors carry the model's own names (model.h), so no renaming happens;
// each is converted to the model's dtype (fp32 master weights) as it is loaded, and its
// dtype in the folder is remembered (HfWeights::dtypes) so that saving writes the same
// dtypes back. Collective where noted; errors as fsdp/state (c10::Error naming the file
// and the tensor: missing, unexpected, another shape).
#ifndef FSDP_EXAMPLES_LLAMA_HF_CHECKPOINT_H_
#define FSDP_EXAMPLES_LLAMA_HF_CHECKPOINT_H_

#include <map>
#include <string>

#include <c10/core/ScalarType.h>

#include "fsdp/core/fully_sharded.h"

namespace fsdp::llama {

struct HfWeights {
  std::map<std::string, c10::ScalarType> dtypes;  // FQN -> its dtype in the folder
};

// Loads the weights of HF folder `dir` into `model` (every rank calls it).
HfWeights load_hf_weights(FullyShardedRoot& model, const std::string& dir);

// Writes the model as an HF folder `out_dir` that transformers' from_pretrained loads:
// the weights (split into files of at most `max_shard_size` bytes, with the index, as
// save_pretrained(max_shard_size=...)) and the other files of `from_dir` that describe the
// model (config.json, generation_config.json and the tokenizer's files) copied unchanged.
// Collective: the units are gathered one at a time; rank 0 writes.
void save_hf_folder(FullyShardedRoot& model, const std::string& from_dir,
                    const std::string& out_dir, int64_t max_shard_size);

// A size as transformers' max_shard_size takes it: bytes ("20000"), or a number with KB,
// MB, GB (powers of 1000) or KiB, MiB, GiB (powers of 1024): "20KB" is 20000, "2GiB"
// 2147483648. Throws c10::Error naming the value otherwise.
int64_t parse_shard_size(const std::string& text);

}  // namespace fsdp::llama

#endif  // FSDP_EXAMPLES_LLAMA_HF_CHECKPOINT_H_
