#!/usr/bin/env bash
# Each decoder family of //models (Llama 3.x with llama3 RoPE and biases, Llama with linear
# RoPE in transformers 4.x spelling, Qwen2 with YaRN, biases, tied embeddings and sliding
# layers, Qwen3, Mistral, Gemma 2, Gemma 3 text in 5.x and 4.x spellings, Granite, OLMo 2,
# Phi-3 with fused projections, partial rotary embeddings and longrope) against
# transformers 5.23 on tiny checkpoints it wrote (families.py make: each family feature
# shown to change the loss by >= 5x the tolerance). Per family, examples/llama:finetune
# with --steps=0 at W = 1 and W = 3 (W = 3 divides no tensor): eval loss within 1e-5
# relative of transformers' (eager, fp32) and every tensor written back bit for bit; full
# and LoRA fine-tunes (every projection adapted) at W = 3 lower the eval loss, and transformers (the written folder)
# and PEFT (base + adapter) compute the eval loss fsdp printed.
# With SET "moe" (moe_families_test): the mixture-of-experts families instead (Qwen3-MoE
# with a dense layer and renormalised top-k, Mixtral, OLMoE, Qwen2-MoE with its shared
# expert, gpt-oss with sinks, biases, sliding layers, YaRN and the clamped SwiGLU,
# DeepSeek-V3 with latent attention (q_lora_rank set, and null), interleaved RoPE, YaRN's
# mscale_all_dim, grouped sigmoid routing with a random e_score_correction_bias, a shared
# expert and a dense first layer), experts one by one in the checkpoints (gpt-oss's fused,
# as in fsdp) and fused in fsdp; at W = 1 one step at lr 0 whose training loss
# (cross-entropy + router_aux_loss_coef x the load-balancing loss; DeepSeek-V3 has none)
# equals transformers' output_router_logits=True loss within 1e-5 relative (Qwen3-MoE's
# and gpt-oss's on conversation rows too, packed and padded); they train with that loss;
# DeepSeek-V3's bf16 folder (its router bias fp32) written back bit for bit, its router
# bias kept by the full fine-tune; LoRA on the experts and a router loss for DeepSeek-V3
# are refused with exit status 2.
#   families_test.sh FINETUNE FAMILIES_PY PYTHON [SET]
set -euo pipefail
finetune=${1:?usage: families_test.sh FINETUNE FAMILIES_PY PYTHON [dense|moe]}
script=${2:?} python=${3:?} set=${4:-dense}
dir=${TEST_TMPDIR:-$(mktemp -d)}/families
rm -rf "$dir" && mkdir -p "$dir"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$python" "$script" make "$dir" "$set"
while read -r name trains targets aux; do
  d="$dir/$name"
  common=(--from="$d/model" --data="$dir/train.bin" --eval_data="$dir/eval.bin" --context=40
          --batch_size=3 --checkpoint_interval=0 --max_shard_size=40KB)
  for w in 1 3; do
    steps=(--steps=0)
    # MoE: one step at lr 0 (the weights stay bit for bit): its loss, router term included.
    [[ $set == moe && $w == 1 ]] && steps=(--steps=1 --lr=0 --warmup_steps=0)
    "$finetune" "${common[@]}" --world_size=$w "${steps[@]}" --out_dir="$d/w$w" > "$d/w$w.log"
  done
  if [[ -d $d/bf16 ]]; then  # a bf16 folder whose router bias transformers keeps fp32
    "$finetune" "${common[@]}" --from="$d/bf16" --world_size=3 --steps=0 --out_dir="$d/bf16_w3" \
        > "$d/bf16_w3.log"
  fi
  [ "$trains" = 1 ] || continue
  if [[ $aux == 1 ]]; then  # the router's term on conversation rows, packed and not
    for rows in packed per_row; do
      packing=--packing
      [[ $rows == per_row ]] && packing=--nopacking
      "$finetune" "${common[@]}" --data="$dir/chat.safetensors" "$packing" --world_size=1 \
          --steps=1 --lr=0 --warmup_steps=0 --router_aux_loss_coef=0.1 --out_dir="$d/chat_$rows" \
          > "$d/chat_$rows.log"
    done
  fi
  train=(--world_size=3 --steps=8 --lr=1e-2 --warmup_steps=0 --log_interval=8)
  "$finetune" "${common[@]}" "${train[@]}" --out_dir="$d/full" > "$d/full.log"
  "$finetune" "${common[@]}" "${train[@]}" --out_dir="$d/lora" --lora_rank=4 \
      --lora_target_modules="$targets" > "$d/lora.log"
done < "$dir/variants.txt"
# `refused NAME EXPECTED FLAGS...`: finetune with FLAGS exits with status 2 before any rank
# starts, its message containing EXPECTED.
refused() {
  local name=$1 expected=$2 status=0
  shift 2
  "$finetune" --data="$dir/train.bin" --context=40 --out_dir="$dir/$name" "$@" \
      2> "$dir/$name.err" || status=$?
  if [[ $status != 2 ]] || ! grep -qF "$expected" "$dir/$name.err"; then
    echo "FAIL: $*: expected exit status 2 and \"$expected\", got $status:"
    cat "$dir/$name.err"; exit 1
  fi
  echo "$* refused: $(cat "$dir/$name.err")"
}
if [[ $set == moe ]]; then  # LoRA on the routed experts; DeepSeek-V3's absent router loss
  refused experts "LoRA on the experts (PEFT's target_parameters) is not supported yet" \
      --from="$dir/qwen3_moe/model" --lora_rank=4 --lora_target_modules=q_proj,experts
  refused no_aux "a deepseek_v3 decoder has no load-balancing loss" \
      --from="$dir/deepseek_v3/model" --router_aux_loss_coef=0.01
fi
"$python" "$script" check "$dir"
echo "PASS: every family's loss matches transformers' at W = 1 and 3, and trains"
