// TorchScript archives read as data give the tree torch::jit::load's module gives (nested
// containers, a parameter shared by two modules, a None parameter, buffers and plain
// attributes left out), run none of the archive's code, and refuse damaged records by name.
// tests/plan_oracle_test.sh compares plans of real architectures with PyTorch's.
#include "fsdp/wrap/torchscript_tree.h"

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "fsdp/formats/testing/python_testing.h"

namespace fsdp {
namespace {

using formats_testing::run_python;
using formats_testing::scratch_path;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

// One line per node: "fqn type param:numel:slot ...".
std::vector<std::string> describe(const ModuleTree& tree) {
  std::vector<std::string> lines;
  for (const ModuleNode& node : tree.nodes()) {
    std::string line = absl::StrCat(node.fqn, " ", node.type_name);
    for (const ParamEntry& param : node.params) {
      absl::StrAppend(&line, " ", param.name, ":", param.numel, ":", param.slot);
    }
    lines.push_back(line);
  }
  return lines;
}

// Made once by the pinned environment's Python (one interpreter start for all tests):
// net.pt: Net, a Linear(3, 4); a Linear(3, 4, bias=False) whose weight is the first's; a
//   Sequential of a Linear(4, 4) and a ReLU; a ModuleList of a LayerNorm; a buffer and an
//   int attribute;
// evil.pt: a module whose __setstate__ writes the file setstate_ran;
// short.pt: net.pt with its storage record data/1 4 bytes short;
// function.pt: a scripted function.
class TorchScriptTreeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = std::filesystem::path(scratch_path("x")).parent_path().string();
    formats_testing::write_bytes(scratch_path("torchscript_models.py"), absl::StrCat(R"(
import torch
from torch import nn
from typing import Tuple
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(3, 4, bias=False)
        self.b.weight = self.a.weight
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.register_buffer("buf", torch.zeros(2))
        self.lst = nn.ModuleList([nn.LayerNorm(4)])
        self.count = 7
    def forward(self, x):
        return self.seq(self.a(x) + self.b(x)) + self.lst[0](self.a(x)) + self.count
class Evil(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
    def forward(self, x):
        return self.lin(x)
    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, bool]:
        return (self.lin.weight, self.training)
    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, bool]) -> None:
        torch.save(state[0], ")",
                                                                                     marker(), R"(")
        self.training = state[1]
)"));
    run_python(absl::StrCat("import sys, zipfile, torch\nsys.path.insert(0, '", dir, R"(')
import torchscript_models as m
dir = sys.path[0]
torch.jit.script(m.Net()).save(dir + '/net.pt')
torch.jit.script(m.Evil()).save(dir + '/evil.pt')
with zipfile.ZipFile(dir + '/net.pt') as z:
    records = {i.filename: z.read(i.filename) for i in z.infolist()}
with zipfile.ZipFile(dir + '/short.pt', 'w') as z:
    for name, data in records.items():
        z.writestr(name, data[:-4] if name == 'net/data/1' else data)
def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x
torch.jit.save(torch.jit.script(double), dir + '/function.pt')
)"));
  }
  static std::string marker() { return scratch_path("setstate_ran"); }
};

TEST_F(TorchScriptTreeTest, DataReaderGivesTheTreeTorchJitLoadGives) {
  const std::string path = scratch_path("net.pt");
  const ModuleTree tree = load_torchscript_tree(path);
  EXPECT_THAT(describe(tree),
              ElementsAre(" torchscript_models.Net",  // the root: an empty FQN
                          "a torch.nn.modules.linear.Linear weight:12:0 bias:4:1",
                          "b torch.nn.modules.linear.Linear weight:12:0",
                          "seq torch.nn.modules.container.Sequential",
                          "seq.0 torch.nn.modules.linear.Linear weight:16:2 bias:4:3",
                          "seq.1 torch.nn.modules.activation.ReLU",
                          "lst torch.nn.modules.container.ModuleList",
                          "lst.0 torch.nn.modules.normalization.LayerNorm weight:4:4 bias:4:5"));
  EXPECT_EQ(tree.num_param_slots(), 6);
  EXPECT_EQ(describe(load_torchscript_tree_trusted(path)), describe(tree));
}

TEST_F(TorchScriptTreeTest, SetstateIsRefusedAndNeverRun) {
  EXPECT_THAT(error_of([&] { load_torchscript_tree(scratch_path("evil.pt")); }),
              HasSubstr("evil.pt': module class torchscript_models.Evil restores its attributes "
                        "with its own __setstate__, code the archive carries; fsdp reads "
                        "TorchScript archives as data and never runs their code; if you trust "
                        "the file, --trust_torchscript"));
  EXPECT_FALSE(std::filesystem::exists(marker()));
}

TEST_F(TorchScriptTreeTest, DamagedRecordsAreNamed) {
  EXPECT_THAT(error_of([&] { load_torchscript_tree(scratch_path("short.pt")); }),
              HasSubstr("short.pt': record data/1 holds 44 bytes, not the 48 of 12 elements of "
                        "Float"));
  EXPECT_THAT(error_of([&] { load_torchscript_tree(scratch_path("function.pt")); }),
              HasSubstr("function.pt' holds a scripted function, not a module"));
  EXPECT_THAT(error_of([&] { load_torchscript_tree(scratch_path("absent.pt")); }),
              HasSubstr("cannot open TorchScript archive '" + scratch_path("absent.pt") +
                        "': No such file or directory"));
}

}  // namespace
}  // namespace fsdp
