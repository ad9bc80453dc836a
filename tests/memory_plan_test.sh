#!/usr/bin/env bash
# examples/llama:finetune's memory plan (Note [Checking the plan before loading]) against
# what the ranks measure: a random 31 M-parameter Llama folder (transformers'
# save_pretrained), W = 2, a full and a LoRA fine-tune, LoRA and QLoRA (--quantize=nf4) on
# the same model saved in bf16 (a bf16 frozen base; NF4 projections), and a full fine-tune
# of a random 30 M-parameter Qwen3-MoE folder (16 experts, top-4, a dense layer; the
# router's load-balancing loss on, as by default); each run's largest peak resident
# set must lie within 15% of the plan printed before loading, and the MoE run's parameter
# count (printed by the trainer and by fsdp_plan) is transformers' exactly, both naming what
# gathering a sparse layer's experts costs and what --moe_units=sublayer would peak at; the
# same MoE run with --moe_units=sublayer (attention and feed-forward units) within 15% too.
# With --max_memory_per_rank below the plan, every rank
# stops before reading a weight, naming the sum and the budget, and writes nothing.
# fsdp_plan --config gives the same plan from the config.json alone (all but the runtime,
# which the trainer measures), and the smallest world size that fits a memory per rank.
# The trainer does not link libtorch_cuda, which a CPU run would map for nothing.
#   memory_plan_test.sh FINETUNE FSDP_PLAN PYTHON
set -euo pipefail
finetune=${1:?usage: memory_plan_test.sh FINETUNE FSDP_PLAN PYTHON} plan=${2:?} python=${3:?}
dir=${TEST_TMPDIR:-$(mktemp -d)}/memory_plan
rm -rf "$dir" && mkdir -p "$dir"
# LibTorch's CUDA kernels are loaded only on CUDA (fsdp/base/torch_compat_cuda.h): linked,
# they would add 235 MiB to every CPU rank before the first weight.
if readelf -d "$finetune" | grep -q 'NEEDED.*libtorch_cuda'; then
  echo "FAIL: $finetune links libtorch_cuda, which every CPU run would then map"; exit 1
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$python" - "$dir" <<'PY'
import sys
import numpy as np
import torch
import transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(
    hidden_size=384, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
    intermediate_size=1024, vocab_size=32000, max_position_embeddings=256)
llama = transformers.LlamaForCausalLM(config)
llama.save_pretrained(sys.argv[1] + "/model")
llama.to(torch.bfloat16).save_pretrained(sys.argv[1] + "/model_bf16")
moe = transformers.Qwen3MoeConfig(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=16,
    num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[3], vocab_size=32000,
    max_position_embeddings=256)
model = transformers.Qwen3MoeForCausalLM(moe)
model.save_pretrained(sys.argv[1] + "/moe")
with open(sys.argv[1] + "/moe_numel", "w") as f:
    f.write(str(sum(p.numel() for p in model.parameters())))
np.random.default_rng(0).integers(0, 32000, 50000, dtype=np.uint16).tofile(sys.argv[1] + "/train.bin")
PY
common=(--from="$dir/model" --data="$dir/train.bin" --world_size=2 --context=64
        --batch_size=4 --steps=2 --checkpoint_interval=0)
