"""The safetensors library's side of fsdp/state:safetensors_benchmark: one rank of W
loading the benchmark's folder, either whole with safetensors.torch.load_file (every
rank materialises the full state dict, as model.load_state_dict(load_file(f)) before
sharding does: each tensor cloned out of the library's memory map) or with safe_open
slices (only this rank's rows of each tensor, copied into a preallocated shard as fsdp's
flat shard holds them when every tensor is its own unit). Prints one line: mode, world
size, rank, bytes, seconds, peak RSS added (file pages the map touched count too).

  safetensors_load.py DIR load_file|safe_open WORLD_SIZE RANK
"""
import json
import os
import resource
import sys
import time

import torch  # noqa: F401  (imported before the baseline RSS is taken)
from safetensors import safe_open
from safetensors.torch import load_file


def rss_peak_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(folder, mode, world_size, rank):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    shard = None
    if mode == "safe_open":  # the rank's shard, allocated and touched before the baseline
        numel = 0
        for name in files:
            with safe_open(os.path.join(folder, name), "pt") as f:
                for key in f.keys():
                    shape = f.get_slice(key).get_shape()
                    chunk = -(-shape[0] // world_size)
                    rows = max(0, min(shape[0], (rank + 1) * chunk) - rank * chunk)
                    numel += rows * (f.get_slice(key).get_shape()[1] if len(shape) > 1 else 1)
        shard = torch.zeros(numel)
    base = rss_peak_kib()
    start = time.perf_counter()
    nbytes = 0
    held = []
    offset = 0
    for name in files:
        path = os.path.join(folder, name)
        if mode == "load_file":
            tensors = {k: v.clone() for k, v in load_file(path).items()}
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            held.append(tensors)
            continue
        with safe_open(path, "pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                rows = part.get_shape()[0]
                chunk = -(-rows // world_size)
                t = part[rank * chunk:min(rows, (rank + 1) * chunk)].reshape(-1)
                shard[offset:offset + t.numel()].copy_(t)
                offset += t.numel()
                nbytes += t.numel() * t.element_size()
    seconds = time.perf_counter() - start
    print(f"safetensors {mode} W={world_size} rank={rank}: read {nbytes} bytes in "
          f"{seconds:.3f} s ({nbytes / seconds / 1e9:.2f} GB/s), peak RSS +"
          f"{(rss_peak_kib() - base) / 1024:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
