#!/usr/bin/python3
"""Writes RESULTS.md and the gnuplot inputs from the outputs of benchmarks/run_all.

  report.py --raw DIR --out DIR --command "benchmarks/run_all ..."

DIR (--raw) holds gpt.json, collectives.json, plan.json (Google Benchmark JSON, every
repetition), plan_seed.txt (plan_benchmark's comparison with PyTorch's Python) and
peer/WIDTH_W_STRATEGY_REP_{ours,peer}.json (benchmarks/peer: fsdp and PyTorch's FSDP2
or DDP on the same GPT, batches and weights).
Every figure is the median over repetitions with [min, max]; ratios are per repetition
(both sides measured in the same run) and then summarised the same way. Writes
OUT/RESULTS.md and OUT/plot_data/*.dat for plots.gp.
"""

import argparse
import collections
import datetime
import json
import os
import re
import statistics
import subprocess


def load_runs(path):
    """run name (without /iterations:, /manual_time, ...) -> list of per-repetition dicts."""
    runs = collections.OrderedDict()
    if not os.path.exists(path):
        return runs
    with open(path) as f:
        data = json.load(f)
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration":
            continue
        name = re.sub(r"/(iterations|repeats):\d+|/(manual|real)_time", "", b["run_name"])
        runs.setdefault(name, []).append(b)
    return runs


class Stat:
    """Median, min and max of one counter over repetitions."""

    def __init__(self, values):
        self.values = values
        self.median = statistics.median(values) if values else float("nan")
        self.min = min(values) if values else float("nan")
        self.max = max(values) if values else float("nan")

    def fmt(self, digits=2):
        if not self.values:
            return "-"
        if len(self.values) == 1:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} [{self.min:.{digits}f}, {self.max:.{digits}f}]"

    def dat(self):
        return f"{self.median:.6g} {self.min:.6g} {self.max:.6g}"


def stat(reps, key, scale=1.0):
    return Stat([r[key] * scale for r in reps if key in r])


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


STRATEGIES = ["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"]


def write_dat(dat, name, columns, lines):
    """One file per curve for plots.gp: NAME_CURVE.dat."""
    for curve, rows in lines.items():
        with open(dat(f"{name}_{curve}"), "w") as f:
            f.write(f"# {columns}\n" + "\n".join(rows) + "\n")


def memory_section(gpt, dat):
    rows = []
    lines = collections.defaultdict(list)  # strategy -> plot rows
    for w in (1, 2, 4):
        if w == 1 and "BM_Strategy/FULL_SHARD/W:1" in gpt:
            reps = gpt["BM_Strategy/FULL_SHARD/W:1"]
            rows.append([1, "plain LibTorch", stat(reps, "ref_peak_MB").fmt(),
                         stat(reps, "ref_mem_formula_MB").fmt(),
                         stat(reps, "ref_mem_ratio").fmt(3)])
        for s in STRATEGIES:
            reps = gpt.get(f"BM_Strategy/{s}/W:{w}")
            if not reps:
                continue
            peak, formula = stat(reps, "peak_MB"), stat(reps, "mem_formula_MB")
            ratio = stat(reps, "mem_ratio")
            rows.append([w, "every strategy (runs as NO_SHARD)" if w == 1 else s,
                         peak.fmt(), formula.fmt(), ratio.fmt(3)])
            lines[s].append(f"{w} {peak.dat()} {formula.median:.6g} {ratio.dat()}")
    write_dat(dat, "memory", "W peak(median min max) formula ratio(median min max)", lines)
    return ("## 1. Memory: per-rank peak of model state\n\n"
            "Rank 0's peak bytes during one training step (tracking allocator, training thread "
            "only), against REFERENCE §5 (see the formulas in gpt_step_benchmark.cc). "
            "Target: ratio within 1 ± 0.10.\n\n"
            + table(["W", "strategy", "peak MB", "formula MB", "ratio"], rows)
            + "\n![memory](memory.png)\n")


