"""Times PyTorch's own `_recursive_wrap` on the synthetic trees of plan_benchmark.cc.

  torch_plan_timing.py --shape wide|deep --modules N --min_num_params P --repeats R

Prints one line: "<median seconds> <modules> <units>". The trees are built exactly as
plan_benchmark.cc builds its ModuleTrees (see synthetic_tree there); only the
`_recursive_wrap` call is timed, on a fresh copy of the tree each repeat.

  torch_plan_timing.py --exported OUT_DIR --oracle tests/plan_oracle.py --repeats R

exports every model of plan_oracle.py with torch.export to OUT_DIR/NAME.pt2 and prints a
line "<name> <path> <modules> <plan seconds> <load seconds>" for each: the median time of
plan_oracle.py's plan() (FSDP's auto-wrap: `_recursive_wrap`, then the root, and each
unit's parameters) with the size policy at --min_num_params on the Python model, and of
torch.export.load on the archive, for plan_benchmark.cc to set beside fsdp's.
"""

import argparse
import copy
import functools
import importlib.util
import os
import statistics
import time

import torch.nn as nn
import torch

import torch.distributed.fsdp.wrap as torch_wrap


def leaf() -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.empty(4))
    m.bias = nn.Parameter(torch.empty(2))
    return m


def wide(modules: int) -> nn.Module:
    """Root -> modules/10 blocks -> 9 leaves each."""
    root = nn.Module()
    for b in range(modules // 10):
        block = nn.Module()
        for i in range(9):
            block.add_module(str(i), leaf())
        root.add_module(str(b), block)
    return root


def deep(modules: int) -> nn.Module:
    """Root -> modules/200 chains of 100 nested nodes, each node with one leaf."""
    root = nn.Module()
    for c in range(modules // 200):
        head = nn.Module()
        node = head
        for depth in range(100):
            node.add_module("leaf", leaf())
            if depth < 99:
                nxt = nn.Module()
                node.add_module("next", nxt)
                node = nxt
        root.add_module(str(c), head)
    return root


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_exported(out_dir: str, oracle_path: str, min_num_params: int, repeats: int) -> None:
    spec = importlib.util.spec_from_file_location("plan_oracle", oracle_path)
    oracle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oracle)
    os.makedirs(out_dir, exist_ok=True)
    policy = functools.partial(torch_wrap.size_based_auto_wrap_policy,
                               min_num_params=min_num_params)
    for name in oracle.MODELS:
        model = oracle.build_model(name)
        path = os.path.join(out_dir, name + ".pt2")
        oracle.export(model, oracle.example_inputs(name), path)
        copies = [copy.deepcopy(model) for _ in range(repeats)]
        plan_s = median_seconds(lambda: oracle.plan(copies.pop(), policy, 1), repeats)
        load_s = median_seconds(lambda: torch.export.load(path), repeats)
        print(name, path, sum(1 for _ in model.modules()), plan_s, load_s, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=["wide", "deep"])
    parser.add_argument("--modules", type=int)
    parser.add_argument("--min_num_params", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exported", help="export plan_oracle.py's models here and time them")
    parser.add_argument("--oracle", help="path of tests/plan_oracle.py (with --exported)")
    args = parser.parse_args()
    if args.exported:
        time_exported(args.exported, args.oracle, args.min_num_params, args.repeats)
        return
    if args.shape is None or args.modules is None:
        parser.error("--shape and --modules are required without --exported")

    policy = functools.partial(torch_wrap.size_based_auto_wrap_policy,
                               min_num_params=args.min_num_params)
    model = (wide if args.shape == "wide" else deep)(args.modules)
    units = []

    def wrapper_cls(module, **kwargs):
        units.append(module)
        return module  # wrapping in place keeps the tree reusable for counting

    times = []
    for _ in range(args.repeats):
        tree = copy.deepcopy(model)
        units.clear()
        start = time.perf_counter()
        torch_wrap._recursive_wrap(tree, policy, wrapper_cls, ignored_modules=set(),
                             ignored_params=set(), only_wrap_children=True)
        times.append(time.perf_counter() - start)
    print(statistics.median(times), sum(1 for _ in model.modules()), len(units))


if __name__ == "__main__":
    main()
