// LoRA layers, targeting, merging and PEFT names; LoRA under FSDP trained against one
// process (ranks as threads, the fake communicator).
#include "fsdp/lora/lora.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include <ATen/Functions.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/formats/nf4.h"
#include "fsdp/state/state_dict.h"

namespace fsdp {
namespace {

using namespace ::fsdp::core_testing;  // NOLINT: the shared test models
using lora::LoraConfig;
using lora::LoraLinear;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// An attention-like block: q_proj, v_proj and o_proj LoraLinears, an MLP Linear.
struct AttnBlockImpl : torch::nn::Module {
  AttnBlockImpl() {
    q_proj = register_module("q_proj", LoraLinear(8, 8));
    v_proj = register_module(
        "v_proj", LoraLinear(lora::LoraLinearImpl(torch::nn::LinearOptions(8, 8).bias(false))));
    o_proj = register_module("o_proj", LoraLinear(8, 8));
    mlp = register_module("mlp", torch::nn::Linear(8, 8));
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = x + o_proj(torch::tanh(q_proj(x)) * v_proj(x));
    return h + mlp(torch::relu(h));
  }
  LoraLinear q_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  torch::nn::Linear mlp{nullptr};
};

LoraConfig qv_config() {
  LoraConfig config;
  config.r(2).lora_alpha(6).target_modules({"q_proj", "v_proj"});
  return config;
}

// A tiny LM whose two blocks are FSDP units, LoRA on q_proj and v_proj: every unit mixes
// frozen base weights and trainable adapters; the embedding (the root) is frozen too.
struct LoraLmImpl : torch::nn::Module {
  LoraLmImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(TinyLmImpl::kVocab, 8));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) {
      blocks->push_back(Unit<AttnBlockImpl>(std::make_shared<AttnBlockImpl>()));
    }
    lora::apply_lora(*this, qv_config());
    // Nonzero B, so that the adapters change the output from the first step.
    torch::NoGradGuard no_grad;
    for (const auto& item : named_parameters()) {
      if (absl::EndsWith(item.key(), "lora_B.weight")) item.value().normal_(0, 0.1);
    }
  }
  at::Tensor forward(at::Tensor tokens) {
    at::Tensor x = embedding(tokens);
    for (const auto& block : *blocks) x = block->as<UnitImpl<AttnBlockImpl>>()->forward(x);
    return at::matmul(x, embedding->weight.t());
  }
  static Batch batch(int step, int64_t rows) { return TinyLmImpl::batch(step, rows); }
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& next) {
    return TinyLmImpl::loss(logits, next);
  }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  int step = 0;
};

TEST(LoraLinearTest, WithoutAnAdapterItIsALinear) {
  torch::manual_seed(3);
  torch::nn::Linear plain(5, 4);
  torch::manual_seed(3);
  LoraLinear lora(5, 4);
  EXPECT_TRUE(at::equal(plain->weight, lora->weight));
  EXPECT_TRUE(at::equal(plain->bias, lora->bias));
  std::vector<std::string> names;
  for (const auto& item : lora->named_parameters()) names.push_back(item.key());
  EXPECT_THAT(names, ElementsAre("weight", "bias"));
  const at::Tensor x = at::randn({3, 5});
  EXPECT_TRUE(at::equal(plain(x), lora(x)));
}

