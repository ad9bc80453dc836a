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

// Net: Linear(3, 4); Linear(3, 4, bias=False) whose weight is the first's; Sequential of
// a Linear(4, 4) and a ReLU; ModuleList of a LayerNorm; a buffer and an int attribute.
std::string write_net() {
  const std::string path = scratch_path("net.pt");
  const std::string module = scratch_path("torchscript_net.py");
  formats_testing::write_bytes(module, R"(
import torch
from torch import nn
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
)");
  run_python(absl::StrCat(
      "import sys, torch\nsys.path.insert(0, '",
      std::filesystem::path(module).parent_path().string(),
      "')\nimport torchscript_net\ntorch.jit.script(torchscript_net.Net()).save('", path, "')\n"));
  return path;
}

TEST(TorchScriptTreeTest, DataReaderGivesTheTreeTorchJitLoadGives) {
  const std::string path = write_net();
  const ModuleTree tree = load_torchscript_tree(path);
  EXPECT_THAT(describe(tree),
              ElementsAre(" torchscript_net.Net",  // the root: an empty FQN
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

TEST(TorchScriptTreeTest, SetstateIsRefusedAndNeverRun) {
  const std::string path = scratch_path("evil.pt");
  const std::string marker = scratch_path("setstate_ran");
  std::filesystem::remove(marker);
  formats_testing::write_bytes(scratch_path("torchscript_evil.py"), absl::StrCat(R"(
import torch
from typing import Tuple
class Evil(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
    def forward(self, x):
        return self.lin(x)
    @torch.jit.export
    def __getstate__(self) -> Tuple[torch.Tensor, bool]:
        return (self.lin.weight, self.training)
    @torch.jit.export
    def __setstate__(self, state: Tuple[torch.Tensor, bool]) -> None:
        torch.save(state[0], ")",
                                                                                 marker, R"(")
        self.training = state[1]
)"));
  run_python(absl::StrCat("import sys, torch\nsys.path.insert(0, '",
                          std::filesystem::path(path).parent_path().string(),
                          "')\nimport torchscript_evil\ntorch.jit.script(torchscript_evil.Evil())"
                          ".save('",
                          path, "')\n"));
  EXPECT_THAT(error_of([&] { load_torchscript_tree(path); }),
              HasSubstr("module class __torch__.Evil restores its attributes with its own "
                        "__setstate__, code the archive carries; fsdp reads TorchScript archives "
                        "as data and never runs their code; if you trust the file, "
                        "--trust_torchscript"));
  EXPECT_FALSE(std::filesystem::exists(marker));
}

TEST(TorchScriptTreeTest, DamagedRecordsAreNamed) {
  const std::string path = write_net();
  // A storage record cut short, and a scripted function instead of a module.
  run_python(absl::StrCat(R"(
import zipfile, torch
src = ')",
                          path, R"('
with zipfile.ZipFile(src) as z:
    records = {i.filename: z.read(i.filename) for i in z.infolist()}
with zipfile.ZipFile(src.replace('net.pt', 'short.pt'), 'w') as z:
    for name, data in records.items():
        z.writestr(name, data[:-4] if name == 'net/data/1' else data)
def double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x
torch.jit.save(torch.jit.script(double), src.replace('net.pt', 'function.pt'))
)"));
  EXPECT_THAT(error_of([&] { load_torchscript_tree(scratch_path("short.pt")); }),
              HasSubstr("record data/1 holds 44 bytes, not the 48 of 12 elements of Float"));
  EXPECT_THAT(error_of([&] { load_torchscript_tree(scratch_path("function.pt")); }),
              HasSubstr("holds a scripted function, not a module"));
  EXPECT_THAT(error_of([&] { load_torchscript_tree(scratch_path("absent.pt")); }),
              HasSubstr("not a regular file"));
}

}  // namespace
}  // namespace fsdp
