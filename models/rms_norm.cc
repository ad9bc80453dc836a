#include "models/rms_norm.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/rsqrt.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace fsdp::models {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, NormStyle style, const at::TensorOptions& options)
    : eps(eps), style(style) {
  weight = register_parameter("weight", at::empty({dim}, options));
  if (!options.device().is_meta()) reset_parameters();
}

void RMSNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight.fill_(style == NormStyle::kGemma ? 0.0 : 1.0);
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  switch (style) {
    case NormStyle::kGemma:
      return (normed * (1.0 + weight.to(at::kFloat))).to(x.scalar_type());
    case NormStyle::kOlmo:
      return (weight * normed).to(x.scalar_type());
    case NormStyle::kLlama:
      break;
  }
  return weight * normed.to(x.scalar_type());
}

}  // namespace fsdp::models
