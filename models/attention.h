// The decoder's self-attention: grouped-query, causal (over the last sliding_window keys
// in a sliding layer), with RoPE, optional q/k norms, logit soft-cap and sinks, its projections
// fsdp::lora::LoraLinear under the families' names (q_proj, k_proj, v_proj, o_proj, or
// qkv_proj fused); or DeepSeek-V3's multi-head latent attention (config.latent_attention():
// q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj). PyTorch/transformers
// counterpart: LlamaAttention and the families' variants, DeepseekV3Attention
// (attn_implementation "eager" when soft-capped or with sinks, else sdpa).
//
//   fsdp::models::Attention attention(config, fsdp::models::LayerType::kFull);
//   at::Tensor y = attention(x, cos, sin);  // x [batch, time, hidden] -> y the same
//
// Errors: none of their own (ATen's, for shapes other than the config's). Threading: as
// any LibTorch module.
#ifndef FSDP_MODELS_ATTENTION_H_
#define FSDP_MODELS_ATTENTION_H_

#include <cstdint>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/lora/lora.h"
#include "models/config.h"
#include "models/rms_norm.h"

namespace fsdp::models {

// One layer's keys and values of the tokens run so far, for generation (KVCacheScope in
// decoder.h): each [batch, kv_heads, length, head_dim], after the k norm and RoPE;
// undefined before the first forward. PyTorch/transformers: one layer of DynamicCache.
struct KVCacheLayer {
  at::Tensor keys, values;
};

// Input [batch, time, hidden]; cos, sin [time, rotary_dim], or [batch, 1, time,
// rotary_dim] for packed rows (rotary.h, of the layer type's RoPE). `mask`: undefined for
// causal attention over the whole row, or bool [batch, 1, time, time] (true: query i may
// attend to key j; packed_attention_mask) for packed rows, with a sliding layer's window
// applied on top. Output [batch, time, hidden]. With `cache` set, the input is the `time`
// tokens after the cache's: they attend to the cached keys too (positions: cos and sin
// are theirs), and their keys and values are appended to it. Latent attention: queries and
// keys of qk_head_dim() per head (the unrotated qk_nope_head_dim, then the rotated head_dim),
// values of v_head_dim; the cache holds them expanded per head.
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(const DecoderConfig& config, LayerType type, const at::TensorOptions& options = {});
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& mask = {});
  // The sinks' values as built (zeros); the projections reset themselves.
  void reset_parameters();

  int64_t heads, kv_heads, head_dim;  // latent attention: head_dim is the rotated part
  int64_t window;                     // 0: causal over every earlier position
  double scale, softcap;
  lora::LoraLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  lora::LoraLinear qkv_proj{nullptr};  // fused_projections: q, k, v in one (the others null)
  // [head_dim] each (qk_norm), or [heads * head_dim] / [kv_heads * head_dim]
  // (qk_norm_full_width); null without either.
  RMSNorm q_norm{nullptr}, k_norm{nullptr};
  bool full_width_norm = false;
  // Latent attention (config.latent_attention()), as config.h describes them; q_a_proj,
  // q_a_layernorm and q_b_proj null without q_lora_rank (then q_proj); the other modules
  // above but o_proj null.
  lora::LoraLinear q_a_proj{nullptr}, q_b_proj{nullptr}, kv_a_proj_with_mqa{nullptr},
      kv_b_proj{nullptr};
  RMSNorm q_a_layernorm{nullptr}, kv_a_layernorm{nullptr};
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, v_head_dim = 0;
  bool rope_interleave = false;
  // attention_sinks (gpt_oss): [heads], a logit per head that joins each query's softmax
  // over the keys and is dropped after it (transformers' eager_attention_forward of
  // GptOssAttention); zeros as built. Undefined without.
  at::Tensor sinks;
  KVCacheLayer* cache = nullptr;  // set by KVCacheScope (decoder.h) while it lives

 private:
  // Latent attention's queries, keys [batch, heads, time, qk_head_dim()] and values [batch,
  // heads, time, v_head_dim], rotated.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> latent_qkv(const at::Tensor& x,
                                                            const at::Tensor& cos,
                                                            const at::Tensor& sin);
};
TORCH_MODULE(Attention);

// The attention mask of packed rows, several examples side by side in each: `segments`
// [batch, time] (int64) numbers each position's example within its row (-1: padding).
// Returns bool [batch, 1, time, time], true where query i may attend to key j: the same
// segment and j <= i (padding attends to the padding up to it, so no row of the softmax
// is empty). PyTorch/transformers: the block-diagonal causal mask of packed sequences
// (padding_free with position_ids; flash-attention's varlen cu_seqlens).
at::Tensor packed_attention_mask(const at::Tensor& segments);

// Whether scaled_dot_product_attention of the queries `q` [batch, heads, t, head_dim] over
// grouped keys and values `k`, `v` [batch, kv_heads, s, head_dim] (heads a multiple of
// kv_heads), with `mask` (bool [batch or 1, 1, t, s]; undefined: causal) and `scale`, would
// run PyTorch's math kernel off the CPU, so that AttentionImpl repeats the key/value heads
// first (Note [Grouped heads with a mask] in attention.cc). A host-side check of the
// kernels' constraints (at::_fused_sdp_choice, what scaled_dot_product_attention itself
// asks), which queues nothing on the device. False on the CPU.
bool grouped_heads_take_the_math_kernel(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& mask, double scale);

}  // namespace fsdp::models

#endif  // FSDP_MODELS_ATTENTION_H_
