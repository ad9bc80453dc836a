"""Fine-tuning A/B: examples/llama:finetune against transformers + PyTorch FSDP2
(benchmarks/peer/hf_fsdp2_finetune.py) on the same run: the same random Llama folder
(written by transformers' save_pretrained, fp32 safetensors), the same token windows, batch,
context, steps, learning rate and seed, W ranks on the CPU over Gloo, one intra-op thread each.

    ~/.cache/fsdp/torch-2.11.0/bin/python benchmarks/finetune_ab.py [--write_readme]

Run it with the project's venv python (tools/setup.sh makes it; it has transformers and
PEFT). It builds `bazel build -c opt //examples/llama:finetune` unless --finetune names a
binary. Cases (issue 36's goals):
  lora   LoRA rank 8 on q_proj, v_proj of a 672 M-parameter Llama (hidden 2048, 12 layers,
         16 heads, 4 KV heads, intermediate 5632, vocab 32000)
  full   full AdamW fine-tune of a 201 M-parameter Llama (hidden 1024, intermediate 2816)
  limit  LoRA rank 8 on a 1.21 B-parameter Llama (the lora case's with 24 layers: a 4,628 MiB
         fp32 folder), every rank in its own memory cgroup limited to --limit_mib (4,352 MiB:
         less than the whole model). The 672 M model does not fit ours under any limit below
         its 2,564 MiB folder yet (OOM-killed at 2,048 and 2,500 MiB): the constant part of
         a rank's peak (the gathered embeddings and head, one layer, the batch) is too large
         a share of it.
  tiny   a 2-layer Llama, full fine-tune: the two sides' losses must agree
         at every step within --check_losses (tests/finetune_ab_test.sh)
  lora_bf16  the lora case on the same model saved in bf16 (issue 46): both sides keep the
         frozen base in bf16, the adapters and AdamW in fp32, bf16 compute
  qlora  the lora_bf16 case with --quantize=nf4 on both sides: ours quantizes as each rank
         reads its shards; the peer loads the whole folder through bitsandbytes
         (BitsAndBytesConfig NF4, double quantization, bf16 quant storage, which FSDP2
         needs) on every rank. The goal's NF4 folder is the model written by transformers'
         save_pretrained after that load (its size is measured)
  moe_full  full fine-tune (bf16 compute, fp32 master weights and AdamW) of a 1.02 B-
         parameter Qwen3-MoE saved in bf16 (issue 47: hidden 1024, 18 layers, 16 heads,
         4 KV heads, head_dim 64, 64 experts of 256, top 8 renormalised, vocab 32000), the
         router's load-balancing loss on both sides (router_aux_loss_coef 0.001)
  moe_lora  LoRA rank 8 on q_proj, v_proj of the same folder, the frozen base in bf16
Each rank is its own process, started as torchrun starts it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the runner collects each process's peak
resident set with os.wait4 (ru_maxrss), and stamps each of rank 0's `step k/N` lines (both
sides print one after every step, after the all-reduce of the loss) as it arrives:
tokens/s = batch x context x (N - 1) / (time of line N - time of line 1), the steps after
the first, the same for both sides. Wall time: the first start to the last exit (loading,
training, and for ours writing OUT/hf and OUT/adapter, which the peer does not do).
--memory_max=BYTES puts every rank of every case in its own memory cgroup (v1
memory.limit_in_bytes or v2 memory.max) with that limit.
"""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = os.path.join(ROOT, "benchmarks", "peer", "hf_fsdp2_finetune.py")
MIB = 1 << 20