TEST(LoraLinearTest, AnAdapterStartsAtZeroAndAddsScaledLowRankUpdate) {
  LoraLinear lora(5, 4);
  LoraConfig config;
  config.r(3).lora_alpha(12).target_modules({"x"});
  const at::Tensor x = at::randn({2, 5});
  const at::Tensor before = lora(x).detach();
  lora->add_adapter(config);
  std::vector<std::string> names;
  for (const auto& item : lora->named_parameters()) names.push_back(item.key());
  EXPECT_THAT(names, ElementsAre("weight", "bias", "lora_A.weight", "lora_B.weight"));
  EXPECT_EQ(lora->lora_A->weight.sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(lora->lora_B->weight.sizes(), (std::vector<int64_t>{4, 3}));
  EXPECT_FALSE(lora->weight.requires_grad());
  EXPECT_FALSE(lora->bias.requires_grad());
  EXPECT_TRUE(lora->lora_A->weight.requires_grad());
  EXPECT_TRUE(lora->lora_B->weight.requires_grad());
  EXPECT_EQ(lora->scaling(), 4.0);
  // kaiming_uniform_(a = sqrt(5)) on fan_in 5: U(-1/sqrt(5), 1/sqrt(5)).
  EXPECT_LE(lora->lora_A->weight.abs().max().item<float>(), 1 / std::sqrt(5.0f));
  EXPECT_GT(lora->lora_A->weight.abs().max().item<float>(), 0);
  EXPECT_EQ(lora->lora_B->weight.abs().max().item<float>(), 0);
  EXPECT_TRUE(at::equal(lora(x), before));
  {
    torch::NoGradGuard no_grad;
    lora->lora_B->weight.fill_(0.5);
  }
  const at::Tensor want =
      before + at::matmul(at::matmul(x, lora->lora_A->weight.t()), lora->lora_B->weight.t()) * 4.0;
  EXPECT_TRUE(at::allclose(lora(x), want, 0, 1e-6));
  EXPECT_TRUE(at::allclose(lora->delta_weight(),
                           at::matmul(lora->lora_B->weight, lora->lora_A->weight) * 4.0, 0, 0));
  EXPECT_THAT([&] { lora->add_adapter(config); },
              ThrowsMessage<c10::Error>(HasSubstr("has an adapter already")));
}

// PEFT's autocast_adapter_dtype: a bf16 base gets fp32 adapters (the input cast to fp32 for
// them, their update cast back to bf16), unless the config turns it off.
TEST(LoraLinearTest, AdaptersOfA16BitBaseAreFloat32AsPeftMakesThem) {
  for (bool autocast : {true, false}) {
    SCOPED_TRACE(autocast ? "autocast" : "no autocast");
    torch::manual_seed(0);
    lora::LoraLinear lora(torch::nn::LinearOptions(5, 4), at::TensorOptions().dtype(at::kBFloat16));
    lora::LoraConfig config;
    config.r(2).lora_alpha(4).target_modules({"x"}).autocast_adapter_dtype(autocast);
    lora->add_adapter(config);
    const at::ScalarType adapter = autocast ? at::kFloat : at::kBFloat16;
    EXPECT_EQ(lora->weight.scalar_type(), at::kBFloat16);
    EXPECT_EQ(lora->lora_A->weight.scalar_type(), adapter);
    EXPECT_EQ(lora->lora_B->weight.scalar_type(), adapter);
    {
      torch::NoGradGuard no_grad;
      lora->lora_B->weight.fill_(0.25);
    }
    const at::Tensor x = at::randn({3, 5}).to(at::kBFloat16);
    const at::Tensor base = torch::nn::functional::linear(x, lora->weight, lora->bias);
    const at::Tensor update =
        at::matmul(at::matmul(x.to(adapter), lora->lora_A->weight.t()), lora->lora_B->weight.t()) *
        2.0;
    const at::Tensor want = (base + update).to(at::kBFloat16);
    const at::Tensor got = lora(x);
    EXPECT_EQ(got.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(got, want));
  }
}

// QLoRA's base: store_weight_nf4 keeps the weight as bitsandbytes' NF4 bytes (double
// quantized) in parameters of their own; forward and backward compute with the weight
// dequantized, exactly as a Linear over that dense weight would.
TEST(LoraLinearTest, AnNf4BaseComputesWithItsDequantizedWeight) {
  torch::manual_seed(0);
  LoraLinear lora(40, 24);  // 960 weights: 15 blocks of 64
  lora->add_adapter(qv_config());
  {
    torch::NoGradGuard no_grad;
    lora->lora_B->weight.normal_(0, 0.1);
  }
  const at::Tensor dense = dequantize_nf4(quantize_nf4(lora->weight.detach()));
  lora->store_weight_nf4();
  EXPECT_TRUE(lora->stores_weight());
  std::vector<std::string> names;
  for (const auto& item : lora->named_parameters()) names.push_back(item.key());
  EXPECT_THAT(names, ElementsAre("weight", "bias", "weight_absmax", "weight_nested_absmax",
                                 "weight_nested_quant_map", "weight_nested_offset", "lora_A.weight",
                                 "lora_B.weight"));
  EXPECT_EQ(lora->weight.scalar_type(), at::kByte);
  EXPECT_EQ(lora->weight.sizes(), (std::vector<int64_t>{480}));
  EXPECT_EQ(lora->weight_absmax.sizes(), (std::vector<int64_t>{15}));
  EXPECT_EQ(lora->weight_absmax.scalar_type(), at::kByte);
  // The float32 scales as their bytes.
  EXPECT_EQ(lora->weight_nested_absmax.sizes(), (std::vector<int64_t>{4}));
  EXPECT_EQ(lora->weight_nested_quant_map.sizes(), (std::vector<int64_t>{1024}));
  EXPECT_EQ(lora->weight_nested_offset.scalar_type(), at::kByte);
  for (const at::Tensor& p : {lora->weight, lora->weight_absmax, lora->weight_nested_absmax,
                              lora->weight_nested_quant_map, lora->weight_nested_offset}) {
    EXPECT_FALSE(p.requires_grad());
  }
  EXPECT_TRUE(at::equal(lora->dense_weight(at::kFloat), dense));
  // The same layer with the dense weight: outputs and gradients equal.
  LoraLinear plain(40, 24);
  {
    torch::NoGradGuard no_grad;
    plain->weight.copy_(dense);
    plain->bias.copy_(lora->bias);
  }
  plain->add_adapter(qv_config());
  {
    torch::NoGradGuard no_grad;
    plain->lora_A->weight.copy_(lora->lora_A->weight);
    plain->lora_B->weight.copy_(lora->lora_B->weight);
  }
  const at::Tensor x = at::randn({3, 5, 40});
  const at::Tensor x1 = x.clone().requires_grad_(true), x2 = x.clone().requires_grad_(true);
  const at::Tensor y1 = lora(x1), y2 = plain(x2);
  EXPECT_TRUE(at::allclose(y1, y2, 0, 1e-6));
  (y1 * y1).sum().backward();
  (y2 * y2).sum().backward();
  EXPECT_TRUE(at::allclose(x1.grad(), x2.grad(), 0, 1e-6));
  EXPECT_TRUE(at::allclose(lora->lora_A->weight.grad(), plain->lora_A->weight.grad(), 0, 1e-5));
  EXPECT_TRUE(at::allclose(lora->lora_B->weight.grad(), plain->lora_B->weight.grad(), 0, 1e-5));
  EXPECT_THAT([&] { lora->store_weight_nf4(); },
              ThrowsMessage<c10::Error>(HasSubstr("stored in NF4 already")));
}

TEST(ApplyLoraTest, TargetsByNameSuffixOrRegexAndFreezesTheRest) {
  auto block = std::make_shared<AttnBlockImpl>();
  EXPECT_THAT(lora::apply_lora(*block, qv_config()), ElementsAre("q_proj", "v_proj"));
  std::vector<std::string> trainable;
  for (const auto& item : block->named_parameters()) {
    if (item.value().requires_grad()) trainable.push_back(item.key());
  }
  EXPECT_THAT(trainable, ElementsAre("q_proj.lora_A.weight", "q_proj.lora_B.weight",
                                     "v_proj.lora_A.weight", "v_proj.lora_B.weight"));
  EXPECT_FALSE(block->o_proj->has_adapter());

  LoraConfig regex;
  regex.target_regex("blocks\\.1\\.(q|o)_proj");
  LoraLmImpl lm;  // q_proj and v_proj adapted already
  EXPECT_THAT([&] { lora::apply_lora(lm, regex); },
              ThrowsMessage<c10::Error>(HasSubstr("'blocks.1.q_proj' has an adapter already")));
  regex.target_regex("blocks\\.1\\.o_proj");
  EXPECT_THAT(lora::apply_lora(lm, regex), ElementsAre("blocks.1.o_proj"));
  EXPECT_TRUE(lora::is_target("model.layers.0.self_attn.q_proj", qv_config()));
  EXPECT_FALSE(lora::is_target("model.layers.0.self_attn.qq_proj", qv_config()));
}

TEST(ApplyLoraTest, ErrorsNameWhatToDo) {
  auto block = std::make_shared<AttnBlockImpl>();
  LoraConfig config;
  config.target_modules({"mlp"});
  EXPECT_THAT([&] { lora::apply_lora(*block, config); },
              ThrowsMessage<c10::Error>(HasSubstr(
                  "'mlp' is a target but a torch::nn::Linear, which cannot carry an adapter; "
                  "hold an fsdp::lora::LoraLinear there instead")));
  config.target_modules({"k_proj"});
  EXPECT_THAT([&] { lora::apply_lora(*block, config); },
              ThrowsMessage<c10::Error>(
                  HasSubstr("no LoraLinear matches target_modules [k_proj]; the model's LoraLinear "
                            "modules are [q_proj, v_proj, o_proj]")));
  config.target_regex("q_proj");
  EXPECT_THAT([&] { lora::apply_lora(*block, config); },
              ThrowsMessage<c10::Error>(HasSubstr("exactly one; got both")));
  config.target_modules({}).target_regex("q_proj").r(0);
  EXPECT_THAT([&] { lora::apply_lora(*block, config); },
              ThrowsMessage<c10::Error>(HasSubstr("expected LoRA rank r >= 1, got 0")));
}

TEST(LoraStateDictTest, AdapterNamesArePeftsAndMergingFoldsTheUpdateIn) {
  auto lm = make<LoraLmImpl>();
  const StateDict full = module_state_dict(*lm);
  const lora::StateDict adapter = lora::adapter_state_dict(full);
  EXPECT_THAT(adapter.keys(), ElementsAre("base_model.model.blocks.0.q_proj.lora_A.weight",
                                          "base_model.model.blocks.0.q_proj.lora_B.weight",
                                          "base_model.model.blocks.0.v_proj.lora_A.weight",
                                          "base_model.model.blocks.0.v_proj.lora_B.weight",
                                          "base_model.model.blocks.1.q_proj.lora_A.weight",
                                          "base_model.model.blocks.1.q_proj.lora_B.weight",
                                          "base_model.model.blocks.1.v_proj.lora_A.weight",
                                          "base_model.model.blocks.1.v_proj.lora_B.weight"));
  const lora::StateDict merged = lora::merged_state_dict(full, qv_config());
  // The merged weights in a model without adapters give the adapted model's output.
  struct PlainLmImpl : torch::nn::Module {
    PlainLmImpl() {
      embedding = register_module("embedding", torch::nn::Embedding(TinyLmImpl::kVocab, 8));
      blocks = register_module("blocks", torch::nn::ModuleList());
      for (int i = 0; i < 2; ++i) {
        blocks->push_back(Unit<AttnBlockImpl>(std::make_shared<AttnBlockImpl>()));
      }
    }
    torch::nn::Embedding embedding{nullptr};
    torch::nn::ModuleList blocks{nullptr};
  };
  PlainLmImpl plain;
  EXPECT_EQ(merged.keys(), module_state_dict(plain).keys());
  load_module_state_dict(plain, merged);
  const at::Tensor& a = full["blocks.1.v_proj.lora_A.weight"];
  const at::Tensor& b = full["blocks.1.v_proj.lora_B.weight"];
  EXPECT_TRUE(at::allclose(merged["blocks.1.v_proj.weight"],
                           full["blocks.1.v_proj.weight"] + at::matmul(b, a) * 3.0, 0, 1e-7));
  at::Tensor x = at::randn({3, 8});
  at::Tensor want = x, got = x;
  for (int i = 0; i < 2; ++i) {
    want = lm->blocks[i]->as<UnitImpl<AttnBlockImpl>>()->module()->forward(want);
    got = plain.blocks[i]->as<UnitImpl<AttnBlockImpl>>()->module()->forward(got);
  }
  EXPECT_TRUE(at::allclose(got, want, 0, 1e-5));
  EXPECT_THAT([&] { lora::merged_state_dict(full, LoraConfig().r(4).target_modules({"q_proj"})); },
              ThrowsMessage<c10::Error>(HasSubstr("with r = 4, got [2, 8], [8, 2] and [8, 8]")));
}

// LoRA under FSDP: every unit mixes frozen base weights and trainable adapters; training
// matches one process with the same adapters, every strategy, W = 1, 2, 3.
TEST(LoraFsdpTest, TrainsLikeOneProcessEveryStrategy) {
  for (int world_size : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "W = " << world_size);
    on_ranks(world_size, [](std::shared_ptr<Communicator> comm) {
      expect_parity_for_all_strategies<LoraLmImpl>(comm);
    });
  }
}

