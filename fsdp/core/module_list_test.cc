// Issue 25, item 1: a GPT written as LibTorch users write it (blocks in a
// torch::nn::ModuleList, called through as<BlockImpl>()), trained under the transformer
// policy with the one documented change (fsdp::forward_as), and the error for a block
// called directly. See Note [Auto-wrapping] in fully_sharded.cc and Note [A unit's
// module called directly] in unit.cc.
#include <memory>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include "fsdp/base/names.h"
#include "fsdp/comm/fake.h"
#include "fsdp/core/fully_sharded.h"
#include "fsdp/core/testing/parity_testing.h"
#include "fsdp/wrap/policy.h"

namespace fsdp {
namespace {

using core_testing::Batch;
using core_testing::make;
using core_testing::on_ranks;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kVocab = 13;
constexpr int64_t kWidth = 8;
constexpr int64_t kContext = 5;

// A pre-norm transformer block: causal self-attention (2 heads) and an MLP.
struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl() {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    // No bias: a key bias has a zero gradient (softmax ignores it) that Adam would turn
    // into steps of rounding noise.
    qkv = register_module(
        "qkv", torch::nn::Linear(torch::nn::LinearOptions(kWidth, 3 * kWidth).bias(false)));
    proj = register_module("proj", torch::nn::Linear(kWidth, kWidth));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    up = register_module("up", torch::nn::Linear(kWidth, 4 * kWidth));
    down = register_module("down", torch::nn::Linear(4 * kWidth, kWidth));
  }
  at::Tensor forward(at::Tensor x) {
    const int64_t b = x.size(0), t = x.size(1);
    std::vector<at::Tensor> qkv_parts = qkv(ln1(x)).view({b, t, 3, 2, kWidth / 2}).unbind(2);
    at::Tensor attn = at::scaled_dot_product_attention(
        qkv_parts[0].transpose(1, 2), qkv_parts[1].transpose(1, 2), qkv_parts[2].transpose(1, 2),
        /*attn_mask=*/{}, /*dropout_p=*/0.0,
        /*is_causal=*/true);
    x = x + proj(attn.transpose(1, 2).reshape({b, t, kWidth}));
    return x + down(torch::nn::functional::gelu(up(ln2(x))));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, up{nullptr}, down{nullptr};
};

// The new user's GPT: blocks in a ModuleList, a tied output head. kThroughUnit: the one
// documented change, fsdp::forward_as<GptBlockImpl>(m, x) for
// m->as<GptBlockImpl>()->forward(x). kAnnotated: each block appended as
// fsdp::wrap(block) (a unit inside an EnableWrap scope).
template <bool kThroughUnit, bool kAnnotated = false>
struct PlainGptImpl : torch::nn::Module {
  PlainGptImpl() {
    embedding = register_module("embedding", torch::nn::Embedding(kVocab, kWidth));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) {
      auto block = std::make_shared<GptBlockImpl>();
      blocks->push_back(kAnnotated ? fsdp::wrap(block) : block);
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
  }
  at::Tensor forward(at::Tensor tokens) {
    at::Tensor x = embedding(tokens);
    for (auto& m : *blocks) {
      if constexpr (kThroughUnit) {
        x = fsdp::forward_as<GptBlockImpl>(m, x);
      } else {
        x = m->as<GptBlockImpl>()->forward(x);
      }
    }
    return at::matmul(ln_f(x), embedding->weight.t());
  }
  static Batch batch(int step, int64_t rows) {
    at::Tensor tokens =
        (at::arange(rows * (kContext + 1), at::kLong).view({rows, kContext + 1}) * 5 + step) %
        kVocab;
    return {tokens.narrow(1, 0, kContext), tokens.narrow(1, 1, kContext)};
  }
  static at::Tensor loss(const at::Tensor& logits, const at::Tensor& next) {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), next.reshape({-1}));
  }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  int step = 0;
};
using ThroughUnitGptImpl = PlainGptImpl<true>;
using DirectGptImpl = PlainGptImpl<false>;
using AnnotatedThroughUnitGptImpl = PlainGptImpl<true, /*kAnnotated=*/true>;
using AnnotatedDirectGptImpl = PlainGptImpl<false, /*kAnnotated=*/true>;

