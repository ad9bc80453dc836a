"""The Python half of memory_levers_test.sh and of the GPU check's fine-tune step.

    memory_levers.py make DIR     a random tiny Llama folder in float32 (DIR/model) and the
                                  same weights in bfloat16 (DIR/model_bf16), both written
                                  by transformers' save_pretrained, and 16384 random token
                                  ids (uint16) in DIR/train.bin
    memory_levers.py dtypes HF... prints a line per HF folder: the dtypes of its tensors,
                                  sorted, unique
"""
import glob
import os
import sys

import torch


def make(root):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(os.path.join(root, "model"))
    model.to(torch.bfloat16).save_pretrained(os.path.join(root, "model_bf16"))
    ids = torch.randint(0, config.vocab_size, (16384,), dtype=torch.int32)
    ids.numpy().astype("<u2").tofile(os.path.join(root, "train.bin"))


def dtypes(*folders):
    from safetensors import safe_open

    for folder in folders:
        found = set()
        for name in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with safe_open(name, "pt") as f:
                for key in f.keys():
                    found.add(str(f.get_slice(key).get_dtype()))
        print(" ".join(sorted(found)))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"make": make, "dtypes": dtypes}[command](*args)
