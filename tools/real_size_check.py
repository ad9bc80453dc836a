"""Fine-tunes at real size on one GPU (issue 51, item 2): examples/llama:finetune against
transformers + PEFT + PyTorch FSDP2 (benchmarks/peer/hf_fsdp2_finetune.py --device=cuda) on
the same random folder and the same batches, W = 1. Run by the GPU bundle
(`bash .gpu_bundle/run.sh real_size`, docs/GPU.md); no weights travel: each folder is made
on the device by transformers from its config, in bf16, with random values.

    python3 real_size_check.py --finetune=bin/examples/llama/finetune \
        --peer=peer/hf_fsdp2_finetune.py --work=/tmp/real_size --out=$OUT/real_size.md

Cases (--cases; context and batch per case, 5 steps by default):
  llama1b_full    a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads, 8 KV heads,
                  intermediate 8192, vocabulary 128256, tied embeddings), full fine-tune:
                  bf16 compute, fp32 master weights and AdamW (both sides' default for a
                  bf16 folder), context 2048, 4 windows a step
  qwen3_8b_lora   a Qwen3-8B-shaped model (hidden 4096, 36 layers, 32 heads of 128, 8 KV
                  heads, intermediate 12288, vocabulary 151936), LoRA rank 16 on q_proj,
                  k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj over the bf16 base,
                  activation checkpointing, context 4096, 1 window a step
  qwen3_8b_qlora  the same with ours' --quantize=nf4 (the peer needs bitsandbytes, which
                  the device does not have: its row says so)
  tiny_full, tiny_lora  2-layer versions of the above (a Llama, a Qwen3) on the CPU
                  (--device=cpu): the plumbing, checked here without a GPU
Per row: tokens/s of the steps after the first (from the time each `step k/N` line
arrives, the same for both sides), model FLOPs utilisation, peak GPU memory (ours:
max_memory_allocated of its device handle; the peer: torch.cuda.max_memory_allocated) and
the loss at the last step. MFU = FLOPs per token x tokens/s / the device's dense bf16 peak
(989.4 TFLOP/s for an H100 or H200 SXM; none for another device). FLOPs per token, with N
the weights of the matrix products (every linear layer and the head) and the attention's
12 x layers x context x (heads x head_dim): a full fine-tune 6 N + attention; LoRA 4 N +
attention (forward 2 N and the input gradients 2 N; the frozen weights get no weight
gradient, and the adapters' FLOPs are left out). A checkpointed layer's recomputation is
not counted (the usual convention: MFU counts the model's FLOPs, not the work done).
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=131072, rms_norm_eps=1e-5)
QWEN3_8B = dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6)
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32000,
            tie_word_embeddings=False, max_position_embeddings=2048, rms_norm_eps=1e-5)
TINY_QWEN3 = dict(TINY, model_type="qwen3", rms_norm_eps=1e-6)
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"

# name: (model, LoRA rank, ours' extra flags, the peer runs it, context, windows a step)
CASES = {
    "llama1b_full": ("llama1b", 0, [], True, 2048, 4),
    "qwen3_8b_lora": ("qwen3_8b", 16, ["--activation_checkpointing"], True, 4096, 1),
    "qwen3_8b_qlora": ("qwen3_8b", 16, ["--activation_checkpointing", "--quantize=nf4"], False,
                       4096, 1),
    "tiny_full": ("tiny", 0, [], True, 128, 2),
    "tiny_lora": ("tiny_qwen3", 8, ["--activation_checkpointing"], True, 128, 2),
}
MODELS = {"llama1b": LLAMA_1B, "qwen3_8b": QWEN3_8B, "tiny": TINY, "tiny_qwen3": TINY_QWEN3}
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="llama1b_full,qwen3_8b_lora,qwen3_8b_qlora")
    p.add_argument("--finetune", required=True, help="examples/llama:finetune binary")
    p.add_argument("--peer", required=True, help="benchmarks/peer/hf_fsdp2_finetune.py")
    p.add_argument("--work", required=True, help="folders, tokens and runs go here")
    p.add_argument("--out", required=True, help="the markdown table is written here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout_s", type=int, default=240, help="per side and case")
    p.add_argument("--make_folder", nargs=3, metavar=("DIR", "MODEL", "DEVICE"),
                   help=argparse.SUPPRESS)
    return p.parse_args()


def make_folder(folder, model, device):
    """A random folder of `model` in bf16 written by transformers (own process: its memory
    is returned before the runs)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = dict(MODELS[model])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    net.save_pretrained(folder, safe_serialization=True)


