"""Times PyTorch's own `_recursive_wrap` on the synthetic trees of plan_benchmark.cc.

  torch_plan_timing.py --shape wide|deep --modules N --min_num_params P --repeats R

Prints one line: "<median seconds> <modules> <units>". The trees are built exactly as
plan_benchmark.cc builds its ModuleTrees (see synthetic_tree there); only the
`_recursive_wrap` call is timed, on a fresh copy of the tree each repeat.
"""

import argparse
import copy
import functools
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=["wide", "deep"], required=True)
    parser.add_argument("--modules", type=int, required=True)
    parser.add_argument("--min_num_params", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

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
