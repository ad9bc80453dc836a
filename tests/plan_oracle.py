#!/usr/bin/python3
"""Reference oracle for the C++ wrap planner (`fsdp_plan`).

Runs PyTorch's own `_recursive_wrap` and auto-wrap policies (the installed
torch's torch/distributed/fsdp/wrap.py, the semantics fsdp follows) on real
Python models and prints the FSDP units it would create, so the C++ planner
can be compared against it.

Subcommands:
  make-models OUT_DIR   script + save every scriptable model as OUT_DIR/NAME.pt and
                        export every model with torch.export as OUT_DIR/NAME.pt2
  oracle --model NAME --policy size|always|transformer|module
         [--min_num_params N] [--layer_cls PY.CLASS.PATH ...] [--world_size W]
                        print {"total_numel": N, "units": [...]} as JSON
  oracle-batch CASES OUT_DIR
                        the same for each line "NAME MODEL WORLD_SIZE FLAGS..." of the
                        file CASES, in one process: OUT_DIR/NAME.oracle.json (or .err)
  selfcheck             check the wrap emulation on a tiny model
  timing OUT_DIR FSDP_PLAN
                        time fsdp_plan on OUT_DIR/NAME.pt2 against _recursive_wrap on
                        the same Python models; print a Markdown table

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


class Block(nn.Module):
    """A GPT-2 block (nanoGPT's layout): ln_1, attn (c_attn, c_proj), ln_2, mlp."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.ModuleDict(dict(c_attn=nn.Linear(dim, 3 * dim), c_proj=nn.Linear(dim, dim)))
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn["c_attn"](self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["c_proj"](y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT: transformer = ModuleDict(wte, wpe, h = ModuleList(Block), ln_f),
    lm_head tied to wte. The ModuleDict and the ModuleList are never called."""

    def __init__(self, vocab: int = 128, ctx: int = 16, dim: int = 32, layers: int = 3):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(ctx, dim),
            h=nn.ModuleList([Block(dim, 4) for _ in range(layers)]), ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.transformer.wte(ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class FrozenUnused(nn.Module):
    """Frozen parameters, a ModuleDict, and modules never called: a ModuleList of
    Linears (spare) and a Linear (extra)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.stem.requires_grad_(False)
        self.heads = nn.ModuleDict({"a": nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                                    "b": nn.Linear(32, 8)})
        self.spare = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.extra = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["b"](self.heads["a"](self.stem(x)))


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
    "gpt": GPT,
    "frozen_unused": FrozenUnused,
}

# Models also saved as TorchScript (NAME.pt); every model is exported (NAME.pt2).
SCRIPTED = {"resnet18", "mobilenet_v3_small", "transformer_encoder", "transformer", "tied_lm"}
# Models also exported on the meta device (NAME.meta.pt2: 0-byte weights, and ties that
# only the graph shows).
META = {"resnet18", "tied_lm", "gpt"}


def example_inputs(name: str) -> tuple:
    """Inputs torch.export traces each model with (small: export time is CI time)."""
    if name in ("resnet18", "mobilenet_v3_small"):
        return (torch.randn(2, 3, 32, 32),)
    if name == "transformer_encoder":
        return (torch.randn(5, 2, 64),)
    if name == "transformer":
        return (torch.randn(5, 2, 64), torch.randn(4, 2, 64))
    if name in ("tied_lm", "gpt"):
        return (torch.zeros(2, 8, dtype=torch.long),)
    return (torch.randn(2, 16),)


def build_model(name: str) -> nn.Module:
    if name not in MODELS:
        sys.exit(f"plan_oracle: unknown model {name!r}; known: {sorted(MODELS)}")
    torch.manual_seed(0)
    return MODELS[name]()


def total_numel(model: nn.Module) -> int:
    # parameters() already dedups shared parameters by identity.
    return sum(p.numel() for p in model.parameters())


def export(model: nn.Module, inputs: tuple, path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(model, inputs), path)
    print(f"saved {path}", file=sys.stderr)


def cmd_make_models(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    manifest = {}
    for name in MODELS:
        model = build_model(name)
        manifest[name] = {"total_numel": total_numel(model)}
        if name in SCRIPTED:
            with warnings.catch_warnings():  # scripting TransformerEncoder is noisy
                warnings.simplefilter("ignore")
                scripted = torch.jit.script(model)
            path = os.path.join(out_dir, name + ".pt")
            scripted.save(path)
            manifest[name]["pt"] = path
            print(f"saved {path}", file=sys.stderr)
        path = os.path.join(out_dir, name + ".pt2")
        export(model, example_inputs(name), path)
        manifest[name]["pt2"] = path
        if name in META:
            with torch.device("meta"):
                torch.manual_seed(0)
                meta_model = MODELS[name]()
            inputs = tuple(t.to("meta") for t in example_inputs(name))
            export(meta_model, inputs, os.path.join(out_dir, name + ".meta.pt2"))
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


def cmd_oracle_batch(parser, cases_path: str, out_dir: str) -> None:
    """Runs every case of `cases_path` (torch and torchvision are imported once)."""
    with open(cases_path) as f:
        lines = [line.split() for line in f if line.strip()]
    for name, model, world_size, *flags in lines:
        argv = ["oracle", f"--model={model}", f"--world_size={world_size}", *flags]
        try:
            args = parser.parse_args(argv)
            args.layer_cls = [c for group in args.layer_cls for c in group]
            if args.world_size < 1:
                sys.exit("plan_oracle: --world_size must be >= 1")
            result = plan(build_model(args.model), make_policy(args), args.world_size)
        except (SystemExit, Exception) as e:  # one case's failure is reported, not fatal
            with open(os.path.join(out_dir, name + ".oracle.err"), "w") as f:
                f.write(f"{type(e).__name__}: {e}\n")
            continue
        with open(os.path.join(out_dir, name + ".oracle.json"), "w") as f:
            json.dump(result, f)
            f.write("\n")


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
    batch = sub.add_parser("oracle-batch", help="oracle for every line of a cases file")
    batch.add_argument("cases")
    batch.add_argument("out_dir")
    sub.add_parser("selfcheck")
    args = parser.parse_args()

    if args.cmd == "make-models":
        cmd_make_models(args.out_dir)
    elif args.cmd == "oracle":
        args.layer_cls = [c for group in args.layer_cls for c in group]
        cmd_oracle(args)
    elif args.cmd == "oracle-batch":
        cmd_oracle_batch(parser, args.cases, args.out_dir)
    else:
        cmd_selfcheck()


if __name__ == "__main__":
    main()
