"""The Python half of llama_finetune_test.sh (examples/llama:finetune against transformers).

    llama_finetune.py make DIR       a random tiny Llama folder (DIR/model, grouped-query
                                     attention, untied embeddings) whose tokenizer.json is a
                                     BPE tokenizer trained on TEXT files; DIR/train.txt and
                                     DIR/eval.txt
    llama_finetune.py same DIR A B   every tensor of HF folder B equals A's, bit for bit
    llama_finetune.py differ DIR A B every tensor of B differs from A's (training moved it),
                                     in the same dtype and shape
    llama_finetune.py lora DIR A B   B (LoRA on q_proj, v_proj, merged) keeps every other
                                     tensor of A bit for bit and changes every q_proj, v_proj
    llama_finetune.py peft DIR BASE ADAPTER HF
                                     PEFT's PeftModel.from_pretrained(BASE, ADAPTER) gives
                                     logits within 1e-5 of transformers' on the merged HF
    llama_finetune.py eval DIR HF CONTEXT LOG
                                     transformers' mean next-token loss over DIR/eval.bin in
                                     consecutive windows of CONTEXT + 1 tokens equals the
                                     `eval loss after` line of LOG (relative 1e-5)
    llama_finetune.py logits DIR HF LOGITS
                                     transformers' logits on DIR/ids.pt (HF loaded by
                                     from_pretrained) within 1e-5 of LOGITS' (fsdp's)
    llama_finetune.py bnb4 DIR BASE OUT
                                     BASE: a random tiny bf16 Llama (tied embeddings, hidden
                                     64); OUT: BASE loaded by transformers in bitsandbytes'
                                     4-bit NF4 with double quantization (bf16 compute), saved
    llama_finetune.py batch DIR QUEUE
                                     each line of QUEUE (one of the commands below without
                                     DIR, its words tab-separated) in this one process
    llama_finetune.py bnb4_peft DIR BASE4 ADAPTER HF EVAL CONTEXT LOG
                                     on token file EVAL in windows of CONTEXT + 1: transformers +
                                     bitsandbytes' loss on the 4-bit BASE4 equals LOG's `eval
                                     loss before`, PEFT's with ADAPTER over it `eval loss
                                     after` (relative 1e-4); HF (the merged folder: bf16, no
                                     quantization_config) loads in transformers with logits
                                     and loss close to PEFT's over BASE4 (BNB4_MERGED_*)
"""
import glob
import json
import os
import re
import sys

import numpy as np
import torch

TOLERANCE = 1e-5
# fsdp's bf16 run against transformers + bitsandbytes' on the same 4-bit folder.
BNB4_TOLERANCE = 1e-4
# OUT/hf (base dequantized + update, rounded to bf16 once) against PEFT over the 4-bit folder
# (the base's bf16 output + the fp32 update rounded to bf16): the largest logit difference
# (bf16's spacing is 0.0078 between 1 and 2) and the relative loss difference allowed.
BNB4_MERGED_LOGITS = 0.02
BNB4_MERGED_LOSS = 1e-4


def tensors(folder):
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    assert files, f"{folder}: no safetensors files"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


def make(root, texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    text = ""
    for name in texts:
        with open(name, encoding="utf-8", errors="replace") as f:
            text += f.read()
    text = text[:200_000]
    cut = len(text) * 9 // 10
    with open(os.path.join(root, "train.txt"), "w", encoding="utf-8") as f:
        f.write(text[:cut])
    with open(os.path.join(root, "eval.txt"), "w", encoding="utf-8") as f:
        f.write(text[cut:])
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator([text[:cut]], trainer)
    folder = os.path.join(root, "model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="30KB")
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    # A bfloat16 folder with tied embeddings, as many released checkpoints are.
    config.tie_word_embeddings = True
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(
        os.path.join(root, "model_bf16"), max_shard_size="30KB")
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    torch.save({"ids": ids}, os.path.join(root, "ids.pt"))
    print(f"{folder}: vocabulary {config.vocab_size}, "
          f"{len(glob.glob(os.path.join(folder, '*.safetensors')))} safetensors files")


def same(a, b):
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb), (sorted(ta), sorted(tb))
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].view(-1).view(torch.uint8), tb[name].view(-1).view(torch.uint8)), (
            f"{name} differs")
    print(f"{b}: {len(ta)} tensors equal to {a}'s bit for bit")


def differ(a, b):
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb), (sorted(ta), sorted(tb))
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
    unchanged = [n for n in ta if torch.equal(ta[n], tb[n])]
    assert not unchanged, f"not trained: {unchanged}"
    print(f"{b}: all {len(ta)} tensors moved by training")


