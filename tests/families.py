"""The Python half of families_test.sh: each decoder family of //models against transformers.

    families.py make DIR [SET]
                            one tiny checkpoint per variant of SET (dense: VARIANTS, the
                            default; moe: MOE_VARIANTS), written by transformers'
                            save_pretrained (DIR/<variant>/model; the 4.x variants' config.json
                            then rewritten by hand in transformers 4.x spellings), token files
                            DIR/train.bin and DIR/eval.bin, DIR/variants.txt ("name trains
                            lora_targets aux" per line, aux 1 where the family has a
                            load-balancing loss; DeepSeek-V3 also as a bf16 folder,
                            DIR/deepseek_v3/bf16); prints, per family feature, how much turning it off changes
                            transformers' loss (each must change it by >= 5x the tolerance)
    families.py check DIR   against the finetune runs families_test.sh made: fsdp's eval loss
                            at W = 1 and W = 3 equals transformers' (eager attention, fp32)
                            within 1e-5 relative; --steps=0 wrote every tensor back bit for
                            bit; full and LoRA fine-tunes lowered the eval loss, and
                            transformers (full, merged LoRA) and PEFT (base + adapter) compute
                            the eval loss fsdp printed after training. MoE families (their
                            W = 1 run takes one step at lr 0): the first step's training
                            loss, cross-entropy + router_aux_loss_coef x the router's
                            load-balancing loss, equals transformers'
                            model(..., output_router_logits=True).loss on the same batch;
                            so does Qwen3-MoE's on conversation rows (DIR/chat.safetensors),
                            packed and one example a row, with --router_aux_loss_coef=0.1
                            (the padding, if counted, would move the loss by over 10x the
                            tolerance), against transformers on the batch's examples
                            padded, with their attention mask
"""
import json
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_finetune import tensors  # noqa: E402

TOLERANCE = 1e-5
CONTEXT = 40  # longer than the sliding windows (8) and the original RoPE lengths (16)
VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, initializer_range=0.15)
GEMMA = dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=8,
             head_dim=8)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# name: (config class, kwargs, trains, 4.x config.json written by hand or None, ablations).