// Builds Net inside an EnableWrap scope with `options` (its fsdp::wrap calls annotate).
template <typename Net>
std::shared_ptr<Net> make_in_scope(const FullyShardedDataParallelOptions& options) {
  EnableWrap scope(options);
  return make<Net>();
}

FullyShardedDataParallelOptions block_policy(std::shared_ptr<Communicator> comm,
                                             ShardingStrategy strategy) {
  return FullyShardedDataParallelOptions(std::move(comm))
      .sharding_strategy(strategy)
      .auto_wrap_policy(transformer_auto_wrap_policy({ModuleType::of<GptBlockImpl>()}));
}

TEST(ModuleListTest, ForwardAsIsThePlainCallWithoutFsdp) {
  auto through = make<ThroughUnitGptImpl>();
  auto direct = make<DirectGptImpl>();
  const Batch batch = ThroughUnitGptImpl::batch(0, 2);
  EXPECT_TRUE(at::equal(through->forward(batch.input), direct->forward(batch.input)));
  // On a Unit<T> (annotated, not bound) and on a holder, too.
  auto block = std::make_shared<GptBlockImpl>();
  const at::Tensor x = at::randn({2, kContext, kWidth});
  Unit<GptBlockImpl> unit(block);
  EXPECT_TRUE(at::equal(fsdp::forward_as<GptBlockImpl>(unit.ptr(), x), block->forward(x)));
  EXPECT_TRUE(at::equal(fsdp::forward_as(unit, x), block->forward(x)));
  EXPECT_THAT([&] { fsdp::forward_as<torch::nn::LinearImpl>(block, x); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                  "fsdp::forward_as: expected a torch::nn::LinearImpl (or a unit around one), "
                  "but the module is a fsdp::(anonymous namespace)::GptBlockImpl")));
}

// Done-when of issue 25: the plain ModuleList GPT, after the one change, trains under the
// transformer policy at W = 2 in parity with one process (REFERENCE §7), each block a
// unit and the tied embedding in the root, for every strategy.
TEST(ModuleListTest, TransformerPolicyTrainsAPlainModuleListGptInParity) {
  const core_testing::Reference sgd = core_testing::reference<ThroughUnitGptImpl>(2, false);
  const core_testing::Reference adam = core_testing::reference<ThroughUnitGptImpl>(2, true);
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(sharding_strategy_name(strategy));
      core_testing::expect_parity_on<ThroughUnitGptImpl>(comm, sgd, block_policy(comm, strategy),
                                                         /*adam=*/false);
      core_testing::expect_parity_on<ThroughUnitGptImpl>(comm, adam, block_policy(comm, strategy),
                                                         /*adam=*/true);
    }
    FullyShardedDataParallel<ThroughUnitGptImpl> model(
        make<ThroughUnitGptImpl>(), block_policy(comm, ShardingStrategy::kFullShard));
    std::vector<std::string> fqns;
    for (const auto& unit : model->units()) fqns.push_back(unit->fqn());
    EXPECT_THAT(fqns, ElementsAre("", "blocks.0", "blocks.1", "blocks.2"));
    // Root: embedding 13 x 8 + ln_f 16; a block: 2 x 16 + 8 x 24 + 8 x 8 + 8 + 8 x 32 +
    // 32 + 32 x 8 + 8.
    EXPECT_EQ(model->units()[0]->handle()->numel(), 13 * 8 + 16);
    EXPECT_EQ(model->units()[1]->handle()->numel(), 32 + 192 + 72 + 288 + 264);
    // The ModuleList still holds the blocks themselves; the units are registered in
    // their place, so names clean to the plain model's.
    EXPECT_NE(model->module()->blocks[0]->as<GptBlockImpl>(), nullptr);
    EXPECT_EQ(model->module()->blocks->named_children()[0].key(), "0");
    std::vector<std::string> names;
    for (const auto& item : model->named_parameters()) {
      names.push_back(clean_tensor_name(item.key()));
    }
    std::vector<std::string> plain;
    for (const auto& item : make<ThroughUnitGptImpl>()->named_parameters()) {
      plain.push_back(item.key());
    }
    EXPECT_EQ(names, plain);
  });
}

