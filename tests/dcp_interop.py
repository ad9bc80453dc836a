"""The PyTorch half of dcp_interop_test.sh: the GPT example's model (benchmarks/peer's
Gpt) under fully_shard over Gloo, AdamW, and Distributed Checkpoint folders.

  dcp_interop.py DIR   1. dcp.load of DIR/cpp_ckpt (fsdp, W = 2) into fully_shard at W = 3
                          and 1: the model equals DIR/cpp_full.pt exactly, and 20 more
                          steps match DIR/cpp_losses.txt within 1e-4
                       2. dcp_to_torch_save of DIR/cpp_ckpt holds DIR/cpp_full.pt's tensors
                       3. fully_shard at W = 2: 2 steps, dcp.save to DIR/py_ckpt, the full
                          model to DIR/py_full.pt, 20 more steps' losses to py_losses.txt

Each rank is a spawned process that ends on its own terms (worker): once its work is done
it meets the others at a barrier, destroys the process group and leaves with os._exit.
destroy_process_group does not free the Gloo backend here: DTensor's sharding-propagation
caches (module globals) keep DTensorSpecs, their DeviceMesh and through it the process
group alive (the FileStore file, removed when the last reference to the group goes, is
still there after destroy_process_group and gc.collect). A spawned process that returns
normally therefore tears Gloo down during Python's interpreter finalization, racing its
own worker threads and the autograd engine's, and a rank whose work had succeeded
sometimes aborted there ("terminate called without an active exception", exit -6, as
PyTorch issue 190489 reports). os._exit skips that teardown; results were already written
(SimpleQueue.put writes to the pipe before returning; files are closed).
"""
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                                "peer"))
from fsdp2_gpt import Gpt  # noqa: E402

VOCAB, CONTEXT, ROWS, STEPS = 23, 8, 6, 20  # as dcp_interop.cc


def tokens(step):
    return (torch.arange(ROWS * (CONTEXT + 1)).view(ROWS, CONTEXT + 1) * 7 + step * 3) % VOCAB


def build():
    torch.manual_seed(0)
    model = Gpt(VOCAB, CONTEXT, 16, 2, 2)
    for module in model.modules():
        if type(module).__name__ == "Block":
            fully_shard(module)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, step, rank, world):
    rows = ROWS // world
    batch = tokens(step)[rank * rows:(rank + 1) * rows]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(batch[:, :CONTEXT]).reshape(-1, VOCAB),
                           batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def full_model(model):
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))


def load_ours(rank, world, out, results):
    model, optimizer = build()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, checkpoint_id=f"{out}/cpp_ckpt")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    full = full_model(model)
    if rank == 0:
        want = torch.load(f"{out}/cpp_full.pt")
        assert sorted(full) == sorted(want), "the keys differ from cpp_full.pt's"
        diff = max((full[k] - want[k]).abs().max().item() for k in want)
        groups = optimizer.param_groups
        results.put((state["step"], diff, groups[0]["lr"], groups[0]["betas"]))
    losses = [train_step(model, optimizer, step, rank, world) for step in range(2, 2 + STEPS)]
    if rank == 0:
        results.put(losses)


def save_ours(rank, world, out, results):
    model, optimizer = build()
    for step in range(2):
        train_step(model, optimizer, step, rank, world)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": 2}, checkpoint_id=f"{out}/py_ckpt")
    full = full_model(model)
    if rank == 0:
        torch.save(full, f"{out}/py_full.pt")
    losses = [train_step(model, optimizer, step, rank, world) for step in range(2, 2 + STEPS)]
    if rank == 0:
        results.put(losses)


def worker(rank, world, store, fn, out, results):
    torch.set_num_threads(1)
    status = 1
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        fn(rank, world, out, results)
        dist.barrier()  # no rank tears its connections down while a peer still uses them
        dist.destroy_process_group()
        status = 0
    except BaseException:  # noqa: B036: reported, then the exit status says it
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # results.put wrote to the pipe already; see the module docstring


def run(fn, world, out, tag):
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    store = f"{out}/store_{tag}_{world}"
    processes = [context.Process(target=worker, args=(r, world, store, fn, out, results))
                 for r in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"{fn.__name__} at W = {world}: a rank exited with {p.exitcode}")
    gathered = []
    while not results.empty():
        gathered.append(results.get())
    return gathered


def main(out):
    cpp_losses = [float(line) for line in open(f"{out}/cpp_losses.txt")]
    status = 0
    for world in (3, 1):
        (step, diff, lr, betas), losses = run(load_ours, world, out, "load")
        worst = max(abs(a - b) for a, b in zip(losses, cpp_losses))
        print(f"fsdp DCP in fully_shard W = {world}: step {step}, lr {lr}, betas {betas}, "
              f"max |tensor difference| = {diff:.3g}, max |loss difference| over {STEPS} "
              f"steps = {worst:.3g}")
        if step != 2 or diff != 0 or worst > 1e-4 or lr != 1e-2 or tuple(betas) != (0.9, 0.999):
            status = 1
    dcp_to_torch_save(f"{out}/cpp_ckpt", f"{out}/cpp_torch_save.pt")
    converted = torch.load(f"{out}/cpp_torch_save.pt")
    want = torch.load(f"{out}/cpp_full.pt")
    same = sorted(converted["model"]) == sorted(want) and all(
        torch.equal(converted["model"][k], want[k]) for k in want)
    print(f"dcp_to_torch_save of fsdp's folder: keys {sorted(converted)}, model equal to "
          f"fsdp's full state dict: {same}, step {converted['step']}, "
          f"{len(converted['optim']['state'])} parameters with optimizer state")
    if not same or converted["step"] != 2:
        status = 1
    (losses,) = run(save_ours, 2, out, "save")
    with open(f"{out}/py_losses.txt", "w") as f:
        f.writelines(f"{loss!r}\n" for loss in losses)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