# An ablation (what, config overrides, weight edit) turns one family feature off.
VARIANTS = {
    "llama3": ("LlamaConfig", dict(SMALL, rope_parameters=LLAMA3, attention_bias=True,
                                   mlp_bias=True), True, None, [
        ("rope llama3 -> default", {"rope_parameters": {"rope_type": "default",
                                                        "rope_theta": 10000.0}}, None),
        ("attention and MLP biases zeroed", {}, "bias"),
    ]),
    "llama_linear_4x": ("LlamaConfig", dict(SMALL, rope_parameters={
        "rope_type": "linear", "rope_theta": 100.0, "factor": 4.0}), False, {
        "rope_parameters": None, "rope_theta": 100.0,
        "rope_scaling": {"type": "linear", "factor": 4.0}, "torch_dtype": "float32"}, [
        ("rope linear -> default", {"rope_parameters": {"rope_type": "default",
                                                        "rope_theta": 100.0}}, None),
    ]),
    "qwen2_yarn": ("Qwen2Config", dict(SMALL, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 16}, use_sliding_window=True, sliding_window=8,
        max_window_layers=1), True, None, [
        ("rope yarn -> default", {"rope_parameters": {"rope_type": "default",
                                                      "rope_theta": 1e6}}, None),
        ("sliding window off", {"layer_types": ["full_attention"] * 3}, None),
        ("q/k/v biases zeroed", {}, "bias"),
    ]),
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}), True, None, [
        ("q/k norm weights -> 1", {}, "qk_norm"),
    ]),
    "mistral": ("MistralConfig", dict(SMALL, sliding_window=8), True, None, [
        ("sliding window off", {"sliding_window": None}, None),
    ]),
    "gemma2": ("Gemma2Config", dict(SMALL, **GEMMA, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0), True, None, [
        ("attention soft-cap off", {"attn_logit_softcapping": None}, None),
        ("final soft-cap off", {"final_logit_softcapping": None}, None),
        ("sliding window off", {"layer_types": ["full_attention"] * 3}, None),
        ("query_pre_attn_scalar -> head_dim", {"query_pre_attn_scalar": 8}, None),
    ]),
    "gemma3_text": ("Gemma3TextConfig", dict(SMALL, **GEMMA, layer_types=[
        "sliding_attention", "sliding_attention", "full_attention"], rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), True, None, [
        ("full layers' linear rope -> default", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}, None),
        ("sliding layers' rope_theta -> the full layers'", {"rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}}, None),
        ("sliding window off", {"layer_types": ["full_attention"] * 3}, None),
        ("q/k norm weights -> 0 (identity scale)", {}, "qk_norm"),
    ]),
    "granite": ("GraniteConfig", dict(SMALL, embedding_multiplier=3.0, attention_multiplier=0.5,
                                      residual_multiplier=0.5, logits_scaling=2.0), True, None, [
        ("embedding_multiplier -> 1", {"embedding_multiplier": 1.0}, None),
        ("attention_multiplier -> 1", {"attention_multiplier": 1.0}, None),
        ("residual_multiplier -> 1", {"residual_multiplier": 1.0}, None),
        ("logits_scaling -> 1", {"logits_scaling": 1.0}, None),
    ]),
    "olmo2": ("Olmo2Config", dict(SMALL), True, None, [
        ("full-width q/k norm weights -> 1", {}, "qk_norm"),
    ]),
    "phi3": ("Phi3Config", dict(SMALL, pad_token_id=None, original_max_position_embeddings=16,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 100.0,
                                                 "short_factor": [1.0, 1.5],
                                                 "long_factor": [3.0, 5.0],
                                                 "partial_rotary_factor": 0.5}), True, None, [
        ("longrope -> default", {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0,
                                                     "partial_rotary_factor": 0.5}}, None),
        ("long factors -> the short ones", {"rope_parameters": {
            "rope_type": "longrope", "rope_theta": 100.0, "short_factor": [1.0, 1.5],
            "long_factor": [1.0, 1.5], "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 16}}, None),
    ]),
    "gemma3_text_4x": ("Gemma3TextConfig", dict(SMALL, **GEMMA, layer_types=[
        "sliding_attention", "sliding_attention", "full_attention"], rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), False, {
        "layer_types": None, "_sliding_window_pattern": None, "rope_parameters": None,
        "sliding_window_pattern": 3,
        "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "torch_dtype": "float32"}, [
        ("rope_scaling linear -> none", {"rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}, None),
    ]),
}

# rope_theta 100: the correction range ends mid-pair, so truncate counts.
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}

# The mixture-of-experts families: 8 or 4 experts, top-2, experts of width 16; the
# checkpoints hold the experts one by one (save_pretrained's names), fsdp fuses them.
MOE = dict(SMALL, pad_token_id=None, bos_token_id=None, eos_token_id=None)
MOE_VARIANTS = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE, head_dim=16, moe_intermediate_size=16,
                                         num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=True, mlp_only_layers=[2]), True, None, [
        ("norm_topk_prob off", {"norm_topk_prob": False}, None),
        ("top-2 -> top-1", {"num_experts_per_tok": 1}, None),
        ("router zeroed (uniform routing)", {}, "router"),
        ("q/k norm weights -> 1", {}, "qk_norm"),
    ]),
    "mixtral": ("MixtralConfig", dict(MOE, intermediate_size=16, num_local_experts=4,
                                      num_experts_per_tok=2), False, None, [
        ("top-2 -> top-1", {"num_experts_per_tok": 1}, None),
        ("router zeroed (uniform routing)", {}, "router"),
    ]),
    "olmoe": ("OlmoeConfig", dict(MOE, intermediate_size=16, num_experts=4,
                                  num_experts_per_tok=2, norm_topk_prob=False), False, None, [
        ("norm_topk_prob on", {"norm_topk_prob": True}, None),
        ("full-width q/k norm weights -> 1", {}, "qk_norm"),
    ]),
    "qwen2_moe": ("Qwen2MoeConfig", dict(MOE, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, num_experts=4,
                                         num_experts_per_tok=2, mlp_only_layers=[0]), False,
                  None, [
        ("shared_expert_gate zeroed (sigmoid 1/2)", {}, "shared_gate"),
        ("q/k/v biases zeroed", {}, "bias"),
        ("norm_topk_prob on", {"norm_topk_prob": True}, None),
    ]),
    # gpt-oss's bf16 layout, experts fused on disk as in fsdp; gate_up_proj sharpened so that
    # swiglu_limit's clamp is active (sharpen).
    "gpt_oss": ("GptOssConfig", dict(MOE, head_dim=16, intermediate_size=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=8,
                                     rope_parameters=GPT_OSS_YARN), True, None, [
        ("sinks -> -inf (none)", {}, "sinks"),
        ("attention and router biases zeroed", {}, "bias"),
        ("experts' biases zeroed", {}, "experts_bias"),
        ("sliding layers -> full", {"layer_types": ["full_attention"] * 3}, None),
        ("rope yarn -> default", {"rope_parameters": {"rope_type": "default",
                                                      "rope_theta": 100.0}}, None),
        ("yarn truncate false -> true", {"rope_parameters": dict(GPT_OSS_YARN, truncate=True)},
         None),
        ("swiglu_limit 7 -> 1e4 (no clamp)", {"swiglu_limit": 1e4}, None),
    ]),
}
# DeepSeek-V3: latent attention with q_lora_rank, attention biases, interleaved RoPE and
# YaRN with mscale_all_dim; a dense first layer, then 8 experts in 4 groups (the best 2
# groups compete), top-2, norm_topk_prob, routed_scaling_factor 2.5, one shared expert, and a
# random e_score_correction_bias (sharpen). Its plain-q_proj variant (q_lora_rank null) loads
# and computes only.
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "mscale": 1.0,
                 "mscale_all_dim": 0.5, "original_max_position_embeddings": 16}
