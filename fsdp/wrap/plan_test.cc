// Every row of REFERENCE §1 with its exact unit set, plus `_recursive_wrap`'s remainder logic,
// shared parameters, ignored modules and errors.
#include "fsdp/wrap/plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/transformerlayer.h>

#include "tests/test_models.h"

namespace fsdp {
namespace {

using ::fsdp::testing::linear;
using ::fsdp::testing::reference_model_n;
using ::fsdp::testing::seq;
using ::fsdp::testing::TiedLinear;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

std::vector<std::string> unit_fqns(const WrapPlan& plan) {
  std::vector<std::string> fqns;
  for (const PlannedUnit& unit : plan.units) fqns.push_back(unit.fqn);
  return fqns;
}

std::vector<int64_t> unit_numels(const WrapPlan& plan) {
  std::vector<int64_t> numels;
  for (const PlannedUnit& unit : plan.units) numels.push_back(unit.numel);
  return numels;
}

AutoWrapPolicy size_policy(int64_t min_num_params) {
  return size_based_auto_wrap_policy(SizeBasedPolicyOptions().min_num_params(min_num_params));
}

WrapPlanOptions ignoring(const ModuleTree& tree, std::vector<std::string> fqns) {
  WrapPlanOptions options;
  for (const std::string& fqn : fqns) options.ignored_modules().push_back(tree.find(fqn));
  return options;
}

TEST(ReferencePlanTest, AlwaysWrapsEveryModule) {
  auto model = reference_model_n();
  const WrapPlan plan = plan_fsdp_units(ModuleTree::from_module(*model), always_wrap_policy());
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "0", "1", "2", "2.0", "2.1"));
  EXPECT_THAT(unit_numels(plan), ElementsAre(0, 30, 30, 0, 30, 30));
  EXPECT_EQ(plan.total_numel, 120);
}

TEST(ReferencePlanTest, SizeMin40WrapsTheRemainderOfTheInnerSequential) {
  auto model = reference_model_n();
  const WrapPlan plan = plan_fsdp_units(ModuleTree::from_module(*model), size_policy(40));
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "2"));
  EXPECT_THAT(unit_numels(plan), ElementsAre(60, 60));
  EXPECT_EQ(plan.units[1].remainder, 60);
  EXPECT_EQ(plan.wrapped_numel, 60);
}

TEST(ReferencePlanTest, SizeMin40WithIgnoredModulesExcludesTheirNumel) {
  auto model = reference_model_n();
  const ModuleTree tree = ModuleTree::from_module(*model);
  const WrapPlan plan = plan_fsdp_units(tree, size_policy(40), ignoring(tree, {"1", "2.0"}));
  EXPECT_THAT(unit_fqns(plan), ElementsAre(""));
  EXPECT_EQ(plan.total_numel, 60);
  EXPECT_THAT(unit_numels(plan), ElementsAre(60));
}

TEST(ReferencePlanTest, AlwaysWithIgnoredModules) {
  auto model = reference_model_n();
  const ModuleTree tree = ModuleTree::from_module(*model);
  const WrapPlan plan = plan_fsdp_units(tree, always_wrap_policy(), ignoring(tree, {"1", "2.0"}));
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "0", "2", "2.1"));
  EXPECT_THAT(unit_numels(plan), ElementsAre(0, 30, 0, 30));
}

TEST(ReferencePlanTest, ModuleListOfSmallLinearsStaysInRoot) {
  torch::nn::ModuleList list(torch::nn::Linear(5, 5), torch::nn::Linear(5, 5));
  const WrapPlan plan = plan_fsdp_units(ModuleTree::from_module(*list), size_policy(40));
  EXPECT_THAT(unit_fqns(plan), ElementsAre(""));
  EXPECT_THAT(unit_numels(plan), ElementsAre(60));
}

TEST(ReferencePlanTest, ModuleListOfOneLargeLinear) {
  torch::nn::ModuleList list(torch::nn::Linear(10, 10));
  const WrapPlan plan = plan_fsdp_units(ModuleTree::from_module(*list), size_policy(40));
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "0"));
  EXPECT_THAT(unit_numels(plan), ElementsAre(0, 110));
}

