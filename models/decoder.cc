#include "models/decoder.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/activation.h>

#include "fsdp/core/checkpoint_wrapper.h"

namespace fsdp::models {
namespace {

// See Note [Where the decoder's tensors are created].
lora::LoraLinear linear(int64_t in, int64_t out, bool bias, const at::TensorOptions& options) {
  return lora::LoraLinear(torch::nn::LinearOptions(in, out).bias(bias), options);
}

// HF's rotate_half: [-x2, x1] with x1, x2 the two halves of the last dimension.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// x [..., head_dim] with its first cos.size(-1) dimensions rotated (all of them unless the
// rotary embedding is partial), as transformers' apply_rotary_pos_emb.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t d = cos.size(-1);
  if (d == x.size(-1)) return x * cos + rotate_half(x) * sin;
  const at::Tensor rotated = x.narrow(-1, 0, d);
  return at::cat({rotated * cos + rotate_half(rotated) * sin, x.narrow(-1, d, x.size(-1) - d)}, -1);
}

// True where query i may attend to key j: j <= i, and j > i - window when window > 0.
at::Tensor attention_mask(int64_t time, int64_t window, c10::Device device) {
  const auto ids = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor q = at::arange(time, ids).unsqueeze(1), k = at::arange(time, ids).unsqueeze(0);
  at::Tensor mask = k <= q;
  if (window > 0) mask = mask & (k > q - window);
  return mask;
}

// s / t as Python computes a number divided by a tensor (t.reciprocal() * s), so that the
// frequencies agree with transformers' to the bit.
at::Tensor rdiv(double s, const at::Tensor& t) { return t.reciprocal() * s; }

double yarn_mscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// The inverse frequencies [head_dim / 2] (fp32) of `rope` and the factor its cos and sin
// are scaled by. See Note [RoPE types].
std::pair<at::Tensor, double> inverse_frequencies(const RopeConfig& rope, int64_t dim, int64_t time,
                                                  c10::Device device) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  // Made on `device` (tests/device_check_test.cc): no host tensor copied in each forward.
  const at::Tensor exponents = at::arange(0, dim, 2, f32.dtype(at::kLong)).to(f32) / double(dim);
  if (rope.type == "longrope") {
    const std::vector<double>& factors =
        time > rope.original_max_position_embeddings ? rope.long_factor : rope.short_factor;
    const at::Tensor ext = at::tensor(factors, at::kDouble).to(f32);
    return {rdiv(1.0, ext * at::pow(rope.theta, exponents)), rope.attention_factor};
  }
  if (rope.type == "yarn") {
    const at::Tensor pos_freqs = at::pow(rope.theta, exponents);
    const at::Tensor extrapolation = rdiv(1.0, pos_freqs);
    const at::Tensor interpolation = rdiv(1.0, rope.factor * pos_freqs);
    const double original = double(rope.original_max_position_embeddings);
    const auto correction_dim = [&](double rotations) {
      return dim * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(rope.theta));
    };
    double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
    if (rope.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    const at::Tensor ramp = at::clamp((at::arange(dim / 2, f32) - low) / (high - low), 0, 1);
    const at::Tensor extrapolation_factor = 1 - ramp;
    double attention = rope.attention_factor;
    if (attention == 0) {
      attention = rope.mscale > 0 && rope.mscale_all_dim > 0
                      ? yarn_mscale(rope.factor, rope.mscale) /
                            yarn_mscale(rope.factor, rope.mscale_all_dim)
                      : yarn_mscale(rope.factor, 1.0);
    }
    return {interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor,
            attention};
  }
  at::Tensor inv_freq = rdiv(1.0, at::pow(rope.theta, exponents));
  if (rope.type == "linear") inv_freq = inv_freq / rope.factor;
  if (rope.type == "llama3") {
    const double original = double(rope.original_max_position_embeddings);
    const double low_wavelen = original / rope.low_freq_factor;
    const double high_wavelen = original / rope.high_freq_factor;
    const at::Tensor wavelen = rdiv(2 * M_PI, inv_freq);
    const at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq);
    const at::Tensor smooth = (rdiv(original, wavelen) - rope.low_freq_factor) /
                              (rope.high_freq_factor - rope.low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
    const at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
    inv_freq = at::where(medium, smoothed, scaled);
  }
  return {inv_freq, 1.0};
}

}  // namespace

