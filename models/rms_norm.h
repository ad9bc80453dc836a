// The decoder's RMSNorm (transformers' LlamaRMSNorm, Olmo2RMSNorm, Gemma2RMSNorm: which
// one is `style`, config.h's NormStyle).
//
//   fsdp::models::RMSNorm norm(/*dim=*/hidden, /*eps=*/1e-6, fsdp::models::NormStyle::kLlama);
//   at::Tensor y = norm(x);   // x [..., hidden] -> y of x's shape and dtype
//
// Errors: none of its own (ATen's, for a last dimension other than `dim`). Threading: as
// any LibTorch module.
#ifndef FSDP_MODELS_RMS_NORM_H_
#define FSDP_MODELS_RMS_NORM_H_

#include <cstdint>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "models/config.h"

namespace fsdp::models {

// x / sqrt(mean(x^2) + eps) over the last dimension in fp32, then the weight applied as
// `style` says (config.h) and cast back to x's dtype. weight [dim]: ones at construction,
// zeros for kGemma (so every style starts as the identity); created with `options`, and
// left uninitialised on c10::kMeta (see reset_parameters).
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps, NormStyle style, const at::TensorOptions& options = {});
  at::Tensor forward(const at::Tensor& x);
  // The constructor's values, in place: ones, zeros for kGemma.
  void reset_parameters();

  at::Tensor weight;
  double eps;
  NormStyle style;
};
TORCH_MODULE(RMSNorm);

}  // namespace fsdp::models

#endif  // FSDP_MODELS_RMS_NORM_H_
