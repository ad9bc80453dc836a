// Rotary position embeddings (RoPE) as transformers computes them: the cos and sin
// tables of one RopeConfig (config.h) and their application to queries and keys in HF's
// rotate_half convention.
//
//   auto [cos, sin] = fsdp::models::rotary_cos_sin(config.rope, config.rotary_dim, time,
//                                                  device, at::kBFloat16);
//   q = fsdp::models::apply_rotary(q, cos, sin);   // q [batch, heads, time, head_dim]
//
// PyTorch/transformers counterpart: the family's RotaryEmbedding (ROPE_INIT_FUNCTIONS)
// and apply_rotary_pos_emb. Errors: none of their own (ATen's, for mismatched shapes).
// Threading: pure functions.
#ifndef FSDP_MODELS_ROTARY_H_
#define FSDP_MODELS_ROTARY_H_

#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "models/config.h"

namespace fsdp::models {

// cos and sin of `rope` at positions 0..time-1: [time, rotary_dim] each, in `dtype`,
// created on `device` (computed in fp32 and scaled by the rope type's attention factor;
// see Note [RoPE types] in rotary.cc).
std::pair<at::Tensor, at::Tensor> rotary_cos_sin(const RopeConfig& rope, int64_t rotary_dim,
                                                 int64_t time, c10::Device device,
                                                 at::ScalarType dtype);

// x [..., time, head_dim] with its first cos.size(-1) dimensions rotated (all of them
// unless the rotary embedding is partial); cos, sin [time, rotary_dim] broadcast over the
// leading dimensions. Same shape and dtype as x.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace fsdp::models

#endif  // FSDP_MODELS_ROTARY_H_
