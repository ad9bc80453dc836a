// The sparse mixture-of-experts block of the MoE families (config.h: qwen3_moe, mixtral,
// olmoe, qwen2_moe, gpt_oss, deepseek_v3), the MLP of their sparse layers: a router picks each
// token's top-k experts and the token's output is their SwiGLU outputs weighted by the router. The
// experts are held fused, as transformers 5.x holds them in memory:
//
//   mlp.gate.weight                    [num_experts, hidden]       the router, no bias
//   mlp.experts.gate_up_proj           [num_experts, 2 I, hidden]  per expert: gate rows,
//                                                                  then up rows
//   mlp.experts.down_proj              [num_experts, hidden, I]
//   mlp.shared_expert.{gate,up,down}_proj.weight                   qwen2_moe: a dense MLP
//   mlp.shared_expert_gate.weight      [1, hidden]                 of its own width
//
// (I = moe_intermediate_size.) The checkpoints hold the experts one by one
// (mlp.experts.E.gate_proj.weight [I, hidden], ...; mixtral block_sparse_moe.experts.E.w1,
// w3, w2): hf_checkpoint.h reads and writes those names into and out of the fused tensors.
// gpt_oss holds them as its checkpoint does (DecoderConfig::experts_transposed), with
// biases, and a router with a bias:
//
//   mlp.router.weight, mlp.router.bias [num_experts, hidden], [num_experts]
//   mlp.experts.gate_up_proj           [num_experts, hidden, 2 I]  gate, up interleaved:
//                                                                  columns 0, 2, ... gate
//   mlp.experts.gate_up_proj_bias      [num_experts, 2 I]
//   mlp.experts.down_proj              [num_experts, I, hidden]
//   mlp.experts.down_proj_bias         [num_experts, hidden]
//
// deepseek_v3 (DecoderConfig::router_sigmoid_groups) routes with a sigmoid and a correction
// bias, the checkpoint's buffer, and adds its shared experts ungated:
//
//   mlp.gate.weight                    [num_experts, hidden]       the router, trained
//   mlp.gate.e_score_correction_bias   [num_experts] fp32          a buffer, not trained
//   mlp.shared_experts.{gate,up,down}_proj.weight                  a dense MLP of
//                                                                  n_shared_experts x I
//
//   fsdp::models::SparseMoeBlock moe(config);
//   at::Tensor y = moe(x);  // x [batch, time, hidden] -> y the same
//   moe->router_logits;     // [batch * time, num_experts], the last forward's
//
// PyTorch/transformers counterpart: Qwen3MoeSparseMoeBlock (Qwen3MoeTopKRouter,
// Qwen3MoeExperts), MixtralSparseMoeBlock, OlmoeSparseMoeBlock, Qwen2MoeSparseMoeBlock,
// GptOssMLP (GptOssTopKRouter, GptOssExperts), DeepseekV3MoE (DeepseekV3TopkRouter,
// DeepseekV3Experts, DeepseekV3MLP as shared_experts);
// load_balancing_loss below is their modeling files' load_balancing_loss_func.
// Errors: none of their own (ATen's, for shapes other than the config's). Threading: as
// any LibTorch module.
#ifndef FSDP_MODELS_MOE_H_
#define FSDP_MODELS_MOE_H_

#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "fsdp/lora/lora.h"
#include "models/config.h"
#include "models/mlp.h"

namespace fsdp::models {

// How a layer's experts are held and what they compute (DecoderConfig's experts_transposed,
// swiglu_limit, swiglu_alpha).
struct ExpertsStyle {
  // gate_up_proj [E, H, 2 I] with gate and up interleaved (gate the even columns),
  // down_proj [E, I, H], and biases gate_up_proj_bias [E, 2 I], down_proj_bias [E, H].
  bool transposed = false;
  // > 0: the clamped SwiGLU (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha g), g =
  // gate.clamp(max=limit); else silu(gate) * up.
  double swiglu_limit = 0.0;
  double swiglu_alpha = 1.702;
};

// The rows an expert's matrix products run on for `rows` tokens routed to it: `rows`
// rounded up to a multiple of kExpertRowMultiple when x (the layer's input) is bf16 or
// fp16 on the CPU, where oneDNN keeps a kernel with buffers of its own for each shape it
// sees; else `rows`. See Note [Expert rows in multiples of 8] in moe.cc.
inline constexpr int64_t kExpertRowMultiple = 8;
int64_t expert_gemm_rows(int64_t rows, const at::Tensor& x);

// A layer's routed experts, fused: gate_up_proj [E, 2 I, H], down_proj [E, H, I] (or as
// `style` says), in the constructor's tensor options (values as torch::nn::Linear's per
// expert, biases zero; none on c10::kMeta: reset_parameters). See Note [Experts gathered
// per expert] in moe.cc; in bf16 and fp16 on the CPU each expert's rows are padded, Note
// [Expert rows in multiples of 8].
struct ExpertsImpl : torch::nn::Module {
  ExpertsImpl(int64_t num_experts, int64_t hidden, int64_t inner,
              const at::TensorOptions& options = {}, const ExpertsStyle& style = {});
  // x [tokens, H]; top_k_index [tokens, k] (int64, experts below E); top_k_weights
  // [tokens, k] -> [tokens, H] in x's dtype: sum over j of w[t, j] expert_{i[t, j]}(x[t]),
  // expert_e(x) = down_e(act(gate_e(x), up_e(x))).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& top_k_index,
                     const at::Tensor& top_k_weights);
  // Uniform in +-1/sqrt(fan_in) per expert, as torch::nn::Linear's weight; biases zero.
  void reset_parameters();
  // The activation of gate and up [.., I] each, as `style` says.
  at::Tensor activation(const at::Tensor& gate, const at::Tensor& up) const;

