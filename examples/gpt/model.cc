#include "examples/gpt/model.h"

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/activation.h>

#include "fsdp/core/checkpoint_wrapper.h"

namespace fsdp::examples {

BlockImpl::BlockImpl(const GptOptions& options) : heads(options.heads()) {
  const int64_t w = options.width();
  TORCH_CHECK(w % options.heads() == 0, "width ", w, " must be a multiple of heads ",
              options.heads());
  norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
  qkv = register_module("qkv", torch::nn::Linear(w, 3 * w));
  proj = register_module("proj", torch::nn::Linear(w, w));
  norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({w})));
  up = register_module("up", torch::nn::Linear(w, 4 * w));
  down = register_module("down", torch::nn::Linear(4 * w, w));
}

at::Tensor BlockImpl::forward(at::Tensor x) {
  if (!checkpoint_activations) return compute(x);
  return checkpoint([this](const std::vector<at::Tensor>& in) { return compute(in[0]); }, {x},
                    parameters());
}

at::Tensor BlockImpl::compute(const at::Tensor& input) {
  at::Tensor x = input;
  const int64_t b = x.size(0), t = x.size(1), w = x.size(2), d = w / heads;
  // Causal self-attention over `heads` heads of width d: PyTorch's fused kernel
  // (flash attention where the device and dtype allow, else the math kernel), the same
  // call as torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).
  auto parts = qkv(norm1(x)).view({b, t, 3, heads, d}).permute({2, 0, 3, 1, 4}).unbind(0);
  const at::Tensor attended =
      at::scaled_dot_product_attention(parts[0], parts[1], parts[2], /*attn_mask=*/{},
                                       /*dropout_p=*/0.0, /*is_causal=*/true);
  x = x + proj(attended.transpose(1, 2).reshape({b, t, w}));
  return x + down(torch::nn::functional::gelu(up(norm2(x))));
}

GptImpl::GptImpl(const GptOptions& options) : options(options) {
  token = register_module("token", torch::nn::Embedding(options.vocab_size(), options.width()));
  position = register_module("position", torch::nn::Embedding(options.context(), options.width()));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.layers(); ++i) {
    units.push_back(Unit<BlockImpl>(std::make_shared<BlockImpl>(options)));
    blocks->push_back(units.back());
  }
  norm =
      register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({options.width()})));
  // GPT-2's embedding scale: with the tied head, N(0, 1) rows would start at ~sqrt(width)
  // logits.
  torch::NoGradGuard no_grad;
  token->weight.normal_(0.0, 0.02);
  position->weight.normal_(0.0, 0.02);
}

at::Tensor GptImpl::forward(at::Tensor tokens) {
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t <= options.context(), "sequence of ", t, " tokens is longer than the context ",
              options.context());
  // The positions on the tokens' device (the embeddings' device, cuda:N under device_id).
  at::Tensor x = token(tokens) + position(at::arange(t, tokens.options().dtype(at::kLong)));
  for (auto& unit : units) x = unit(x);
  return at::matmul(norm(x), token->weight.t());  // output head tied to the embedding
}

}  // namespace fsdp::examples