MODELS = {  # name: LlamaConfig fields (Qwen3MoeConfig's where model_type says so)
    "llama672m": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    "llama1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                    num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    "llama201m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    "llama_tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=32000),
    "qwen3moe1b": dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=64, num_experts=64, num_experts_per_tok=8,
                       moe_intermediate_size=256, norm_topk_prob=True, vocab_size=32000),
}
CASES = {  # name: model, LoRA rank (0: full), whether under --limit_mib, learning rate,
    # the folder's dtype, --quantize
    "lora": ("llama672m", 8, False, 1e-4, "float32", "none"),
    "full": ("llama201m", 0, False, 1e-4, "float32", "none"),
    "limit": ("llama1b", 8, True, 1e-4, "float32", "none"),
    "tiny": ("llama_tiny", 0, False, 1e-3, "float32", "none"),
    "lora_bf16": ("llama672m", 8, False, 1e-4, "bfloat16", "none"),
    "qlora": ("llama672m", 8, False, 1e-4, "bfloat16", "nf4"),
    "moe_full": ("qwen3moe1b", 0, False, 1e-4, "bfloat16", "none"),
    "moe_lora": ("qwen3moe1b", 8, False, 1e-4, "bfloat16", "none"),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="lora,full,limit,lora_bf16,qlora,moe_full,moe_lora", help="comma-separated: " + ",".join(CASES))
    p.add_argument("--cache", default="/tmp/fsdp_finetune_ab", help="folders, tokens, outputs")
    p.add_argument("--finetune", default="",
                   help="examples/llama:finetune binary (default: build it with -c opt)")
    p.add_argument("--world_size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=2, help="global batch (windows)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--limit_mib", type=int, default=4352,
                   help="the limit case's per-rank memory limit (MiB)")
    p.add_argument("--memory_max", type=int, default=0,
                   help="bytes: every rank of every case in its own cgroup with this limit")
    p.add_argument("--check_losses", type=float, default=0.0,
                   help="exit 1 unless the sides' losses agree at every step within this "
                   "relative error (a full fine-tune: the same weights and tokens)")
    p.add_argument("--write_readme", action="store_true",
                   help="write the table into benchmarks/README.md")
    p.add_argument("--make_folder", nargs=3, metavar=("DIR", "MODEL", "DTYPE"),
                   help=argparse.SUPPRESS)
    p.add_argument("--make_nf4_folder", nargs=2, metavar=("DIR", "FROM"), help=argparse.SUPPRESS)
    return p.parse_args()


def make_folder(folder, model, dtype):
    """A random Llama or Qwen3-MoE folder (safetensors in `dtype`: the same values rounded)
    by transformers; run in its own process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    fields = dict(MODELS[model])
    moe = fields.pop("model_type", "llama") == "qwen3_moe"
    config = (Qwen3MoeConfig if moe else LlamaConfig)(
        max_position_embeddings=2048, tie_word_embeddings=False, **fields)
    (Qwen3MoeForCausalLM if moe else LlamaForCausalLM)(config).to(
        getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)


def make_nf4_folder(folder, source):
    """`source` loaded through bitsandbytes (NF4, double quantization, bf16 compute) and
    written back by save_pretrained: a pre-quantized 4-bit folder as the Hub has them."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    AutoModelForCausalLM.from_pretrained(source, quantization_config=quantization,
                                         dtype=torch.bfloat16, device_map="cpu").save_pretrained(
                                             folder, safe_serialization=True)


def prepare(args, model, dtype="float32", nf4=False):
    """The case's folder (made once and kept in --cache): `model` in `dtype`, or with `nf4`
    that folder as bitsandbytes writes it in 4 bits."""
    name = model + ("" if dtype == "float32" else "_" + dtype)
    folder = os.path.join(args.cache, name + ("_nf4" if nf4 else ""))
    if not os.path.exists(os.path.join(folder, ".complete")):
        shutil.rmtree(folder, ignore_errors=True)
        print(f"writing {folder} ...", flush=True)
        make = (["--make_nf4_folder", folder, prepare(args, model, dtype)] if nf4 else
                ["--make_folder", folder, model, dtype])
        subprocess.run([sys.executable, os.path.abspath(__file__), *make], check=True)
        open(os.path.join(folder, ".complete"), "w").close()
    return folder


