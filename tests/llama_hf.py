"""The Python half of llama_hf_test.sh: transformers' LlamaForCausalLM against fsdp's.

    llama_hf.py make DIR     random small LlamaConfigs (grouped-query attention, 4 heads
                             and 2 key/value heads; untied and tied embeddings) saved by
                             save_pretrained in several shards: DIR/untied, DIR/tied; the
                             token ids DIR/ids.pt
    llama_hf.py check DIR    transformers' logits on those ids against fsdp's
                             (DIR/<name>/logits.pt from llama_logits), each within 1e-5
"""
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VARIANTS = {
    "untied": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "tied": dict(tie_word_embeddings=True, rope_theta=500000.0),
}
TOLERANCE = 1e-5


def config(tie_word_embeddings, rope_theta):
    return LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )


def make(root):
    torch.manual_seed(0)
    for name, kwargs in VARIANTS.items():
        model = LlamaForCausalLM(config(**kwargs)).eval()
        with torch.no_grad():  # non-trivial norms, so a swapped weight shows
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        out = os.path.join(root, name)
        model.save_pretrained(out, max_shard_size="20KB")
        shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
        assert len(shards) > 1, f"{out}: expected several shards, got {shards}"
        print(f"{name}: {len(shards)} safetensors files")
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    torch.save({"ids": ids}, os.path.join(root, "ids.pt"))


def check(root):
    ids = torch.load(os.path.join(root, "ids.pt"))["ids"]
    failed = 0
    for name in VARIANTS:
        folder = os.path.join(root, name)
        model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        ours = torch.load(os.path.join(folder, "logits.pt"))
        assert ours, f"{folder}/logits.pt holds no logits"
        for key, logits in ours.items():
            assert logits.shape == expected.shape, (key, logits.shape, expected.shape)
            diff = (logits - expected).abs().max().item()
            ok = diff <= TOLERANCE
            failed += not ok
            print(f"{name} {key}: max |fsdp - transformers| = {diff:.3g} "
                  f"({'ok' if ok else 'FAIL'}, tolerance {TOLERANCE})")
    return failed


if __name__ == "__main__":
    command, root = sys.argv[1], sys.argv[2]
    if command == "make":
        make(root)
    elif command == "check":
        sys.exit(1 if check(root) else 0)
    else:
        sys.exit(f"unknown command {command}")
