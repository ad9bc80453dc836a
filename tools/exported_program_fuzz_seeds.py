"""Seed corpus for fsdp/formats:exported_program_fuzzer: the model.json and
model_weights_config.json of archives written by torch.export.save itself (a tied LM,
a frozen parameter, a buffer, a module never called, on the CPU and on the meta
device), each seed the two texts joined by a NUL byte.

  exported_program_fuzz_seeds.py DIR
"""
import io
import os
import sys
import zipfile

import torch
import torch.nn as nn


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(16, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.tok.weight
        self.blocks[0].bias.requires_grad_(False)
        self.register_buffer("scale", torch.ones(4, dtype=torch.bfloat16))
        self.unused = nn.Linear(2, 2)

    def forward(self, ids):
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x) * self.scale.float()
        return self.head(x)


def texts(model, inputs):
    buffer = io.BytesIO()
    torch.export.save(torch.export.export(model, inputs), buffer)
    with zipfile.ZipFile(buffer) as z:
        names = z.namelist()
        pick = lambda suffix: z.read(next(n for n in names if n.endswith(suffix)))
        return pick("models/model.json") + b"\0" + pick("weights/model_weights_config.json")


def main(out):
    os.makedirs(out, exist_ok=True)
    ids = torch.zeros(2, 3, dtype=torch.long)
    seeds = {"tied_cpu": texts(TiedNet(), (ids,))}
    with torch.device("meta"):
        meta = TiedNet()
    seeds["tied_meta"] = texts(meta, (ids.to("meta"),))
    seeds["linear"] = texts(nn.Sequential(nn.Linear(3, 2)), (torch.randn(1, 3),))
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main(sys.argv[1])