def make_tokens(args):
    import numpy as np
    path = os.path.join(args.cache, "tokens.bin")
    if not os.path.exists(path):
        np.random.default_rng(0).integers(0, 32000, 200_000, dtype=np.uint16).tofile(path)
    return path


def folder_stats(folder):
    """Bytes of the safetensors files, and the elements of their tensors."""
    from safetensors import safe_open
    nbytes = numel = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            nbytes += os.path.getsize(os.path.join(folder, name))
            with safe_open(os.path.join(folder, name), "pt") as f:
                for key in f.keys():
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    numel += n
    return nbytes, numel


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memory_cgroup_root():
    """(directory of this process's memory cgroup, 'v1' | 'v2'), or (None, None)."""
    with open("/proc/self/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            d = "/sys/fs/cgroup/memory" + path
            if os.path.isdir(d):
                return d, "v1"
    for _, controllers, path in lines:
        if controllers == "":
            d = "/sys/fs/cgroup" + path
            if os.path.exists(os.path.join(d, "memory.max")) or os.path.exists(
                    os.path.join(os.path.dirname(d), "cgroup.subtree_control")):
                return d, "v2"
    return None, None


def make_cgroup(name, limit):
    root, version = memory_cgroup_root()
    if root is None:
        sys.exit("finetune_ab: no memory cgroup to put a limit on (/proc/self/cgroup)")
    path = os.path.join(root, name)
    if os.path.isdir(path):
        os.rmdir(path)
    os.mkdir(path)
    with open(os.path.join(path, "memory.limit_in_bytes" if version == "v1" else "memory.max"),
              "w") as f:
        f.write(str(limit))
    return path


class Rank:
    """One rank's process: output lines stamped on arrival into a log, rusage at exit."""

    def __init__(self, command, env, log_path, cgroup):
        def enter_cgroup():
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        self.lines = []  # (seconds since the epoch, line)
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        preexec_fn=enter_cgroup if cgroup else None)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def finish(self, status, usage):
        """Records the exit `status` and rusage os.wait4 returned; the exit code and peak MiB."""
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self.reader.join()
        self.log.close()
        return self.process.returncode, usage.ru_maxrss / 1024  # KiB on Linux


def wait_all(ranks):
    """Waits for every rank (any order); the first to fail ends the others, which would
    otherwise wait for it in a collective until their timeout. [(exit code, peak MiB)]."""
    by_pid = {rank.process.pid: i for i, rank in enumerate(ranks)}
    results = [None] * len(ranks)
    while by_pid:
        pid, status, usage = os.wait4(-1, 0)
        if pid not in by_pid:
            continue
        i = by_pid.pop(pid)
        results[i] = ranks[i].finish(status, usage)
        if results[i][0] != 0:
            for other in by_pid:
                os.kill(other, signal.SIGTERM)
    return results


