"""Fine-tunes at real size on one GPU (issue 51, item 2): examples/llama:finetune against
transformers + PEFT + PyTorch FSDP2 (benchmarks/peer/hf_fsdp2_finetune.py --device=cuda) on
the same random folder and the same batches, W = 1. Run by the GPU bundle
(`bash .gpu_bundle/run.sh real_size [CASES]`, docs/GPU.md); no weights travel: each folder
is made on the device by transformers from its config, in bf16, with random values.

    python3 real_size_check.py --finetune=bin/examples/llama/finetune \
        --peer=peer/hf_fsdp2_finetune.py --work=/tmp/real_size --out=$OUT/real_size.md

Cases (--cases, default llama1b_full,qwen3_8b_lora; 10 steps each):
  llama1b_full    a Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads, 8 KV heads,
                  intermediate 8192, vocabulary 128256, tied embeddings), full fine-tune:
                  bf16 compute, fp32 master weights and AdamW (both sides' default for a
                  bf16 folder), context 2048, 4 windows a step
  qwen3_8b_lora   a Qwen3-8B-shaped model (hidden 4096, 36 layers, 32 heads of 128, 8 KV
                  heads, intermediate 12288, vocabulary 151936), LoRA rank 16 on q_proj,
                  k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj over the bf16 base,
                  activation checkpointing, context 4096, 1 window a step
  qwen3_8b_qlora  the same with ours' --quantize=nf4, ours only (the peer needs
                  bitsandbytes, which the device does not have: its row says so). Ours
                  quantizes 7 B weights on the CPU as it reads them (~30 s on one core),
                  and it has 480 s and a device command of its own
  tiny_full, tiny_lora  2-layer versions of the above (a Llama, a Qwen3) on the CPU
                  (--device=cpu): the plumbing, checked here without a GPU
Each side has its case's time limit (240 s; the QLoRA one 480 s), cut to what is left of
--deadline_s (540 s: the script ends inside a 10-minute device command); a case that
cannot start in time says so. The table is rewritten after every side, with the last
lines of each failed side's log, so a command killed midway keeps what was measured;
every side dies with this script (PR_SET_PDEATHSIG). Ours' written-back folder (OUT/hf)
is deleted after each run, so the disk holds the folders (2.5 GB and 16.4 GB) and one
copy at a time.
Per row: tokens/s of the steps after the first (from the time each `step k/N` line
arrives, the same for both sides), model FLOPs utilisation, peak GPU memory (ours:
max_memory_allocated of its device handle; the peer: torch.cuda.max_memory_allocated) and
the loss at the last step (ours prints 4 decimals). MFU = FLOPs per token x tokens/s / the
device's dense bf16 peak (nvidia-smi's name: 989.4 TFLOP/s for an H100 SXM or H200, 835
for an H100 NVL, 756 for an H100 PCIe; none for another device). FLOPs per token, with N
the weights of the matrix products (every linear layer and the head) and the attention's
12 x layers x context x (heads x head_dim): a full fine-tune 6 N + attention; LoRA 4 N +
attention (forward 2 N and the input gradients 2 N; the frozen weights get no weight
gradient, and the adapters' FLOPs are left out). A checkpointed layer's recomputation is
not counted (the usual convention: MFU counts the model's FLOPs, not the work done).
"""

import argparse
import os
import re
import shutil
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

# name: (model, LoRA rank, ours' extra flags, the peer runs it, context, windows a step,
# seconds per side)
CASES = {
    "llama1b_full": ("llama1b", 0, [], True, 2048, 4, 240),
    "qwen3_8b_lora": ("qwen3_8b", 16, ["--activation_checkpointing"], True, 4096, 1, 240),
    "qwen3_8b_qlora": ("qwen3_8b", 16, ["--activation_checkpointing", "--quantize=nf4"], False,
                       4096, 1, 480),
    "tiny_full": ("tiny", 0, [], True, 128, 2, 240),
    "tiny_lora": ("tiny_qwen3", 8, ["--activation_checkpointing"], True, 128, 2, 240),
}
MODELS = {"llama1b": LLAMA_1B, "qwen3_8b": QWEN3_8B, "tiny": TINY, "tiny_qwen3": TINY_QWEN3}
# Dense bf16 TFLOP/s by the device's name (nvidia-smi's), the more specific first.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989.4e12),
             ("H200", 989.4e12)]
MIN_SIDE_S = 60  # a side is not started with less time left


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="llama1b_full,qwen3_8b_lora")
    p.add_argument("--finetune", required=True, help="examples/llama:finetune binary")
    p.add_argument("--peer", required=True, help="benchmarks/peer/hf_fsdp2_finetune.py")
    p.add_argument("--work", required=True, help="folders, tokens and runs go here")
    p.add_argument("--out", required=True, help="the markdown table is written here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--deadline_s", type=int, default=540, help="the whole run")
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


def folder_bytes(fields):
    """The bf16 folder's size, near enough: the matrix weights and an untied embedding."""
    untied = 0 if fields["tie_word_embeddings"] else fields["vocab_size"] * fields["hidden_size"]
    return 2 * (matmul_weights(fields) + untied)


def flops_per_token(fields, lora, context):
    attention = 12 * fields["num_hidden_layers"] * context * (
        fields["num_attention_heads"] * fields["head_dim"])
    return (4 if lora else 6) * matmul_weights(fields) + attention


def device_peak(device):
    """(dense bf16 FLOP/s or None, the device's name), asked of nvidia-smi: this process
    opens no CUDA context of its own."""
    if device != "cuda":
        return None, "CPU"
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                               "--id=0"], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"unknown CUDA device (nvidia-smi: {error})"
    for key, value in PEAK_BF16:
        if key in name:
            return value, name
    return None, name


