"""The conversation fine-tune's loss against transformers (tests/chat_finetune_test.sh).

    chat_finetune.py make DIR     a random tiny Llama folder (DIR/model) and a conversation
                                  file (DIR/chat.safetensors, prepare_chat.py's format) of
                                  12 examples, six of 20 tokens and six of 12 (rows of 32
                                  tokens: 6 when packed, 12 one a row), each counting a
                                  random tail of its tokens; prints the expected loss
    chat_finetune.py loss DIR     transformers' loss over the file: each example alone
                                  (positions from 0), next-token cross-entropy summed over
                                  the counted targets, divided by their number
    chat_finetune.py generate MODEL_DIR SAMPLES_JSONL PART TOKENS
                                  transformers' greedy answers equal finetune's (PART:
                                  before or after) in its --sample_prompts output
"""
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file


def make(d):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(d + "/model")
    rng = np.random.default_rng(1)
    ids, mask, offsets = [], [], [0]
    for length in [20, 12] * 6:
        ids.extend(rng.integers(0, 128, length))
        answer = int(rng.integers(2, length // 2))  # the last `answer` tokens count
        mask.extend([0] * (length - answer) + [1] * answer)
        offsets.append(offsets[-1] + length)
    save_file({"input_ids": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.uint8),
               "example_offsets": np.asarray(offsets, np.int64)},
              d + "/chat.safetensors", metadata={"format": "fsdp-chat-v1"})


def loss(d):
    from safetensors.numpy import load_file
    data = load_file(d + "/chat.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(d + "/model", dtype=torch.float32)
    model.eval()
    total, count = 0.0, 0
    offsets = data["example_offsets"]
    with torch.no_grad():
        for e in range(len(offsets) - 1):
            ids = torch.tensor(data["input_ids"][offsets[e]:offsets[e + 1]], dtype=torch.long)
            counted = torch.tensor(data["loss_mask"][offsets[e]:offsets[e + 1]], dtype=torch.bool)
            logits = model(ids[None]).logits[0].double()
            targets = ids[1:].masked_fill(~counted[1:], -100)
            total += torch.nn.functional.cross_entropy(
                logits[:-1], targets, ignore_index=-100, reduction="sum").item()
            count += int(counted[1:].sum())
    print(f"{total / count:.9f}")


def generate(model_dir, samples, part, tokens):
    """transformers' greedy answer (generate, do_sample=False, at most `tokens` new tokens,
    stopping at the folder's eos_token_id) to each line's prompt against the line's
    `part`; prints one line per sample and exits 1 on the first difference."""
    import json
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with open(samples) as f:
        lines = [json.loads(line) for line in f]
    for number, line in enumerate(lines, start=1):
        prompt = torch.tensor([line["prompt"]], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=int(tokens),
                                 pad_token_id=model.generation_config.eos_token_id)
        want = out[0, prompt.shape[1]:].tolist()
        if line[part] != want:
            print(f"FAIL sample {number} {part}: fsdp {line[part]}, transformers {want}")
            sys.exit(1)
    changed = sum(line.get("before") != line.get("after") for line in lines)
    if part == "after" and changed == 0:
        print("FAIL: training changed no answer (are the after answers the trained model's?)")
        sys.exit(1)
    print(f"ok: {len(lines)} {part} answers equal transformers' greedy ones ({changed} changed "
          "by training)")


if __name__ == "__main__":
    if sys.argv[1] == "generate":
        generate(*sys.argv[2:])
    else:
        {"make": make, "loss": loss}[sys.argv[1]](sys.argv[2])