def run_side(args, side, case, folder, tokens, lora_rank, lr, limit, quantize):
    """Starts W ranks of one side, waits for all; returns the measurements."""
    out = os.path.join(args.cache, "runs", f"{case}_{side}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    common = [f"--from={folder}", f"--data={tokens}", f"--steps={args.steps}",
              f"--context={args.context}", f"--batch_size={args.batch_size}", f"--lr={lr}",
              "--warmup_steps=0", f"--seed={args.seed}", f"--lora_rank={lora_rank}",
              f"--quantize={quantize}"]
    if lora_rank:  # the peer's default; ours asks for targets where PEFT has no default
        common.append("--lora_target_modules=q_proj,v_proj")
    if side == "ours":
        command = [args.finetune, *common, f"--out_dir={out}/out", "--log_interval=1",
                   "--checkpoint_interval=0", f"--world_size={args.world_size}"]
    else:
        command = [sys.executable, PEER, *common]
    port = free_port()
    ranks, cgroups = [], []
    start = time.time()
    for r in range(args.world_size):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
        cgroup = make_cgroup(f"finetune_ab_{os.getpid()}_{r}", limit) if limit else None
        ranks.append(Rank(command, env, f"{out}/rank{r}.log", cgroup))
        cgroups.append(cgroup)
    results = wait_all(ranks)
    for cgroup in filter(None, cgroups):
        os.rmdir(cgroup)
    wall = time.time() - start
    lead = ranks[0].lines
    step_line = re.compile(r"step (\d+)/\d+ \| loss ([0-9.]+)")
    steps = [(t, m) for t, line in lead for m in [step_line.search(line)] if m]
    losses = [float(m.group(2)) for _, m in steps]
    if side == "ours" and os.path.exists(f"{out}/out/metrics.csv"):  # the loss to 7 digits
        with open(f"{out}/out/metrics.csv") as f:
            rows = [line.split(",") for line in f if line[:1].isdigit()]
        losses = [float(row[1]) for row in rows] or losses
    tokens_per_s = None
    if len(steps) == args.steps and args.steps > 1:
        seconds = steps[-1][0] - steps[0][0]
        tokens_per_s = args.batch_size * args.context * (args.steps - 1) / seconds
    plan = None
    for _, line in lead:
        # "memory plan: ... = peak 2.57 GiB (2636 MiB) per rank"
        m = re.search(r"memory plan:.*= peak .*?\(([0-9]+) MiB\) per rank", line)
        if m:
            plan = float(m.group(1).replace(",", ""))
            break
    codes = [c for c, _ in results]
    status = "ok" if all(c == 0 for c in codes) else (
        "OOM-killed" if limit and -signal.SIGKILL in codes else f"failed {codes}")
    return dict(side=side, codes=codes, peaks=[p for _, p in results], wall=wall,
                tokens_per_s=tokens_per_s, losses=losses, plan=plan, status=status, log=out)