// QLoRA: LoraLmImpl with every adapted and unadapted LoraLinear's base in NF4. Each unit
// then holds trainable fp32 adapters, frozen fp32 parameters (the MLP, biases, NF4 scales)
// and frozen uint8 NF4 bytes: three flat parameters, the bytes gathered as stored.
struct QloraLmImpl : LoraLmImpl {
  QloraLmImpl() {
    for (const auto& block : *blocks) {
      auto& inner = *block->as<UnitImpl<AttnBlockImpl>>()->module();
      for (auto* layer : {&inner.q_proj, &inner.v_proj, &inner.o_proj}) {
        (*layer)->store_weight_nf4();
      }
    }
  }
};

TEST(LoraFsdpTest, QloraTrainsLikeOneProcessEveryStrategy) {
  on_ranks(2, [](std::shared_ptr<Communicator> comm) {
    FullyShardedDataParallel<QloraLmImpl> model(make<QloraLmImpl>(),
                                                FullyShardedDataParallelOptions(comm));
    const FullyShardedUnit& block = *model->units()[1];
    ASSERT_EQ(block.frozen_handles().size(), 2u);
    // q_proj's codes come first among the frozen parameters, then its fp32 bias. Per block:
    // 3 x (32 code bytes, 1 absmax byte, 4 + 1024 + 4 bytes of float32 scales) in the uint8
    // flat parameter.
    EXPECT_EQ(block.frozen_handles()[0]->sharded_flat_param().scalar_type(), at::kByte);
    EXPECT_EQ(block.frozen_handles()[0]->numel(), 3 * (32 + 1 + 4 + 1024 + 4));
    EXPECT_EQ(block.frozen_handles()[1]->sharded_flat_param().scalar_type(), at::kFloat);
  });
  for (int world_size : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "W = " << world_size);
    on_ranks(world_size, [](std::shared_ptr<Communicator> comm) {
      expect_parity_for_all_strategies<QloraLmImpl>(comm);
    });
  }
}

}  // namespace
}  // namespace fsdp
