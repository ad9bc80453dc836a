#include "models/rotary.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>

namespace fsdp::models {
namespace {

// HF's rotate_half: [-x2, x1] with x1, x2 the two halves of the last dimension.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
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
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const RopeConfig& rope, int64_t rotary_dim,
                                                 int64_t time, c10::Device device,
                                                 at::ScalarType dtype) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto [inv_freq, attention_factor] = inverse_frequencies(rope, rotary_dim, time, device);
  const at::Tensor freqs = at::arange(time, f32.dtype(at::kLong)).to(f32).unsqueeze(1) * inv_freq;
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {(angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)};
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t d = cos.size(-1);
  if (d == x.size(-1)) return x * cos + rotate_half(x) * sin;
  const at::Tensor rotated = x.narrow(-1, 0, d);
  return at::cat({rotated * cos + rotate_half(rotated) * sin, x.narrow(-1, d, x.size(-1) - d)}, -1);
}

}  // namespace fsdp::models