// Note [RoPE types]
// The inverse frequencies follow transformers' ROPE_INIT_FUNCTIONS operation for operation
// in fp32 (so the angles agree to the bit): "default" 1 / theta^(2i / d); "linear" those
// divided by factor (position interpolation); "llama3" divides the low frequencies (wave
// lengths above original_max_position_embeddings / low_freq_factor) by factor, keeps the
// high ones (below .. / high_freq_factor) and blends in between; "yarn" blends
// interpolated and extrapolated frequencies over the dimensions between the correction
// range of beta_fast and beta_slow rotations, and scales cos and sin by its attention
// factor (0.1 ln(factor) + 1 unless given); "longrope" divides them by short_factor, or by
// long_factor when the sequence is longer than original_max_position_embeddings (as
// transformers' longrope_frequency_update picks them per forward), and scales cos and sin
// by its attention factor. "dynamic" (NTK scaling recomputed past the trained length) is
// refused by the config reader.
//
// Note [Where the decoder's tensors are created]
// Every parameter is created with the tensor options the CausalLMImpl constructor takes,
// in three kinds of module: RMSNormImpl (its weight), fsdp::lora::LoraLinear (projections
// and head, through `linear` above) and torch::nn::Embedding, given its weight through
// EmbeddingOptions::_weight (its own constructor would allocate on the CPU in the default
// dtype). On a real device each module initialises itself as it is built, in construction
// order, so the values equal the decoder's before it took tensor options (fp32 on the
// CPU: torch::nn::Embedding's and Linear's own initialisation). On c10::kMeta nothing is
// allocated or drawn, and reset_decoder_parameters, passed to
// FullyShardedRoot::init_parameters, gives each module what its constructor would have:
// init_parameters visits the modules in pre-order, the order the constructors run in, so
// with the same seed a meta build equals a CPU build. The decoder has no buffers: RoPE's
// cos and sin and Gemma's embedding scale are computed in forward from the config, so a
// checkpoint load, which has no non-persistent buffers, leaves nothing uncomputed.

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
    qkv_proj = register_module(
        "qkv_proj", linear(hidden, (heads + 2 * kv_heads) * head_dim, config.qkv_bias, options));
  } else {
    q_proj = register_module("q_proj", linear(hidden, heads * head_dim, config.qkv_bias, options));
    k_proj =
        register_module("k_proj", linear(hidden, kv_heads * head_dim, config.qkv_bias, options));
    v_proj =
        register_module("v_proj", linear(hidden, kv_heads * head_dim, config.qkv_bias, options));
  }
  o_proj = register_module("o_proj", linear(heads * head_dim, hidden, config.o_bias, options));
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
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin) {
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
  q = rotate(q, cos, sin);
  k = rotate(k, cos, sin);
  at::Tensor attended;
  if (softcap > 0) {
    // As transformers' eager attention: scores scaled, capped, masked, softmax in fp32.
    if (kv_heads != heads) {  // each key/value head serves heads / kv_heads query heads
      k = k.repeat_interleave(heads / kv_heads, 1);
      v = v.repeat_interleave(heads / kv_heads, 1);
    }
    at::Tensor scores = at::matmul(q, k.transpose(2, 3)) * scale;
    scores = at::tanh(scores / softcap) * softcap;
    scores = scores.masked_fill(attention_mask(t, window, x.device()).logical_not(),
                                -std::numeric_limits<double>::infinity());
    attended = at::matmul(at::softmax(scores, -1, at::kFloat).to(q.scalar_type()), v);
  } else {
    attended = at::scaled_dot_product_attention(
        q, k, v,
        window > 0 ? std::optional<at::Tensor>(attention_mask(t, window, x.device()))
                   : std::nullopt,
        /*dropout_p=*/0.0, /*is_causal=*/window == 0, scale, /*enable_gqa=*/kv_heads != heads);
  }
  return o_proj(attended.transpose(1, 2).reshape({b, t, heads * head_dim}));
}

