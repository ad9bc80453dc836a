#include "models/attention.h"

#include <limits>
#include <optional>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/max.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tanh.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "models/internal/projection.h"
#include "models/rotary.h"

namespace fsdp::models {
namespace {

using models_internal::projection;

// [queries, keys], true where query i may attend to key j, the queries being the last of
// the keys' positions (query i at position keys - queries + i): j <= that position, and
// j > it - window when window > 0.
at::Tensor attention_mask(int64_t queries, int64_t keys, int64_t window, c10::Device device) {
  const auto ids = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor q = at::arange(keys - queries, keys, ids).unsqueeze(1);
  const at::Tensor k = at::arange(keys, ids).unsqueeze(0);
  at::Tensor mask = k <= q;
  if (window > 0) mask = mask & (k > q - window);
  return mask;
}

}  // namespace

at::Tensor packed_attention_mask(const at::Tensor& segments) {
  TORCH_CHECK(segments.dim() == 2 && segments.scalar_type() == at::kLong,
              "packed_attention_mask: expected segments [batch, time] of int64, got ",
              segments.sizes(), " of ", segments.scalar_type());
  const int64_t t = segments.size(1);
  const at::Tensor same = segments.unsqueeze(2) == segments.unsqueeze(1);  // [B, T, T]
  return (same & attention_mask(t, t, 0, segments.device())).unsqueeze(1);
}

AttentionImpl::AttentionImpl(const DecoderConfig& config, LayerType type,
                             const at::TensorOptions& options)
    : heads(config.num_attention_heads),
      kv_heads(config.num_key_value_heads),
      head_dim(config.head_dim),
      window(type == LayerType::kSliding ? config.sliding_window : 0),
      scale(config.attention_scale),
      softcap(config.attn_logit_softcapping) {
  const int64_t hidden = config.hidden_size;
  if (config.fused_projections) {
    qkv_proj = register_module("qkv_proj", projection(hidden, (heads + 2 * kv_heads) * head_dim,
                                                      config.qkv_bias, options));
  } else {
    q_proj =
        register_module("q_proj", projection(hidden, heads * head_dim, config.qkv_bias, options));
    k_proj = register_module("k_proj",
                             projection(hidden, kv_heads * head_dim, config.qkv_bias, options));
    v_proj = register_module("v_proj",
                             projection(hidden, kv_heads * head_dim, config.qkv_bias, options));
  }
  o_proj = register_module("o_proj", projection(heads * head_dim, hidden, config.o_bias, options));
  const auto norm = [&](const char* name, int64_t dim) {
    return register_module(name, RMSNorm(dim, config.rms_norm_eps, config.norm_style, options));
  };
  if (config.qk_norm) {
    q_norm = norm("q_norm", head_dim);
    k_norm = norm("k_norm", head_dim);
  } else if (config.qk_norm_full_width) {
    full_width_norm = true;
    q_norm = norm("q_norm", heads * head_dim);
    k_norm = norm("k_norm", kv_heads * head_dim);
  }
  if (config.attention_sinks) {
    sinks = register_parameter("sinks", at::empty({heads}, options));
    if (!options.device().is_meta()) reset_parameters();
  }
}

void AttentionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  if (sinks.defined()) sinks.zero_();
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& mask) {
  const int64_t b = x.size(0), t = x.size(1);
  // [batch, heads, time, head_dim]: normed per head or over the full width, then rotated
  // (cos, sin broadcast over batch and heads).
  const at::Tensor qkv = qkv_proj ? qkv_proj(x) : at::Tensor();
  int64_t offset = 0;  // into qkv: q, then k, then v
  const auto project = [&](lora::LoraLinear& proj, RMSNorm& norm, int64_t n) {
    at::Tensor y = qkv.defined() ? qkv.narrow(-1, offset, n * head_dim) : proj(x);
    offset += n * head_dim;
    if (norm && full_width_norm) y = norm(y);
    y = y.view({b, t, n, head_dim});
    if (norm && !full_width_norm) y = norm(y);
    return y.transpose(1, 2);
  };
  at::Tensor q = project(q_proj, q_norm, heads), k = project(k_proj, k_norm, kv_heads);
  RMSNorm none{nullptr};
  at::Tensor v = project(v_proj, none, kv_heads);
  q = apply_rotary(q, cos, sin);
  k = apply_rotary(k, cos, sin);
  if (cache != nullptr) {  // generation: after the cached keys and values
    if (cache->keys.defined()) {
      k = at::cat({cache->keys, k}, 2);
      v = at::cat({cache->values, v}, 2);
    }
    cache->keys = k;
    cache->values = v;
  }
  const int64_t s = k.size(2);  // keys: t, or the cache's then these t
  // Packed rows: the rows' mask, with the window on top; else causal (and the window).
  // is_causal aligns the queries with the first keys, not the last: after a cache, a mask.
  at::Tensor allowed = mask;
  if (mask.defined() && window > 0) allowed = mask & attention_mask(t, t, window, x.device());
  const bool eager = softcap > 0 || sinks.defined();
  if (!mask.defined() && (window > 0 || eager || s > t))
    allowed = attention_mask(t, s, window, x.device());
  at::Tensor attended;
  if (eager) {
    // As transformers' eager attention: scores scaled, capped, masked, softmax in fp32
    // (with sinks: in the scores' dtype).
    if (kv_heads != heads) {  // each key/value head serves heads / kv_heads query heads
      k = k.repeat_interleave(heads / kv_heads, 1);
      v = v.repeat_interleave(heads / kv_heads, 1);
    }
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)) * scale;
    if (softcap > 0) scores = at::tanh(scores / softcap) * softcap;
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    if (sinks.defined()) {
      // gpt_oss: the sink as one more key of each query, less the row's maximum, softmax in
      // the scores' dtype, the sink's column dropped.
      at::Tensor logits = at::cat(
          {scores, sinks.to(scores.scalar_type()).view({1, heads, 1, 1}).expand({b, heads, t, 1})},
          -1);
      logits = logits - std::get<0>(at::max(logits, -1, /*keepdim=*/true));
      attended = at::matmul(at::softmax(logits, -1).narrow(-1, 0, s).to(v.scalar_type()), v);
    } else {
      attended = at::matmul(at::softmax(scores, -1, at::kFloat).to(q.scalar_type()), v);
    }
  } else {
    attended = at::scaled_dot_product_attention(
        q, k, v, allowed.defined() ? std::optional<at::Tensor>(allowed) : std::nullopt,
        /*dropout_p=*/0.0, /*is_causal=*/!allowed.defined(), scale,
        /*enable_gqa=*/kv_heads != heads);
  }
  return o_proj(attended.transpose(1, 2).reshape({b, t, heads * head_dim}));
}

}  // namespace fsdp::models