  ExpertsStyle style;
  // The zero rows the last forward added to the experts' matrix products (Note [Expert
  // rows in multiples of 8] in moe.cc): what decoder_activation_bytes' expert_padded_rows
  // takes.
  int64_t padded_rows = 0;
  at::Tensor gate_up_proj, down_proj;
  at::Tensor gate_up_proj_bias, down_proj_bias;  // style.transposed; else undefined
};
TORCH_MODULE(Experts);

// deepseek_v3's router (DecoderConfig::router_sigmoid_groups), registered as mlp.gate:
// `weight` [num_experts, hidden] (trained; uniform in +-1/sqrt(hidden) as built, as
// torch::nn::Linear's) and `e_score_correction_bias` [num_experts], a buffer always in fp32
// (transformers keeps it so: _keep_in_fp32_modules_strict) that the checkpoint holds and no
// optimizer trains (zeros as built, as transformers initialises it). See Note [Grouped
// sigmoid routing] in moe.cc.
struct SigmoidGroupRouterImpl : torch::nn::Module {
  SigmoidGroupRouterImpl(const DecoderConfig& config, const at::TensorOptions& options = {});
  // x [tokens, hidden] -> the top-k weights [tokens, k] (fp32) and experts [tokens, k]
  // (int64), in no particular order within a token.
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x);
  void reset_parameters();

  int64_t top_k, n_group, topk_group;
  bool norm_topk_prob;
  double routed_scaling_factor;
  at::Tensor weight, e_score_correction_bias;
};
TORCH_MODULE(SigmoidGroupRouter);

// The block: router `gate`, softmax over the experts in fp32, the top num_experts_per_tok
// (renormalised with norm_topk_prob), the experts; qwen2_moe adds
// sigmoid(shared_expert_gate(x)) * shared_expert(x). gpt_oss (router_bias_topk_softmax):
// router `router` with a bias, its top-k logits softmaxed in their dtype. deepseek_v3
// (router_sigmoid_groups): router `gate` a SigmoidGroupRouter, plus shared_experts(x).
struct SparseMoeBlockImpl : torch::nn::Module {
  explicit SparseMoeBlockImpl(const DecoderConfig& config, const at::TensorOptions& options = {});
  at::Tensor forward(const at::Tensor& x);

  int64_t top_k;
  bool norm_topk_prob, weights_fp32, topk_softmax;
  lora::LoraLinear gate{nullptr};  // mlp.gate, or gpt_oss's mlp.router; null for deepseek_v3
  SigmoidGroupRouter group_router{nullptr};  // deepseek_v3's mlp.gate
  Experts experts{nullptr};
  // qwen2_moe's shared_expert, or deepseek_v3's shared_experts (shared_experts_ungated)
  MLP shared_expert{nullptr};
  lora::LoraLinear shared_expert_gate{nullptr};  // qwen2_moe
  // The last forward's router logits [tokens, num_experts] in the hidden dtype, with their
  // autograd graph (for load_balancing_loss); undefined before the first, and always for
  // deepseek_v3, which has no load-balancing loss.
  at::Tensor router_logits;
};
TORCH_MODULE(SparseMoeBlock);

// transformers' load_balancing_loss_func(router_logits, num_experts, top_k,
// attention_mask): over every sparse layer's router logits ([tokens, num_experts] each,
// the same tokens), E x sum_e f_e P_e, where f_e is the fraction of the layers' top-k
// choices that went to expert e (each token counted k times, divided by the tokens) and
// P_e the mean router probability of e. `token_mask` (undefined: every token counts)
// is transformers' attention_mask flattened: [tokens] (bool or 0/1 of any dtype, any
// shape of that many elements), 1 where the token counts; the counts and the mean
// probabilities are then over those tokens only (transformers 5.x weights them by the
// mask the same way). A 0-dim fp32 tensor with grad through P. The trainer adds
// router_aux_loss_coef times it to the loss (transformers does with
// output_router_logits). Throws c10::Error for no logits, or a mask of another number of
// tokens.
at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts,
                               int64_t top_k, const at::Tensor& token_mask = {});

}  // namespace fsdp::models

#endif  // FSDP_MODELS_MOE_H_
