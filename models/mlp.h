// The decoder's gated MLP, down(act(gate(x)) * up(x)) with act SiLU or GeLU-tanh
// (config.activation), its projections fsdp::lora::LoraLinear under the families' names
// (gate_proj, up_proj, down_proj, or gate_up_proj fused). PyTorch/transformers
// counterpart: LlamaMLP, GemmaMLP, Phi3MLP.
//
//   fsdp::models::MLP mlp(config);
//   at::Tensor y = mlp(x);  // x [batch, time, hidden] -> y the same
//
// Errors: none of their own (ATen's, for shapes other than the config's). Threading: as
// any LibTorch module.
#ifndef FSDP_MODELS_MLP_H_
#define FSDP_MODELS_MLP_H_

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/lora/lora.h"
#include "models/config.h"

namespace fsdp::models {

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const DecoderConfig& config, const at::TensorOptions& options = {});
  at::Tensor forward(const at::Tensor& x);

  bool gelu_tanh;
  lora::LoraLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  lora::LoraLinear gate_up_proj{nullptr};  // fused_projections: gate, up in one
};
TORCH_MODULE(MLP);

}  // namespace fsdp::models

#endif  // FSDP_MODELS_MLP_H_