TEST(ReferencePlanTest, MultiheadAttentionIsAForcedLeaf) {
  auto model = seq({linear(10), torch::nn::MultiheadAttention(100, 1).ptr()});
  const WrapPlan plan = plan_fsdp_units(ModuleTree::from_module(*model), size_policy(40));
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "0"));
  // in_proj 3*100*100 + 300, out_proj 100*100 + 100: all in the root.
  EXPECT_THAT(unit_numels(plan), ElementsAre(40400, 110));
}

struct TinyTransformer : torch::nn::Module {
  TinyTransformer() {
    embedding = register_module("embedding", torch::nn::Embedding(10, 8));
    layers = register_module("layers", torch::nn::ModuleList());
    layers->push_back(torch::nn::TransformerEncoderLayer(
        torch::nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16)));
    layers->push_back(torch::nn::TransformerEncoderLayer(
        torch::nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16)));
    decoder = register_module(
        "decoder", torch::nn::TransformerDecoderLayer(
                       torch::nn::TransformerDecoderLayerOptions(8, 2).dim_feedforward(16)));
    head = register_module("head", std::make_shared<TiedLinear>(embedding->weight));
  }
  torch::nn::Embedding embedding{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::TransformerDecoderLayer decoder{nullptr};
  std::shared_ptr<TiedLinear> head;
};

TEST(ReferencePlanTest, TransformerPolicyWrapsLayersAndKeepsTiedEmbeddingInRoot) {
  TinyTransformer model;
  const WrapPlan plan = plan_fsdp_units(
      ModuleTree::from_module(model),
      transformer_auto_wrap_policy({ModuleType::of<torch::nn::TransformerEncoderLayerImpl>(),
                                    ModuleType::of<torch::nn::TransformerDecoderLayerImpl>()}));
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "layers.0", "layers.1", "decoder"));
  // Root: embedding 10x8 (shared with the head, counted once) + head bias 10.
  EXPECT_EQ(plan.units[0].numel, 90);
  int64_t encoder_numel = 0;
  for (const auto& p : model.layers[0]->parameters()) encoder_numel += p.numel();
  EXPECT_EQ(plan.units[1].numel, encoder_numel);
}

TEST(ReferencePlanTest, LambdaPolicyRecursesAlwaysAndWrapsWhatTheLambdaSays) {
  auto model = reference_model_n();
  const WrapPlan plan = plan_fsdp_units(
      ModuleTree::from_module(*model),
      lambda_auto_wrap_policy([](const ModuleNode& m) { return m.fqn == "2.1" || m.fqn == "0"; }));
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "0", "2.1"));
  EXPECT_THAT(unit_numels(plan), ElementsAre(60, 30, 30));
}

TEST(ReferencePlanTest, OrPolicyWrapsWhenAnyMemberSaysSo) {
  auto model = reference_model_n();
  const WrapPlan plan = plan_fsdp_units(
      ModuleTree::from_module(*model),
      or_policy({lambda_auto_wrap_policy([](const ModuleNode& m) { return m.fqn == "1"; }),
                 size_policy(60)}));
  // "1" by the lambda; "2" by size (remainder 60 >= 60).
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "1", "2"));
}

TEST(ReferencePlanTest, BatchNormIndividually) {
  auto model = seq({torch::nn::Conv2d(3, 4, 3).ptr(), torch::nn::BatchNorm2d(4).ptr(),
                    torch::nn::ReLU().ptr(), torch::nn::Conv2d(4, 4, 3).ptr(),
                    seq({torch::nn::BatchNorm1d(4).ptr()})});
  const WrapPlan plan =
      plan_fsdp_units(ModuleTree::from_module(*model), wrap_batchnorm_individually());
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "1", "4.0"));
  EXPECT_THAT(unit_numels(plan), ElementsAre(112 + 148, 8, 8));
}

TEST(PlanTest, NoPolicyMeansRootOnly) {
  auto model = reference_model_n();
  const WrapPlan plan = plan_fsdp_units(ModuleTree::from_module(*model), nullptr);
  EXPECT_THAT(unit_fqns(plan), ElementsAre(""));
  EXPECT_THAT(unit_numels(plan), ElementsAre(120));
  EXPECT_THROW(plan_recursive_wrap(ModuleTree::from_module(*model), nullptr), c10::Error);
}

