#include "models/moe.h"

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include <ATen/TensorOperators.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/activation.h>

#include "models/internal/projection.h"

namespace fsdp::models {

using models_internal::projection;

ExpertsImpl::ExpertsImpl(int64_t num_experts, int64_t hidden, int64_t inner,
                         const at::TensorOptions& options, const ExpertsStyle& style)
    : style(style) {
  if (style.transposed) {
    gate_up_proj =
        register_parameter("gate_up_proj", at::empty({num_experts, hidden, 2 * inner}, options));
    gate_up_proj_bias =
        register_parameter("gate_up_proj_bias", at::empty({num_experts, 2 * inner}, options));
    down_proj = register_parameter("down_proj", at::empty({num_experts, inner, hidden}, options));
    down_proj_bias =
        register_parameter("down_proj_bias", at::empty({num_experts, hidden}, options));
  } else {
    gate_up_proj =
        register_parameter("gate_up_proj", at::empty({num_experts, 2 * inner, hidden}, options));
    down_proj = register_parameter("down_proj", at::empty({num_experts, hidden, inner}, options));
  }
  if (!options.device().is_meta()) reset_parameters();
}

void ExpertsImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const int64_t fan_in = style.transposed ? 1 : 2;
  const double gate_up = 1.0 / std::sqrt(double(gate_up_proj.size(fan_in)));
  const double down = 1.0 / std::sqrt(double(down_proj.size(fan_in)));
  gate_up_proj.uniform_(-gate_up, gate_up);
  down_proj.uniform_(-down, down);
  if (gate_up_proj_bias.defined()) gate_up_proj_bias.zero_();
  if (down_proj_bias.defined()) down_proj_bias.zero_();
}

at::Tensor ExpertsImpl::activation(const at::Tensor& gate, const at::Tensor& up) const {
  if (style.swiglu_limit <= 0) return torch::nn::functional::silu(gate) * up;
  const double limit = style.swiglu_limit;
  const at::Tensor g = gate.clamp_max(limit);
  return (up.clamp(-limit, limit) + 1) * (g * at::sigmoid(g * style.swiglu_alpha));
}

// Note [Experts gathered per expert]
// Each token goes to k of E experts, so computing every expert on every token would cost
// E / k times the work. The (token, choice) pairs are sorted by expert instead (a stable
// sort: each expert's tokens stay in order), the tokens gathered in that order
// (index_select), each expert that has tokens runs once on its contiguous run of them
// (two matmuls with its slices of gate_up_proj and down_proj), the outputs are weighted by
// the router and summed back into their tokens (index_add_), each token's k outputs added
// in the order of their experts. This is the arithmetic of transformers' Qwen3MoeExperts,
// which loops over the experts that have tokens and gathers each one's with torch.where;
// the counts per expert cost one device-to-host copy per layer. A grouped GEMM
// (at::_grouped_mm) would save the launches per expert on CUDA; the loop keeps CPU and
// every dtype.
// Note [Expert rows in multiples of 8]
// Each expert's matrix products take the number of tokens routed to it as their row count,
// which changes from expert to expert and step to step. In bf16 or fp16 on the CPU, ATen
// runs them with oneDNN, which builds and caches a kernel (a "primitive", with buffers of
// its own, allocated beside LibTorch's allocator and so outside the memory plan) for each
// shape it sees. Measured on the 1.02 B Qwen3-MoE of benchmarks/README.md (64 experts,
// W = 2, LoRA, a 2-core Xeon with AMX, 2026-12-07): the process's heap held 428 MiB at its
// peak and the largest rank 1,831 MiB against a plan of 1,528. So there each expert's rows
// are rounded up to a multiple of kExpertRowMultiple with zero rows, whose outputs are
// dropped: a few shapes per layer remain (heap 168 MiB, largest rank 1.02x the plan, the
// same tokens/s and losses to the printed digits). A real row's output does not depend on
// the zero rows beside it, though a kernel chosen for another row count may round
// differently. The padded rows are made once per layer: every expert's tokens, with its
// zero rows after them, are one tensor (cat of views and of constant_pad_nd, neither of
// which saves anything for backward), so what autograd keeps is the exact rows' tensors
// plus at most kExpertRowMultiple - 1 rows per expert that has tokens
// (decoder_activation_bytes counts that bound). fp32 (no per-shape cache) and other
// devices keep the exact rows.
int64_t expert_gemm_rows(int64_t rows, const at::Tensor& x) {
  const bool reduced = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (!reduced || !x.is_cpu()) return rows;
  return (rows + kExpertRowMultiple - 1) / kExpertRowMultiple * kExpertRowMultiple;
}