MLPImpl::MLPImpl(const DecoderConfig& config, const at::TensorOptions& options)
    : gelu_tanh(config.gemma) {
  const int64_t hidden = config.hidden_size, inner = config.intermediate_size;
  if (config.fused_projections) {
    gate_up_proj =
        register_module("gate_up_proj", linear(hidden, 2 * inner, config.mlp_bias, options));
  } else {
    gate_proj = register_module("gate_proj", linear(hidden, inner, config.mlp_bias, options));
    up_proj = register_module("up_proj", linear(hidden, inner, config.mlp_bias, options));
  }
  down_proj = register_module("down_proj", linear(inner, hidden, config.mlp_bias, options));
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

DecoderLayerImpl::DecoderLayerImpl(const DecoderConfig& config, int64_t index,
                                   const at::TensorOptions& options)
    : type(config.layer_types.at(index)), residual_multiplier(config.residual_multiplier) {
  const auto norm = [&](const char* name) {
    return register_module(
        name, RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style, options));
  };
  self_attn = register_module("self_attn", Attention(config, type, options));
  mlp = register_module("mlp", MLP(config, options));
  if (!config.post_norms) input_layernorm = norm("input_layernorm");
  post_attention_layernorm = norm("post_attention_layernorm");
  if (config.gemma) pre_feedforward_layernorm = norm("pre_feedforward_layernorm");
  if (config.gemma || config.post_norms) {
    post_feedforward_layernorm = norm("post_feedforward_layernorm");
  }
}

at::Tensor DecoderLayerImpl::forward(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  if (!checkpoint_activations) return compute(x, cos, sin);
  return checkpoint(
      [this](const std::vector<at::Tensor>& in) { return compute(in[0], in[1], in[2]); },
      {x, cos, sin}, parameters());
}

at::Tensor DecoderLayerImpl::compute(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  if (!input_layernorm) {  // olmo2: norms after the sublayers only
    x = x + post_attention_layernorm(self_attn(x, cos, sin));
    return x + post_feedforward_layernorm(mlp(x));
  }
  if (!pre_feedforward_layernorm) {
    if (residual_multiplier != 1.0) {  // granite
      x = x + self_attn(input_layernorm(x), cos, sin) * residual_multiplier;
      return x + mlp(post_attention_layernorm(x)) * residual_multiplier;
    }
    x = x + self_attn(input_layernorm(x), cos, sin);
    return x + mlp(post_attention_layernorm(x));
  }
  x = x + post_attention_layernorm(self_attn(input_layernorm(x), cos, sin));
  return x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)));
}

// Note [The embeddings and the head are units]
// With untied embeddings, embed_tokens and lm_head are FSDP units of their own, as each
// decoder layer is (torchtitan shards them apart from the root too): each is gathered only
// while it runs, forward and backward, and freed after, instead of both staying gathered
// in the root from the start of forward to the end of backward. For a Llama with a 32000
// vocabulary and hidden size 2048 that is 250 MiB gathered at a time instead of 500 MiB
// (fp32), and the head's unsharded gradient is reduced as soon as backward leaves it. Tied
// embeddings stay in the root: one parameter serves both ends. The names are unchanged
// (FSDP's names drop the unit's wrapper: fsdp/base/names.h).
DecoderModelImpl::DecoderModelImpl(const DecoderConfig& config, const at::TensorOptions& options)
    : config(config) {
  // See Note [Where the decoder's tensors are created].
  torch::nn::EmbeddingOptions embedding(config.vocab_size, config.hidden_size);
  if (config.pad_token_id >= 0) embedding.padding_idx(config.pad_token_id);
  embedding._weight(at::empty({config.vocab_size, config.hidden_size}, options));
  embed_tokens = torch::nn::Embedding(embedding);
  if (!options.device().is_meta()) embed_tokens->reset_parameters();
  // See Note [The embeddings and the head are units].
  if (config.tie_word_embeddings) {
    register_module("embed_tokens", embed_tokens);
  } else {
    embed_unit =
        register_module("embed_tokens", Unit<torch::nn::EmbeddingImpl>(embed_tokens.ptr()));
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    units.push_back(Unit<DecoderLayerImpl>(std::make_shared<DecoderLayerImpl>(config, i, options)));
    layers->push_back(units.back());
  }
  norm = register_module(
      "norm", RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style, options));
}