TEST(PlanTest, RecursiveWrapWithoutOnlyWrapChildrenMayWrapTheRoot) {
  auto model = reference_model_n();
  const ModuleTree tree = ModuleTree::from_module(*model);
  WrapPlan plan = plan_recursive_wrap(tree, size_policy(40));
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "2"));
  EXPECT_EQ(plan.wrapped_numel, 120);
  plan = plan_recursive_wrap(tree, size_policy(40), WrapPlanOptions().only_wrap_children(true));
  EXPECT_THAT(unit_fqns(plan), ElementsAre("2"));
  EXPECT_EQ(plan.wrapped_numel, 60);
  // Below the threshold nothing is recursed into or wrapped.
  plan = plan_recursive_wrap(tree, size_policy(121));
  EXPECT_TRUE(plan.units.empty());
  EXPECT_EQ(plan.wrapped_numel, 0);
}

TEST(PlanTest, PolicyIsCalledInTheSeedsOrderWithTheSeedsNumbers) {
  auto model = reference_model_n();
  std::vector<std::string> calls;
  auto recording = [&](const ModuleNode& m, bool recurse, int64_t numel) {
    calls.push_back((recurse ? "R " : "W ") + m.fqn + " " + std::to_string(numel));
    return recurse || m.fqn == "2.0";
  };
  plan_fsdp_units(ModuleTree::from_module(*model), recording);
  EXPECT_THAT(calls, ElementsAre("R  120", "R 0 30", "W 0 30", "R 1 30", "W 1 30", "R 2 60",
                                 "R 2.0 30", "W 2.0 30", "R 2.1 30", "W 2.1 30", "W 2 30"));
}

TEST(PlanTest, SharedParametersAreCountedOnceAndOwnedByTheFirstUnitToWrap) {
  auto first = torch::nn::Linear(5, 5);
  auto model =
      seq({first.ptr(), linear(5), seq({std::make_shared<TiedLinear>(first->weight), linear(5)})});
  const WrapPlan plan = plan_fsdp_units(ModuleTree::from_module(*model), always_wrap_policy());
  EXPECT_EQ(plan.total_numel, 95);
  EXPECT_THAT(unit_fqns(plan), ElementsAre("", "0", "1", "2", "2.0", "2.1"));
  // "0" wraps before "2.0", so it owns the shared weight; PyTorch's `_recursive_wrap` still
  // offers 2.0 its full 30 elements.
  EXPECT_THAT(unit_numels(plan), ElementsAre(0, 30, 30, 0, 5, 30));
  EXPECT_EQ(plan.units[4].remainder, 30);
}

TEST(PlanTest, SharedParameterInsideOneSubtreeCountsOnce) {
  auto first = torch::nn::Linear(5, 5);
  auto model = seq({seq({first.ptr(), std::make_shared<TiedLinear>(first->weight)})});
  std::vector<int64_t> offered;
  auto recording = [&](const ModuleNode& m, bool recurse, int64_t numel) {
    if (recurse && m.fqn == "0") offered.push_back(numel);
    return recurse;
  };
  plan_fsdp_units(ModuleTree::from_module(*model), recording);
  EXPECT_THAT(offered, ElementsAre(35));
}

TEST(PlanTest, IgnoredParametersAreNotCounted) {
  auto model = reference_model_n();
  const ModuleTree tree = ModuleTree::from_module(*model);
  WrapPlanOptions options;
  options.ignored_params().push_back(tree.node(tree.find("2.0")).params[0].key);  // 25
  const WrapPlan plan = plan_fsdp_units(tree, size_policy(40), options);
  EXPECT_EQ(plan.total_numel, 95);
  EXPECT_THAT(unit_fqns(plan), ElementsAre(""));  // "2" has 35 left
}

TEST(PlanTest, WrapOrderIsPostOrder) {
  auto model = reference_model_n();
  const WrapPlan plan = plan_fsdp_units(ModuleTree::from_module(*model), always_wrap_policy());
  std::vector<std::string> order;
  for (int k : plan.wrap_order) order.push_back(plan.units[k].fqn);
  EXPECT_THAT(order, ElementsAre("0", "1", "2.0", "2.1", "2", ""));
}