def matmul_weights(fields):
    """N: the elements of every linear layer's weight and of the head."""
    h, inner, layers = fields["hidden_size"], fields["intermediate_size"], fields["num_hidden_layers"]
    q = fields["num_attention_heads"] * fields["head_dim"]
    kv = fields["num_key_value_heads"] * fields["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inner
    return layers * per_layer + fields["vocab_size"] * h


def flops_per_token(fields, lora, context):
    attention = 12 * fields["num_hidden_layers"] * context * (
        fields["num_attention_heads"] * fields["head_dim"])
    return (4 if lora else 6) * matmul_weights(fields) + attention


def device_peak(device):
    if device != "cuda":
        return None, "CPU"
    import torch
    name = torch.cuda.get_device_name(0)
    for key, value in PEAK_BF16.items():
        if key in name:
            return value, name
    return None, name


def run(command, env, log_path, timeout_s):
    """Runs `command`, stamping each `step k/N` line, killed after timeout_s (silent or
    not); returns (status, stamps, losses, text)."""
    stamps, losses, lines = [], [], []
    with open(log_path, "w") as log:
        # Its own process group, so that the timer ends its children too (ours' ranks).
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)

        def kill():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended as the timer fired
                pass

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        for line in process.stdout:
            log.write(line)
            lines.append(line)
            match = re.match(r"step (\d+)/\d+ \| loss ([0-9.eE+-]+)", line)
            if match:
                stamps.append(time.monotonic())
                losses.append(float(match.group(2)))
        code = process.wait()
        timed_out = not timer.is_alive()
        timer.cancel()
    status = f"timed out after {timeout_s} s" if timed_out else "ok" if code == 0 else f"exit {code}"
    return status, stamps, losses, "".join(lines)


def peak_mb(text, pattern):
    match = re.search(pattern, text)
    return float(match.group(1)) if match else None


def main():
    args = parse_args()
    if args.make_folder:
        make_folder(*args.make_folder)
        return 0
    import numpy as np
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"real_size_check: unknown case(s) {unknown}; known: {', '.join(CASES)}")
    os.makedirs(args.work, exist_ok=True)
    peak, device_name = device_peak(args.device)
    # The peer is one rank as torchrun starts it; ours starts its one rank itself.
    peer_env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                    LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517",
                    PYTHONUNBUFFERED="1")
    rows = []
    for case in cases:
        model, lora, extra, peer_runs, context, windows = CASES[case]
        fields = MODELS[model]
        folder = os.path.join(args.work, model)
        if not os.path.exists(os.path.join(folder, "config.json")):
            print(f"real_size_check: writing a random {model} folder", flush=True)
            subprocess.run([sys.executable, __file__, "--finetune", args.finetune, "--peer",
                            args.peer, "--work", args.work, "--out", args.out, "--make_folder",
                            folder, model, args.device], check=True)
        tokens = os.path.join(args.work, f"{model}_tokens.bin")
        if not os.path.exists(tokens):  # random ids, enough for every window
            rng = np.random.default_rng(1234)
            rng.integers(0, fields["vocab_size"], 4 * context * windows * args.steps + context,
                         dtype=np.uint32).tofile(tokens)
        common = [f"--steps={args.steps}", f"--context={context}", f"--batch_size={windows}",
                  "--lr=1e-5", "--seed=1234"]
        lora_flags = [f"--lora_rank={lora}", f"--lora_target_modules={ALL_LINEAR}"] if lora else []
        ours = [args.finetune, f"--from={folder}", f"--data={tokens}", "--data_dtype=uint32",
                "--world_size=1", f"--device={args.device}", "--warmup_steps=0",
                "--log_interval=1", "--checkpoint_interval=0", "--timeout_s=600",
                f"--out_dir={os.path.join(args.work, case + '_ours')}"] + common + lora_flags + extra
        peer = [sys.executable, args.peer, f"--from={folder}", f"--data={tokens}",
                "--data_dtype=uint32", f"--device={args.device}"] + common + lora_flags + [
                    f for f in extra if f == "--activation_checkpointing"]
        sides = [("ours", ours, os.environ, r"rank 0: peak memory ([0-9.]+) MB")]
        sides.append(("peer", peer, peer_env, r"peak memory allocated: ([0-9.]+) MB")
                     if peer_runs else ("peer", None, None, None))
        for side, command, env, memory in sides:
            if command is None:
                rows.append((case, side, "not run: the peer's QLoRA needs bitsandbytes", None,
                             None, None, None))
                continue
            print(f"real_size_check: {case}, {side}", flush=True)
            status, stamps, losses, text = run(command, env, os.path.join(
                args.work, f"{case}_{side}.log"), args.timeout_s)
            tokens_per_s = (windows * context * (len(stamps) - 1) / (stamps[-1] - stamps[0])
                            if len(stamps) >= 2 else None)
            mfu = (flops_per_token(fields, lora, context) * tokens_per_s / peak
                   if tokens_per_s and peak else None)
            if status == "ok" and len(losses) != args.steps:
                status = f"{len(losses)} of {args.steps} steps"
            rows.append((case, side, status, tokens_per_s, mfu, peak_mb(text, memory) if memory
                         else None, losses[-1] if losses else None))
            if status != "ok":
                print(text[-3000:], flush=True)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    table = (f"Device: {device_name}; W = 1, {args.steps} steps; tokens/s of steps 2-"
             f"{args.steps}; MFU as tools/real_size_check.py says.\n\n"
             "| case | side | status | tokens/s | MFU | peak memory (MB) | last loss |\n"
             "|---|---|---|---|---|---|---|\n")
    for case, side, status, tps, mfu, memory, loss in rows:
        table += (f"| {case} | {side} | {status} | {fmt(tps, ',.0f')} | "
                  f"{fmt(mfu and 100 * mfu, '.1f')}{'%' if mfu else ''} | {fmt(memory, ',.0f')} | "
                  f"{fmt(loss, '.5f')} |\n")
    with open(args.out, "w") as f:
        f.write(table)
    print(table, flush=True)
    return 0 if all(row[2] == "ok" or row[2].startswith("not run") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