at::Tensor ExpertsImpl::forward(const at::Tensor& x, const at::Tensor& top_k_index,
                                const at::Tensor& top_k_weights) {
  const int64_t num_experts = gate_up_proj.size(0), k = top_k_index.size(1);
  padded_rows = 0;
  if (x.size(0) == 0) return at::zeros_like(x);
  const at::Tensor choices = top_k_index.reshape(-1);  // [tokens * k]: token t's j-th at t k + j
  const at::Tensor order = at::argsort(choices, /*stable=*/true);
  const at::Tensor tokens = order.div(k, "floor");
  // Tokens per expert, read on the host once (at::bincount on CUDA also reads the choices'
  // minimum and maximum back).
  const at::Tensor counts = at::zeros({num_experts}, choices.options())
                                .scatter_add_(0, choices, at::ones_like(choices))
                                .cpu();
  const int64_t* count = counts.data_ptr<int64_t>();
  at::Tensor gathered = x.index_select(0, tokens);
  // Note [Expert rows in multiples of 8]: each expert's run of rows, padded.
  std::vector<int64_t> rows(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) {
    rows[e] = count[e] == 0 ? 0 : expert_gemm_rows(count[e], x);
    padded_rows += rows[e] - count[e];
  }
  if (padded_rows > 0) {
    std::vector<at::Tensor> runs;
    int64_t begin = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (count[e] == 0) continue;
      const at::Tensor run = gathered.narrow(0, begin, count[e]);
      begin += count[e];
      runs.push_back(rows[e] == count[e] ? run
                                         : at::constant_pad_nd(run, {0, 0, 0, rows[e] - count[e]}));
    }
    gathered = at::cat(runs);
  }
  // Note [Each expert's weights by unbind]
  // gate_up_proj[e] would be a select per expert, and each select's backward makes a
  // gradient the size of all E experts (zeros but for expert e), which autograd then sums:
  // E full-size fills and additions per weight and step. unbind gives every expert's view
  // from one autograd node, whose backward stacks the experts' gradients once (zeros for
  // the experts without tokens). Measured with PyTorch 2.11 on one CPU thread, 64 experts
  // of [512, 1024] in bf16, 16 tokens each: forward and backward of one weight 1.84-1.88 s
  // by select, 0.054-0.067 s by unbind.
  const std::vector<at::Tensor> gate_up = gate_up_proj.unbind(0), down = down_proj.unbind(0);
  const std::vector<at::Tensor> gate_up_bias =
      style.transposed ? gate_up_proj_bias.unbind(0) : std::vector<at::Tensor>();
  const std::vector<at::Tensor> down_bias =
      style.transposed ? down_proj_bias.unbind(0) : std::vector<at::Tensor>();
  std::vector<at::Tensor> outputs;
  int64_t begin = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e] == 0) continue;
    const at::Tensor run = gathered.narrow(0, begin, rows[e]);
    begin += rows[e];
    at::Tensor out;
    if (!style.transposed) {
      const at::Tensor both = at::linear(run, gate_up[e]);
      const int64_t inner = both.size(-1) / 2;
      out =
          at::linear(activation(both.narrow(-1, 0, inner), both.narrow(-1, inner, inner)), down[e]);
    } else {
      // gpt_oss: x @ W + b, as GptOssExperts, gate and up interleaved.
      const at::Tensor both = at::matmul(run, gate_up[e]) + gate_up_bias[e];
      const int64_t inner = both.size(-1) / 2;
      const at::Tensor h =
          activation(both.slice(-1, 0, 2 * inner, 2), both.slice(-1, 1, 2 * inner, 2));
      out = at::matmul(h, down[e]) + down_bias[e];
    }
    outputs.push_back(rows[e] == count[e] ? out : out.narrow(0, 0, count[e]));
  }
  const at::Tensor weighted =
      (at::cat(outputs) * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1))
          .to(x.scalar_type());
  return at::zeros_like(x).index_add_(0, tokens, weighted);
}