TEST(PlanTest, AlreadyWrappedModuleIsAnErrorNamingItsFqn) {
  auto wrapper = std::make_shared<torch::nn::Module>();
  wrapper->register_module("_fsdp_wrapped_module", linear(5));
  auto model = seq({linear(5), seq({wrapper})});
  const ModuleTree tree = ModuleTree::from_module(*model);
  EXPECT_THAT([&] { plan_fsdp_units(tree, always_wrap_policy()); },
              ThrowsMessage<c10::Error>(HasSubstr("module '1.0' (torch::nn::Module) is "
                                                  "already an FSDP unit")));
  // Ignoring it (or its parent) is allowed.
  EXPECT_NO_THROW(plan_fsdp_units(tree, always_wrap_policy(), ignoring(tree, {"1"})));
}

TEST(PlanTest, BadIgnoredIndexIsAnError) {
  auto model = reference_model_n();
  WrapPlanOptions options;
  options.ignored_modules().push_back(42);
  EXPECT_THAT([&] { plan_fsdp_units(ModuleTree::from_module(*model), nullptr, options); },
              ThrowsMessage<c10::Error>(HasSubstr("ignored module index 42")));
}

TEST(PolicyTest, SizePolicyDefaultsAndOverrides) {
  ModuleTree tree;
  tree.add_root("torch.nn.modules.activation.MultiheadAttention");
  tree.add_child(0, "list", "torch.nn.modules.container.ModuleList");
  const ModuleNode& mha = tree.node(0);
  const ModuleNode& list = tree.node(1);
  AutoWrapPolicy policy = size_policy(10);
  EXPECT_FALSE(policy(mha, /*recurse=*/true, 100));  // force leaf
  EXPECT_TRUE(policy(mha, /*recurse=*/false, 100));
  EXPECT_FALSE(policy(mha, /*recurse=*/false, 9));
  EXPECT_TRUE(policy(list, /*recurse=*/true, 100));
  EXPECT_FALSE(policy(list, /*recurse=*/false, 100));  // excluded
  policy = size_based_auto_wrap_policy(SizeBasedPolicyOptions()
                                           .min_num_params(10)
                                           .force_leaf_modules(std::vector<ModuleType>{})
                                           .exclude_wrap_modules(std::vector<ModuleType>{
                                               ModuleType::named("torch.nn.modules.activation."
                                                                 "MultiheadAttention")}));
  EXPECT_TRUE(policy(mha, /*recurse=*/true, 100));
  EXPECT_FALSE(policy(mha, /*recurse=*/false, 100));
  EXPECT_TRUE(policy(list, /*recurse=*/false, 100));
  // The default threshold is 1e8.
  EXPECT_FALSE(size_based_auto_wrap_policy()(list, /*recurse=*/true, 99999999));
  EXPECT_TRUE(size_based_auto_wrap_policy()(list, /*recurse=*/true, 100000000));
  EXPECT_THAT([] { size_policy(-1); },
              ThrowsMessage<c10::Error>(HasSubstr("min_num_params must be >= 0, got -1")));
}

struct MyAttention : torch::nn::MultiheadAttentionImpl {
  MyAttention() : torch::nn::MultiheadAttentionImpl(8, 2) {}
};

TEST(PolicyTest, CppTypesMatchSubclassesAndTheirPythonNames) {
  auto model = seq({std::make_shared<MyAttention>()});
  const ModuleTree tree = ModuleTree::from_module(*model);
  const ModuleType mha = ModuleType::of<torch::nn::MultiheadAttentionImpl>();
  EXPECT_EQ(mha.class_path(), "torch.nn.modules.activation.MultiheadAttention");
  EXPECT_TRUE(mha.matches(tree.node(1)));  // subclass, via dynamic_cast
  EXPECT_FALSE(mha.matches(tree.node(0)));
  ModuleTree scripted;
  scripted.add_root("torch.nn.modules.activation.MultiheadAttention");
  EXPECT_TRUE(mha.matches(scripted.node(0)));  // by name
}

}  // namespace
}  // namespace fsdp
