#include "fsdp/core/mixed_precision.h"

#include <torch/nn/modules/batchnorm.h>

namespace fsdp {

bool is_batch_norm(const torch::nn::Module& module) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module) != nullptr ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module) != nullptr;
}

}  // namespace fsdp
