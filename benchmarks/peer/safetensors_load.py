"""The safetensors library's side of fsdp/state:safetensors_benchmark: one rank of W
loading the benchmark's folder, either whole with safetensors.torch.load_file (every
rank holds the full model, then keeps its shard) or with safe_open slices (only this
rank's rows of each tensor, as fsdp's flat shard holds them when every tensor is its
own unit). Prints one line: mode, world size, rank, bytes read, seconds, peak RSS added.

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
    base = rss_peak_kib()
    start = time.perf_counter()
    nbytes = 0
    held = []
    for name in files:
        path = os.path.join(folder, name)
        if mode == "load_file":
            tensors = load_file(path)
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            held.append(tensors)
            continue
        with safe_open(path, "pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                rows = part.get_shape()[0]
                chunk = -(-rows // world_size)
                t = part[rank * chunk:min(rows, (rank + 1) * chunk)]
                nbytes += t.numel() * t.element_size()
                held.append(t)
    seconds = time.perf_counter() - start
    print(f"safetensors {mode} W={world_size} rank={rank}: read {nbytes} bytes in "
          f"{seconds:.3f} s ({nbytes / seconds / 1e9:.2f} GB/s), peak RSS +"
          f"{(rss_peak_kib() - base) / 1024:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
