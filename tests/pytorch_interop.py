"""The PyTorch half of pytorch_interop_test.sh: the GPT example's model in PyTorch
(benchmarks/peer/fsdp2_gpt.py's Gpt).

  pytorch_interop.py DIR   loads DIR/cpp_model.pt strictly, compares its logits with
                           DIR/cpp_io.pt's, then writes DIR/py_model.pt
                           (torch.save(model.state_dict())) and DIR/py_io.pt; checks
                           fsdp's full Adagrad and RMSprop state files against
                           torch.optim's after the same 2 steps, and that they load into
                           torch.optim and step on as PyTorch's own state does
"""
import os
import sys

import torch

# The GPT of examples/gpt in PyTorch, shared with the FSDP2 peer.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                                "peer"))
from fsdp2_gpt import Gpt  # noqa: E402

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 23, 8, 16, 2, 2  # as pytorch_interop.cc


# As pytorch_interop.cc's write_optimizer_states.
OPTIMIZERS = {
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1),
    # eps = 0.01: centered RMSprop divides each gradient by its own running deviation, so
    # a gradient that is only rounding noise (the key bias's, which softmax cancels) would
    # make a state that differs with the order of the ranks' sums; eps bounds that.
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.9, centered=True,
                                                  eps=0.01),
}


def train_two_steps(model, optimizer, tokens):
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB),
                                          tokens.roll(1, 1).reshape(-1)).backward()
        optimizer.step()


def check_optimizer(out, name, tokens):
    """fsdp's full optimizer state file (FQN -> state name -> tensor) against
    torch.optim's state after the same two steps from the same weights; then loaded into
    torch.optim (load_state_dict), one more step matches PyTorch's own."""
    ours = torch.load(f"{out}/cpp_optim_{name}.pt")
    model = Gpt(VOCAB, CONTEXT, WIDTH, HEADS, LAYERS)
    model.load_state_dict(torch.load(f"{out}/cpp_init.pt"), strict=True)
    optimizer = OPTIMIZERS[name](model.parameters())
    train_two_steps(model, optimizer, tokens)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(ours) == sorted(names), (name, sorted(ours), sorted(names))
    worst = 0.0
    ok = True
    for param_name, param in model.named_parameters():
        theirs = optimizer.state[param]
        mine = ours[param_name]
        assert sorted(mine) == sorted(theirs), (name, param_name, sorted(mine), sorted(theirs))
        for key, value in theirs.items():
            assert mine[key].dtype == value.dtype and mine[key].shape == value.shape, \
                (name, param_name, key, mine[key].dtype, value.dtype, mine[key].shape, value.shape)
            ok = ok and torch.allclose(mine[key], value, rtol=1e-4, atol=1e-6)
            worst = max(worst, (mine[key] - value).abs().max().item())
    # Loaded into torch.optim over fsdp's weights, one more step equals PyTorch's own.
    loaded_model = Gpt(VOCAB, CONTEXT, WIDTH, HEADS, LAYERS)
    loaded_model.load_state_dict(torch.load(f"{out}/cpp_model_{name}.pt"), strict=True)
    loaded = OPTIMIZERS[name](loaded_model.parameters())
    loaded.load_state_dict({"state": {i: ours[n] for i, n in enumerate(names)},
                            "param_groups": optimizer.state_dict()["param_groups"]})
    for m, o in ((model, optimizer), (loaded_model, loaded)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(tokens).reshape(-1, VOCAB),
                                          tokens.roll(1, 1).reshape(-1)).backward()
        o.step()
    after = max((a - b).abs().max().item()
                for a, b in zip(model.parameters(), loaded_model.parameters()))
    print(f"fsdp {name} state in torch.optim: {len(ours)} parameters, "
          f"max |state difference| = {worst:.3g}, after one more step max |weight difference| "
          f"= {after:.3g}")
    return ok and torch.allclose(torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                                 torch.cat([p.detach().reshape(-1)
                                            for p in loaded_model.parameters()]),
                                 rtol=1e-4, atol=1e-6)


def main(out):
    io = torch.load(f"{out}/cpp_io.pt")
    for name in OPTIMIZERS:
        if not check_optimizer(out, name, io["tokens"]):
            return 1
    model = Gpt(VOCAB, CONTEXT, WIDTH, HEADS, LAYERS)
    state = torch.load(f"{out}/cpp_model.pt")
    model.load_state_dict(state, strict=True)  # same key set, shapes and dtypes
    with torch.no_grad():
        diff = (model(io["tokens"]) - io["logits"]).abs().max().item()
    print(f"fsdp checkpoint in PyTorch: {len(state)} keys, max |logit difference| = {diff:.3g}")
    if diff > 1e-5:
        return 1
    torch.manual_seed(7)
    model = Gpt(VOCAB, CONTEXT, WIDTH, HEADS, LAYERS)
    tokens = torch.randint(VOCAB, (3, CONTEXT))
    with torch.no_grad():
        logits = model(tokens)
    torch.save(model.state_dict(), f"{out}/py_model.pt")
    torch.save({"tokens": tokens, "logits": logits}, f"{out}/py_io.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
