"""The PyTorch half of pytorch_interop_test.sh: the GPT example's model in PyTorch
(benchmarks/peer/fsdp2_gpt.py's Gpt).

  pytorch_interop.py DIR   loads DIR/cpp_model.pt strictly, compares its logits with
                           DIR/cpp_io.pt's, then writes DIR/py_model.pt
                           (torch.save(model.state_dict())) and DIR/py_io.pt
"""
import os
import sys

import torch

# The GPT of examples/gpt in PyTorch, shared with the FSDP2 peer.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                                "peer"))
from fsdp2_gpt import Gpt  # noqa: E402

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 23, 8, 16, 2, 2  # as pytorch_interop.cc


def main(out):
    model = Gpt(VOCAB, CONTEXT, WIDTH, HEADS, LAYERS)
    state = torch.load(f"{out}/cpp_model.pt")
    model.load_state_dict(state, strict=True)  # same key set, shapes and dtypes
    io = torch.load(f"{out}/cpp_io.pt")
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
