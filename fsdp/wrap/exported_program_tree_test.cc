// ModuleTree from a .pt2 archive's contents: pre-order, classes ("unknown" where the graph
// never called a module), tied parameters on one key, and the wrap plans PyTorch's
// _recursive_wrap makes of the same Python model (tests/plan_oracle_test.sh compares real
// exports).
#include "fsdp/wrap/exported_program_tree.h"

#include <utility>

#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/wrap/plan.h"
#include "fsdp/wrap/policy.h"

namespace fsdp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ExportedTensorInfo tensor(std::string fqn, std::vector<int64_t> sizes, std::string file,
                          bool requires_grad = true) {
  ExportedTensorInfo t;
  t.fqn = std::move(fqn);
  t.sizes = std::move(sizes);
  t.weight_file = std::move(file);
  t.requires_grad = requires_grad;
  return t;
}

// class LM(nn.Module):  # as torch.export.save would record it
//   tok = Embedding(100, 8); blocks = ModuleList([Linear(8, 8), Linear(8, 8)])
//   head = Linear(8, 100, bias=False), head.weight = tok.weight; unused = Linear(2, 2)
// blocks and unused are never called: no class.
ExportedProgramInfo lm_info() {
  ExportedProgramInfo info;
  info.modules = {{"", "__main__.LM"},
                  {"tok", "torch.nn.modules.sparse.Embedding"},
                  {"blocks", ""},
                  {"blocks.0", "torch.nn.modules.linear.Linear"},
                  {"blocks.1", "torch.nn.modules.linear.Linear"},
                  {"head", "torch.nn.modules.linear.Linear"},
                  {"unused", ""}};
  info.parameters = {tensor("tok.weight", {100, 8}, "weight_0"),
                     tensor("blocks.0.weight", {8, 8}, "weight_1"),
                     tensor("blocks.0.bias", {8}, "weight_2", /*requires_grad=*/false),
                     tensor("blocks.1.weight", {8, 8}, "weight_3"),
                     tensor("blocks.1.bias", {8}, "weight_4"),
                     tensor("head.weight", {100, 8}, "weight_0"),
                     tensor("unused.weight", {2, 2}, "weight_5"),
                     tensor("unused.bias", {2}, "weight_6")};
  info.parameters[5].tied_to = "tok.weight";
  return info;
}

std::vector<std::string> unit_fqns(const WrapPlan& plan) {
  std::vector<std::string> out;
  for (const PlannedUnit& unit : plan.units)
    out.push_back(unit.fqn + ":" + std::to_string(unit.numel));
  return out;
}

TEST(ExportedProgramTreeTest, BuildsPreOrderTreeWithUnknownClassesAndTies) {
  ExportedProgramTree exported = module_tree_from_exported_program(lm_info());
  const ModuleTree& tree = exported.tree;
  std::vector<std::string> nodes;
  for (const ModuleNode& node : tree.nodes()) nodes.push_back(node.fqn + "=" + node.type_name);
  EXPECT_THAT(nodes, ElementsAre("=__main__.LM", "tok=torch.nn.modules.sparse.Embedding",
                                 "blocks=unknown", "blocks.0=torch.nn.modules.linear.Linear",
                                 "blocks.1=torch.nn.modules.linear.Linear",
                                 "head=torch.nn.modules.linear.Linear", "unused=unknown"));
  EXPECT_EQ(tree.node(2).name, "blocks");
  EXPECT_THAT(tree.node(2).children, ElementsAre(3, 4));
  // 7 distinct weights: head.weight is tok.weight.
  EXPECT_EQ(tree.num_param_slots(), 7);
  const ParamEntry& head = tree.node(5).params.at(0);
  EXPECT_EQ(head.name, "weight");
  EXPECT_EQ(head.key, tree.node(1).params.at(0).key);
  EXPECT_EQ(exported.parameter(head).fqn, "tok.weight");
  EXPECT_EQ(head.numel, 800);
  const ParamEntry& bias = tree.node(3).params.at(1);
  EXPECT_FALSE(exported.parameter(bias).requires_grad);  // frozen
  // Keys stay valid when the value moves.
  const ExportedProgramTree moved = std::move(exported);
  EXPECT_EQ(moved.parameter(moved.tree.node(5).params.at(0)).fqn, "tok.weight");
}

TEST(ExportedProgramTreeTest, UnknownContainerMatchesModuleListOnly) {
  const ExportedProgramTree exported = module_tree_from_exported_program(lm_info());
  const ModuleType list = ModuleType::named("torch.nn.modules.container.ModuleList");
  const ModuleType dict = ModuleType::named("torch.nn.modules.container.ModuleDict");
  const ModuleType linear = ModuleType::named("torch.nn.modules.linear.Linear");
  EXPECT_TRUE(list.matches(exported.tree.node(2)));  // blocks: children, no params
  EXPECT_TRUE(dict.matches(exported.tree.node(2)));
  EXPECT_FALSE(linear.matches(exported.tree.node(2)));
  EXPECT_FALSE(list.matches(exported.tree.node(6)));  // unused: its own parameters
  EXPECT_FALSE(list.matches(exported.tree.node(3)));
}

TEST(ExportedProgramTreeTest, PlansAsRecursiveWrapOnThePythonModel) {
  const ExportedProgramTree exported = module_tree_from_exported_program(lm_info());
  // PyTorch's _recursive_wrap on the Python LM gives these (checked with
  // tests/plan_oracle.py's plan()): blocks (a ModuleList) is never a unit under the size
  // policy, unused (a Linear) is; head's weight belongs to tok's unit.
  EXPECT_THAT(
      unit_fqns(plan_fsdp_units(
          exported.tree, size_based_auto_wrap_policy(SizeBasedPolicyOptions().min_num_params(6)))),
      ElementsAre(":0", "tok:800", "blocks.0:72", "blocks.1:72", "head:0", "unused:6"));
  EXPECT_THAT(
      unit_fqns(plan_fsdp_units(exported.tree, size_based_auto_wrap_policy(
                                                   SizeBasedPolicyOptions().min_num_params(100)))),
      ElementsAre(":150", "tok:800", "head:0"));
  EXPECT_THAT(
      unit_fqns(plan_fsdp_units(exported.tree, always_wrap_policy())),
      ElementsAre(":0", "tok:800", "blocks:0", "blocks.0:72", "blocks.1:72", "head:0", "unused:6"));
}

TEST(ExportedProgramTreeTest, MissingParentIsAnError) {
  ExportedProgramInfo info = lm_info();
  info.modules.erase(info.modules.begin() + 2);  // "blocks"
  try {
    module_tree_from_exported_program(std::move(info));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what_without_backtrace(),
                HasSubstr("'blocks.0' needs module 'blocks', which the module list lacks"));
  }
}

}  // namespace
}  // namespace fsdp
