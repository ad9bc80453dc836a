#include "models/mlp.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/gelu.h>
#include <torch/nn/functional/activation.h>

#include "models/internal/projection.h"

namespace fsdp::models {

using models_internal::projection;

MLPImpl::MLPImpl(const DecoderConfig& config, const at::TensorOptions& options)
    : gelu_tanh(config.activation == Activation::kGeluTanh) {
  const int64_t hidden = config.hidden_size, inner = config.intermediate_size;
  if (config.fused_projections) {
    gate_up_proj =
        register_module("gate_up_proj", projection(hidden, 2 * inner, config.mlp_bias, options));
  } else {
    gate_proj = register_module("gate_proj", projection(hidden, inner, config.mlp_bias, options));
    up_proj = register_module("up_proj", projection(hidden, inner, config.mlp_bias, options));
  }
  down_proj = register_module("down_proj", projection(inner, hidden, config.mlp_bias, options));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  at::Tensor gate, up;
  if (gate_up_proj) {  // the first half is the gate
    const at::Tensor both = gate_up_proj(x);
    const int64_t inner = both.size(-1) / 2;
    gate = both.narrow(-1, 0, inner), up = both.narrow(-1, inner, inner);
  } else {
    gate = gate_proj(x), up = up_proj(x);
  }
  return down_proj((gelu_tanh ? at::gelu(gate, "tanh") : torch::nn::functional::silu(gate)) * up);
}

}  // namespace fsdp::models