// The unchanged model (m->as<GptBlockImpl>()->forward(x)) under FSDP bypasses the units:
// one error naming the first block's unit and the change, under every strategy (FULL_SHARD
// and SHARD_GRAD_OP: its parameters hold no memory; NO_SHARD: it did not run).
TEST(ModuleListTest, CallingABlockDirectlyIsAnErrorNamingTheUnit) {
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(sharding_strategy_name(strategy));
      FullyShardedDataParallel<DirectGptImpl> model(make<DirectGptImpl>(),
                                                    block_policy(comm, strategy));
      const Batch batch = DirectGptImpl::batch(0, 2);
      EXPECT_THAT(
          [&] { model->forward(batch.input); },
          ::testing::ThrowsMessage<c10::Error>(HasSubstr(
              "FullyShardedDataParallel: the forward called the module of unit 'blocks.0' "
              "(fsdp::(anonymous namespace)::GptBlockImpl) directly, bypassing the unit, so "
              "its parameters were not gathered for it; call it through its unit with "
              "fsdp::forward_as, e.g. `x = fsdp::forward_as<fsdp::(anonymous "
              "namespace)::GptBlockImpl>(m, x);`")));
    }
  });
}

// Issue 36, item 6: blocks annotated with fsdp::wrap behave as policy-picked ones. The
// list keeps the blocks themselves (the units registered in their place), so the
// forward_as model trains in parity with one process and names and units are the policy
// path's, and the unchanged model meets the policy path's error instead of a null
// as<GptBlockImpl>().
TEST(ModuleListTest, AnnotatedBlocksAreUnitsInTheListsPlace) {
  const core_testing::Reference sgd = core_testing::reference<ThroughUnitGptImpl>(2, false);
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(sharding_strategy_name(strategy));
      const auto options = FullyShardedDataParallelOptions(comm).sharding_strategy(strategy);
      auto net = make_in_scope<AnnotatedThroughUnitGptImpl>(options);
      EXPECT_NE(net->blocks[0]->as<GptBlockImpl>(), nullptr);
      EXPECT_TRUE(wrap_annotation(*net->blocks[0]).has_value());
      core_testing::expect_parity_on<AnnotatedThroughUnitGptImpl>(
          comm, sgd, options, /*adam=*/false, nullptr,
          [&] { return make_in_scope<AnnotatedThroughUnitGptImpl>(options); });

      FullyShardedDataParallel<AnnotatedThroughUnitGptImpl> model(net, options);
      std::vector<std::string> fqns;
      for (const auto& unit : model->units()) fqns.push_back(unit->fqn());
      EXPECT_THAT(fqns, ElementsAre("", "blocks.0", "blocks.1", "blocks.2"));
      EXPECT_NE(model->module()->blocks[0]->as<GptBlockImpl>(), nullptr);
      EXPECT_FALSE(wrap_annotation(*net->blocks[0]).has_value());  // the unit took it

      FullyShardedDataParallel<AnnotatedDirectGptImpl> direct(
          make_in_scope<AnnotatedDirectGptImpl>(options), options);
      EXPECT_THAT([&] { direct->forward(AnnotatedDirectGptImpl::batch(0, 2).input); },
                  ::testing::ThrowsMessage<c10::Error>(HasSubstr(
                      "FullyShardedDataParallel: the forward called the module of unit 'blocks.0' "
                      "(fsdp::(anonymous namespace)::GptBlockImpl) directly, bypassing the unit")));
    }
  });
}