def traffic_section(gpt, dat):
    rows = []
    lines = collections.defaultdict(list)
    for w in (2, 4):
        for s in STRATEGIES:
            reps = gpt.get(f"BM_Strategy/{s}/W:{w}")
            if not reps:
                continue
            wire, formula = stat(reps, "wire_MB"), stat(reps, "wire_formula_MB")
            lo = Stat([r["lo_ratio"] * r["wire_formula_MB"] for r in reps])
            rows.append([w, s, wire.fmt(3), lo.fmt(3), formula.fmt(3),
                         stat(reps, "wire_ratio").fmt(4), stat(reps, "lo_ratio").fmt(4)])
            lines[s].append(f"{w} {wire.dat()} {lo.dat()} {formula.median:.6g}")
    write_dat(dat, "traffic", "W counters_MB(m,min,max) lo_MB(m,min,max) formula_MB", lines)
    return ("## 2. Traffic: bytes sent per rank per step\n\n"
            "From the communicator's counters (mean per step) and from the `lo` tx counter "
            "of /proc/net/dev (all ranks' loopback bytes / W in the timed step that sent "
            "least: TCP/IP headers count, and so does other processes' loopback traffic, "
            "which only adds), against REFERENCE §4 (FULL_SHARD "
            "3 Psi s (W-1)/W, the others 2 Psi s (W-1)/W). Target: within 5%.\n\n"
            + table(["W", "strategy", "counters MB", "lo MB", "formula MB",
                     "counters / formula", "lo / formula"], rows)
            + "\n![traffic](traffic.png)\n")


def step_section(gpt):
    rows = []
    for w in (1, 2, 4):
        for s in STRATEGIES:
            reps = gpt.get(f"BM_Strategy/{s}/W:{w}")
            if not reps:
                continue
            base = "plain LibTorch" if w == 1 else "NO_SHARD"
            has_ref = "time_ratio" in reps[0]
            rows.append([w, s + (" (runs as NO_SHARD)" if w == 1 else ""),
                         stat(reps, "ms").fmt(1),
                         base if has_ref else "-",
                         stat(reps, "ref_ms").fmt(1) if has_ref else "-",
                         stat(reps, "time_ratio").fmt(3) if has_ref else "-"])
    prefetch = []
    for p in ("BACKWARD_PRE", "BACKWARD_POST", "FORWARD"):
        reps = gpt.get(f"BM_Prefetch/{p}/W:2")
        if not reps:
            continue
        prefetch.append([p if p != "FORWARD" else "forward + BACKWARD_PRE",
                         stat(reps, "ms").fmt(1), stat(reps, "ref_ms").fmt(1),
                         stat(reps, "time_ratio").fmt(3), stat(reps, "peak_MB").fmt(2),
                         stat(reps, "ref_peak_MB").fmt(2)])
    return ("## 3. Step time\n\n"
            "One step (zero_grad, forward, backward, Adam) per rank, stepped alternately "
            "with its baseline in the same run; the ratio is ours / baseline. Targets: "
            "FSDP at W = 1 within 1.05 of plain LibTorch.\n\n"
            + table(["W", "strategy", "ms", "baseline", "baseline ms", "ratio"], rows)
            + "\n### Prefetch (FULL_SHARD, W = 2, against no prefetch)\n\n"
            + table(["prefetch", "ms", "no-prefetch ms", "ratio", "peak MB",
                     "no-prefetch peak MB"], prefetch)
            + "\nAll-gather limit: fsdp has no `limit_all_gathers` option; prefetching is "
            "one unit ahead by construction (Note [Prefetching] in "
            "fsdp/core/internal/runtime.cc), so at most one all-gather is in flight "
            "besides the one being waited for, which is what the limit enforces in "
            "PyTorch.\n")


