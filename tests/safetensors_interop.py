"""The Python half of safetensors_interop_test.sh (see safetensors_interop.cc): checks
fsdp's files with safetensors.torch.load_file / safe_open, and writes files with
save_file and huggingface_hub's save_torch_state_dict (what transformers'
save_pretrained uses) for fsdp to read.

  safetensors_interop.py DIR
"""
import json
import os
import sys

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# NetImpl's state dict (fsdp/core/testing/parity_testing.h), in order.
MODEL = [("l1.weight", (8, 4)), ("l1.bias", (8,)), ("l2.weight", (7, 8)), ("l2.bias", (7,)),
         ("head.weight", (3, 7)), ("head.bias", (3,))]


def value(k, shape, dtype):  # keep in step with safetensors_interop.cc
    numel = 1
    for d in shape:
        numel *= d
    i = torch.arange(numel, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i + k) % 3 == 0).reshape(shape)
    if dtype.is_floating_point:
        return ((i * 3 + k) * 0.25).to(torch.float64).reshape(shape).to(dtype)
    return ((i * 7 + k) % 100).reshape(shape).to(dtype)


def model_values():
    return {name: value(k, shape, torch.float32) for k, (name, shape) in enumerate(MODEL)}


def check_fsdp_files(out):
    got = load_file(os.path.join(out, "fsdp_dtypes.safetensors"))
    assert sorted(got) == sorted(DTYPES), sorted(got)
    for name, dtype in DTYPES.items():
        assert got[name].dtype == dtype, (name, got[name].dtype)
        assert torch.equal(got[name], value(5, (3, 4), dtype)), name
    with safe_open(os.path.join(out, "fsdp_dtypes.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}, f.metadata()
        assert torch.equal(f.get_slice("F32")[1:3], value(5, (3, 4), torch.float32)[1:3])
    print(f"fsdp_dtypes.safetensors: {len(DTYPES)} dtypes equal in load_file")
    folder = os.path.join(out, "fsdp_model")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    loaded = {}
    for name in files:
        part = load_file(os.path.join(folder, name))
        assert all(index["weight_map"][k] == name for k in part), name
        loaded.update(part)
    want = model_values()
    assert sorted(loaded) == sorted(want), sorted(loaded)
    for name, tensor in want.items():
        assert torch.equal(loaded[name], tensor), name
    size = sum(t.numel() * t.element_size() for t in want.values())
    assert index["metadata"]["total_size"] == size, index["metadata"]
    print(f"fsdp_model/: {len(files)} files, {len(want)} tensors equal in load_file")


def write_python_files(out):
    save_file({name: value(9, (2, 5), dtype) for name, dtype in DTYPES.items()},
              os.path.join(out, "py_dtypes.safetensors"), metadata={"format": "pt"})
    os.makedirs(os.path.join(out, "py_model"))
    save_torch_state_dict(model_values(), os.path.join(out, "py_model"), max_shard_size=200)


def write_transformers_llama(out):
    """A random tiny Llama with tied embeddings, saved by transformers in 4 KB shards (no
    lm_head.weight in the files), and its state dict (the embedding once) for reference."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    model.save_pretrained(os.path.join(out, "hf_llama"), max_shard_size="4KB")
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, os.path.join(out, "hf_llama_expected.safetensors"))
    print(f"hf_llama/: save_pretrained wrote {len(state)} tensors")


def main(out):
    check_fsdp_files(out)
    write_python_files(out)
    write_transformers_llama(out)


if __name__ == "__main__":
    main(sys.argv[1])
