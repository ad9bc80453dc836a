#!/usr/bin/env bash
# examples/llama:finetune on a conversation file against transformers (issue 48): the
# loss over the counted tokens (each example alone, summed, divided by their number) is
# the one fsdp reports, within 1e-5 relative, at W = 1 and W = 3, packed and one example a
# row, as the evaluation loss at --steps=0 and as the first step's training loss with and
# without --grad_accumulation_steps=2 (the global batch: every row once); one AdamW step
# at W = 3 in two micro-batches reaches W = 1's next loss; --sample_prompts' greedy answers
# before and after training equal transformers' generate() on the folder read and written.
#   chat_finetune_test.sh FINETUNE SCRIPT_PY PYTHON
set -euo pipefail
finetune=${1:?usage: chat_finetune_test.sh FINETUNE SCRIPT_PY PYTHON} script=${2:?} python=${3:?}
dir=${TEST_TMPDIR:-$(mktemp -d)}/chat_finetune
rm -rf "$dir" && mkdir -p "$dir"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$python" "$script" make "$dir"
want=$("$python" "$script" loss "$dir")
echo "transformers: $want"
failed=0
close() {  # close NAME GOT: within 1e-5 relative of $want
  if awk -v g="$2" -v w="$want" 'BEGIN { d = g - w; if (d < 0) d = -d; exit !(d <= 1e-5 * w) }'; then
    echo "ok $1: $2"
  else
    echo "FAIL $1: $2, transformers $want"; failed=1
  fi
}
common=(--from="$dir/model" --data="$dir/chat.safetensors" --context=32 --checkpoint_interval=0
        --timeout_s=60)
for world in 1 3; do
  for packing in true false; do
    rows=6; [[ $packing == false ]] && rows=12
    name="W=$world packing=$packing"
    out="$dir/eval_${world}_$packing"
    "$finetune" "${common[@]}" --world_size=$world --packing=$packing --batch_size=6 --steps=0 \
      --eval_data="$dir/chat.safetensors" --out_dir="$out" >"$out.log" 2>&1 ||
      { cat "$out.log"; exit 1; }
    close "$name: eval loss at --steps=0" "$(sed -n 's/.*eval loss before: //p' "$out.log")"
    for accumulation in 1 2; do
      out="$dir/train_${world}_${packing}_$accumulation"
      "$finetune" "${common[@]}" --world_size=$world --packing=$packing --batch_size=$rows \
        --grad_accumulation_steps=$accumulation --steps=1 --lr=0 --out_dir="$out" >"$out.log" 2>&1 ||
        { cat "$out.log"; exit 1; }
      close "$name, --grad_accumulation_steps=$accumulation: step 1's training loss" \
        "$(sed -n 2p "$out/metrics.csv" | cut -d, -f2)"
    done
  done
done
# The gradient is that of the global mean too: after one AdamW step, W = 3 in micro-batches
# of unequal counted targets reaches the loss W = 1 reaches in one batch.
# W = 3 also answers every example's prompt greedily (KV cache) before and after training.
for run in "1 1" "3 2"; do
  read -r world accumulation <<<"$run"
  out="$dir/step2_$world"
  samples=()
  [[ $world == 3 ]] && samples=(--sample_prompts="$dir/chat.safetensors" --sample_tokens=8)
  "$finetune" "${common[@]}" --world_size=$world --batch_size=6 --grad_accumulation_steps=$accumulation \
    --steps=2 --lr=1e-2 --warmup_steps=0 "${samples[@]}" --out_dir="$out" >"$out.log" 2>&1 ||
    { cat "$out.log"; exit 1; }
done
want=$(sed -n 3p "$dir/step2_1/metrics.csv" | cut -d, -f2)
close "step 2's training loss at W = 3 with 2 micro-batches against W = 1's ($want)" \
  "$(sed -n 3p "$dir/step2_3/metrics.csv" | cut -d, -f2)"
# The answers before training are the folder's, after it the written folder's.
"$python" "$script" generate "$dir/model" "$dir/step2_3/samples.jsonl" before 8 || failed=1
"$python" "$script" generate "$dir/step2_3/hf" "$dir/step2_3/samples.jsonl" after 8 || failed=1
grep -q "samples: $dir/step2_3/samples.jsonl (12 prompts answered before and after)" \
  "$dir/step2_3.log" || { echo "FAIL: the samples line"; grep "samples" "$dir/step2_3.log"; failed=1; }
grep -q "data: 12 examples in 6 rows of 32 tokens (packed best-fit decreasing, 0.0% padding)" \
  "$dir/eval_3_true.log" || { echo "FAIL: the packed rows"; grep "data:" "$dir/eval_3_true.log"; failed=1; }
exit $failed
