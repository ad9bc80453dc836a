"""transformers + PyTorch FSDP2's side of benchmarks/finetune_ab.py: one rank of a fine-tune
of a Hugging Face decoder folder (Llama, Qwen3-MoE), the same run as examples/llama:finetune's.

    RANK=r WORLD_SIZE=W MASTER_ADDR=... MASTER_PORT=... hf_fsdp2_finetune.py \
        --from=HF_DIR --data=TOKENS --steps=5 --context=128 --batch_size=2 [--lora_rank=8]

(torchrun sets the variables too.) What it does, as a careful PyTorch user would:
- AutoModelForCausalLM.from_config(HF_DIR/config.json) under `torch.device("meta")` (no
  memory), then with --lora_rank PEFT's get_peft_model (LoraConfig r, alpha, dropout and
  target modules as the trainer's flags; q_proj,v_proj by default), still on meta. A
  16-bit folder (config dtype bfloat16 or float16) is trained as the trainer's
  --mixed_precision=auto does: bf16 compute (MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)), the master weights fp32, except a LoRA run's frozen base, which
  stays in the folder's dtype (the adapters fp32: PEFT's autocast_adapter_dtype).
- With --quantize=nf4 (QLoRA): every rank loads the whole folder with from_pretrained and
  BitsAndBytesConfig (NF4, double quantization, bf16 compute, bf16 quant storage: the
  storage FSDP needs, since the default uint8 storage cannot be sharded as a parameter),
  which quantizes each Linear but lm_head as it loads; then PEFT's adapters (drawn as below).
- fully_shard (FSDP2, Gloo, a 1-D mesh of W ranks) on every decoder layer, then on the root.
- to_empty(device="cpu"), then each rank reads only its rows of each weight from the
  folder's safetensors (safe_open + get_slice of the rows torch.chunk gives rank r, which
  is DTensor's Shard(0) split) into its local shard, one tensor at a time. This is leaner than
  set_model_state_dict(..., broadcast_from_rank0=True), where rank 0 holds the whole state
  dict (a full copy of the model) while it broadcasts. A mixture of experts' fused
  `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (transformers 5.x in
  memory) are read from the folder's per-expert tensors (`mlp.experts.E.gate_proj.weight`,
  `up_proj`, `down_proj`), the rank's experts only.
- Non-persistent buffers (the rotary embedding's inv_freq) recomputed by building a fresh
  rotary module on the CPU; LoRA A drawn as PEFT does (kaiming_uniform_(a=sqrt(5))) on the
  CPU from torch.manual_seed(--seed), in module order, and B zero, then sharded as above.
- AdamW(lr, weight_decay) over the trainable parameters, learning rate as the trainer's
  (linear warm-up over --warmup_steps, then cosine to lr / 10), fp32, one intra-op thread.
- Batches as examples/llama/finetune.cc's batch(): torch.manual_seed(seed * 1000003 + step);
  starts = torch.randint(n - context - 1, (batch,)); rank r takes the r-th slice of
  batch / W windows of context + 1 tokens. The loss is the mean next-token cross-entropy of
  the rank's windows, averaged over the ranks. A mixture of experts (a config with
  router_aux_loss_coef) adds router_aux_loss_coef x the router's load-balancing loss, as
  transformers does with output_router_logits=True and as the trainer does by default; the
  experts run as transformers picks by default (grouped_mm where torch has it; printed).
Rank 0 prints `step k/N | loss X` after each step (after the all-reduce of the loss, as the
trainer), and its own peak resident set after loading and at the end.
With --device=cuda (tools/real_size_check.py) rank r runs on cuda:LOCAL_RANK over NCCL: the
shards are materialised there, each batch is copied there, and rank 0 also prints
torch.cuda.max_memory_allocated at the end. --activation_checkpointing turns on
transformers' gradient checkpointing (non-reentrant) before the adapters and fully_shard.
"""

