// Wrap planning time on synthetic trees of 1k, 10k and 100k modules, wide and deep:
// time per module must stay flat as the tree grows. After the Google Benchmark runs, the
// same trees are planned by PyTorch's own `_recursive_wrap` (the pinned torch 2.11's
// torch.distributed.fsdp.wrap's semantics; torch_plan_timing.py)
// and the ratio is printed.
//
//   bazel run -c opt //fsdp/wrap:plan_benchmark
//
// Shapes (identical in torch_plan_timing.py): wide = root -> N/10 blocks -> 9 leaves;
// deep = root -> N/200 chains of 100 nested nodes, each node with one leaf. Every leaf
// holds a 4- and a 2-element parameter. Policy: size-based, min_num_params = 50.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <benchmark/benchmark.h>

#include "fsdp/wrap/module_tree.h"
#include "fsdp/wrap/plan.h"
#include "fsdp/wrap/policy.h"

namespace fsdp {
namespace {

constexpr int64_t kMinNumParams = 50;

void add_leaf(ModuleTree& tree, int parent, const std::string& name, uintptr_t* next_key) {
  const int leaf = tree.add_child(parent, name, "Leaf");
  tree.add_param(leaf, "weight", reinterpret_cast<const void*>((*next_key)++), 4);
  tree.add_param(leaf, "bias", reinterpret_cast<const void*>((*next_key)++), 2);
}

ModuleTree synthetic_tree(bool deep, int64_t modules) {
  ModuleTree tree;
  uintptr_t next_key = 1;
  tree.add_root("Root");
  if (!deep) {
    for (int64_t b = 0; b < modules / 10; ++b) {
      const int block = tree.add_child(0, absl::StrCat(b), "Block");
      for (int i = 0; i < 9; ++i) add_leaf(tree, block, absl::StrCat(i), &next_key);
    }
    return tree;
  }
  for (int64_t c = 0; c < modules / 200; ++c) {
    int node = tree.add_child(0, absl::StrCat(c), "Node");
    for (int depth = 0; depth < 100; ++depth) {
      add_leaf(tree, node, "leaf", &next_key);
      if (depth < 99) node = tree.add_child(node, "next", "Node");
    }
  }
  return tree;
}

AutoWrapPolicy benchmark_policy() {
  return size_based_auto_wrap_policy(SizeBasedPolicyOptions().min_num_params(kMinNumParams));
}

void run_plan(benchmark::State& state, bool deep) {
  const ModuleTree tree = synthetic_tree(deep, state.range(0));
  const AutoWrapPolicy policy = benchmark_policy();
  size_t units = 0;
  for (auto _ : state) {
    WrapPlan plan = plan_fsdp_units(tree, policy);
    units = plan.units.size();
    benchmark::DoNotOptimize(plan);
  }
  state.counters["modules"] = tree.size();
  state.counters["units"] = static_cast<double>(units);
  state.counters["time_per_module"] = benchmark::Counter(
      tree.size(), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_PlanWide(benchmark::State& state) { run_plan(state, /*deep=*/false); }
void BM_PlanDeep(benchmark::State& state) { run_plan(state, /*deep=*/true); }
BENCHMARK(BM_PlanWide)
    ->Arg(1000)
    ->Arg(10000)
    ->Arg(30000)
    ->Arg(100000)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PlanDeep)->Arg(1000)->Arg(10000)->Arg(100000)->Unit(benchmark::kMicrosecond);

// Median wall time of `repeats` plans of the tree, in seconds.
double median_plan_seconds(const ModuleTree& tree, int repeats) {
  const AutoWrapPolicy policy = benchmark_policy();
  std::vector<double> seconds;
  for (int r = 0; r < repeats; ++r) {
    const absl::Time start = absl::Now();
    WrapPlan plan = plan_fsdp_units(tree, policy);
    benchmark::DoNotOptimize(plan);
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

// The pinned environment's Python, in the runfiles of `bazel run` (bazel/libtorch.bzl).
constexpr char kPython[] = "../libtorch/bin/python3";

// Runs torch_plan_timing.py; returns its median seconds, or -1 with a message.
double seed_seconds(const std::string& script, bool deep, int64_t modules, int repeats) {
  const std::string command =
      absl::StrFormat("%s %s --shape %s --modules %d --min_num_params %d --repeats %d", kPython,
                      script, deep ? "deep" : "wide", modules, kMinNumParams, repeats);
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  double seconds = -1;
  if (pipe == nullptr || std::fscanf(pipe.get(), "%lf", &seconds) != 1) {
    std::fprintf(stderr, "seed timing failed: %s\n", command.c_str());
    return -1;
  }
  // Read the rest of the line too: closing the pipe early would fail the script's
  // print (BrokenPipeError) when its output is unbuffered (PYTHONUNBUFFERED).
  while (std::fgetc(pipe.get()) != EOF) {
  }
  return seconds;
}

void compare_with_seed(const std::string& script) {
  std::printf("\nPyTorch's _recursive_wrap (Python) vs plan_fsdp_units (C++), same trees:\n");
  std::printf("%-6s %8s %14s %14s %10s %16s\n", "shape", "modules", "seed_s", "ours_s", "ratio",
              "ours_ns_per_mod");
  for (bool deep : {false, true}) {
    for (int64_t modules : {1000, 10000, 100000}) {
      const ModuleTree tree = synthetic_tree(deep, modules);
      const int repeats = modules <= 1000 ? 5 : 1;
      const double seed = seed_seconds(script, deep, modules, repeats);
      const double ours = median_plan_seconds(tree, 5);
      std::printf("%-6s %8d %14.6f %14.6f %10.1f %16.1f\n", deep ? "deep" : "wide", tree.size(),
                  seed, ours, seed > 0 ? seed / ours : 0.0, ours * 1e9 / tree.size());
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  // Under `bazel run` the runfiles tree holds the script; FSDP_SKIP_SEED=1 skips this.
  if (std::getenv("FSDP_SKIP_SEED") == nullptr) {
    fsdp::compare_with_seed("fsdp/wrap/torch_plan_timing.py");
  }
  return 0;
}