def scaling_section(gpt, dat):
    rows = []
    lines = collections.defaultdict(list)
    for name, reps in gpt.items():
        m = re.match(r"BM_ModelSize/width:(\d+)/W:2", name)
        if not m:
            continue
        psi = stat(reps, "psi_M")
        full_ms, no_ms = stat(reps, "ms"), stat(reps, "ref_ms")
        full_mb, no_mb = stat(reps, "peak_MB"), stat(reps, "ref_peak_MB")
        full_f, no_f = stat(reps, "mem_formula_MB"), stat(reps, "ref_mem_formula_MB")
        rows.append([m.group(1), f"{psi.median:.2f}", full_ms.fmt(1), no_ms.fmt(1),
                     stat(reps, "time_ratio").fmt(3), full_mb.fmt(1),
                     f"{full_f.median:.1f}", no_mb.fmt(1), f"{no_f.median:.1f}"])
        lines["W2"].append(f"{psi.median:.6g} {full_ms.dat()} {no_ms.dat()} {full_mb.dat()} "
                           f"{no_mb.dat()} {full_f.median:.6g} {no_f.median:.6g}")
    write_dat(dat, "scaling", "psi_M full_ms(m,min,max) noshard_ms(m,min,max) "
              "full_MB(m,min,max) noshard_MB(m,min,max) full_formula_MB noshard_formula_MB",
              lines)
    return ("## 4. Scaling with model size (W = 2)\n\n"
            "GPT with 4 layers at four widths; FULL_SHARD against NO_SHARD stepped "
            "alternately.\n\n"
            + table(["width", "Psi (M)", "FULL_SHARD ms", "NO_SHARD ms", "ratio",
                     "FULL_SHARD peak MB", "formula", "NO_SHARD peak MB", "formula"], rows)
            + "\n![scaling time](scaling_time.png) ![scaling memory](scaling_memory.png)\n")


def planner_section(plan, seed_text, dat):
    rows = []
    lines = collections.defaultdict(list)
    for name, reps in plan.items():
        m = re.match(r"BM_Plan(Wide|Deep)/(\d+)", name)
        if not m:
            continue
        ns = stat(reps, "time_per_module", 1e9)
        rows.append([m.group(1).lower(), m.group(2), ns.fmt(1),
                     stat(reps, "real_time").fmt(0) + " " + reps[0]["time_unit"]])
        lines[m.group(1).lower()].append(f"{m.group(2)} {ns.dat()}")
    write_dat(dat, "planner", "modules ns_per_module(m,min,max)", lines)
    seed_rows = []
    exported_rows = []
    for line in seed_text.splitlines():
        parts = line.split()
        if len(parts) == 6 and parts[0] in ("wide", "deep"):
            seed_rows.append([parts[0], parts[1], parts[2], parts[3], parts[4], parts[5]])
        elif len(parts) == 9 and parts[1].isdigit():  # a .pt2 archive's row
            exported_rows.append(parts)
    return ("## 5. Planner\n\n`plan_fsdp_units` on synthetic trees (size policy, "
            "min_num_params 50; see fsdp/wrap/plan_benchmark.cc): time per module.\n\n"
            + table(["shape", "modules", "ns / module", "time per plan"], rows)
            + "\nAgainst PyTorch 2.11's own Python `_recursive_wrap` on the same trees "
            "(torch_plan_timing.py; medians of 5 plans, 1 for PyTorch above 1k modules):\n\n"
            + table(["shape", "modules", "PyTorch s", "ours s", "PyTorch / ours",
                     "ours ns/module"],
                    seed_rows)
            + "\n![planner](planner.png)\n"
            + ("\n" + EXPORTED_INTRO + "\n\n"
               + table(["model", "modules", "units", "ours read ms", "ours plan ms",
                        "torch.export.load ms", "PyTorch plan ms", "plan: PyTorch / ours",
                        "read: PyTorch / ours"], exported_rows)
               if exported_rows else ""))


EXPORTED_INTRO = (
    "`.pt2` archives (torch.export.save of tests/plan_oracle.py's models, torch 2.11, "
    "torchvision 0.26): fsdp reads each archive (`load_exported_program_tree`: the zip "
    "directory, model.json and the weights config; weight bytes are not read) and plans it "
    "(`plan_fsdp_units`, size policy, min_num_params 1e5), against PyTorch in Python: "
    "`torch.export.load` of the same archive (which also loads the weights) and FSDP's "
    "auto-wrap on the Python model (`_recursive_wrap`, then the root, and each unit's "
    "parameters, as tests/plan_oracle.py's `plan()`); medians of 5 "
    "(torch_plan_timing.py --exported).")


