// LlamaForCausalLM in LibTorch: the decoder of Hugging Face transformers' modeling_llama.py,
// built from a LlamaConfig (config.h), with the same module and parameter names, so an HF
// checkpoint's tensors load under their own names with no renaming:
//
//   model.embed_tokens.weight                         [vocab_size, hidden_size]
//   model.layers.N.self_attn.{q,k,v,o}_proj.weight    q: [heads * head_dim, hidden_size],
//                                                     k, v: [kv_heads * head_dim, hidden_size],
//                                                     o: [hidden_size, heads * head_dim]
//   model.layers.N.mlp.{gate,up,down}_proj.weight     gate, up: [intermediate, hidden],
//                                                     down: [hidden, intermediate]
//   model.layers.N.{input,post_attention}_layernorm.weight, model.norm.weight  [hidden_size]
//   lm_head.weight                                    [vocab_size, hidden_size]; absent when
//                                                     tie_word_embeddings (the output head is
//                                                     model.embed_tokens.weight, and HF's
//                                                     files hold no lm_head.weight either)
//
//   auto model = std::make_shared<fsdp::llama::LlamaForCausalLMImpl>(config);
//   at::Tensor logits = model->forward(ids);   // ids [batch, time] int64
//
// Each decoder layer is an fsdp::Unit (one FSDP unit once a FullyShardedDataParallel root
// binds the model; embeddings, final norm and head stay in the root). The layers are
// pre-norm: x + attention(rms_norm(x)), then x + mlp(rms_norm(x)); RMSNorm in fp32 with
// rms_norm_eps; rotary embeddings with rope_theta in HF's rotate_half convention;
// grouped-query attention through at::scaled_dot_product_attention (causal, enable_gqa);
// SwiGLU MLP down(silu(gate(x)) * up(x)). No bias anywhere, no dropout, no KV cache. The
// projections of attention and MLP are fsdp::lora::LoraLinear (a plain Linear until
// fsdp::lora::apply_lora adds an adapter, e.g. to "q_proj" and "v_proj").
// Threading: as any LibTorch module (one forward at a time per instance).
#ifndef FSDP_EXAMPLES_LLAMA_MODEL_H_
#define FSDP_EXAMPLES_LLAMA_MODEL_H_

#include <cstdint>
#include <vector>

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include "examples/llama/config.h"
#include "fsdp/core/unit.h"
#include "fsdp/lora/lora.h"

namespace fsdp::llama {

// weight * x / sqrt(mean(x^2) + eps), the mean over the last dimension, computed in fp32
// and cast back to x's dtype before the weight (HF's LlamaRMSNorm).
struct LlamaRMSNormImpl : torch::nn::Module {
  LlamaRMSNormImpl(int64_t hidden_size, double eps);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;  // [hidden_size], ones at construction
  double eps;
};
TORCH_MODULE(LlamaRMSNorm);

// Input [batch, time, hidden]; cos, sin [time, head_dim] (LlamaModelImpl::rotary).
struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  int64_t heads, kv_heads, head_dim;
  lora::LoraLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(LlamaAttention);

struct LlamaMLPImpl : torch::nn::Module {
  explicit LlamaMLPImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& x);

  lora::LoraLinear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

// One decoder layer, one FSDP unit. Input and output [batch, time, hidden].
struct LlamaDecoderLayerImpl : torch::nn::Module {
  explicit LlamaDecoderLayerImpl(const LlamaConfig& config);
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin);

  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};

// Token ids [batch, time] (int64) -> final hidden states [batch, time, hidden].
struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& ids);
  // cos and sin of the rotary embedding at positions 0..time-1: [time, head_dim] each, in
  // `dtype` (computed in fp32 as HF's LlamaRotaryEmbedding does).
  std::pair<at::Tensor, at::Tensor> rotary(int64_t time, c10::Device device,
                                           at::ScalarType dtype) const;

  LlamaConfig config;
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<Unit<LlamaDecoderLayerImpl>> units;  // the layers, typed
  LlamaRMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

// Token ids [batch, time] (int64, time <= max_position_embeddings) -> logits
// [batch, time, vocab_size] in the parameters' dtype. PyTorch: transformers'
// LlamaForCausalLM(config)(input_ids).logits.
struct LlamaForCausalLMImpl : torch::nn::Module {
  explicit LlamaForCausalLMImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& ids);

  LlamaConfig config;
  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tie_word_embeddings
};

}  // namespace fsdp::llama

#endif  // FSDP_EXAMPLES_LLAMA_MODEL_H_
