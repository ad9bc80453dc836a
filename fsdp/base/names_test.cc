#include "fsdp/base/names.h"

#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include "tests/test_models.h"

namespace fsdp {
namespace {

using ::fsdp::testing::linear;
using ::fsdp::testing::seq;
using ::fsdp::testing::TiedLinear;
using ::testing::ElementsAre;
using ::testing::UnorderedElementsAre;

TEST(CleanTensorNameTest, RemovesWrapperPrefixesAtAnyDepth) {
  EXPECT_EQ(clean_tensor_name("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module."
                              "_checkpoint_wrapped_module.attn.weight"),
            "layers.0.attn.weight");
  EXPECT_EQ(clean_tensor_name("0.weight"), "0.weight");
  EXPECT_EQ(clean_tensor_name(""), "");
  // Only whole prefixes go: a name that merely contains the word stays.
  EXPECT_EQ(clean_tensor_name("my_fsdp_wrapped_module"), "my_fsdp_wrapped_module");
}

struct TwoLinears : torch::nn::Module {
  TwoLinears() {
    a = register_module("a", torch::nn::Linear(3, 3));
    b = register_module("b", std::make_shared<TiedLinear>(a->weight));
  }
  torch::nn::Linear a{nullptr};
  std::shared_ptr<TiedLinear> b;
};

TEST(ParamToFqnsTest, SharedParameterKeepsFirstFqnWhenDeduplicated) {
  TwoLinears model;
  std::vector<ParamKey> order;
  auto dedup = param_to_fqns(model, /*dedup_shared_params=*/true, &order);
  ASSERT_EQ(order.size(), 3u);  // a.weight, a.bias, b.bias
  EXPECT_THAT(dedup.at(param_key(model.a->weight)), ElementsAre("a.weight"));
  EXPECT_THAT(dedup.at(param_key(model.a->bias)), ElementsAre("a.bias"));
  EXPECT_THAT(dedup.at(param_key(model.b->bias)), ElementsAre("b.bias"));
  EXPECT_EQ(order[0], param_key(model.a->weight));

  auto all = param_to_fqns(model, /*dedup_shared_params=*/false);
  EXPECT_THAT(all.at(param_key(model.a->weight)), ElementsAre("a.weight", "b.weight"));
}

TEST(ApplyToModulesTest, PreOrderWithPrefixes) {
  auto outer = seq({linear(1), seq({linear(1), linear(1)})});
  std::vector<std::string> seen;
  apply_to_modules(*outer, [&](const torch::nn::Module&, const std::string& prefix, int depth) {
    seen.push_back(prefix + "@" + std::to_string(depth));
  });
  EXPECT_THAT(seen, ElementsAre("@0", "0.@1", "1.@1", "1.0.@2", "1.1.@2"));
}

// The mutable overload visits the same modules in the same order, and a visitor may
// change what it visits, its children included (they are read after the visit).
TEST(ApplyToModulesTest, MutableTraversalMayChangeWhatItVisits) {
  auto outer = seq({linear(1), seq({linear(1), linear(1)})});
  std::vector<std::string> seen;
  apply_to_modules(*outer, [&](torch::nn::Module& module, const std::string& prefix, int depth) {
    seen.push_back(prefix + "@" + std::to_string(depth));
    if (prefix == "1.") module.register_module("2", linear(1));
    module.register_buffer("visits", at::ones({1}));
  });
  EXPECT_THAT(seen, ElementsAre("@0", "0.@1", "1.@1", "1.0.@2", "1.1.@2", "1.2.@2"));
  EXPECT_EQ(outer->named_buffers().size(), 6u);
}

TEST(ApplyToModulesTest, FqnsOfWrappedModelEqualUnwrapped) {
  // A wrapper-shaped tree: the prefixes disappear once cleaned.
  auto wrapper = std::make_shared<torch::nn::Module>();
  wrapper->register_module("_fsdp_wrapped_module", torch::nn::Linear(2, 2));
  auto model = seq({wrapper, linear(2)});
  std::vector<std::string> names;
  for (const auto& [key, fqns] : param_to_fqns(*model)) names.push_back(fqns[0]);
  EXPECT_THAT(names, UnorderedElementsAre("0.weight", "0.bias", "1.weight", "1.bias"));
}

TEST(GetRootModulesTest, KeepsOnlyModulesNotInsideAnother) {
  auto inner = seq({linear(1)});
  auto outer = seq({inner, linear(1)});
  auto separate = linear(1);
  const torch::nn::Module* leaf = outer->named_children()["1"].get();
  auto roots = get_root_modules({outer.get(), inner.get(), leaf, separate.get()});
  EXPECT_THAT(roots, UnorderedElementsAre(outer.get(), separate.get()));
  EXPECT_TRUE(get_root_modules({}).empty());
}

}  // namespace
}  // namespace fsdp
