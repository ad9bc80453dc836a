"""PyTorch's side of the comparison with fsdp: the GPT of examples/gpt under FSDP2.

Trains the same model as benchmarks/peer/gpt_fsdp.cc (same architecture, parameter
names and shapes) from the same prepared weights and token batches, with PyTorch 2.11's
`fully_shard` on every block and on the root, or DistributedDataParallel for NO_SHARD,
and writes the same JSON. Run with the pinned environment's torchrun:

    torchrun --nproc_per_node=2 benchmarks/peer/fsdp2_gpt.py --data=DIR --heads=4 \
        --strategy=full_shard --out=peer.json

Strategies: full_shard = fully_shard(reshard_after_forward=True) (the root keeps its
parameters after forward, as fsdp's root does), shard_grad_op = reshard_after_forward
False, no_shard = DDP. AdamW(lr, weight_decay=0.01), fp32, constant learning rate, one
intra-op thread per rank. tests/pytorch_interop.py imports its Gpt. gpt_fsdp.cc's file
comment defines the batches and every JSON field; "peak_allocated_mb" is absent here
because PyTorch counts no CPU allocations.

On a GPU (issue 18 item 6; tools/gpu_bundle_run.sh runs it at W = 1 with the torchrun
variables set by hand): `--device cuda` puts rank r on cuda:LOCAL_RANK with NCCL, and
`--mixed_precision bf16` gives fully_shard MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32), as gpt_fsdp.cc's --mixed_precision=bf16. Each step then ends with
torch.cuda.synchronize(); "peak_allocated_mb" is torch.cuda.max_memory_allocated() (reset
just before the first step), and "device", "device_name", "mixed_precision" and
"parameters" are added.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)); examples/gpt's BlockImpl."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads)
                   .permute(2, 0, 3, 1, 4).unbind(0))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Gpt(nn.Module):
    """Token and position embeddings, blocks, final norm, head tied to the embedding."""

    def __init__(self, vocab, context, width, heads, layers):
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens):
        x = self.token(tokens) + self.position(torch.arange(tokens.size(1), device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.token.weight.t()


def status_mb(field):
    """A field of /proc/self/status ("VmRSS", "VmHWM") in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return -1.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with init.pt and batches.pt")
    parser.add_argument("--out", required=True, help="where rank 0 writes the JSON")
    parser.add_argument("--strategy", default="full_shard",
                        choices=["full_shard", "shard_grad_op", "no_shard"])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup_steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mixed_precision", default="none", choices=["none", "bf16"])
    args = parser.parse_args()

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    init = torch.load(os.path.join(args.data, "init.pt"))
    tokens = torch.load(os.path.join(args.data, "batches.pt"))["tokens"].to(device)
    steps, batch, context = tokens.size(0), tokens.size(1), tokens.size(2) - 1
    if batch % world:
        raise SystemExit(f"the prepared batch of {batch} sequences does not split evenly "
                         f"over {world} ranks")
    layers = sum(1 for name in init if name.endswith(".qkv.weight"))
    vocab, width = init["token.weight"].shape
    model = Gpt(vocab, init["position.weight"].size(0), width, args.heads, layers)
    model.load_state_dict(init)
    model.to(device)
    parameters = sum(p.numel() for p in model.parameters())
    if args.strategy == "no_shard":
        model = DistributedDataParallel(model)
        side = "ddp"
    else:
        mesh = init_device_mesh(device.type, (world,))
        reshard = args.strategy == "full_shard"
        mp_policy = MixedPrecisionPolicy()
        if args.mixed_precision == "bf16":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
        side = "fsdp2"
    adamw = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    local = batch // world
    losses, step_ms = [], []
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := VmRSS
    start_rss = status_mb("VmRSS")
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(steps):
        rows = tokens[step, rank * local:(rank + 1) * local]
        begin = time.perf_counter()
        adamw.zero_grad()
        logits = model(rows[:, :context])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                               rows[:, 1:].reshape(-1))
        loss.backward()
        adamw.step()
        if cuda:
            torch.cuda.synchronize(device)
        step_ms.append((time.perf_counter() - begin) * 1e3)
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)  # Gloo has no AVG
        losses.append(mean.item() / world)
    if rank == 0:
        warmup = min(args.warmup_steps, steps - 1)
        result = {
            "side": side, "strategy": args.strategy, "world_size": world, "width": width,
            "losses": losses, "step_ms": step_ms,
            "tokens_per_s": (steps - warmup) * batch * context / (sum(step_ms[warmup:]) / 1e3),
            "peak_rss_mb": status_mb("VmHWM"), "start_rss_mb": start_rss,
        }
        if cuda:
            result.update({
                "peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 1e6,
                "device": str(device), "device_name": torch.cuda.get_device_name(device),
                "mixed_precision": args.mixed_precision, "parameters": parameters,
            })
        with open(args.out, "w") as out:
            json.dump(result, out)
    dist.barrier()
    # Leave without tearing down Gloo: at W = 4 its teardown once aborted a rank
    # ("terminate called without an active exception") and once left two ranks waiting,
    # after every result was written.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
