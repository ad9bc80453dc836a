// The mixture-of-experts block: the load-balancing loss equals transformers'
// load_balancing_loss_func on fixed router logits, the experts gathered per expert equal
// each token's top-k experts computed one by one, and a Qwen3-MoE decoder keeps the
// router logits of its sparse layers only.
#include "models/moe.h"

#include <cmath>
#include <vector>

#include <ATen/Functions.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/activation.h>

#include "models/decoder.h"

namespace fsdp::models {
namespace {

// Layer l's logits [6 tokens, 4 experts]: 3 sin(0.37 i + l), i the element's index.
std::vector<at::Tensor> fixed_logits() {
  std::vector<at::Tensor> logits;
  for (int l = 0; l < 2; ++l) {
    logits.push_back((at::sin(at::arange(24, at::kFloat) * 0.37 + l) * 3).view({6, 4}));
  }
  return logits;
}

// transformers 5.23's load_balancing_loss_func(logits, 4, k) on the same logits (in
// Python: torch.sin(torch.arange(24.) * 0.37 + l) * 3): 1.09877253 (k = 1), 1.9506135
// (k = 2).
TEST(LoadBalancingLoss, EqualsTransformersOnFixedLogits) {
  EXPECT_NEAR(load_balancing_loss(fixed_logits(), 4, 1).item<double>(), 1.09877253, 1e-6);
  EXPECT_NEAR(load_balancing_loss(fixed_logits(), 4, 2).item<double>(), 1.9506135, 1e-6);
  std::vector<at::Tensor> logits = fixed_logits();
  for (at::Tensor& l : logits) l.requires_grad_(true);
  load_balancing_loss(logits, 4, 2).backward();  // through the mean probabilities
  EXPECT_GT(logits[0].grad().abs().sum().item<double>(), 0);
  try {
    load_balancing_loss({}, 4, 2);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(e.msg(),
              "load_balancing_loss: expected the router logits of one or more sparse layers (run "
              "a forward of a mixture-of-experts model first)");
  }
}

// With transformers' attention_mask: the 6 tokens as a batch of 2 x 3, token 2 (the
// first row's last) padding. transformers 5.23's load_balancing_loss_func(logits, 4, k,
// torch.tensor([[1, 1, 0], [1, 1, 1]])): 1.09989333 (k = 1), 1.98998928 (k = 2). An
// all-ones mask is no mask.
TEST(LoadBalancingLoss, EqualsTransformersWithAnAttentionMask) {
  const at::Tensor mask = at::tensor({1, 1, 0, 1, 1, 1}, at::kLong).view({2, 3});
  EXPECT_NEAR(load_balancing_loss(fixed_logits(), 4, 1, mask).item<double>(), 1.09989333, 1e-6);
  EXPECT_NEAR(load_balancing_loss(fixed_logits(), 4, 2, mask).item<double>(), 1.98998928, 1e-6);
  EXPECT_NEAR(load_balancing_loss(fixed_logits(), 4, 2, at::ones({6}, at::kBool)).item<double>(),
              1.9506135, 1e-6);
  try {
    load_balancing_loss(fixed_logits(), 4, 2, at::ones({5}));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(e.msg(),
              "load_balancing_loss: expected a token mask of 6 elements (one per routed token), "
              "got 5");
  }
}

// The experts gathered per expert compute, for each token, the weighted sum of its top-k
// experts' SwiGLU outputs (each computed alone here). Token 2 has no expert 0 and expert
// 3 has no token: both paths are taken.
TEST(Experts, GatheredPerExpertEqualsEachTokenAlone) {
  torch::manual_seed(0);
  Experts experts(4, 8, 6);
  const at::Tensor x = at::randn({5, 8});
  const at::Tensor index = at::tensor({0, 1, 1, 2, 2, 1, 0, 2, 1, 0}, at::kLong).view({5, 2});
  const at::Tensor weights = at::rand({5, 2});
  const at::Tensor y = experts(x, index, weights);
  for (int64_t t = 0; t < 5; ++t) {
    at::Tensor want = at::zeros({8});
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t e = index[t][j].item<int64_t>();
      const at::Tensor both = at::matmul(experts->gate_up_proj[e], x[t]);
      const at::Tensor h = torch::nn::functional::silu(both.narrow(0, 0, 6)) * both.narrow(0, 6, 6);
      want = want + weights[t][j] * at::matmul(experts->down_proj[e], h);
    }
    EXPECT_TRUE(at::allclose(y[t], want, 1e-5, 1e-6)) << "token " << t;
  }
  EXPECT_TRUE(at::equal(experts(x.narrow(0, 0, 0), index.narrow(0, 0, 0), weights.narrow(0, 0, 0)),
                        at::zeros({0, 8})));
}

// Note [Expert rows in multiples of 8]: only bf16 and fp16 on the CPU round up.
TEST(Experts, GemmRowsRoundUpForReducedPrecisionOnTheCpuOnly) {
  const at::Tensor bf16 = at::zeros({1, 4}, at::kBFloat16);
  EXPECT_EQ(expert_gemm_rows(1, bf16), 8);
  EXPECT_EQ(expert_gemm_rows(8, bf16), 8);
  EXPECT_EQ(expert_gemm_rows(9, bf16), 16);
  EXPECT_EQ(expert_gemm_rows(37, at::zeros({1, 4}, at::kHalf)), 40);
  EXPECT_EQ(expert_gemm_rows(37, at::zeros({1, 4})), 37);
  EXPECT_EQ(
      expert_gemm_rows(37, at::zeros({1, 4}, at::TensorOptions(at::kMeta).dtype(at::kBFloat16))),
      37);
}

// In bf16 on the CPU each expert's 1-4 tokens run padded to 8 rows; the outputs and the
// gradients of the real rows equal fp32's over the same bf16 values, to bf16's precision.
TEST(Experts, PaddedRowsInBf16KeepEachTokensOutputAndGradients) {
  torch::manual_seed(0);
  Experts experts(4, 8, 6, at::TensorOptions().dtype(at::kBFloat16));
  Experts reference(4, 8, 6);
  {
    at::NoGradGuard no_grad;
    reference->gate_up_proj.copy_(experts->gate_up_proj);
    reference->down_proj.copy_(experts->down_proj);
  }
  const at::Tensor x = at::randn({5, 8}).to(at::kBFloat16).requires_grad_();
  const at::Tensor x32 = x.detach().to(at::kFloat).requires_grad_();
  const at::Tensor index = at::tensor({0, 1, 1, 2, 2, 1, 0, 2, 1, 0}, at::kLong).view({5, 2});
  const at::Tensor weights = at::rand({5, 2});
  const at::Tensor y = experts(x, index, weights.to(at::kBFloat16));
  const at::Tensor want = reference(x32, index, weights);
  // 3, 4 and 3 tokens: 5 + 4 + 5 zero rows; none in fp32.
  EXPECT_EQ(experts->padded_rows, 14);
  EXPECT_EQ(reference->padded_rows, 0);
  ASSERT_EQ(y.sizes(), at::IntArrayRef({5, 8}));
  EXPECT_TRUE(at::allclose(y.to(at::kFloat), want, 2e-2, 2e-2)) << y << want;
  y.to(at::kFloat).square().sum().backward();
  want.square().sum().backward();
  EXPECT_TRUE(at::allclose(x.grad().to(at::kFloat), x32.grad(), 3e-2, 3e-2));
  EXPECT_TRUE(at::allclose(experts->down_proj.grad().to(at::kFloat), reference->down_proj.grad(),
                           3e-2, 3e-2));
  EXPECT_TRUE(at::allclose(experts->gate_up_proj.grad().to(at::kFloat),
                           reference->gate_up_proj.grad(), 3e-2, 3e-2));
  // A forward of no tokens pads nothing.
  experts(x.detach().narrow(0, 0, 0), index.narrow(0, 0, 0),
          weights.narrow(0, 0, 0).to(at::kBFloat16));
  EXPECT_EQ(experts->padded_rows, 0);
}

TEST(SparseMoeBlock, Qwen3MoeDecoderKeepsItsSparseLayersRouterLogits) {
  const DecoderConfig config = parse_decoder_config(
      R"({"model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 16,
          "intermediate_size": 24, "moe_intermediate_size": 8, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 3, "num_experts": 4,
          "num_experts_per_tok": 2, "norm_topk_prob": true, "mlp_only_layers": [1],
          "vocab_size": 32})",
      "cfg.json");
  torch::manual_seed(0);
  CausalLMImpl model(config);
  EXPECT_TRUE(model.model->decoder_layers[0]->moe && !model.model->decoder_layers[0]->mlp);
  EXPECT_TRUE(model.model->decoder_layers[1]->mlp && !model.model->decoder_layers[1]->moe);
  // The layer's own names (the model's carry the unit's wrapper until FSDP cleans them).
  const auto layer = [&](int64_t i) { return model.model->decoder_layers[i]->named_parameters(); };
  EXPECT_EQ(layer(0)["mlp.experts.gate_up_proj"].sizes(), at::IntArrayRef({4, 16, 16}));
  EXPECT_EQ(layer(2)["mlp.experts.down_proj"].sizes(), at::IntArrayRef({4, 16, 8}));
  EXPECT_EQ(layer(2)["mlp.gate.weight"].sizes(), at::IntArrayRef({4, 16}));
  EXPECT_EQ(layer(1)["mlp.gate_proj.weight"].sizes(), at::IntArrayRef({24, 16}));
  const at::Tensor ids = at::randint(32, {2, 5}, at::kLong);
  const at::Tensor logits = model.forward(ids);
  EXPECT_EQ(logits.sizes(), at::IntArrayRef({2, 5, 32}));
  const std::vector<at::Tensor> router = model.model->router_logits();
  ASSERT_EQ(router.size(), 2u);  // layers 0 and 2
  EXPECT_EQ(router[0].sizes(), at::IntArrayRef({10, 4}));
  EXPECT_TRUE(at::equal(model.aux_loss(), load_balancing_loss(router, 4, 2)));
}