// PyTorch's CustomPolicy: per-unit overrides returned by the policy (blocks.1 NO_SHARD
// under a FULL_SHARD root), an empty UnitOptions is not a unit (blocks.2); training
// matches one process.
TEST(PolicyTest, CustomPolicyGivesUnitsTheirOwnSettings) {
  const CustomPolicy policy([](const ModuleNode& node) -> CustomPolicy::Result {
    if (node.cpp_module == nullptr ||
        dynamic_cast<const GptBlockImpl*>(node.cpp_module) == nullptr) {
      return false;
    }
    if (node.fqn == "blocks.1") return UnitOptions().sharding_strategy(ShardingStrategy::kNoShard);
    if (node.fqn == "blocks.2") return UnitOptions();
    return true;
  });
  const core_testing::Reference sgd = core_testing::reference<ThroughUnitGptImpl>(2, false);
  on_ranks(2, [&](std::shared_ptr<Communicator> comm) {
    const auto options = FullyShardedDataParallelOptions(comm).auto_wrap_policy(policy);
    FullyShardedDataParallel<ThroughUnitGptImpl> model(make<ThroughUnitGptImpl>(), options);
    std::vector<std::string> fqns;
    std::vector<ShardingStrategy> strategies;
    for (const auto& unit : model->units()) {
      fqns.push_back(unit->fqn());
      strategies.push_back(unit->handle()->strategy());
    }
    EXPECT_THAT(fqns, ElementsAre("", "blocks.0", "blocks.1"));
    EXPECT_THAT(strategies, ElementsAre(ShardingStrategy::kFullShard, ShardingStrategy::kFullShard,
                                        ShardingStrategy::kNoShard));
    core_testing::expect_parity_on<ThroughUnitGptImpl>(comm, sgd, options, /*adam=*/false);
  });
}

// PyTorch's ModuleWrapPolicy: every module of its types, nested ones too.
TEST(PolicyTest, ModuleWrapPolicyPicksEveryModuleOfItsTypes) {
  auto world = FakeWorld::create(1);
  FullyShardedDataParallel<ThroughUnitGptImpl> model(
      make<ThroughUnitGptImpl>(),
      FullyShardedDataParallelOptions(world->communicator(0))
          .auto_wrap_policy(ModuleWrapPolicy(
              {ModuleType::of<GptBlockImpl>(), ModuleType::of<torch::nn::LayerNormImpl>()})));
  std::vector<std::string> fqns;
  for (const auto& unit : model->units()) fqns.push_back(unit->fqn());
  EXPECT_THAT(
      fqns, ElementsAre("", "blocks.0", "blocks.0.ln1", "blocks.0.ln2", "blocks.1", "blocks.1.ln1",
                        "blocks.1.ln2", "blocks.2", "blocks.2.ln1", "blocks.2.ln2", "ln_f"));
}

// Issue 25, item 2: an optimizer over parameters() reached through a torch::nn::Module&
// (the original parameters) fails at construction (Note [Original parameters are not
// leaves] in fully_sharded.cc); recurse = false gives the root's own flat parameter.
TEST(ParametersTest, AnOptimizerOverTheOriginalParametersFailsAtConstruction) {
  auto world = FakeWorld::create(1);
  FullyShardedDataParallel<ThroughUnitGptImpl> model(
      make<ThroughUnitGptImpl>(),
      block_policy(world->communicator(0), ShardingStrategy::kFullShard));
  torch::nn::Module& module = *model;
  EXPECT_EQ(module.parameters().size(), 3u + 3u * 11u);  // the originals
  EXPECT_THAT([&] { torch::optim::SGD sgd(module.parameters(), 0.1); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("can't optimize a non-leaf Tensor")));
  EXPECT_THAT([&] { torch::optim::SGD sgd(model->module()->parameters(), 0.1); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("can't optimize a non-leaf Tensor")));
  const std::vector<at::Tensor> all = model->parameters();
  ASSERT_EQ(all.size(), 4u);
  for (size_t k = 0; k < all.size(); ++k) {
    EXPECT_TRUE(all[k].is_same(model->units()[k]->handle()->sharded_flat_param())) << k;
    EXPECT_TRUE(all[k].is_leaf()) << k;
  }
  const std::vector<at::Tensor> own = model->parameters(/*recurse=*/false);
  ASSERT_EQ(own.size(), 1u);
  EXPECT_TRUE(own[0].is_same(all[0]));
  torch::optim::SGD sgd(model->parameters(), 0.1);  // the flat shards: accepted
  EXPECT_EQ(sgd.param_groups()[0].params().size(), 4u);
}

}  // namespace
}  // namespace fsdp
