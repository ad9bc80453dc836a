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

}  // namespace fsdp::llama

#endif  // FSDP_EXAMPLES_LLAMA_HF_CHECKPOINT_H_
