"""Seed corpus for fsdp/formats:pickle_fuzzer: Distributed Checkpoint metadata (the
classes of torch.distributed.checkpoint.metadata) and plain values, at protocols 2 to 5.

  pickle_fuzz_seeds.py DIR
"""
import os
import pickle
import sys

import torch
from torch.distributed.checkpoint import metadata as m


def dcp_metadata():
    chunk = m.ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 3]))
    tensor = m.TensorStorageMetadata(
        properties=m.TensorProperties(dtype=torch.bfloat16),
        size=torch.Size([4, 3]),
        chunks=[chunk],
    )
    index = m.MetadataIndex(fqn="model.w", offset=torch.Size([2, 0]), index=0)
    return m.Metadata(
        state_dict_metadata={"model.w": tensor, "step": m.BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "step": ("step",)},
        storage_data={index: ("__0_0.distcp", 0, 1577)},
        version="1.0.0",
    )


def main(out):
    os.makedirs(out, exist_ok=True)
    values = {"i": [0, 255, 65536, -1, 2**62], "f": 0.5, "s": "\u00e9", "t": (None, True)}
    for protocol in (2, 3, 4, 5):
        for name, value in (("metadata", dcp_metadata()), ("values", values)):
            with open(os.path.join(out, f"{name}_{protocol}.pkl"), "wb") as f:
                pickle.dump(value, f, protocol=protocol)


if __name__ == "__main__":
    main(sys.argv[1])
