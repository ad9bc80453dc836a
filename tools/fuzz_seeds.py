"""Seed corpus for fsdp/state:torch_file_fuzzer: the pickles (data.pkl) of torch.save
files like the ones fsdp reads, each with one storage of 16 floats (the fuzzer's archive
holds one 64-byte record "data/0"), and pickle_fuzz_seeds.py's hostile pickles (deep
nesting, a memo bomb).

  fuzz_seeds.py DIR
"""
import collections
import io
import os
import sys
import zipfile

import torch

from pickle_fuzz_seeds import hostile_pickles


def pickle_of(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        return archive.read(name)


def main(out):
    os.makedirs(out, exist_ok=True)
    storage = torch.arange(16.0)
    state_dict = collections.OrderedDict(w=storage[:9].view(3, 3), b=storage[9:12])
    state_dict._metadata = collections.OrderedDict({"": {"version": 1}})  # as Module.state_dict()
    seeds = {
        "state_dict": state_dict,
        "one_item": {"only": storage[:2]},
        "strided": {"t": storage.view(4, 4).t(), "p": torch.nn.Parameter(storage[:3])},
        "nested": {"state": {"l1.weight": {"exp_avg": storage[:4], "step": 3}}},
        "metadata": {"format": "fsdp.sharded_checkpoint", "version": 1, "world_size": 2,
                     "files": {"rank_00000.pt": [10, 7]}, "flag": True, "x": 0.5,
                     "tensors": {"model/w": {"shape": [3, 3], "pieces": (0, 0, 9)}}},
    }
    for name, obj in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(pickle_of(obj))
    for name in ("deep_list", "deep_tuple", "memo_bomb"):
        with open(os.path.join(out, f"hostile_{name}"), "wb") as f:
            f.write(hostile_pickles()[name])


if __name__ == "__main__":
    main(sys.argv[1])
