// The decoder's linear layers (projections and head): fsdp::lora::LoraLinear created
// with the decoder's tensor options. See Note [Where the decoder's tensors are created]
// in decoder.cc. Not a public API.
#ifndef FSDP_MODELS_INTERNAL_PROJECTION_H_
#define FSDP_MODELS_INTERNAL_PROJECTION_H_

#include <cstdint>

#include <c10/core/TensorOptions.h>
#include <torch/nn/options/linear.h>

#include "fsdp/lora/lora.h"

namespace fsdp::models_internal {

// weight [out, in] (+ bias [out]), initialised as torch::nn::Linear unless on c10::kMeta.
inline lora::LoraLinear projection(int64_t in, int64_t out, bool bias,
                                   const at::TensorOptions& options) {
  return lora::LoraLinear(torch::nn::LinearOptions(in, out).bias(bias), options);
}

}  // namespace fsdp::models_internal

#endif  // FSDP_MODELS_INTERNAL_PROJECTION_H_