def die_with_parent():
    """In the child: SIGKILL when this script ends (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def run(command, env, log_path, timeout_s):
    """Runs `command`, stamping each `step k/N` line, killed after timeout_s (silent or
    not); returns (status, stamps, losses, text)."""
    stamps, losses, lines = [], [], []
    with open(log_path, "w") as log:
        # Its own process group, so that the timer ends its children too (ours' ranks).
        try:
            process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, errors="replace",
                                       start_new_session=True, preexec_fn=die_with_parent)
        except OSError as error:
            return f"cannot start: {error}", stamps, losses, str(error)

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


def write_table(path, device_name, steps, rows, failures):
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    table = (f"Device: {device_name}; W = 1, {steps} steps; tokens/s of steps 2-{steps}; MFU "
             "as tools/real_size_check.py says.\n\n"
             "| case | side | status | tokens/s | MFU | peak memory (MB) | last loss |\n"
             "|---|---|---|---|---|---|---|\n")
    for case, side, status, tps, mfu, memory, loss in rows:
        table += (f"| {case} | {side} | {status} | {fmt(tps, ',.0f')} | "
                  f"{fmt(mfu and 100 * mfu, '.1f')}{'%' if mfu else ''} | {fmt(memory, ',.0f')} | "
                  f"{fmt(loss, '.5f')} |\n")
    for name, tail in failures:
        table += f"\n{name}, the end of its log:\n\n" + "".join(
            "    " + line + "\n" for line in tail.splitlines())
    with open(path, "w") as f:
        f.write(table)
    return table


def main():
    args = parse_args()
    if args.make_folder:
        make_folder(*args.make_folder)
        return 0
    import numpy as np
    start = time.monotonic()
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
    rows, failures = [], []
    left = lambda: args.deadline_s - (time.monotonic() - start)

    def skip(case, why):
        rows.extend([(case, "ours", why, None, None, None, None),
                     (case, "peer", why, None, None, None, None)])

    for case in cases:
        model, lora, extra, peer_runs, context, windows, side_s = CASES[case]
        fields = MODELS[model]
        folder = os.path.join(args.work, model)
        if not os.path.exists(os.path.join(folder, "config.json")):
            free = shutil.disk_usage(args.work).free
            if free < 2.5 * folder_bytes(fields):  # the folder and ours' written-back copy
                skip(case, f"not run: {free / 1e9:.1f} GB free in {args.work}")
                continue
            print(f"real_size_check: writing a random {model} folder", flush=True)
            partial = folder + ".partial"  # renamed when complete: a killed write is redone
            shutil.rmtree(partial, ignore_errors=True)
            status, _, _, text = run([sys.executable, __file__, "--finetune", args.finetune,
                                      "--peer", args.peer, "--work", args.work, "--out",
                                      args.out, "--make_folder", partial, model, args.device],
                                     os.environ, partial + ".log", int(max(1, left())))
            if status != "ok":
                skip(case, f"not run: writing the folder: {status}")
                failures.append((f"{case}, writing the folder", text[-3000:]))
                write_table(args.out, device_name, args.steps, rows, failures)
                continue
            os.rename(partial, folder)
        tokens = os.path.join(args.work, f"{model}_tokens.bin")
        if not os.path.exists(tokens):  # random ids, enough for every window
            rng = np.random.default_rng(1234)
            rng.integers(0, fields["vocab_size"], 4 * context * windows * args.steps + context,
                         dtype=np.uint32).tofile(tokens)
        common = [f"--steps={args.steps}", f"--context={context}", f"--batch_size={windows}",
                  "--lr=1e-5", "--seed=1234"]
        lora_flags = [f"--lora_rank={lora}", f"--lora_target_modules={ALL_LINEAR}"] if lora else []
        out_dir = os.path.join(args.work, case + "_ours")
        ours = [args.finetune, f"--from={folder}", f"--data={tokens}", "--data_dtype=uint32",
                "--world_size=1", f"--device={args.device}", "--warmup_steps=0",
                "--log_interval=1", "--checkpoint_interval=0", "--timeout_s=600",
                f"--out_dir={out_dir}"] + common + lora_flags + extra
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
            limit = int(min(side_s, left()))
            if limit < MIN_SIDE_S:
                rows.append((case, side, f"not run: {max(0, limit)} s left of --deadline_s",
                             None, None, None, None))
                continue
            print(f"real_size_check: {case}, {side} ({limit} s at most)", flush=True)
            shutil.rmtree(out_dir, ignore_errors=True)  # an earlier run's
            status, stamps, losses, text = run(command, env, os.path.join(
                args.work, f"{case}_{side}.log"), limit)
            if side == "ours":
                shutil.rmtree(out_dir, ignore_errors=True)  # OUT/hf: a copy of the folder
            tokens_per_s = (windows * context * (len(stamps) - 1) / (stamps[-1] - stamps[0])
                            if len(stamps) >= 2 else None)
            mfu = (flops_per_token(fields, lora, context) * tokens_per_s / peak
                   if tokens_per_s and peak else None)
            if status == "ok" and len(losses) != args.steps:
                status = f"{len(losses)} of {args.steps} steps"
            rows.append((case, side, status, tokens_per_s, mfu, peak_mb(text, memory) if memory
                         else None, losses[-1] if losses else None))
            if status != "ok":
                failures.append((f"{case}, {side}", "".join(text.splitlines(True)[-40:])))
            write_table(args.out, device_name, args.steps, rows, failures)
    print(write_table(args.out, device_name, args.steps, rows, failures), flush=True)
    return 0 if all(row[2] == "ok" or row[2].startswith("not run: the peer") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
