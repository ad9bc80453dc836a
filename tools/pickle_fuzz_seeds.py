"""Seed corpus for fsdp/formats:pickle_fuzzer: Distributed Checkpoint metadata (the
classes of torch.distributed.checkpoint.metadata) and plain values, at protocols 2 to 5,
and hostile pickles (hostile_pickles: deep nesting, a memo bomb; metadata with chunks that
overlap and leave a hole, and with huge sizes), which fuzz_seeds.py shares.

  pickle_fuzz_seeds.py DIR
"""
import os
import pickle
import sys

import torch
from torch.distributed.checkpoint import metadata as m


def dcp_metadata(rows=4, chunks=((2, 2),)):
    """Metadata of a [rows, 3] bfloat16 tensor stored as row chunks (first row, rows)."""
    tensor = m.TensorStorageMetadata(
        properties=m.TensorProperties(dtype=torch.bfloat16),
        size=torch.Size([rows, 3]),
        chunks=[m.ChunkStorageMetadata(offsets=torch.Size([first, 0]),
                                       sizes=torch.Size([count, 3])) for first, count in chunks],
    )
    storage = {m.MetadataIndex(fqn="model.w", offset=torch.Size([first, 0]), index=i):
               ("__0_0.distcp", 1577 * i, 1577) for i, (first, _) in enumerate(chunks)}
    return m.Metadata(
        state_dict_metadata={"model.w": tensor, "step": m.BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "step": ("step",)},
        storage_data=storage,
        version="1.0.0",
    )


def hostile_pickles():
    """name -> pickle bytes that a careless reader crashes, hangs or runs out of memory on."""
    depth = 100000
    return {
        # EMPTY_LIST x depth, APPEND x (depth - 1): a list nested 100,000 deep.
        "deep_list": b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b".",
        # MARK x depth, then TUPLE x depth: tuples nested 100,000 deep.
        "deep_tuple": b"\x80\x02" + b"(" * depth + b"t" * depth + b".",
        # 30 levels of a list holding its inner list twice through the memo: 2^30 leaves
        # if expanded, 300 bytes as written.
        "memo_bomb": b"\x80\x02]q\x00" + b"".join(
            b"](h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"eq" + bytes([i])
            for i in range(1, 31)) + b".",
        # Rows 0..2 and 1..3 of a 5-row tensor: row 1..2 twice, row 4 never.
        "overlap_and_hole": pickle.dumps(dcp_metadata(5, ((0, 3), (1, 3))), protocol=2),
        "huge_sizes": pickle.dumps(dcp_metadata(2**62, ((0, 2**62),)), protocol=2),
    }


def main(out):
    os.makedirs(out, exist_ok=True)
    values = {"i": [0, 255, 65536, -1, 2**62], "f": 0.5, "s": "\u00e9", "t": (None, True)}
    for protocol in (2, 3, 4, 5):
        for name, value in (("metadata", dcp_metadata()), ("values", values)):
            with open(os.path.join(out, f"{name}_{protocol}.pkl"), "wb") as f:
                pickle.dump(value, f, protocol=protocol)
    for name, data in hostile_pickles().items():
        with open(os.path.join(out, f"hostile_{name}.pkl"), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main(sys.argv[1])
