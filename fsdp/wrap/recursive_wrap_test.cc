#include "fsdp/wrap/recursive_wrap.h"

#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/base/names.h"
#include "fsdp/wrap/wrap_context.h"
#include "tests/test_models.h"

namespace fsdp {
namespace {

using ::fsdp::testing::linear;
using ::fsdp::testing::reference_model_n;
using ::fsdp::testing::seq;
using ::fsdp::testing::submodule;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// A stand-in unit wrapper: holds the module as "_fsdp_wrapped_module" and remembers the
// options it was made with.
struct TestUnit : torch::nn::Module {
  TestUnit(std::shared_ptr<torch::nn::Module> module, int tag) : tag(tag) {
    register_module(std::string(kFsdpWrappedModule), std::move(module));
  }
  int tag;
};

int tag_of(const std::shared_ptr<torch::nn::Module>& module) {
  auto* unit = dynamic_cast<TestUnit*>(module.get());
  return unit == nullptr ? -1 : unit->tag;
}

std::shared_ptr<torch::nn::Module> make_unit(std::shared_ptr<torch::nn::Module> module) {
  return std::make_shared<TestUnit>(std::move(module), 0);
}

// Cleaned FQNs of the TestUnits in `root` (pre-order); "" for the root itself.
std::vector<std::string> unit_fqns(const std::shared_ptr<torch::nn::Module>& root) {
  std::vector<std::string> fqns;
  for (const auto& item : root->named_modules()) {
    if (dynamic_cast<const TestUnit*>(item.value().get()) != nullptr) {
      fqns.push_back(clean_tensor_name(item.key() + "."));
    }
  }
  for (std::string& fqn : fqns) {
    if (!fqn.empty()) fqn.pop_back();  // the "." added to clean the last segment
  }
  return fqns;
}

TEST(RecursiveWrapTest, AlwaysPolicyReplacesEveryChild) {
  auto model = reference_model_n();
  std::vector<std::string> order;
  auto factory = [&](std::shared_ptr<torch::nn::Module> m) {
    order.push_back(std::to_string(m->parameters().size()));
    return make_unit(m);
  };
  RecursiveWrapResult result = recursive_wrap(model, always_wrap_policy(), factory,
                                              RecursiveWrapOptions().only_wrap_children(true));
  EXPECT_EQ(result.module, model);
  EXPECT_EQ(result.wrapped_numel, 120);
  EXPECT_THAT(result.wrapped_fqns, ElementsAre("0", "1", "2", "2.0", "2.1"));
  EXPECT_THAT(unit_fqns(model), ElementsAre("0", "1", "2", "2.0", "2.1"));
  // Children first: "2" is made after "2.0" and "2.1" and receives them wrapped.
  EXPECT_THAT(order, ElementsAre("2", "2", "2", "2", "4"));
  // Parameter names are those of the unwrapped model once cleaned.
  std::vector<std::string> names;
  for (const auto& item : model->named_parameters()) names.push_back(clean_tensor_name(item.key()));
  EXPECT_THAT(names, ElementsAre("0.weight", "0.bias", "1.weight", "1.bias", "2.0.weight",
                                 "2.0.bias", "2.1.weight", "2.1.bias"));
}

TEST(RecursiveWrapTest, RootIsWrappedWhenAllowed) {
  auto model = reference_model_n();
  RecursiveWrapResult result = recursive_wrap(
      model, size_based_auto_wrap_policy(SizeBasedPolicyOptions().min_num_params(40)), make_unit);
  ASSERT_NE(dynamic_cast<TestUnit*>(result.module.get()), nullptr);
  EXPECT_EQ(result.module->named_children()[std::string(kFsdpWrappedModule)], model);
  EXPECT_THAT(unit_fqns(result.module), ElementsAre("", "2"));
  EXPECT_EQ(result.wrapped_numel, 120);
}

TEST(RecursiveWrapTest, IgnoredModulesAndParametersAreLeftAlone) {
  auto model = reference_model_n();
  RecursiveWrapOptions options;
  options.ignored_modules({submodule(model, "1").get(), submodule(model, "2.0").get()})
      .only_wrap_children(true);
  recursive_wrap(model, always_wrap_policy(), make_unit, options);
  EXPECT_THAT(unit_fqns(model), ElementsAre("0", "2", "2.1"));

  auto other = reference_model_n();
  RecursiveWrapOptions by_param;
  by_param.ignored_params({submodule(other, "2.0")->named_parameters()["weight"]});
  RecursiveWrapResult result = recursive_wrap(
      other, size_based_auto_wrap_policy(SizeBasedPolicyOptions().min_num_params(40)), make_unit,
      by_param.only_wrap_children(true));
  EXPECT_TRUE(unit_fqns(other).empty());
  EXPECT_EQ(result.wrapped_numel, 0);
}

TEST(RecursiveWrapTest, CustomReplaceChildIsUsed) {
  auto model = reference_model_n();
  std::vector<std::string> replaced;
  RecursiveWrapOptions options;
  options.only_wrap_children(true).replace_child([&](torch::nn::Module& parent,
                                                     const ModuleNode& child,
                                                     std::shared_ptr<torch::nn::Module> wrapped) {
    replaced.push_back(child.fqn);
    replace_registered_child(parent, child, std::move(wrapped));
  });
  recursive_wrap(model, always_wrap_policy(), make_unit, options);
  EXPECT_THAT(replaced, ElementsAre("0", "1", "2.0", "2.1", "2"));
}

// A wrapper that stays inert until activated (as an unbound fsdp::Unit): the policy sees
// through it, the factory receives the wrapper, and FQNs leave it out.
TEST(RecursiveWrapTest, UnwrapSeesThroughInertWrappers) {
  auto inner = linear(6);
  auto model = seq({std::make_shared<TestUnit>(inner, 3), linear(2)});
  std::vector<std::shared_ptr<torch::nn::Module>> offered;
  std::vector<std::string> replaced;
  RecursiveWrapOptions options;
  options.only_wrap_children(true)
      .unwrap([](const torch::nn::Module& m) -> const torch::nn::Module* {
        auto* unit = dynamic_cast<const TestUnit*>(&m);
        return unit == nullptr ? nullptr : unit->children()[0].get();
      })
      .replace_child([&](torch::nn::Module&, const ModuleNode& child,
                         std::shared_ptr<torch::nn::Module>) { replaced.push_back(child.fqn); });
  RecursiveWrapResult result = recursive_wrap(
      model, size_based_auto_wrap_policy(SizeBasedPolicyOptions().min_num_params(40)),
      [&](std::shared_ptr<torch::nn::Module> m) {
        offered.push_back(m);
        return m;
      },
      options);
  // linear(6) has 6 x 6 + 6 = 42 parameters, linear(2) has 6: only the first is wrapped.
  EXPECT_THAT(result.wrapped_fqns, ElementsAre("0"));
  EXPECT_EQ(result.wrapped_numel, 42);
  ASSERT_EQ(offered.size(), 1u);
  EXPECT_EQ(tag_of(offered[0]), 3);  // the wrapper, not the module inside it
  EXPECT_THAT(replaced, ElementsAre("0"));
}

TEST(RecursiveWrapTest, ErrorsAreClear) {
  auto model = reference_model_n();
  recursive_wrap(model, always_wrap_policy(), make_unit,
                 RecursiveWrapOptions().only_wrap_children(true));
  // Wrapping twice: the first unit met is named.
  EXPECT_THAT([&] { recursive_wrap(model, always_wrap_policy(), make_unit); },
              ThrowsMessage<c10::Error>(HasSubstr("module '0' (")));
  auto fresh = reference_model_n();
  EXPECT_THAT([&] { recursive_wrap(fresh, nullptr, make_unit); },
              ThrowsMessage<c10::Error>(HasSubstr("auto_wrap_policy is empty")));
  EXPECT_THAT([&] { recursive_wrap(fresh, always_wrap_policy(), nullptr); },
              ThrowsMessage<c10::Error>(HasSubstr("wrapper_factory is empty")));
  auto null_factory = [](std::shared_ptr<torch::nn::Module>) {
    return std::shared_ptr<torch::nn::Module>();
  };
  EXPECT_THAT([&] { recursive_wrap(fresh, always_wrap_policy(), null_factory); },
              ThrowsMessage<c10::Error>(HasSubstr("returned null for '0'")));
}

struct Config {
  int tag = 1;
};

TEST(WrapScopeTest, ActiveOnlyWhileTheScopeLives) {
  EXPECT_EQ(WrapScope<Config>::active(), nullptr);
  {
    WrapScope<Config> scope(Config{7});
    ASSERT_EQ(WrapScope<Config>::active(), &scope);
    EXPECT_EQ(WrapScope<Config>::active()->config().tag, 7);
  }
  EXPECT_EQ(WrapScope<Config>::active(), nullptr);
}

TEST(WrapScopeTest, NestedScopesAreAnError) {
  WrapScope<Config> outer(Config{});
  EXPECT_THAT([] { WrapScope<Config> inner(Config{}); },
              ThrowsMessage<c10::Error>(HasSubstr("nested wrap scopes are not supported")));
  EXPECT_THAT([] { WrapScope<int> inner(0); },
              ThrowsMessage<c10::Error>(HasSubstr("nested wrap scopes are not supported")));
  EXPECT_EQ(WrapScope<Config>::active(), &outer);  // the failed inner scope left it alone
}

TEST(WrapScopeTest, ScopesArePerThreadAndTyped) {
  WrapScope<Config> scope(Config{});
  WrapScope<Config>* from_thread = &scope;
  std::thread([&] { from_thread = WrapScope<Config>::active(); }).join();
  EXPECT_EQ(from_thread, nullptr);
  EXPECT_THAT([] { WrapScope<int>::active(); },
              ThrowsMessage<c10::Error>(HasSubstr("configuration of another type")));
}

}  // namespace
}  // namespace fsdp
