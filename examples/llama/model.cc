#include "examples/llama/model.h"

#include <memory>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/activation.h>

namespace fsdp::llama {
namespace {

lora::LoraLinear linear(int64_t in, int64_t out) {
  return lora::LoraLinear(torch::nn::LinearOptions(in, out).bias(false));
}

// HF's rotate_half: [-x2, x1] with x1, x2 the two halves of the last dimension.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t hidden_size, double eps) : eps(eps) {
  weight = register_parameter("weight", at::ones({hidden_size}));
}

at::Tensor LlamaRMSNormImpl::forward(const at::Tensor& x) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor variance = x32.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (x32 * at::rsqrt(variance + eps)).to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config)
    : heads(config.num_attention_heads),
      kv_heads(config.num_key_value_heads),
      head_dim(config.head_dim) {
  q_proj = register_module("q_proj", linear(config.hidden_size, heads * head_dim));
  k_proj = register_module("k_proj", linear(config.hidden_size, kv_heads * head_dim));
  v_proj = register_module("v_proj", linear(config.hidden_size, kv_heads * head_dim));
  o_proj = register_module("o_proj", linear(heads * head_dim, config.hidden_size));
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                       const at::Tensor& sin) {
  const int64_t b = x.size(0), t = x.size(1);
  // [batch, heads, time, head_dim], rotated (cos, sin broadcast over batch and heads).
  const auto project = [&](lora::LoraLinear& proj, int64_t n) {
    return proj(x).view({b, t, n, head_dim}).transpose(1, 2);
  };
  at::Tensor q = project(q_proj, heads), k = project(k_proj, kv_heads);
  const at::Tensor v = project(v_proj, kv_heads);
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  // Each key/value head serves heads / kv_heads query heads (repeat_kv in HF).
  const at::Tensor attended = at::scaled_dot_product_attention(
      q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true, /*scale=*/c10::nullopt,
      /*enable_gqa=*/kv_heads != heads);
  return o_proj(attended.transpose(1, 2).reshape({b, t, heads * head_dim}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& config) {
  gate_proj = register_module("gate_proj", linear(config.hidden_size, config.intermediate_size));
  up_proj = register_module("up_proj", linear(config.hidden_size, config.intermediate_size));
  down_proj = register_module("down_proj", linear(config.intermediate_size, config.hidden_size));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  return down_proj(torch::nn::functional::silu(gate_proj(x)) * up_proj(x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& config) {
  self_attn = register_module("self_attn", LlamaAttention(config));
  mlp = register_module("mlp", LlamaMLP(config));
  input_layernorm =
      register_module("input_layernorm", LlamaRMSNorm(config.hidden_size, config.rms_norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm",
                                             LlamaRMSNorm(config.hidden_size, config.rms_norm_eps));
}

at::Tensor LlamaDecoderLayerImpl::forward(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  x = x + self_attn(input_layernorm(x), cos, sin);
  return x + mlp(post_attention_layernorm(x));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& config) : config(config) {
  embed_tokens =
      register_module("embed_tokens", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    units.push_back(Unit<LlamaDecoderLayerImpl>(std::make_shared<LlamaDecoderLayerImpl>(config)));
    layers->push_back(units.back());
  }
  norm = register_module("norm", LlamaRMSNorm(config.hidden_size, config.rms_norm_eps));
}

std::pair<at::Tensor, at::Tensor> LlamaModelImpl::rotary(int64_t time, c10::Device device,
                                                         at::ScalarType dtype) const {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t d = config.head_dim;
  // inv_freq = 1 / theta^(2i / d), positions x inv_freq, both halves (HF's
  // compute_default_rope_parameters and LlamaRotaryEmbedding.forward, in fp32).
  const at::Tensor inv_freq =
      1.0 / at::pow(config.rope_theta, at::arange(0, d, 2, at::kLong).to(f32) / double(d));
  const at::Tensor freqs = at::arange(time, at::kLong).to(f32).unsqueeze(1) * inv_freq;
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong,
              "LlamaModel: expected token ids [batch, time] of int64, got ", ids.sizes(), " of ",
              ids.scalar_type());
  const int64_t t = ids.size(1);
  TORCH_CHECK(t <= config.max_position_embeddings, "LlamaModel: a sequence of ", t,
              " tokens is longer than max_position_embeddings = ", config.max_position_embeddings,
              "; use shorter windows");
  at::Tensor x = embed_tokens(ids);
  const auto [cos, sin] = rotary(t, x.device(), x.scalar_type());
  for (auto& unit : units) x = unit(x, cos, sin);
  return norm(x);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& config) : config(config) {
  model = register_module("model", LlamaModel(config));
  if (!config.tie_word_embeddings) {
    lm_head = register_module(
        "lm_head",
        torch::nn::Linear(
            torch::nn::LinearOptions(config.hidden_size, config.vocab_size).bias(false)));
  }
}

at::Tensor LlamaForCausalLMImpl::forward(const at::Tensor& ids) {
  const at::Tensor hidden = model(ids);
  if (lm_head) return lm_head(hidden);
  return at::linear(hidden, model->embed_tokens->weight);
}

}  // namespace fsdp::llama
