#include "examples/llama/hf_checkpoint.h"

#include <c10/util/Exception.h>

#include "fsdp/state/checkpoint.h"
#include "fsdp/state/state_dict.h"

namespace fsdp::llama {

HfWeights load_hf_weights(FullyShardedRoot& model, const std::string& dir) {
  // Interim, until fsdp's safetensors reader lands: the folder's tensors as one torch.save
  // file (model.pt).
  const StateDict read = load_state_dict(dir + "/model.pt");
  HfWeights weights;
  StateDict converted;
  for (const auto& item : read) {
    weights.dtypes[item.key()] = item.value().scalar_type();
    converted.insert(item.key(), item.value().to(at::kFloat));
  }
  load_full_state_dict(model, converted);
  return weights;
}

}  // namespace fsdp::llama