SigmoidGroupRouterImpl::SigmoidGroupRouterImpl(const DecoderConfig& config,
                                               const at::TensorOptions& options)
    : top_k(config.num_experts_per_tok),
      n_group(config.n_group),
      topk_group(config.topk_group),
      norm_topk_prob(config.norm_topk_prob),
      routed_scaling_factor(config.routed_scaling_factor) {
  weight =
      register_parameter("weight", at::empty({config.num_experts, config.hidden_size}, options));
  e_score_correction_bias = register_buffer(
      "e_score_correction_bias", at::empty({config.num_experts}, options.dtype(at::kFloat)));
  if (!options.device().is_meta()) reset_parameters();
}

void SigmoidGroupRouterImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(double(weight.size(1)));
  weight.uniform_(-bound, bound);
  e_score_correction_bias.zero_();
}

// Note [Grouped sigmoid routing]
// DeepseekV3TopkRouter, operation for operation: the logits in fp32 (x and the weight cast
// up), scores = sigmoid(logits); the choice is by scores + e_score_correction_bias: the
// experts fall in n_group groups of E / n_group, each group scored by the sum of its two
// best, and only the topk_group best groups' experts compete for the top-k. The weights are
// the chosen experts' scores (not the biased ones), divided by their sum (+ 1e-20) with
// norm_topk_prob, times routed_scaling_factor, in fp32; the gradient reaches the router
// through them. The bias steers the choice only and has no gradient (DeepSeek-V3 updates it
// outside backward, by the experts' load; a fine-tune keeps the checkpoint's).
std::pair<at::Tensor, at::Tensor> SigmoidGroupRouterImpl::forward(const at::Tensor& x) {
  const int64_t experts = weight.size(0);
  const at::Tensor scores = at::linear(x.to(at::kFloat), weight.to(at::kFloat)).sigmoid();
  const at::Tensor biased = scores.detach() + e_score_correction_bias;
  const at::Tensor groups =
      std::get<0>(biased.view({-1, n_group, experts / n_group}).topk(2, -1)).sum(-1);
  const at::Tensor best_groups = std::get<1>(at::topk(groups, topk_group, -1, true, false));
  const at::Tensor allowed = at::zeros_like(groups)
                                 .scatter_(1, best_groups, 1.0)
                                 .unsqueeze(-1)
                                 .expand({-1, n_group, experts / n_group})
                                 .reshape({-1, experts})
                                 .to(at::kBool);
  const at::Tensor index = std::get<1>(
      at::topk(biased.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity()),
               top_k, -1, true, false));
  at::Tensor weights = scores.gather(1, index);
  if (norm_topk_prob) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
  return {weights * routed_scaling_factor, index};
}

