#!/usr/bin/python3
"""Reference oracle for the C++ wrap planner (`fsdp_plan`).

Runs PyTorch's own `_recursive_wrap` and auto-wrap policies (the installed
torch's torch/distributed/fsdp/wrap.py, the semantics fsdp follows) on real
Python models and prints the FSDP units it would create, so the C++ planner
can be compared against it.

Subcommands:
  make-models OUT_DIR   script + save every model as OUT_DIR/NAME.pt
  oracle --model NAME --policy size|always|transformer|module
         [--min_num_params N] [--layer_cls PY.CLASS.PATH ...] [--world_size W]
                        print {"total_numel": N, "units": [...]} as JSON
  selfcheck             check the wrap emulation on a tiny model

Uses only the stdlib, torch and torchvision (the pinned environment's python3,
tools/setup.sh).
"""

import argparse
import functools
import importlib
import json
import os
import sys
import warnings

import torch
import torch.distributed.fsdp.wrap as torch_wrap
import torch.nn as nn

# --------------------------------------------------------------------------
# Models. Constructors are deterministic in structure; values don't matter,
# so the oracle rebuilds the same Python model that make-models scripted.
# --------------------------------------------------------------------------


class TiedLM(nn.Module):
    """Tiny LM whose output head shares its weight with the embedding."""

    def __init__(self, vocab: int = 100, dim: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [nn.TransformerEncoderLayer(dim, 4, 64) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: same Parameter object

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _resnet18() -> nn.Module:
    import torchvision  # imported lazily: only this model needs it
    return torchvision.models.resnet18()  # no weights


def _mobilenet_v3_small() -> nn.Module:
    import torchvision
    return torchvision.models.mobilenet_v3_small()


def _transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128)
    return nn.TransformerEncoder(layer, num_layers=3)


def _transformer() -> nn.Module:
    return nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2,
                          num_decoder_layers=2, dim_feedforward=128)


MODELS = {
    "resnet18": _resnet18,
    "mobilenet_v3_small": _mobilenet_v3_small,
    "transformer_encoder": _transformer_encoder,
    "transformer": _transformer,
    "tied_lm": TiedLM,
}


def build_model(name: str) -> nn.Module:
    if name not in MODELS:
        sys.exit(f"plan_oracle: unknown model {name!r}; known: {sorted(MODELS)}")
    torch.manual_seed(0)
    return MODELS[name]()


def total_numel(model: nn.Module) -> int:
    # parameters() already dedups shared parameters by identity.
    return sum(p.numel() for p in model.parameters())