DEEPSEEK = dict(MOE, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=12, attention_bias=True, moe_intermediate_size=16,
                n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
                n_shared_experts=1, rope_interleave=True, rope_parameters=DEEPSEEK_YARN)
MOE_VARIANTS["deepseek_v3"] = ("DeepseekV3Config", DEEPSEEK, True, None, [
    ("rope_interleave off", {"rope_interleave": False}, None),
    ("rope yarn -> default", {"rope_parameters": {"rope_type": "default",
                                                  "rope_theta": 100.0}}, None),
    ("yarn without mscale_all_dim", {"rope_parameters": {
        k: v for k, v in DEEPSEEK_YARN.items() if k != "mscale_all_dim"}}, None),
    ("topk_group 2 -> 4 (no group limit)", {"topk_group": 4}, None),
    ("norm_topk_prob off", {"norm_topk_prob": False}, None),
    ("routed_scaling_factor 2.5 -> 1", {"routed_scaling_factor": 1.0}, None),
    ("e_score_correction_bias zeroed", {}, "correction_bias"),
    ("shared experts zeroed", {}, "shared_experts"),
    ("first layer's dense MLP zeroed", {}, "dense_mlp"),
    ("attention biases zeroed", {}, "bias"),
])
MOE_VARIANTS["deepseek_v3_q_proj"] = ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=None),
                                      False, None, [])
SETS = {"dense": VARIANTS, "moe": MOE_VARIANTS}


def load(folder, config=None):
    from transformers import AutoModelForCausalLM

    kwargs = {} if config is None else {"config": config}
    return AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()


def windows(root):
    ids = torch.from_numpy(np.fromfile(os.path.join(root, "eval.bin"), dtype="<u2").astype(np.int64))
    n = ids.numel() // (CONTEXT + 1)
    return ids[: n * (CONTEXT + 1)].view(n, CONTEXT + 1)


def loss_of(model, w):
    """Mean next-token cross-entropy over windows `w`, as finetune's eval loss."""
    with torch.no_grad():
        logits = model(input_ids=w[:, :-1]).logits
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1)).item()


