"""The Python half of peft_interop_test.sh: PEFT 0.21 loads fsdp's LoRA adapter.

    peft_interop.py DIR

Builds peft_interop.cc's model in PyTorch, loads DIR/base.pt strictly, then DIR/adapter
with peft.PeftModel.from_pretrained, and checks: the config PEFT read, logits equal to
fsdp's (DIR/io.pt) within 1e-5, merge_and_unload's weights equal to fsdp's
merged_state_dict (DIR/merged.pt) within 1e-6, save_merged's sharded folder (DIR/merged/)
holding the same tensors, and PEFT's own save_pretrained of the loaded adapter holding the
same tensor names as fsdp's file.
"""
import json
import os
import sys
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file

VOCAB, WIDTH = 13, 12


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(WIDTH, WIDTH)
        self.v_proj = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        self.o_proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.o_proj(torch.tanh(self.q_proj(x)) * self.v_proj(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main(directory):
    net = Net()
    net.load_state_dict(torch.load(os.path.join(directory, "base.pt")), strict=True)
    adapter = os.path.join(directory, "adapter")
    model = PeftModel.from_pretrained(net, adapter)
    model.eval()
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.05), config
    assert set(config.target_modules) == {"q_proj", "v_proj"}, config.target_modules
    io = torch.load(os.path.join(directory, "io.pt"))
    with torch.no_grad():
        logits = model(io["tokens"])
    diff = (logits - io["logits"]).abs().max().item()
    print(f"logits: max |PEFT - fsdp| = {diff:.3g}")
    assert diff <= 1e-5, diff
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 4 and all(p.abs().max() > 0 for p in lora_b), "adapters not trained"

    ours = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved)
        theirs = load_file(os.path.join(saved, "adapter_model.safetensors"))
        assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
        for name, tensor in theirs.items():
            assert torch.equal(tensor, ours[name]), name
        with open(os.path.join(saved, "adapter_config.json")) as f:
            their_config = json.load(f)
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        our_config = json.load(f)
    for key in ("peft_type", "r", "lora_alpha", "lora_dropout", "bias", "fan_in_fan_out",
                "use_rslora", "use_dora", "init_lora_weights"):
        assert our_config[key] == their_config[key], (key, our_config[key], their_config[key])

    merged = model.merge_and_unload().state_dict()
    fsdp_merged = torch.load(os.path.join(directory, "merged.pt"))
    assert sorted(merged) == sorted(fsdp_merged), (sorted(merged), sorted(fsdp_merged))
    worst = max((merged[k] - fsdp_merged[k]).abs().max().item() for k in merged)
    print(f"merged weights: max |PEFT - fsdp| = {worst:.3g}")
    assert worst <= 1e-6, worst
    index = os.path.join(directory, "merged", "model.safetensors.index.json")
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    assert len(files) > 1, files
    saved = {}
    for name in files:
        saved.update(load_file(os.path.join(directory, "merged", name)))
    assert sorted(saved) == sorted(merged), sorted(saved)
    for name, tensor in merged.items():
        assert torch.equal(saved[name], fsdp_merged[name]), name
    print(f"save_merged: {len(files)} safetensors files with the index, equal to merged.pt")
    print("PASS: PEFT loads fsdp's adapter; logits and merged weights match")


if __name__ == "__main__":
    main(sys.argv[1])