SparseMoeBlockImpl::SparseMoeBlockImpl(const DecoderConfig& config,
                                       const at::TensorOptions& options)
    : top_k(config.num_experts_per_tok),
      norm_topk_prob(config.norm_topk_prob),
      weights_fp32(config.router_weights_fp32),
      topk_softmax(config.router_bias_topk_softmax) {
  const int64_t hidden = config.hidden_size;
  if (config.router_sigmoid_groups) {
    group_router = register_module("gate", SigmoidGroupRouter(config, options));
  } else {
    gate = register_module(topk_softmax ? "router" : "gate",
                           projection(hidden, config.num_experts, /*bias=*/topk_softmax, options));
  }
  ExpertsStyle style;
  style.transposed = config.experts_transposed;
  style.swiglu_limit = config.swiglu_limit;
  style.swiglu_alpha = config.swiglu_alpha;
  experts = register_module(
      "experts", Experts(config.num_experts, hidden, config.moe_intermediate_size, options, style));
  if (config.shared_expert_intermediate_size > 0) {
    DecoderConfig shared = config;
    shared.intermediate_size = config.shared_expert_intermediate_size;
    shared.fused_projections = shared.mlp_bias = false;
    if (config.shared_experts_ungated) {
      shared_expert = register_module("shared_experts", MLP(shared, options));
    } else {
      shared_expert = register_module("shared_expert", MLP(shared, options));
      shared_expert_gate =
          register_module("shared_expert_gate", projection(hidden, 1, /*bias=*/false, options));
    }
  }
}

at::Tensor SparseMoeBlockImpl::forward(const at::Tensor& x) {
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  if (group_router) {  // deepseek_v3: See Note [Grouped sigmoid routing].
    auto [weights, index] = group_router(flat);
    return (experts(flat, index, weights) + shared_expert(flat)).view(x.sizes());
  }
  router_logits = gate(flat);
  if (topk_softmax) {  // gpt_oss: the top-k logits, softmax over them in their dtype
    auto [top, index] = at::topk(router_logits, top_k, -1);
    return experts(flat, index, at::softmax(top, -1)).view(x.sizes());
  }
  const at::Tensor probs = at::softmax(router_logits, -1, at::kFloat);
  auto [weights, index] = at::topk(probs, top_k, -1);
  if (norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  if (!weights_fp32) weights = weights.to(router_logits.scalar_type());
  at::Tensor out = experts(flat, index, weights);
  if (shared_expert) out = out + at::sigmoid(shared_expert_gate(flat)) * shared_expert(flat);
  return out.view(x.sizes());
}

at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts,
                               int64_t top_k, const at::Tensor& token_mask) {
  TORCH_CHECK(!router_logits.empty(),
              "load_balancing_loss: expected the router logits of one or more sparse layers "
              "(run a forward of a mixture-of-experts model first)");
  const c10::Device device = router_logits.front().device();
  const at::TensorOptions fp32 = at::TensorOptions(device).dtype(at::kFloat);
  at::Tensor mask;  // [tokens, 1] fp32, or undefined
  if (token_mask.defined()) {
    TORCH_CHECK(token_mask.numel() == router_logits.front().size(0),
                "load_balancing_loss: expected a token mask of ", router_logits.front().size(0),
                " elements (one per routed token), got ", token_mask.numel());
    mask = token_mask.reshape({-1, 1}).to(fp32);
  }
  at::Tensor counts = at::zeros({num_experts}, fp32);
  at::Tensor prob_sum = counts.clone();
  at::Tensor rows = at::zeros({}, fp32);
  for (const at::Tensor& logits : router_logits) {
    const at::Tensor routing = at::softmax(logits.to(device), -1);  // in the logits' dtype
    const at::Tensor chosen = std::get<1>(at::topk(routing, top_k, -1));
    const at::Tensor probs = routing.to(at::kFloat);
    if (mask.defined()) {
      counts =
          counts + at::zeros({num_experts}, fp32)
                       .scatter_add_(0, chosen.reshape(-1), mask.expand({-1, top_k}).reshape(-1));
      prob_sum = prob_sum + (probs * mask).sum(0);
      rows = rows + mask.sum();
    } else {
      counts = counts + at::zeros({num_experts}, fp32)
                            .scatter_add_(0, chosen.reshape(-1), at::ones({chosen.numel()}, fp32));
      prob_sum = prob_sum + probs.sum(0);
      rows = rows + double(logits.size(0));
    }
  }
  return (counts / rows * (prob_sum / rows)).sum() * double(num_experts);
}

}  // namespace fsdp::models