for run in full lora lora_bf16 qlora moe moe_split; do
  extra=() from=model
  [[ $run == lora* || $run == qlora ]] && extra=(--lora_rank=8)
  [[ $run == lora_bf16 || $run == qlora ]] && from=model_bf16
  [[ $run == qlora ]] && extra+=(--quantize=nf4)
  [[ $run == moe* ]] && from=moe
  [[ $run == moe_split ]] && extra=(--moe_units=sublayer)
  "$finetune" "${common[@]}" "${extra[@]}" --from="$dir/$from" --out_dir="$dir/$run" |
      tee "$dir/$run.log"
  grep -q "] memory plan: parameters .* = peak .* per rank" "$dir/$run.log"
  ratio=$(sed -n 's/.*(largest \/ plan \([0-9.]*\)).*/\1/p' "$dir/$run.log")
  awk -v r="$ratio" 'BEGIN { exit !(r >= 0.85 && r <= 1.15) }' || {
    echo "FAIL: $run: the largest peak resident set is $ratio x the plan, not within 15%"; exit 1; }
  echo "$run: largest / plan = $ratio"
  # The same terms from fsdp_plan --config (the runtime aside).
  terms=$(sed -n 's/.*memory plan: \(parameters .*\) + allocator.*/\1/p' "$dir/$run.log")
  "$plan" --config="$dir/$from/config.json" --world_size=2 --batch_size=4 --context=64 \
      "${extra[@]}" > "$dir/$run.plan"
  grep -qF "memory plan: $terms + allocator" "$dir/$run.plan" || {
    echo "FAIL: fsdp_plan --config differs from the trainer's plan ($terms):"; cat "$dir/$run.plan"; exit 1; }
  if [[ $run == moe ]]; then  # every expert counted: the parameters are transformers'
    numel=$(cat "$dir/moe_numel")
    grep -q "), $numel parameters ($numel trainable" "$dir/moe.log" &&
        grep -q "): $numel parameters ($numel trainable)" "$dir/moe.plan" || {
      echo "FAIL: transformers' Qwen3-MoE has $numel parameters; the trainer and fsdp_plan say:"
      grep "parameters (" "$dir/moe.log" "$dir/moe.plan"; exit 1; }
    echo "moe: $numel parameters in the trainer, fsdp_plan and transformers"
    # What gathering a sparse layer costs: 16 experts x 3 x 256 x 256 fp32 elements (12 MiB).
    line="mixture of experts: each sparse layer's unit gathers all 16 experts, 12 MiB in Float, though each token uses 4 of them; --moe_units=sublayer (attention and experts units of their own) would peak at "
    grep -qF "$line" "$dir/moe.log" && grep -qF "$line" "$dir/moe.plan" || {
      echo "FAIL: expected \"$line\" from the trainer and fsdp_plan"; exit 1; }
  fi
  if [[ $run == moe_split ]]; then  # the attention and the experts units of their own
    line="mixture of experts: each sparse layer's feed-forward unit gathers all 16 experts, 12 MiB in Float, though each token uses 4 of them; peak "
    grep -qF "$line" "$dir/moe_split.log" && grep -qF "$line" "$dir/moe_split.plan" || {
      echo "FAIL: expected \"$line\" from the trainer and fsdp_plan"; exit 1; }
  fi
done
# The smallest world size for exactly the W = 2 peak is 2 (W = 1 holds more).
peak2=$("$plan" --config="$dir/model/config.json" --world_size=2 --batch_size=4 --context=64 \
        --format=json | "$python" -c 'import json, sys; print(json.load(sys.stdin)["bytes"]["peak"])')
smallest=$("$plan" --config="$dir/model/config.json" --batch_size=4 --context=64 \
           --memory_per_rank="$peak2" --format=json |
           "$python" -c 'import json, sys; print(json.load(sys.stdin)["smallest_world_size"])')
[[ $smallest == 2 ]] || { echo "FAIL: smallest world size for $peak2 bytes is $smallest, not 2"; exit 1; }

status=0
"$finetune" "${common[@]}" --out_dir="$dir/small" --max_memory_per_rank=200MiB \
    >"$dir/small.log" 2>&1 || status=$?
cat "$dir/small.log"
[[ $status == 1 ]] || { echo "FAIL: expected exit status 1 over the budget, got $status"; exit 1; }
grep -q "finetune: the memory plan needs .* per rank, more than the 200 MiB rank 0 may use (--max_memory_per_rank); .* Nothing was read." "$dir/small.log"
[[ ! -e "$dir/small/hf" ]] || { echo "FAIL: a run over its budget wrote $dir/small/hf"; exit 1; }
echo PASS