def lora(a, b):
    ta, tb = tensors(a), tensors(b)
    assert sorted(ta) == sorted(tb), (sorted(ta), sorted(tb))
    targets = [n for n in ta if ".q_proj." in n or ".v_proj." in n]
    assert targets
    for name in ta:
        equal = torch.equal(ta[name], tb[name])
        assert equal != (name in targets), f"{name}: {'unchanged' if equal else 'changed'}"
    print(f"{b}: {len(targets)} adapted weights changed, {len(ta) - len(targets)} frozen "
          "ones kept bit for bit")


def peft_check(root, base, adapter, merged):
    from peft import PeftModel

    ids = torch.load(os.path.join(root, "ids.pt"))["ids"]
    with torch.no_grad():
        ours = PeftModel.from_pretrained(model_of(base), adapter).eval()(input_ids=ids).logits
        expected = model_of(merged)(input_ids=ids).logits
    diff = (ours - expected).abs().max().item()
    print(f"{adapter} on {base} in PEFT against {merged}: max |logits difference| = {diff:.3g}")
    assert diff <= TOLERANCE, diff


def peft_merge(base, adapter, merged):
    """PEFT's merge of `adapter` into the 16-bit `base` (computed in fp32, rounded to the
    folder's dtype once) equals the merged folder fsdp wrote, bit for bit."""
    from peft import PeftModel

    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert json.load(f)["peft_type"] == "LORA"
    saved = tensors(adapter)
    assert all(t.dtype == torch.float32 for t in saved.values()), "adapters are not fp32"
    dtype = next(iter(tensors(base).values())).dtype
    peft = PeftModel.from_pretrained(model_of(base), adapter).merge_and_unload()
    want = {k: v.to(dtype) for k, v in peft.state_dict().items()}
    ours = tensors(merged)
    differ = [n for n in ours if not torch.equal(ours[n], want[n])]
    assert not differ, f"differ from PEFT's merge: {differ}"
    print(f"{merged}: {len(ours)} tensors equal PEFT's merge of {adapter} into {base} "
          f"({dtype}), bit for bit")


def qlora(base, adapter, merged):
    """fsdp's --quantize=nf4 run: every layer projection of OUT/hf is bitsandbytes' NF4 of
    the base weight (quantize_4bit with double quantization, dequantized in fp32), plus the
    adapter's update where there is one, rounded once to the folder's dtype; every other
    tensor is the base's, bit for bit."""
    from bitsandbytes import functional as F
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    scaling = config["lora_alpha"] / config["r"]
    lora = tensors(adapter)
    ours, theirs = tensors(merged), tensors(base)
    assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
    quantized = 0
    for name, weight in theirs.items():
        if not re.fullmatch(r"model\.layers\.\d+\..*_proj\.weight", name):
            assert torch.equal(ours[name], weight), f"{name} is not the base's"
            continue
        codes, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4",
                                       compress_statistics=True)
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
        # The reference kernel: bitsandbytes' native CPU one restarts blocks at each row
        # when a row is not a multiple of 64 long (nf4_interop.py).
        dense = _dequantize_4bit_compute(codes.reshape(-1), absmax.float(),
                                         _get_4bit_code("nf4", "cpu"), 64, tuple(weight.shape),
                                         torch.float32)
        module = "base_model.model." + name[: -len(".weight")]
        if module + ".lora_A.weight" in lora:
            dense = dense + (lora[module + ".lora_B.weight"].float()
                             @ lora[module + ".lora_A.weight"].float()) * scaling
        assert torch.equal(ours[name], dense.to(weight.dtype)), f"{name} differs"
        quantized += 1
    assert quantized
    print(f"{merged}: {quantized} projections are bitsandbytes' NF4 of {base}'s (plus the "
          f"adapter's update), the other {len(ours) - quantized} tensors the base's, bit for bit")


def model_of(folder):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def eval_windows(path, context):
    """Token file `path` in consecutive windows of CONTEXT + 1 tokens (the remainder dropped),
    as finetune's --eval_data."""
    bytes_ = os.path.getsize(path)
    ids = torch.from_numpy(np.fromfile(path, dtype="<u2").astype(np.int64))
    assert ids.numel() * 2 == bytes_
    n = ids.numel() // (context + 1)
    return ids[: n * (context + 1)].view(n, context + 1)


def mean_loss(model, windows):
    """The model's logits on the windows' inputs and its mean next-token loss (fp32)."""
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             windows[:, 1:].reshape(-1)).item()
    return logits, loss


def logged_loss(log, which):
    with open(log) as f:
        return float(re.search(rf"eval loss {which}: ([0-9.]+)", f.read()).group(1))


def eval_loss(root, folder, context, log):
    windows = eval_windows(os.path.join(root, "eval.bin"), context)
    expected = mean_loss(model_of(folder), windows)[1]
    ours = logged_loss(log, "after")
    gap = abs(ours - expected) / expected
    print(f"eval loss after: fsdp {ours:.6f}, transformers {expected:.6f} "
          f"({len(windows)} windows), relative gap {gap:.2g}")
    assert gap <= TOLERANCE, gap


