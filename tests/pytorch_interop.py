"""The PyTorch half of pytorch_interop_test.sh: the GPT example's model in PyTorch.

  pytorch_interop.py DIR   loads DIR/cpp_model.pt strictly, compares its logits with
                           DIR/cpp_io.pt's, then writes DIR/py_model.pt
                           (torch.save(model.state_dict())) and DIR/py_io.pt
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CONTEXT, WIDTH, HEADS, LAYERS = 23, 8, 16, 2, 2  # as pytorch_interop.cc


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        b, t, w = x.shape
        d = w // HEADS
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, d).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.token = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens):
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.token.weight.t()  # tied output head


def main(out):
    model = Gpt()
    state = torch.load(f"{out}/cpp_model.pt")
    model.load_state_dict(state, strict=True)  # same key set, shapes and dtypes
    io = torch.load(f"{out}/cpp_io.pt")
    with torch.no_grad():
        diff = (model(io["tokens"]) - io["logits"]).abs().max().item()
    print(f"fsdp checkpoint in PyTorch: {len(state)} keys, max |logit difference| = {diff:.3g}")
    if diff > 1e-5:
        return 1
    torch.manual_seed(7)
    model = Gpt()
    tokens = torch.randint(VOCAB, (3, CONTEXT))
    with torch.no_grad():
        logits = model(tokens)
    torch.save(model.state_dict(), f"{out}/py_model.pt")
    torch.save({"tokens": tokens, "logits": logits}, f"{out}/py_io.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
