"""Seed corpus for fsdp/state:checkpoint_folder_fuzzer, the part that needs no real save:
pickle_fuzz_seeds.py's hostile pickles as the metadata of a DCP folder (input byte 0 even)
and of an fsdp sharded folder (odd). The target itself adds the seeds derived from a real
save (FSDP_FUZZ_SEED_DIR, see checkpoint_folder_fuzzer.cc).

  checkpoint_folder_fuzz_seeds.py DIR
"""
import os
import sys

from pickle_fuzz_seeds import hostile_pickles


def main(out):
    os.makedirs(out, exist_ok=True)
    for name, data in hostile_pickles().items():
        for kind, folder in ((b"\x00", "dcp"), (b"\x01", "fsdp")):
            with open(os.path.join(out, f"{folder}_hostile_{name}"), "wb") as f:
                f.write(kind + data)


if __name__ == "__main__":
    main(sys.argv[1])