// Note [Router logits out of a checkpointed layer]: with checkpointed layers, the loss
// plus the aux loss has the same value and the same gradients (the routers' included) as
// without.
TEST(SparseMoeBlock, AuxLossTrainsTheRoutersOfCheckpointedLayers) {
  const DecoderConfig config = parse_decoder_config(
      R"({"model_type": "qwen2_moe", "hidden_size": 16, "intermediate_size": 24,
          "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12,
          "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
          "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 32})",
      "cfg.json");
  const at::Tensor ids = at::randint(32, {2, 5}, at::kLong);
  std::vector<at::Tensor> losses, grads;
  for (const bool checkpointed : {false, true}) {
    torch::manual_seed(0);
    CausalLMImpl model(config);
    for (DecoderLayer& layer : model.model->decoder_layers) {
      layer->checkpoint_activations = checkpointed;
    }
    const at::Tensor logits = model.forward(ids);
    ASSERT_EQ(model.model->router_logits().size(), 2u) << "checkpointed " << checkpointed;
    const at::Tensor loss =
        logits.logsumexp(-1).mean() + model.aux_loss(at::tensor({1, 1, 1, 1, 0, 1, 1, 1, 1, 1}));
    loss.backward();
    losses.push_back(loss.detach());
    const at::Tensor router = model.model->decoder_layers[1]->moe->gate->weight;
    ASSERT_TRUE(router.grad().defined()) << "checkpointed " << checkpointed;
    grads.push_back(router.grad());
  }
  EXPECT_TRUE(at::allclose(losses[0], losses[1], 1e-6, 0));
  EXPECT_TRUE(at::allclose(grads[0], grads[1], 1e-5, 1e-7));
  EXPECT_GT(grads[1].abs().sum().item<double>(), 0);
}

}  // namespace
}  // namespace fsdp::models