def sharpen(model, family):
    """Weights that make every feature count: sharp q/k, non-trivial norms and biases."""
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(3.0)
            elif name.endswith("qkv_proj.weight"):  # phi3: the rows of 4 q and 2 k heads of 8
                p[: p.shape[0] * 3 // 4].mul_(3.0)
            elif name.endswith("experts.gate_up_proj") and family == "gpt_oss":
                p.mul_(10.0)  # gate and up beyond swiglu_limit: the clamp counts
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight",
                                "mlp.router.weight")) or ".shared_experts." in name:
                p.mul_(3.0)  # the experts' outputs and the router's choices count
            elif name.endswith("self_attn.sinks"):
                p.normal_(0.0, 2.0)
            elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + w); Qwen3's q/k norms as Llama's by w.
                p.uniform_(-0.5, 0.5) if gemma else p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("mlp.gate.e_score_correction_bias"):  # zeros as transformers makes it
                b.uniform_(-0.3, 0.3)


def token_stream(n, seed):
    """A learnable sequence: mostly token t + 7 after t (mod VOCAB), a tenth random."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(n, dtype=torch.int64)
    out[0] = 0
    noise = torch.rand(n, generator=g) < 0.1
    random = torch.randint(0, VOCAB, (n,), generator=g)
    for i in range(1, n):
        out[i] = random[i] if noise[i] else (out[i - 1] + 7) % VOCAB
    return out.numpy().astype("<u2")


def ablate(folder, family, overrides, edit, w):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = load(folder, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if edit == "bias" and name.endswith(".bias"):
                p.zero_()
            if edit == "experts_bias" and name.endswith("_proj_bias"):
                p.zero_()
            if edit == "sinks" and name.endswith("self_attn.sinks"):
                p.fill_(float("-inf"))
            if edit == "qk_norm" and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(0.0 if family.startswith("gemma") else 1.0)
            if edit == "router" and name.endswith("mlp.gate.weight"):
                p.zero_()
            if edit == "shared_gate" and name.endswith("shared_expert_gate.weight"):
                p.zero_()
            if edit == "shared_experts" and name.endswith("shared_experts.down_proj.weight"):
                p.zero_()
            if edit == "dense_mlp" and name == "model.layers.0.mlp.down_proj.weight":
                p.zero_()
        for name, b in model.named_buffers():
            if edit == "correction_bias" and name.endswith("e_score_correction_bias"):
                b.zero_()
    return loss_of(model, w)


def make_chat(path):
    """12 conversations of 20 and 15 tokens (alternately), each counting a random tail."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    ids, mask, offsets = [], [], [0]
    for length in [20, 15] * 6:
        ids.extend(rng.integers(0, VOCAB, length))
        answer = int(rng.integers(2, length // 2))
        mask.extend([0] * (length - answer) + [1] * answer)
        offsets.append(offsets[-1] + length)
    save_file({"input_ids": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.uint8),
               "example_offsets": np.asarray(offsets, np.int64)},
              path, metadata={"format": "fsdp-chat-v1"})


def add_mtp_tensor(folder, layers):
    """A tensor of a multi-token prediction layer after the decoder's, as DeepSeek-V3's bf16
    conversions hold layer 61's (transformers skips them): written into its own file."""
    from safetensors.torch import save_file

    name = f"model.layers.{layers}.eh_proj.weight"
    save_file({name: torch.randn(32, 64).to(torch.bfloat16)},
              os.path.join(folder, "mtp.safetensors"), metadata={"format": "pt"})
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    index["weight_map"][name] = "mtp.safetensors"
    with open(path, "w") as f:
        json.dump(index, f, indent=2)


def make(root, variants):
    import transformers

    token_stream(4000, 1).tofile(os.path.join(root, "train.bin"))
    if variants is MOE_VARIANTS:
        make_chat(os.path.join(root, "chat.safetensors"))
    token_stream(6 * (CONTEXT + 1), 2).tofile(os.path.join(root, "eval.bin"))
    w = windows(root)
    failed = 0
    with open(os.path.join(root, "variants.txt"), "w") as listing:
        for name, (cls, kwargs, trains, handwritten, ablations) in variants.items():
            torch.manual_seed(0)
            config = getattr(transformers, cls)(**kwargs)
            model = transformers.AutoModelForCausalLM.from_config(config)
            sharpen(model, name)
            folder = os.path.join(root, name, "model")
            model.save_pretrained(folder, max_shard_size="40KB")
            if handwritten is not None:  # the same architecture in transformers 4.x spellings
                path = os.path.join(folder, "config.json")
                with open(path) as f:
                    saved = json.load(f)
                saved.pop("dtype", None)
                for key, value in handwritten.items():
                    if value is None:
                        saved.pop(key, None)
                    else:
                        saved[key] = value
                with open(path, "w") as f:
                    json.dump(saved, f, indent=2)
            if cls == "DeepseekV3Config" and trains:  # its router bias stays fp32 in bf16
                bf16 = os.path.join(root, name, "bf16")
                transformers.AutoModelForCausalLM.from_pretrained(
                    folder, dtype=torch.bfloat16).save_pretrained(bf16, max_shard_size="40KB")
                add_mtp_tensor(bf16, kwargs["num_hidden_layers"])
            base = loss_of(load(folder), w)
            print(f"{name}: transformers' eval loss {base:.6f}")
            for what, overrides, edit in ablations:
                change = abs(ablate(folder, name, overrides, edit, w) - base) / base
                ok = change >= 5 * TOLERANCE
                failed += not ok
                print(f"  {what}: loss changes by {change:.3g} relative "
                      f"({'ok' if ok else 'FAIL'}: >= {5 * TOLERANCE:g})")
            targets = (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if cls == "Phi3Config"
                       # (not the shared experts' and dense layer's gate_proj, up_proj, down_proj:
                       # PEFT 0.21 reads those names as the routed experts of transformers 5's
                       # qwen2_moe-style MoE models, deepseek_v3 included)
                       else (["q_a_proj", "q_b_proj"] if kwargs["q_lora_rank"] else ["q_proj"]) +
                       ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] if cls == "DeepseekV3Config"
                       else ["q_proj", "k_proj", "v_proj", "o_proj"] if variants is MOE_VARIANTS
                       else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"])
            # Whether the family has a load-balancing loss (DeepseekV3 has none).
            aux = int(variants is MOE_VARIANTS and cls != "DeepseekV3Config")
            listing.write(f"{name} {int(trains)} {','.join(targets)} {aux}\n")
    return failed


SEED, BATCH = 1234, 3  # finetune's default --seed; families_test.sh's --batch_size


def first_batch(root):
    """finetune's first training batch of a token file (batch() in finetune.cc): windows of
    CONTEXT + 1 tokens at offsets drawn by torch.randint after manual_seed(seed x 1000003)."""
    ids = torch.from_numpy(np.fromfile(os.path.join(root, "train.bin"), dtype="<u2").astype(np.int64))
    torch.manual_seed(SEED * 1000003)
    starts = torch.randint(ids.numel() - CONTEXT - 1, (BATCH,))
    w = torch.stack([ids[s: s + CONTEXT + 1] for s in starts.tolist()])
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def first_step_loss(model, x, y):
    """transformers' training loss with the router's term, and the term itself."""
    with torch.no_grad():
        out = model(input_ids=x, labels=y, shift_labels=y, output_router_logits=True)
    if out.aux_loss is None:  # DeepseekV3: no load-balancing loss
        return out.loss.item(), 0.0
    return out.loss.item(), model.config.router_aux_loss_coef * out.aux_loss.item()


def chat_first_batch(root, packed):
    """The examples of finetune's first conversation batch (chat_data.cc): rows of CONTEXT
    tokens (packed best-fit decreasing, or one example a row), rows drawn by
    torch.randperm after manual_seed(seed x 1000003); their examples as (ids, mask) each."""
    from safetensors.numpy import load_file

    f = load_file(os.path.join(root, "chat.safetensors"))
    offsets = f["example_offsets"].tolist()
    examples = [(torch.from_numpy(f["input_ids"][a:b].astype(np.int64)),
                 torch.from_numpy(f["loss_mask"][a:b].astype(bool))) for a, b in zip(offsets, offsets[1:])]
    if not packed:
        rows = [[e] for e in range(len(examples))]
    else:  # best-fit decreasing: the row with the least room that holds it, else a new one
        rows, room = [], []  # room: (left, opened, row), the earliest among equals first
        for e in sorted(range(len(examples)), key=lambda e: -len(examples[e][0])):
            n = len(examples[e][0])
            fits = [r for r in room if r[0] >= n]
            if fits:
                best = min(fits)
                room.remove(best)
                row, opened = best[2], best[1]
            else:
                row, opened = len(rows), len(rows)
                rows.append([])
            rows[row].append(e)
            left = CONTEXT - sum(len(examples[x][0]) for x in rows[row])
            if left > 0:
                room.append((left, opened, row))
    torch.manual_seed(SEED * 1000003)
    order = torch.randperm(len(rows))
    return [examples[e] for r in order[:BATCH].tolist() for e in rows[r]]


CHAT_AUX_COEF = 0.1  # families_test.sh's --router_aux_loss_coef on conversations


def chat_loss(model, examples):
    """transformers' training loss over `examples`, padded on the right with their attention
    mask: the counted targets' mean cross-entropy + CHAT_AUX_COEF x the router's
    load-balancing loss over the examples' tokens (the mask's)."""
    model.router_aux_loss_coef = CHAT_AUX_COEF
    length = max(len(ids) for ids, _ in examples)
    x = torch.zeros(len(examples), length, dtype=torch.int64)
    attention = torch.zeros(len(examples), length, dtype=torch.int64)
    labels = torch.full((len(examples), length), -100, dtype=torch.int64)
    for i, (ids, counted) in enumerate(examples):
        x[i, :len(ids)], attention[i, :len(ids)] = ids, 1
        labels[i, :len(ids) - 1] = torch.where(counted[1:], ids[1:], torch.tensor(-100))
    with torch.no_grad():
        return model(input_ids=x, attention_mask=attention, labels=labels, shift_labels=labels,
                     output_router_logits=True).loss.item()


def logged_step(path, step):
    """The training loss metrics.csv recorded for `step`."""
    with open(path) as f:
        for row in f:
            fields = row.strip().split(",")
            if fields[0] == str(step):
                return float(fields[1])
    raise AssertionError(f"{path}: no row for step {step}")


def logged(path, what):
    with open(path) as f:
        return float(re.search(rf"eval loss {what}: ([0-9.]+)", f.read()).group(1))


def same(a, b, skipped=()):
    """Every tensor of folder `a` but those named in `skipped` is in `b`, bit for bit."""
    ta, tb = tensors(a), tensors(b)
    ta = {k: v for k, v in ta.items() if k not in skipped}
    assert sorted(ta) == sorted(tb), (sorted(ta), sorted(tb))
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].view(-1).view(torch.uint8),
                           tb[name].view(-1).view(torch.uint8)), f"{b}: {name} differs"
    return len(ta)


