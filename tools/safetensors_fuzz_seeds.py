"""Seed corpus for fsdp/formats:safetensors_fuzzer: small files written by the safetensors
library itself (safetensors.torch.save), every dtype fsdp reads, an empty file, a
zero-size tensor and metadata.

  safetensors_fuzz_seeds.py DIR
"""
import os
import sys

import torch
from safetensors.torch import save


def main(out):
    os.makedirs(out, exist_ok=True)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
    seeds = {
        "every_dtype": {str(d).split(".")[1]: torch.arange(6).reshape(2, 3).to(d) for d in dtypes},
        "empty": {},
        "zero_size": {"a": torch.zeros(0, 3), "b": torch.ones(2)},
        "scalar": {"s": torch.tensor(3.5)},
    }
    for name, tensors in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(save(tensors, metadata={"format": "pt"}))


if __name__ == "__main__":
    main(sys.argv[1])