def collectives_section(coll, dat):
    rows = []
    lines = collections.defaultdict(list)
    for name, reps in sorted(coll.items(), key=lambda kv: kv[0].startswith("BM_C10d")):
        m = re.match(r"BM_(C10d)?(AllGather|ReduceScatter)/(\d+)$", name)
        if not m:
            continue
        size = int(m.group(3))
        busbw, algbw = stat(reps, "busbw", 1e-9), stat(reps, "algbw", 1e-9)
        rows.append([m.group(2), "c10d native" if m.group(1) else "fsdp",
                     f"{size / 1024:.0f} KiB" if size < 1 << 20 else f"{size >> 20} MiB",
                     stat(reps, "real_time", 1e-3).fmt(2), busbw.fmt(3), algbw.fmt(3),
                     stat(reps, "wire_ratio").fmt(3)])
        lines[(m.group(1) or "") + m.group(2)].append(f"{size} {busbw.dat()}")
    write_dat(dat, "busbw", "bytes_per_rank busbw_GBps(m,min,max)", lines)
    return ("## 6. Collectives (W = 2, loopback, Gloo)\n\n"
            "Bytes per rank (the shard for all-gather and reduce-scatter); nccl-tests "
            "formulas: algbw = bytes x W / t, busbw = algbw (W-1)/W, decimal GB/s. "
            "`lo / formula`: loopback bytes per rank per call over the ring formula. "
            "`fsdp` is fsdp's Gloo communicator (direct exchanges for all-gather and "
            "reduce-scatter); `c10d native` calls LibTorch 2.11's "
            "ProcessGroupGloo `_allgather_base` / `_reduce_scatter_base` directly in the "
            "same run (c10d's reduce-scatter all-reduces the whole input: see Note [Gloo "
            "collectives] in fsdp/comm/gloo.cc).\n\n"
            + table(["collective", "implementation", "bytes per rank", "time ms",
                     "busbw GB/s", "algbw GB/s", "lo / formula"], rows)
            + "\n![busbw](busbw.png)\n")


PEER_NAMES = {"fsdp2": "FSDP2", "ddp": "DDP"}


def load_peer_runs(folder):
    """(width, W, strategy) -> list over repetitions of (ours, peer) result dicts."""
    runs = collections.defaultdict(list)
    if not os.path.isdir(folder):
        return runs
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"(\d+)_(\d+)_(\w+?)_(\d+)_ours\.json", name)
        if not m:
            continue
        with open(os.path.join(folder, name)) as f:
            ours = json.load(f)
        with open(os.path.join(folder, name.replace("_ours.json", "_peer.json"))) as f:
            peer = json.load(f)
        runs[(int(m.group(1)), int(m.group(2)), m.group(3))].append((ours, peer))
    return dict(sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                     STRATEGIES.index(kv[0][2].upper()))))


def growth(result):
    """MB the resident set grew by during training (peak minus the RSS at its start)."""
    return result["peak_rss_mb"] - result["start_rss_mb"]


