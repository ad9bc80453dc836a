#include "fsdp/wrap/module_tree.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>

#include "tests/test_models.h"

namespace fsdp {
namespace {

using ::fsdp::testing::linear;
using ::fsdp::testing::seq;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ModuleTreeTest, SnapshotOfCppModuleIsPreOrderWithPythonTypeNames) {
  auto model = seq({linear(5), seq({linear(2), torch::nn::ReLU().ptr()})});
  ModuleTree tree = ModuleTree::from_module(*model);
  ASSERT_EQ(tree.size(), 5);
  std::vector<std::string> fqns;
  for (const ModuleNode& node : tree.nodes()) fqns.push_back(node.fqn);
  EXPECT_THAT(fqns, ElementsAre("", "0", "1", "1.0", "1.1"));
  EXPECT_EQ(tree.node(0).type_name, "torch::nn::Module");
  EXPECT_EQ(tree.node(1).type_name, "torch.nn.modules.linear.Linear");
  EXPECT_EQ(tree.node(4).type_name, "torch.nn.modules.activation.ReLU");
  EXPECT_EQ(tree.node(3).parent, 2);
  EXPECT_EQ(tree.node(3).depth, 2);
  EXPECT_THAT(tree.node(2).children, ElementsAre(3, 4));
  ASSERT_EQ(tree.node(1).params.size(), 2u);
  EXPECT_EQ(tree.node(1).params[0].name, "weight");
  EXPECT_EQ(tree.node(1).params[0].numel, 25);
  EXPECT_EQ(tree.node(1).cpp_module, model->named_children()["0"].get());
  EXPECT_EQ(tree.find("1.1"), 4);
  EXPECT_EQ(tree.find("9"), -1);
}

TEST(ModuleTreeTest, RecognisesFsdpWrappers) {
  auto wrapper = std::make_shared<torch::nn::Module>();
  wrapper->register_module("_fsdp_wrapped_module", linear(1));
  ModuleTree tree = ModuleTree::from_module(*seq({wrapper, linear(1)}));
  EXPECT_FALSE(tree.node(0).is_fsdp_wrapper);
  EXPECT_TRUE(tree.node(1).is_fsdp_wrapper);
  EXPECT_FALSE(tree.node(2).is_fsdp_wrapper);
}

TEST(ModuleTreeTest, ManualBuildingMustBePreOrder) {
  ModuleTree tree;
  const int root = tree.add_root("Root");
  const int a = tree.add_child(root, "a", "A");
  tree.add_child(a, "x", "X");
  const int b = tree.add_child(root, "b", "B");
  EXPECT_EQ(tree.node(b).fqn, "b");
  EXPECT_EQ(tree.node(2).fqn, "a.x");
  // `a` is no longer on the path to the last added node.
  EXPECT_THAT([&] { tree.add_child(a, "late", "L"); },
              ::testing::ThrowsMessage<c10::Error>(HasSubstr("pre-order")));
  EXPECT_THROW(tree.add_root("Again"), c10::Error);
}

TEST(TypeNameTest, CppFrontendTypesMapToPythonPaths) {
  EXPECT_EQ(python_class_path_for_cpp("torch::nn::MultiheadAttentionImpl"),
            "torch.nn.modules.activation.MultiheadAttention");
  EXPECT_EQ(python_class_path_for_cpp("torch::nn::ModuleListImpl"),
            "torch.nn.modules.container.ModuleList");
  EXPECT_EQ(python_class_path_for_cpp("torch::nn::BatchNorm2dImpl"),
            "torch.nn.modules.batchnorm.BatchNorm2d");
  EXPECT_EQ(python_class_path_for_cpp("my::BlockImpl"), "my::BlockImpl");
  EXPECT_EQ(python_class_path_for_cpp("torch::nn::NotAModuleImpl"), "torch::nn::NotAModuleImpl");
}

TEST(TypeNameTest, TorchScriptNamesAreNormalised) {
  EXPECT_EQ(normalize_torchscript_type_name(
                "__torch__.torch.nn.modules.container.___torch_mangle_3.ModuleList"),
            "torch.nn.modules.container.ModuleList");
  EXPECT_EQ(
      normalize_torchscript_type_name("__torch__.torch.nn.modules.activation.MultiheadAttention"),
      "torch.nn.modules.activation.MultiheadAttention");
  EXPECT_EQ(normalize_torchscript_type_name("__torch__.___torch_mangle_12.Net"), "__main__.Net");
  EXPECT_EQ(normalize_torchscript_type_name("__torch__.torchvision.models.resnet.ResNet"),
            "torchvision.models.resnet.ResNet");
}

TEST(TypeNameTest, KnownTorchClassPaths) {
  EXPECT_TRUE(is_known_torch_class_path("torch.nn.modules.transformer.TransformerEncoderLayer"));
  EXPECT_FALSE(is_known_torch_class_path("torch.nn.modules.linear.Linearr"));
  EXPECT_FALSE(is_known_torch_class_path("torch.nn.modules.conv.Linear"));
  EXPECT_FALSE(is_known_torch_class_path("Linear"));
}

}  // namespace
}  // namespace fsdp
