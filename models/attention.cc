#include "models/attention.h"

#include <limits>
#include <optional>

#include <ATen/SDPBackend.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
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
  const auto norm = [&](const char* name, int64_t dim, double eps) {
    return register_module(name, RMSNorm(dim, eps, config.norm_style, options));
  };
  if (config.latent_attention()) {
    // DeepseekV3Attention's modules, in its order; its two latent norms keep
    // DeepseekV3RMSNorm's default eps (1e-6), not rms_norm_eps.
    kv_lora_rank = config.kv_lora_rank;
    qk_nope_head_dim = config.qk_nope_head_dim;
    v_head_dim = config.v_head_dim;
    rope_interleave = config.rope_interleave;
    const int64_t q_out = heads * config.qk_head_dim();
    if (config.q_lora_rank > 0) {
      q_a_proj = register_module("q_a_proj",
                                 projection(hidden, config.q_lora_rank, config.qkv_bias, options));
      q_a_layernorm = norm("q_a_layernorm", config.q_lora_rank, 1e-6);
      q_b_proj = register_module("q_b_proj",
                                 projection(config.q_lora_rank, q_out, /*bias=*/false, options));
    } else {
      q_proj = register_module("q_proj", projection(hidden, q_out, /*bias=*/false, options));
    }
    kv_a_proj_with_mqa =
        register_module("kv_a_proj_with_mqa",
                        projection(hidden, kv_lora_rank + head_dim, config.qkv_bias, options));
    kv_a_layernorm = norm("kv_a_layernorm", kv_lora_rank, 1e-6);
    kv_b_proj = register_module(
        "kv_b_proj",
        projection(kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim), /*bias=*/false, options));
    o_proj =
        register_module("o_proj", projection(heads * v_head_dim, hidden, config.o_bias, options));
    return;
  }
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
  const double eps = config.rms_norm_eps;
  if (config.qk_norm) {
    q_norm = norm("q_norm", head_dim, eps);
    k_norm = norm("k_norm", head_dim, eps);
  } else if (config.qk_norm_full_width) {
    full_width_norm = true;
    q_norm = norm("q_norm", heads * head_dim, eps);
    k_norm = norm("k_norm", kv_heads * head_dim, eps);
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

// Note [Multi-head latent attention]
// DeepseekV3Attention: the queries from q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x)),
// split per head into an unrotated part (qk_nope_head_dim) and a rotated one (head_dim);
// kv_a_proj_with_mqa(x) split into the latent kv_lora_rank values, normed (kv_a_layernorm)
// and expanded by kv_b_proj into each head's unrotated key part and value, and one rotated
// key part of head_dim shared by every head. The rotated parts go through RoPE; with
// rope_interleave their dimensions pair up as (0, 1), (2, 3), ... and come out as the pairs'
// first elements, then their second ones: de-interleaving them and rotating with
// rotate_half computes transformers' apply_rotary_pos_emb_interleave bit for bit. Queries
// and keys are then [unrotated, rotated] per head, and attention runs as for the other
// families with qk_head_dim-wide scores (scaled by config.attention_scale) over v_head_dim-wide
// values (padded with zeros to qk_head_dim for scaled_dot_product_attention, whose flash
// kernels take one head size, as transformers pads them for flash attention).
std::tuple<at::Tensor, at::Tensor, at::Tensor> AttentionImpl::latent_qkv(const at::Tensor& x,
                                                                         const at::Tensor& cos,
                                                                         const at::Tensor& sin) {
  const int64_t b = x.size(0), t = x.size(1), qk = qk_nope_head_dim + head_dim;
  const auto rotate = [&](const at::Tensor& y) {
    if (!rope_interleave) return apply_rotary(y, cos, sin);
    const at::Tensor pairs = y.unflatten(-1, {head_dim / 2, 2}).transpose(-1, -2);
    return apply_rotary(pairs.flatten(-2), cos, sin);
  };
  const at::Tensor q_states = q_proj ? q_proj(x) : q_b_proj(q_a_layernorm(q_a_proj(x)));
  const at::Tensor q = q_states.view({b, t, heads, qk}).transpose(1, 2);
  const at::Tensor compressed = kv_a_proj_with_mqa(x);
  const at::Tensor latent = kv_a_layernorm(compressed.narrow(-1, 0, kv_lora_rank));
  const at::Tensor k_rot = rotate(compressed.narrow(-1, kv_lora_rank, head_dim).unsqueeze(1));
  const at::Tensor kv =
      kv_b_proj(latent).view({b, t, heads, qk_nope_head_dim + v_head_dim}).transpose(1, 2);
  const at::Tensor query = at::cat(
      {q.narrow(-1, 0, qk_nope_head_dim), rotate(q.narrow(-1, qk_nope_head_dim, head_dim))}, -1);
  const at::Tensor key =
      at::cat({kv.narrow(-1, 0, qk_nope_head_dim), k_rot.expand({b, heads, t, head_dim})}, -1);
  return {query, key, kv.narrow(-1, qk_nope_head_dim, v_head_dim)};
}

// Note [Grouped heads with a mask]
// scaled_dot_product_attention's enable_gqa (keys and values of fewer heads than the
// queries) is taken on CUDA, in PyTorch 2.11, by the flash kernel (bf16/fp16, no mask),
// by cuDNN's (bf16/fp16, masks too; preferred on sm90 and sm100 with cuDNN 9.15 or later,
// as the pinned wheel's 9.19), and by the math kernel, which keeps fp32 scores of
// [batch, heads, t, s] for backward (2 GiB a layer for Qwen3-8B at 4096 tokens); the
// memory-efficient kernel takes masks and fp32 but not grouped heads (it does from
// pytorch/pytorch#191085, after 2.11). So a mask (packed rows, a sliding window, a KV
// cache) on an A100, or fp32 attention anywhere, would run grouped heads in the math
// kernel. grouped_heads_take_the_math_kernel asks PyTorch which kernel it would pick (a
// host-side check); only where that is the math kernel are the keys and values repeated
// per query head first, as transformers' sdpa_attention repeats them whenever it passes a
// mask, and the memory-efficient kernel runs instead. On the CPU the flash kernel takes
// grouped heads with or without a mask, and nothing is repeated (models/memory_plan.cc
// counts what it saves).
bool grouped_heads_take_the_math_kernel(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& mask, double scale) {
  if (q.device().is_cpu()) return false;
  const int64_t backend = at::_fused_sdp_choice(
      q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
      /*dropout_p=*/0.0, /*is_causal=*/!mask.defined(), scale, /*enable_gqa=*/true);
  return backend == static_cast<int64_t>(at::SDPBackend::math);
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& mask) {
  const int64_t b = x.size(0), t = x.size(1);
  at::Tensor q, k, v;
  if (kv_a_proj_with_mqa) {  // See Note [Multi-head latent attention].
    std::tie(q, k, v) = latent_qkv(x, cos, sin);
  } else {
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
    q = apply_rotary(project(q_proj, q_norm, heads), cos, sin);
    k = apply_rotary(project(k_proj, k_norm, kv_heads), cos, sin);
    RMSNorm none{nullptr};
    v = project(v_proj, none, kv_heads);
  }
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
  // Each key/value head serves heads / kv_heads query heads: repeated per query head for
  // eager attention, and where PyTorch would run grouped heads in its math kernel (Note
  // [Grouped heads with a mask]).
  if (k.size(1) != heads &&
      (eager || grouped_heads_take_the_math_kernel(q, k, v, allowed, scale))) {
    k = k.repeat_interleave(heads / k.size(1), 1);
    v = v.repeat_interleave(heads / v.size(1), 1);
  }
  at::Tensor attended;
  if (eager) {
    // As transformers' eager attention: scores scaled, capped, masked, softmax in fp32
    // (with sinks: in the scores' dtype).
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
    // Latent attention's narrower values padded with zeros to the queries' width: the
    // flash kernels take one head size (the math fallback would keep every score), and the
    // padding's outputs, zeros, are dropped.
    const int64_t width = v.size(-1), padding = q.size(-1) - width;
    attended = at::scaled_dot_product_attention(
        q, k, padding > 0 ? at::constant_pad_nd(v, {0, padding}) : v,
        allowed.defined() ? std::optional<at::Tensor>(allowed) : std::nullopt,
        /*dropout_p=*/0.0, /*is_causal=*/!allowed.defined(), scale,
        /*enable_gqa=*/k.size(1) != heads);
    if (padding > 0) attended = attended.narrow(-1, 0, width);
  }
  return o_proj(attended.transpose(1, 2).reshape({b, t, heads * v.size(-1)}));
}

}  // namespace fsdp::models