def goal(case, folder_bytes, numel, world_size, limit, ours, peer, nf4_bytes=0):
    """(what issues 36, 46 and 47 ask of ours in this case, whether met)."""
    largest = max(ours["peaks"])
    ratio = (ours["tokens_per_s"] or 0) / peer["tokens_per_s"] if peer["tokens_per_s"] else 0
    if case in ("lora", "lora_bf16"):
        bound = folder_bytes / 2 / MIB + 800
        return (f"<= {bound:,.0f} MiB (folder / 2 + 800), >= 1.2x peer tokens/s",
                ours["status"] == "ok" and largest <= bound and ratio >= 1.2)
    if case == "qlora":
        bound = nf4_bytes / 2 / MIB + 800
        return (f"<= {bound:,.0f} MiB (NF4 folder / 2 + 800)",
                ours["status"] == "ok" and largest <= bound)
    if case == "full":
        bound = 1.05 * 16 * numel / world_size / MIB + 450
        return (f"<= {bound:,.0f} MiB (1.05 x 16 B x P / W + 450)",
                ours["status"] == "ok" and largest <= bound)
    if case in ("moe_full", "moe_lora"):
        bound = max(peer["peaks"]) if peer["status"] == "ok" else None
        return (f">= 1.2x peer tokens/s, largest <= peer's "
                f"({fmt(bound, ',.0f')} MiB)", ours["status"] == "ok" and ratio >= 1.2 and
                bound is not None and largest <= bound)
    if case == "limit":
        return (f"trains under memory limit {limit / MIB:,.0f} MiB per rank (folder "
                f"{folder_bytes / MIB:,.0f} MiB)", ours["status"] == "ok")
    return "losses agree", None


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(args, rows):
    head = ("| case | side | W | tokens/s | ours/peer | peak RSS per rank (MiB) | largest | "
            "plan MiB | measured/plan | goal (ours) | met | status | wall s | first loss | "
            "last loss |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for row in rows:
        r = row["result"]
        largest = max(r["peaks"])
        body += (f"| {row['case']} | {r['side']} | {args.world_size} | "
                 f"{fmt(r['tokens_per_s'], '.1f')} | "
                 f"{row.get('ratio', '')} | {', '.join(f'{p:,.0f}' for p in r['peaks'])} | "
                 f"{largest:,.0f} | {fmt(r['plan'], ',.0f')} | "
                 f"{fmt(largest / r['plan'] if r['plan'] else None, '.2f')} | "
                 f"{row.get('goal', '')} | "
                 f"{row.get('met', '')} | {r['status']} | {r['wall']:.0f} | "
                 f"{fmt(r['losses'][0] if r['losses'] else None, '.5f')} | "
                 f"{fmt(r['losses'][-1] if r['losses'] else None, '.5f')} |\n")
    return head + body


def machine():
    load = os.getloadavg()
    return (f"{os.cpu_count()} cores ({platform_cpu()}), load average before the run "
            f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def platform_cpu():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def write_readme(args, command, machine_words, settings, text, notes):
    path = os.path.join(ROOT, "benchmarks", "README.md")
    with open(path) as f:
        readme = f.read()
    title = "## Fine-tuning against transformers + FSDP2"
    section = (f"{title}\n\n<!-- written by benchmarks/finetune_ab.py --write_readme -->\n"
               f"Command:\n\n    {command}\n\nMachine: {machine_words}. {settings}\n\n{text}\n"
               f"{notes}")
    begin = readme.find(title)
    if begin < 0:
        readme = readme.rstrip("\n") + "\n\n" + section
    else:
        end = readme.find("\n## ", begin + len(title))
        readme = readme[:begin] + section + (readme[end + 1:] if end >= 0 else "")
    with open(path, "w") as f:
        f.write(readme)


def main():
    args = parse_args()
    if args.make_folder:
        make_folder(*args.make_folder)
        return 0
    if args.make_nf4_folder:
        make_nf4_folder(*args.make_nf4_folder)
        return 0
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"finetune_ab: unknown case(s) {unknown}; known: {', '.join(CASES)}")
    if args.batch_size % args.world_size:
        sys.exit(f"finetune_ab: --batch_size {args.batch_size} must be a multiple of --world_size")
    if not args.finetune:
        subprocess.run(["bazel", "build", "-c", "opt", "//examples/llama:finetune"], cwd=ROOT,
                       check=True)
        bin_dir = subprocess.run(["bazel", "info", "-c", "opt", "bazel-bin"], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout.strip()
        args.finetune = os.path.join(bin_dir, "examples", "llama", "finetune")
    os.makedirs(args.cache, exist_ok=True)
    machine_words = machine()
    settings = (f"W = {args.world_size} on the CPU (Gloo), one intra-op thread per rank; fp32 "
                f"folders trained in fp32, bf16 folders with bf16 compute; "
                f"{args.steps} steps of a global batch of {args.batch_size} windows of "
                f"{args.context} tokens, AdamW (weight decay 0, no warm-up, cosine to lr / 10), "
                f"seed {args.seed}; tokens/s over steps 2-{args.steps}.")
    print(f"machine: {machine_words}\nsettings: {settings}", flush=True)
    tokens = make_tokens(args)
    rows = []
    losses_ok = True
    for case in cases:
        model, lora_rank, limited, lr, dtype, quantize = CASES[case]
        folder = prepare(args, model, dtype)
        folder_bytes, numel = folder_stats(folder)
        nf4_bytes = folder_stats(prepare(args, model, dtype, nf4=True))[0] if quantize == "nf4" else 0
        limit = args.limit_mib * MIB if limited else args.memory_max
        print(f"{case}: {model} ({numel:,} parameters, {dtype} folder "
              f"{folder_bytes / MIB:,.0f} MiB"
              f"{', NF4 folder %.0f MiB' % (nf4_bytes / MIB) if nf4_bytes else ''}), "
              f"{'LoRA rank %d' % lora_rank if lora_rank else 'full'}"
              f"{', NF4 base' if quantize == 'nf4' else ''}"
              f"{', memory limit %d MiB per rank' % (limit // MIB) if limit else ''}", flush=True)
        ours = run_side(args, "ours", case, folder, tokens, lora_rank, lr, limit, quantize)
        peer = run_side(args, "peer", case, folder, tokens, lora_rank, lr, limit, quantize)
        for r in (ours, peer):
            print(f"  {r['side']}: {r['status']}, tokens/s {fmt(r['tokens_per_s'], '.2f')}, "
                  f"peak RSS "
                  f"{[round(p) for p in r['peaks']]} MiB, wall {r['wall']:.0f} s, losses "
                  f"{r['losses']} (logs: {r['log']})", flush=True)
        what, met = goal(case, folder_bytes, numel, args.world_size, limit, ours, peer, nf4_bytes)
        ratio = ("%.2f" % (ours["tokens_per_s"] / peer["tokens_per_s"])
                 if ours["tokens_per_s"] and peer["tokens_per_s"] else "-")
        rows.append(dict(case=case, result=ours, ratio=ratio, goal=what,
                         met="-" if met is None else ("yes" if met else "no")))
        rows.append(dict(case=case, result=peer))
        if args.check_losses > 0:
            a, b = ours["losses"], peer["losses"]
            ok = len(a) == len(b) == args.steps and all(
                abs(x - y) <= args.check_losses * abs(y) for x, y in zip(a, b))
            print(f"  losses: ours {a}, peer {b}: {'agree' if ok else 'DIFFER'} within "
                  f"{args.check_losses:g} relative", flush=True)
            losses_ok &= ok
    text = table(args, rows)
    print("\n" + text, flush=True)
    if args.write_readme:
        command = "~/.cache/fsdp/torch-2.11.0/bin/python benchmarks/finetune_ab.py " + " ".join(
            a for a in sys.argv[1:] if not a.startswith("--finetune"))
        load = os.getloadavg()
        machine_words += (f", after it {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (the machine is "
                          "shared: other builds running alongside slow both sides)")
        write_readme(args, command.strip(), machine_words, settings, text, NOTES)
    return 0 if losses_ok else 1


NOTES = """The peer (benchmarks/peer/hf_fsdp2_finetune.py) builds the model on the meta device,
adds PEFT's adapters, applies `fully_shard` to each decoder layer and the root, then
`to_empty` and each rank reads only its rows of each weight with safetensors' `safe_open`
(`get_slice`), one tensor at a time: leaner than `set_model_state_dict(...,
broadcast_from_rank0=True)`, where rank 0 holds a whole copy of the model while it
broadcasts. Both sides start from the same folder and see the same windows; tokens/s is
measured the same way for both (the runner stamps rank 0's per-step lines as they arrive,
steps 2 to N). Peak RSS is each process's `ru_maxrss` from `os.wait4` (file pages it
mapped count too; Python with torch, transformers and PEFT imported is about 1 GiB of the
peer's). Wall time includes loading, and for ours writing OUT/hf (and OUT/adapter), which the
peer does not do. The LoRA adapters are drawn from the same seed by both, but not with the
same draws, so the losses after the first step differ slightly; the first step's loss is
that of the same weights on the same tokens (on the full fine-tune every step agrees: see
tests:finetune_ab_test). Goals are issues 36's, 46's and 47's, for ours; "plan MiB" is the peak of our
trainer's `memory plan:` line (rank 0), printed before it reads a weight.

The lora_bf16 and qlora cases (issue 46) start from the same random model saved in bf16.
QLoRA's peer loads the whole folder on every rank through bitsandbytes (NF4, double
quantization, bf16 quant storage: with the default uint8 storage `fully_shard` refuses
the weights, "only Tensors of floating point dtype can require gradients"), then adds
PEFT's adapters and shards. It runs, but FSDP2 over bitsandbytes' `Params4bit` does not
train correctly on the CPU: from the second step its losses leave everyone else's (10.95
at step 2 against 10.73 for ours and for the peer without `fully_shard` on one process,
`--fsdp=0`, which gives 10.77201, 10.73060, 10.75242 over 3 steps at W = 1 against ours
at W = 1 10.77345, 10.73260, 10.75077). Ours computes the first step's loss 1.8e-6 from
transformers in fp32 over the same dequantized weights (10.77347); transformers in bf16
over them gives 10.77476 and bitsandbytes' CPU kernels 10.77201, both within 1.4e-4.
Ours dequantizes each projection in forward and again in backward (Note [Dequantizing
NF4 on the CPU] in fsdp/formats/nf4.cc). Converting each element to bf16 one at a time,
ours ran at 53-57 tokens/s against the peer's 70-72 (0.76-0.79x; three runs alternating,
2026-12-07); from a per-block table looked up 32 values at a time with SSSE3, at 84-88
against 67-69 (1.25-1.28x), with the same losses to the last digit.

The moe_full and moe_lora cases (issue 47) start from a random 1.02 B-parameter Qwen3-MoE
saved in bf16. Both sides add the router's load-balancing loss (router_aux_loss_coef 0.001,
transformers' `output_router_logits=True`), and both gather a decoder layer's 64 experts
at once: the peer's `fully_shard` wraps each layer, and ours makes each layer a unit by
default. transformers runs the experts with `grouped_mm`, ours one matrix product per
expert over the tokens routed to it, with two choices that the figures depend on
(models/moe.cc):
- Each expert's weights come from the fused tensor by one `unbind` (Note [Each expert's
  weights by unbind]). Taken one `select` at a time, each expert's weight gradient was a
  zero-filled tensor the size of all 64 experts, summed 64 times per weight: moe_full ran
  at 12.2 tokens/s against the peer's 13.9 (0.88x) on the Xeon below, 42 tokens/s after.
- In bf16 on the CPU each expert's rows are padded to a multiple of 8 (Note [Expert rows
  in multiples of 8]). oneDNN builds and keeps a kernel, with buffers of its own, for each
  matrix shape, and exact rows gave it a new shape whenever an expert's number of tokens
  changed. Before the padding moe_lora peaked at 1.20x its plan while its tensors peaked
  at the plan's figure. Measured on a 2-core Intel Xeon with AVX-512 BF16 and AMX
  (2026-12-07; rank 0's mappings read from `/proc/PID/smaps` at its largest resident set,
  5 steps, plan 1,528 MiB, tensors' tracked peak 1,329 MiB):

| setting | anonymous mappings | glibc heap | largest rank | / plan | tokens/s |
|---|---|---|---|---|---|
| exact rows (a521356) | 1,310 MiB | 428 MiB | 1,827 MiB | 1.20 | 129 |
| exact rows, `ONEDNN_PRIMITIVE_CACHE_CAPACITY=128` | | 374 MiB | 1,764 MiB | 1.15 | 109 |
| exact rows, `ONEDNN_PRIMITIVE_CACHE_CAPACITY=0` | | | 1,694 MiB | 1.11 | 71 |
| exact rows, `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=65536` | 1,590 MiB | 112 MiB | 1,792 MiB | 1.17 | 113 |
| rows padded to a multiple of 8 | 1,297 MiB | 168 MiB | 1,558 MiB | 1.02 | 127 |

The anonymous mappings are fsdp's caching CPU allocator's blocks (tensors of 256 KiB or
more); the heap holds what is allocated below that size. The excess was ~280 MiB of heap
blocks of 64-256 KiB that are not tensors (fsdp's allocator taking tensors down to 64 KiB
moved none of them). The plan counts the most zero rows the padding can add (7 per expert
that has tokens), so it stays an upper bound of what autograd holds.
On a CPU without bf16 instructions (AVX2 only: no AVX-512 BF16, no AMX) every bf16 case
means little: a bf16 matrix product ran 70x slower than fp32 there (0.9 against 66
GFLOP/s, 2026-12-06), moe_lora ran at 4 tokens/s, and its peak was 0.98x its plan, since
oneDNN's bf16 kernels and their cache are not used on such a CPU.
"""


if __name__ == "__main__":
    sys.exit(main())