import argparse
import json
import math
import os
import resource
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="folder", required=True)
    p.add_argument("--data", required=True, help="flat little-endian token ids")
    p.add_argument("--data_dtype", default="uint16", choices=["uint16", "uint32"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=2, help="global batch (windows)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lora_rank", type=int, default=0, help="0: full fine-tune")
    p.add_argument("--lora_alpha", type=float, default=16)
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--lora_target_modules", default="q_proj,v_proj")
    p.add_argument("--quantize", default="none", choices=["none", "nf4"])
    p.add_argument("--fsdp", type=int, default=1,
                   help="0: no fully_shard (one process: plain transformers + PEFT)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: rank r on cuda:LOCAL_RANK over NCCL")
    p.add_argument("--activation_checkpointing", action="store_true",
                   help="transformers' gradient checkpointing (non-reentrant) of every layer")
    return p.parse_args()


def folder_dtype(folder):
    """The folder's 16-bit dtype from its config.json, or None (fp32)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    name = config.get("dtype", config.get("torch_dtype"))
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name)


def learning_rate(step, peak, warmup, steps):
    """examples/trainer/run_support.cc's cosine_learning_rate."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build(args):
    """The model on meta (or, QLoRA, loaded and quantized), LoRA adapters added, every
    decoder layer and the root fully_shard."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from torch.distributed.fsdp import MixedPrecisionPolicy
    sixteen = folder_dtype(args.folder)
    base = sixteen if sixteen is not None and args.lora_rank > 0 else torch.float32
    if args.quantize == "nf4":
        from transformers import BitsAndBytesConfig
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(
            args.folder, quantization_config=quantization, dtype=base, device_map="cpu")
    else:
        config = AutoConfig.from_pretrained(args.folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=base)
    decoder_layers = list(model.model.layers)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank > 0:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(
            r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
            target_modules=args.lora_target_modules.split(","), bias="none"))
    if not args.fsdp:
        assert dist.get_world_size() == 1, "--fsdp=0 runs one process"
        return model, len(decoder_layers)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if sixteen is not None else MixedPrecisionPolicy()
    for layer in decoder_layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, len(decoder_layers)


def checkpoint_key(name):
    """The safetensors key of parameter `name` (PEFT's wrapper prefixes taken off)."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def rows_of(rank, world_size, rows):
    """Rank's rows of a Shard(0) DTensor of `rows` rows (torch.chunk's split)."""
    chunk = -(-rows // world_size)
    return min(rows, rank * chunk), min(rows, (rank + 1) * chunk)


FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def read_fused_experts(folder, weight_map, key, local, begin, end):
    """Experts begin..end-1 of the fused `key` from the folder's per-expert tensors into
    `local` (gate_up_proj: each expert's gate rows, then its up rows)."""
    prefix, kind = key.rsplit(".", 1)
    parts = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
    for e in range(begin, end):
        rows = []
        for part in parts:
            name = f"{prefix}.{e}.{part}.weight"
            with safe_open(os.path.join(folder, weight_map[name]), "pt") as f:
                rows.append(f.get_tensor(name))
        local[e - begin].copy_(torch.cat(rows))


@torch.no_grad()
def materialise(model, args):
    """to_empty, then fill every local shard: weights from the folder, adapters as PEFT.
    QLoRA: the base is loaded already; only the adapters are drawn."""
    quantized = args.quantize == "nf4"
    if not quantized:
        model.to_empty(device=torch.device(args.device, torch.cuda.current_device())
                        if args.device == "cuda" else "cpu")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    index = os.path.join(args.folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(args.folder, "model.safetensors"), "pt") as f:
            weight_map = {key: "model.safetensors" for key in f.keys()}
    torch.manual_seed(args.seed)  # every rank draws the same adapters
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        begin, end = rows_of(rank, world_size, param.shape[0]) if isinstance(
            param, DTensor) else (0, param.shape[0])
        if ".lora_A." in name or ".lora_B." in name:
            full = torch.empty(param.shape)
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5))
            else:
                full.zero_()
            local.copy_(full[begin:end])
            continue
        if quantized:
            continue
        key = checkpoint_key(name)
        if key not in weight_map and key.endswith(FUSED_EXPERTS):
            read_fused_experts(args.folder, weight_map, key, local, begin, end)
            continue
        # Opened per tensor: the file's mapping (whose touched pages count in the resident
        # set) is dropped after each copy instead of growing to this rank's share of it.
        with safe_open(os.path.join(args.folder, weight_map[key]), "pt") as f:
            local.copy_(f.get_slice(key)[begin:end])
    for module in model.modules() if not quantized else []:
        # non-persistent buffers: to_empty left garbage there
        if type(module).__name__.endswith("RotaryEmbedding"):
            fresh = type(module)(module.config)
            for buffer_name, value in fresh.named_buffers():
                getattr(module, buffer_name).copy_(value)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert args.batch_size % world_size == 0, "--batch_size must be a multiple of the world size"
    model, layers = build(args)
    materialise(model, args)
    if rank == 0:
        print(f"peak resident set after loading: "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB (rank 0)",
              flush=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"model: {numel} parameters ({sum(p.numel() for p in trainable)} trainable) "
              f"in {layers} fully_shard layers and the root over {world_size} ranks", flush=True)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=args.weight_decay)
    config = model.config
    aux_coef = getattr(config, "router_aux_loss_coef", 0.0) if hasattr(
        config, "output_router_logits") else 0.0
    if rank == 0 and aux_coef:
        print(f"mixture of experts: experts_implementation "
              f"{config._experts_implementation}, router_aux_loss_coef {aux_coef}", flush=True)
    tokens = torch.from_numpy(np.fromfile(args.data, dtype=args.data_dtype).astype(np.int64))
    local = args.batch_size // world_size
    for step in range(args.steps):
        lr = learning_rate(step, args.lr, args.warmup_steps, args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(args.seed * 1000003 + step)
        starts = torch.randint(tokens.numel() - args.context - 1, (args.batch_size,))
        starts = starts[rank * local:(rank + 1) * local]
        chunk = tokens[starts[:, None] + torch.arange(args.context + 1)[None, :]]
        chunk = chunk.to(torch.cuda.current_device()) if args.device == "cuda" else chunk
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
        optimizer.zero_grad()
        out = model(input_ids=x, output_router_logits=True) if aux_coef else model(input_ids=x)
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        if aux_coef:
            loss = loss + aux_coef * out.aux_loss
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1}/{args.steps} | loss {mean.item() / world_size:.7f} | "
                  f"lr {lr:.2e}", flush=True)
    if rank == 0:
        print(f"peak resident set: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}"
              " MiB (rank 0)", flush=True)
        if args.device == "cuda":
            print(f"peak memory allocated: {torch.cuda.max_memory_allocated() / 1e6:.1f} MB "
                  "(rank 0)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # DTensor's caches keep the Gloo group alive into interpreter teardown, where a rank
    # can abort ("terminate called without an active exception"; tests/dcp_interop.py
    # ends the same way): leave without it.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