def cmd_make_models(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    manifest = {}
    for name in MODELS:
        model = build_model(name)
        with warnings.catch_warnings():  # scripting TransformerEncoder is noisy
            warnings.simplefilter("ignore")
            scripted = torch.jit.script(model)
        path = os.path.join(out_dir, name + ".pt")
        scripted.save(path)
        manifest[name] = {"path": path, "total_numel": total_numel(model)}
        print(f"saved {path}", file=sys.stderr)
    # Not needed by the oracle (it rebuilds from MODELS) but handy to inspect.
    with open(os.path.join(out_dir, "models.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


# --------------------------------------------------------------------------
# Emulating FSDP's construction.
# --------------------------------------------------------------------------

WRAPPED = "_fsdp_wrapped_module"


class Wrapper(nn.Module):
    """Stand-in for FullyShardedDataParallel; records creation order."""

    created = []  # all Wrapper instances, in creation order

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        setattr(self, WRAPPED, module)
        Wrapper.created.append(self)


def clean_fqn(name: str) -> str:
    """FQN in the wrapped tree -> FQN in the unwrapped model."""
    return ".".join(s for s in name.split(".") if s and s != WRAPPED)


def resolve_class(path: str) -> type:
    """'pkg.mod.Class' (or 'pkg.mod.Outer.Inner') -> the class object."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        if isinstance(obj, type):
            return obj
        break
    sys.exit(f"plan_oracle: cannot resolve class {path!r}")


def make_policy(args):
    if args.policy == "always":
        return torch_wrap.always_wrap_policy
    if args.policy == "size":
        return functools.partial(torch_wrap.size_based_auto_wrap_policy,
                                 min_num_params=args.min_num_params)
    if args.policy == "module":
        if not args.layer_cls:
            sys.exit("plan_oracle: --policy=module needs --layer_cls")
        return torch_wrap.ModuleWrapPolicy({resolve_class(c) for c in args.layer_cls})
    if args.policy == "transformer":
        if not args.layer_cls:
            sys.exit("plan_oracle: --policy=transformer needs --layer_cls")
        classes = {resolve_class(c) for c in args.layer_cls}
        return functools.partial(torch_wrap.transformer_auto_wrap_policy,
                                 transformer_layer_cls=classes)
    sys.exit(f"plan_oracle: unknown policy {args.policy!r}")


def plan(model: nn.Module, policy, world_size: int) -> dict:
    """Wrap `model` like FSDP does and describe the resulting units."""
    orig_names = {id(m): n for n, m in model.named_modules()}
    total = total_numel(model)

    # FSDP.__init__ (_auto_wrap): wrap the children per the policy, then the root, always.
    Wrapper.created = []
    if isinstance(policy, torch_wrap._Policy):
        # A _Policy (ModuleWrapPolicy) picks its modules at once, wrapped in post-order.
        targets = policy._run_policy(model, set(), {})
        torch_wrap._post_order_apply(
            model, torch_wrap._construct_wrap_fn(model, targets, Wrapper))
    else:
        torch_wrap._recursive_wrap(model, policy, wrapper_cls=Wrapper,
                                   ignored_modules=set(), ignored_params=set(),
                                   only_wrap_children=True)
    root = Wrapper(model)

    # Each unit flattens the not-yet-claimed params of its subtree; units are
    # processed in creation order (post-order, root last), so a shared
    # parameter goes to the first unit created that contains it.
    claimed = set()
    numel = {}
    for unit in Wrapper.created:
        n = 0
        for p in unit.parameters():
            if id(p) not in claimed:
                claimed.add(id(p))
                n += p.numel()
        numel[id(unit)] = n
    assert sum(numel.values()) == total, "units must cover every parameter"

    # Report units in pre-order of the tree (same as the original tree's).
    units = []
    for name, m in root.named_modules():
        if not isinstance(m, Wrapper):
            continue
        fqn = clean_fqn(name)
        # Cross-check the name against the unwrapped model's module names.
        assert fqn == orig_names[id(getattr(m, WRAPPED))], (fqn, name)
        n = numel[id(m)]
        shard = -(-n // world_size)  # ceil
        units.append({"fqn": fqn, "numel": n, "shard_numel": shard,
                      "padding": shard * world_size - n})
    assert len(units) == len(Wrapper.created)
    return {"total_numel": total, "units": units}


def cmd_oracle(args) -> None:
    if args.world_size < 1:
        sys.exit("plan_oracle: --world_size must be >= 1")
    policy = make_policy(args)
    model = build_model(args.model)
    json.dump(plan(model, policy, args.world_size), sys.stdout)
    sys.stdout.write("\n")


def cmd_selfcheck() -> None:
    """Check torch's wrap + the FSDP emulation on a hand-computed example."""

    def tiny():
        return nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5),
                             nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)))

    def check(policy, expected):
        got = [(u["fqn"], u["numel"]) for u in plan(tiny(), policy, 1)["units"]]
        if got != expected:
            sys.exit(f"plan_oracle selfcheck FAILED: got {got}, want {expected}")

    # Each Linear(5, 5) has 30 params. With min 40, only "2" (60) is wrapped.
    check(functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=40),
          [("", 60), ("2", 60)])
    check(torch_wrap.always_wrap_policy,
          [("", 0), ("0", 30), ("1", 30), ("2", 0), ("2.0", 30), ("2.1", 30)])
    print("selfcheck ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-models", help="script and save the models")
    mk.add_argument("out_dir")
    orc = sub.add_parser("oracle", help="print torch's wrap plan as JSON")
    orc.add_argument("--model", required=True, choices=sorted(MODELS))
    orc.add_argument("--policy", required=True,
                     choices=["size", "always", "transformer", "module"])
    orc.add_argument("--min_num_params", type=int, default=int(1e8))
    # Repeatable and/or comma-separated, like fsdp_plan's --layer_cls.
    orc.add_argument("--layer_cls", nargs="+", action="extend", default=[],
                     type=lambda s: [c for c in s.split(",") if c])
    orc.add_argument("--world_size", type=int, default=1)
    sub.add_parser("selfcheck")
    args = parser.parse_args()

    if args.cmd == "make-models":
        cmd_make_models(args.out_dir)
    elif args.cmd == "oracle":
        args.layer_cls = [c for group in args.layer_cls for c in group]
        cmd_oracle(args)
    else:
        cmd_selfcheck()


if __name__ == "__main__":
    main()