std::pair<at::Tensor, at::Tensor> DecoderModelImpl::rotary(const RopeConfig& rope, int64_t time,
                                                           c10::Device device,
                                                           at::ScalarType dtype) const {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto [inv_freq, attention_factor] =
      inverse_frequencies(rope, config.rotary_dim, time, device);
  const at::Tensor freqs = at::arange(time, f32.dtype(at::kLong)).to(f32).unsqueeze(1) * inv_freq;
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {(angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)};
}

at::Tensor DecoderModelImpl::forward(const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong,
              "DecoderModel: expected token ids [batch, time] of int64, got ", ids.sizes(), " of ",
              ids.scalar_type());
  const int64_t t = ids.size(1);
  TORCH_CHECK(t <= config.max_position_embeddings, "DecoderModel: a sequence of ", t,
              " tokens is longer than max_position_embeddings = ", config.max_position_embeddings,
              "; use shorter windows");
  at::Tensor x = embed_unit ? embed_unit(ids) : embed_tokens(ids);
  if (config.gemma) {  // transformers: a fp32 scalar sqrt(hidden), cast to the weights' dtype
    x = x * at::scalar_tensor(std::sqrt(double(config.hidden_size)), at::kFloat)
                .to(x.scalar_type())
                .to(x.device());
  }
  if (config.embedding_multiplier != 1.0) x = x * config.embedding_multiplier;  // granite
  const auto full = rotary(config.rope, t, x.device(), x.scalar_type());
  const auto sliding = config.model_type == "gemma3_text"
                           ? rotary(config.sliding_rope, t, x.device(), x.scalar_type())
                           : full;
  for (size_t i = 0; i < units.size(); ++i) {
    const auto& [cos, sin] = config.layer_types[i] == LayerType::kSliding ? sliding : full;
    x = units[i](x, cos, sin);
  }
  return norm(x);
}

CausalLMImpl::CausalLMImpl(const DecoderConfig& config, const at::TensorOptions& options)
    : config(config) {
  model = register_module("model", DecoderModel(config, options));
  if (!config.tie_word_embeddings) {
    lm_head = linear(config.hidden_size, config.vocab_size, /*bias=*/false, options);
    head_unit = register_module("lm_head", Unit<lora::LoraLinearImpl>(lm_head.ptr()));
  }
}

at::Tensor CausalLMImpl::forward(const at::Tensor& ids) {
  const at::Tensor hidden = model(ids);
  at::Tensor logits =
      head_unit ? head_unit(hidden) : at::linear(hidden, model->embed_tokens->weight);
  if (config.logits_scaling != 1.0) logits = logits / config.logits_scaling;  // granite
  if (config.final_logit_softcapping > 0) {
    logits = at::tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping;
  }
  return logits;
}

void reset_decoder_parameters(torch::nn::Module& module) {
  if (auto* norm = module.as<RMSNormImpl>()) return norm->reset_parameters();
  if (auto* linear = module.as<lora::LoraLinearImpl>()) return linear->reset_parameters();
  if (auto* embedding = module.as<torch::nn::EmbeddingImpl>()) embedding->reset_parameters();
}

}  // namespace fsdp::models