def peer_section(runs, dat):
    rows, ddp_rows, bars = [], [], []
    for (width, world, strategy), reps in runs.items():
        def both(f):
            return Stat([f(o) for o, _ in reps]), Stat([f(p) for _, p in reps])

        def ratio(f):
            return Stat([f(o) / f(p) for o, p in reps])

        tokens = both(lambda r: r["tokens_per_s"])
        step = both(lambda r: statistics.median(r["step_ms"]))
        rss = both(growth)
        peak = both(lambda r: r["peak_rss_mb"])
        gap = max(abs(a - b) / abs(b) for o, p in reps for a, b in zip(o["losses"], p["losses"]))
        peer = PEER_NAMES[reps[0][1]["side"]]
        rows.append([width, world, strategy.upper(), peer, tokens[0].fmt(0), tokens[1].fmt(0),
                     ratio(lambda r: r["tokens_per_s"]).fmt(2), step[0].fmt(1), step[1].fmt(1),
                     rss[0].fmt(1), rss[1].fmt(1), ratio(growth).fmt(2), peak[0].fmt(0),
                     peak[1].fmt(0), Stat([o["peak_allocated_mb"] for o, _ in reps]).fmt(1),
                     f"{gap:.1e}"])
        bars.append(f"w{width}/W{world}/{strategy.upper()}/{peer} {tokens[0].median:.6g} "
                    f"{tokens[1].median:.6g}")
        ddp = runs.get((width, world, "no_shard"))
        if strategy == "full_shard" and ddp and len(ddp) == len(reps):
            ddp_rows.append([width, world, Stat([o["tokens_per_s"] / d["tokens_per_s"]
                                                 for (o, _), (_, d) in zip(reps, ddp)]).fmt(2)])
    write_dat(dat, "peer", "configuration ours_tokens_per_s peer_tokens_per_s",
              {"tokens": bars})
    reps = len(next(iter(runs.values())))
    return ("## 7. Side by side with PyTorch FSDP2 and DDP\n\n"
            "The GPT of examples/gpt (4 layers, 4 heads, context 128, global batch 16, "
            "fp32, AdamW) trained by fsdp (benchmarks/peer/gpt_fsdp.cc, with "
            "`forward_prefetch`; backward prefetch BACKWARD_PRE, the default) and by PyTorch "
            "2.11 (benchmarks/peer/fsdp2_gpt.py: `fully_shard` on every block and the root, "
            "or DistributedDataParallel for NO_SHARD) under torchrun, from the same weights "
            "on the same batches, 23 steps each, the two alternating "
            f"({reps} repetition{'s' if reps > 1 else ''}; the first 3 steps are not timed). "
            "Ratios are ours / PyTorch. RSS growth: the peak resident set during training "
            "minus the resident set at its start (rank 0; both processes load the same "
            "LibTorch, and PyTorch's Python interpreter is in its start figure, not in its "
            "growth); peak RSS: the whole process; allocated: fsdp's tracking allocator "
            "(PyTorch counts no CPU allocations). Loss gap: the largest relative difference "
            "between the two sides' per-step losses.\n\n"
            + table(["width", "W", "strategy", "peer", "ours tok/s", "peer tok/s",
                     "tok/s ratio", "ours step ms", "peer step ms", "ours RSS growth MB",
                     "peer RSS growth MB", "RSS growth ratio", "ours peak RSS MB",
                     "peer peak RSS MB", "ours allocated MB", "loss gap"], rows)
            + "\nOurs FULL_SHARD against PyTorch DDP (tokens/s ratio, same repetition):\n\n"
            + table(["width", "W", "FULL_SHARD / DDP"], ddp_rows)
            + "\n![tokens per second, ours and PyTorch's](peer.png)\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--raw", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--repetitions", required=True)
    args = parser.parse_args()
    os.makedirs(os.path.join(args.out, "plot_data"), exist_ok=True)

    def dat(name):
        return os.path.join(args.out, "plot_data", name + ".dat")

    gpt = load_runs(os.path.join(args.raw, "gpt.json"))
    coll = load_runs(os.path.join(args.raw, "collectives.json"))
    plan = load_runs(os.path.join(args.raw, "plan.json"))
    seed_path = os.path.join(args.raw, "plan_seed.txt")
    seed_text = open(seed_path).read() if os.path.exists(seed_path) else ""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        commit += " with uncommitted changes"
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    header = (
        "# fsdp benchmark results\n\n"
        f"Written by `{args.command}` on {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC "
        f"at commit {commit}; {os.cpu_count()} CPU cores, load average {load} at the end "
        "(the machine is shared, so absolute times are noisy; ratios compare runs "
        "interleaved in the same process). Each figure: median over "
        f"{args.repetitions} repetitions, [min, max] when there are several. CPU, Gloo "
        "over loopback, fp32, Adam, one intra-op thread per rank.\n\n"
        "Model (sections 1-3): the GPT of examples/gpt, 4 layers, width 128 "
        "(model and batch: the file comment of benchmarks/gpt_step_benchmark.cc). "
        "Sources: benchmarks/gpt_step_benchmark.cc, fsdp/comm/collectives_benchmark.cc, "
        "fsdp/wrap/plan_benchmark.cc.\n\n")
    sections = [header]
    if gpt:
        sections += [memory_section(gpt, dat), traffic_section(gpt, dat), step_section(gpt),
                     scaling_section(gpt, dat)]
    if plan:
        sections.append(planner_section(plan, seed_text, dat))
    if coll:
        sections.append(collectives_section(coll, dat))
    peer = load_peer_runs(os.path.join(args.raw, "peer"))
    if peer:
        sections.append(peer_section(peer, dat))
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
        f.write("\n".join(sections))


if __name__ == "__main__":
    main()