def check(root):
    from peft import PeftModel

    w = windows(root)
    failed = 0

    def compare(label, ours, theirs):
        nonlocal failed
        gap = abs(ours - theirs) / theirs
        ok = gap <= TOLERANCE
        failed += not ok
        print(f"  {label}: fsdp {ours:.6f}, transformers {theirs:.6f}, relative difference "
              f"{gap:.2g} ({'ok' if ok else 'FAIL'})")

    with open(os.path.join(root, "variants.txt")) as f:
        variants = [line.split() for line in f if line.strip()]
    for name, trains, _, has_aux in variants:
        d = os.path.join(root, name)
        model = os.path.join(d, "model")
        print(f"{name}:")
        expected = loss_of(load(model), w)
        moe = name in MOE_VARIANTS
        for world in (1, 3):
            compare(f"eval loss at W = {world}", logged(f"{d}/w{world}.log", "before"), expected)
            n = same(model, f"{d}/w{world}/hf")
            steps = "--steps=1 at lr 0" if moe and world == 1 else "--steps=0"
            print(f"  {steps} at W = {world}: {n} tensors written back bit for bit")
        if os.path.isdir(os.path.join(d, "bf16")):
            layers = json.load(open(os.path.join(model, "config.json")))["num_hidden_layers"]
            mtp = f"model.layers.{layers}.eh_proj.weight"
            n = same(os.path.join(d, "bf16"), f"{d}/bf16_w3/hf", skipped={mtp})
            print(f"  bf16 folder (its e_score_correction_bias fp32, and {mtp}, left unread and "
                  f"unwritten as transformers does): --steps=0 at W = 3: {n} tensors written back "
                  "bit for bit, dtypes included")
        if moe:
            theirs, aux = first_step_loss(load(model), *first_batch(root))
            compare("first step's training loss (cross-entropy + router aux) at W = 1",
                    logged_step(f"{d}/w1/metrics.csv", 1), theirs)
            if has_aux == "1":
                print(f"    (the aux term, {aux:.3g}, is {aux / theirs / TOLERANCE:.0f}x the "
                      "tolerance)")
            else:
                print("    (no aux term: transformers computes no load-balancing loss)")
            if trains == "1" and has_aux == "1":
                for rows in ("packed", "per_row"):
                    theirs = chat_loss(load(model), chat_first_batch(root, rows == "packed"))
                    compare(f"first step's loss on conversation rows ({rows.replace('_', ' ')})",
                            logged_step(f"{d}/chat_{rows}/metrics.csv", 1), theirs)
        if trains == "0":
            continue
        config = json.load(open(os.path.join(model, "config.json")))
        pad = config.get("pad_token_id")
        if pad is not None and not config.get("tie_word_embeddings"):
            # transformers' embedding has padding_idx = pad_token_id: no gradient, no update.
            name = "model.embed_tokens.weight"
            row_before, row_after = tensors(model)[name][pad], tensors(f"{d}/full/hf")[name][pad]
            ok = torch.equal(row_before, row_after)
            failed += not ok
            print(f"  full fine-tune kept the padding row {pad} of the embeddings "
                  f"({'ok' if ok else 'FAIL'})")
        biases = {k: v for k, v in tensors(model).items() if k.endswith("e_score_correction_bias")}
        if biases:  # a buffer, as in transformers: the optimizer leaves it as it was
            trained = tensors(f"{d}/full/hf")
            ok = all(torch.equal(v, trained[k]) for k, v in biases.items())
            failed += not ok
            print(f"  full fine-tune kept the {len(biases)} e_score_correction_bias bit for bit "
                  f"({'ok' if ok else 'FAIL'})")
        for run in ("full", "lora"):
            before, after = logged(f"{d}/{run}.log", "before"), logged(f"{d}/{run}.log", "after")
            ok = after < before
            failed += not ok
            print(f"  {run} fine-tune at W = 3: eval loss {before:.6f} -> {after:.6f} "
                  f"({'ok' if ok else 'FAIL'})")
            compare(f"{run}: {run}/hf loaded by transformers", after,
                    loss_of(load(f"{d}/{run}/hf"), w))
        peft = PeftModel.from_pretrained(load(model), f"{d}/lora/adapter").eval()
        compare("lora: base + adapter loaded by PEFT", logged(f"{d}/lora.log", "after"),
                loss_of(peft, w))
    return failed


if __name__ == "__main__":
    import transformers

    transformers.utils.logging.disable_progress_bar()
    command, root = sys.argv[1], sys.argv[2]
    if command == "make":
        sys.exit(1 if make(root, SETS[sys.argv[3] if len(sys.argv) > 3 else "dense"]) else 0)
    elif command == "check":
        sys.exit(1 if check(root) else 0)
    else:
        sys.exit(f"unknown command {command}")