def bnb4_model(folder):
    """A 4-bit folder loaded as transformers + bitsandbytes load it (its quantization_config)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cpu").eval()


def bnb4(root, base, out):
    """BASE: a random tiny bf16 Llama with tied embeddings whose projections' rows are a multiple
    of 64 long (bitsandbytes' CPU kernels compute other widths as another layout; see qlora());
    OUT: BASE loaded in bitsandbytes' 4-bit NF4 as QLoRA loads it, saved as transformers saves
    it."""
    from safetensors import safe_open
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    with open(os.path.join(root, "model", "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)).to(torch.bfloat16).save_pretrained(base, max_shard_size="30KB")
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    LlamaForCausalLM.from_pretrained(base, quantization_config=config, dtype=torch.bfloat16,
                                     device_map="cpu").save_pretrained(out)
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        states = [k for k in f.keys() if k.endswith(".weight.quant_state.bitsandbytes__nf4")]
    assert states, f"{out}: no 4-bit weight"
    print(f"{out}: {len(states)} weights of {base} in bitsandbytes' 4-bit NF4")


def bnb4_peft(base4, adapter, merged, eval_file, context, log):
    from peft import PeftModel

    windows = eval_windows(eval_file, context)
    gaps = {}
    before = mean_loss(bnb4_model(base4), windows)[1]
    peft_logits, after = mean_loss(PeftModel.from_pretrained(bnb4_model(base4), adapter).eval(),
                                   windows)
    for which, expected in (("before", before), ("after", after)):
        ours = logged_loss(log, which)
        gaps[which] = abs(ours - expected) / expected
        print(f"eval loss {which}: fsdp {ours:.6f}, transformers + bitsandbytes"
              f"{' + PEFT' if which == 'after' else ''} {expected:.6f} ({len(windows)} windows), "
              f"relative gap {gaps[which]:.2g}")
    with open(os.path.join(merged, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config, f"{merged}: quantization_config left"
    dtypes = {t.dtype for t in tensors(merged).values()}
    assert dtypes == {torch.bfloat16}, dtypes
    from transformers import LlamaForCausalLM

    merged_logits, merged_loss = mean_loss(
        LlamaForCausalLM.from_pretrained(merged, dtype=torch.bfloat16).eval(), windows)
    logits_gap = (merged_logits - peft_logits).abs().max().item()
    loss_gap = abs(merged_loss - after) / after
    print(f"{merged} (bf16, no quantization_config) in transformers against PEFT over {base4}: "
          f"max |logits difference| {logits_gap:.3g}, loss {merged_loss:.6f} (relative gap "
          f"{loss_gap:.2g})")
    assert gaps["before"] <= BNB4_TOLERANCE and gaps["after"] <= BNB4_TOLERANCE, gaps
    assert logits_gap <= BNB4_MERGED_LOGITS and loss_gap <= BNB4_MERGED_LOSS, (logits_gap, loss_gap)


def logits(root, folder, path):
    ids = torch.load(os.path.join(root, "ids.pt"))["ids"]
    with torch.no_grad():
        expected = model_of(folder)(input_ids=ids).logits
    failed = 0
    for key, value in torch.load(path).items():
        diff = (value - expected).abs().max().item()
        print(f"{folder} {key}: max |fsdp - transformers| = {diff:.3g}")
        failed += diff > TOLERANCE
    assert not failed


def run(command, root, args):
    if command == "make":
        make(root, args)
    elif command == "same":
        same(args[0], args[1])
    elif command == "differ":
        differ(args[0], args[1])
    elif command == "lora":
        lora(args[0], args[1])
    elif command == "peft":
        peft_check(root, args[0], args[1], args[2])
    elif command == "peft_merge":
        peft_merge(args[0], args[1], args[2])
    elif command == "qlora":
        qlora(args[0], args[1], args[2])
    elif command == "eval":
        eval_loss(root, args[0], int(args[1]), args[2])
    elif command == "logits":
        logits(root, args[0], args[1])
    elif command == "bnb4":
        bnb4(root, args[0], args[1])
    elif command == "bnb4_peft":
        bnb4_peft(args[0], args[1], args[2], args[3], int(args[4]), args[5])
    else:
        sys.exit(f"unknown command {command}")


def batch(root, queue):
    """Each line of `queue` (a command and its arguments, tab-separated) in this one process:
    the checks share one start of torch and transformers."""
    with open(queue) as f:
        lines = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    for line in lines:
        print("check:", " ".join(line), flush=True)
        run(line[0], root, line[1:])


if __name__ == "__main__":
    command, root = sys.argv[1], sys.argv[2]
    if command == "batch":
        batch(root, sys.argv[3])
    else:
        run(command, root, sys.argv[3:])
