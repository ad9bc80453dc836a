#!/usr/bin/env bash
# examples/llama:finetune end to end against transformers: a random tiny Llama folder
# with a BPE tokenizer trained on Debian's fortunes; tokenize.py makes the token files;
# finetune at W = 2 with --steps=0 writes the weights it read bit for bit (and at W = 3
# for a bfloat16 folder with tied embeddings, which then trains with bf16 compute over fp32
# master weights and is written back in bf16, and trains LoRA over its bf16 base); 20 steps of
# full fine-tuning lower the eval loss, and the folder it writes loads in transformers'
# from_pretrained with the eval loss fsdp printed and logits within 1e-5 of fsdp's. QLoRA
# (--quantize=nf4) matches bitsandbytes' NF4, and a bitsandbytes 4-bit folder made by
# transformers trains with LoRA as it is stored (against transformers + bitsandbytes + PEFT).
#   llama_finetune_test.sh FINETUNE LLAMA_LOGITS TOKENIZE_PY TEST_PY PYTHON
set -euo pipefail
finetune=${1:?usage: llama_finetune_test.sh FINETUNE LLAMA_LOGITS TOKENIZE_PY TEST_PY PYTHON}
logits=${2:?} tokenize=${3:?} script=${4:?} python=${5:?}
dir=${TEST_TMPDIR:-$(mktemp -d)}/llama_finetune
rm -rf "$dir" && mkdir -p "$dir"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# The checks that only read what a run wrote are queued and run together by check_queued,
# in one Python process: each start of torch, transformers and PEFT costs seconds.
queue="$dir/checks.tsv"
: > "$queue"
check() { (IFS=$'\t'; echo "$*") >> "$queue"; }
check_queued() { "$python" "$script" batch "$dir" "$queue"; : > "$queue"; }
fortunes=(/usr/share/games/fortunes/{fortunes,literature,science})
"$python" "$script" make "$dir" "${fortunes[@]}"
"$python" "$tokenize" --model="$dir/model" --out="$dir/train.bin" "$dir/train.txt"
"$python" "$tokenize" --model="$dir/model" --out="$dir/eval.bin" "$dir/eval.txt"

common=(--from="$dir/model" --data="$dir/train.bin" --world_size=2 --context=32
        --batch_size=4 --max_shard_size=30KB)
"$finetune" "${common[@]}" --out_dir="$dir/out0" --steps=0 | tee "$dir/out0.log"
check same "$dir/model" "$dir/out0/hf"
# bfloat16 weights and tied embeddings, at W = 3: kept bit for bit through the fp32 master
# weights, then trained (bf16 compute) and written back in bf16.
bf16=(--from="$dir/model_bf16" --data="$dir/train.bin" --world_size=3 --context=32
      --batch_size=3 --max_shard_size=30KB)
"$finetune" "${bf16[@]}" --out_dir="$dir/bf16_0" --steps=0
check same "$dir/model_bf16" "$dir/bf16_0/hf"
"$finetune" "${bf16[@]}" --out_dir="$dir/bf16_3" --steps=3 --lr=1e-2 --warmup_steps=0
check differ "$dir/model_bf16" "$dir/bf16_3/hf"
# LoRA over the bf16 folder: the frozen base stays bf16 on every rank (fp32 adapters; Note
# [The frozen base of a LoRA run] in examples/llama/finetune.cc), half the parameter bytes
# of an fp32 copy of it (--lora_base_dtype=float32) with the same losses, adapters and
# merged folder bit for bit; the merge equals PEFT's of the (fp32) adapter bit for bit.
"$finetune" "${bf16[@]}" --out_dir="$dir/bf16_lora" --steps=3 --lr=1e-2 --warmup_steps=0 \
    --lora_rank=4 | tee "$dir/bf16_lora.log"
grep -q "frozen base kept in BFloat16" "$dir/bf16_lora.log"
grep -q "memory plan: parameters 20 KiB" "$dir/bf16_lora.log"
"$finetune" "${bf16[@]}" --out_dir="$dir/bf16_lora32" --steps=3 --lr=1e-2 --warmup_steps=0 \
    --lora_rank=4 --lora_base_dtype=float32 | tee "$dir/bf16_lora32.log"
grep -q "memory plan: parameters 38 KiB" "$dir/bf16_lora32.log"
diff <(cut -d, -f1-3 "$dir/bf16_lora/metrics.csv") <(cut -d, -f1-3 "$dir/bf16_lora32/metrics.csv")
check same "$dir/bf16_lora32/hf" "$dir/bf16_lora/hf"
check same "$dir/bf16_lora32/adapter" "$dir/bf16_lora/adapter"
check lora "$dir/model_bf16" "$dir/bf16_lora/hf"
check peft_merge "$dir/model_bf16" "$dir/bf16_lora/adapter" "$dir/bf16_lora/hf"
# QLoRA (--quantize=nf4) over both folders: the layer projections are bitsandbytes' NF4 of
# the base bit for bit in OUT/hf (dequantized, plus the update); over the fp32 folder the
# eval loss falls and transformers gives fsdp's eval loss on OUT/hf.
"$finetune" "${bf16[@]}" --out_dir="$dir/bf16_qlora" --steps=3 --lr=1e-2 --warmup_steps=0 \
    --lora_rank=4 --quantize=nf4 | tee "$dir/bf16_qlora.log"
grep -q "QLoRA: 14 projections in NF4" "$dir/bf16_qlora.log"
check qlora "$dir/model_bf16" "$dir/bf16_qlora/adapter" "$dir/bf16_qlora/hf"
# A bitsandbytes 4-bit folder (transformers' save_pretrained after loading a bf16 Llama with
# BitsAndBytesConfig(load_in_4bit=True, nf4, double quantization, bf16 compute)) is read as
# it is stored. Its projections hold the bytes --quantize=nf4 makes of the bf16 folder's
# (bitsandbytes' NF4, as above), so LoRA over either has the same memory plan (the NF4 bytes
# counted), losses, adapter and OUT/hf, bit for bit; the eval losses are transformers +
# bitsandbytes' on the 4-bit folder (PEFT with OUT/adapter over it after training) within
# 1e-4, and OUT/hf (bf16, no quantization_config) loads in transformers close to PEFT's.
# --quantize=nf4 changes nothing there; --lora_rank=0 is refused.
"$python" "$script" bnb4 "$dir" "$dir/model_bf16_h64" "$dir/model_bnb4"
head -c 2178 "$dir/eval.bin" > "$dir/eval_short.bin"  # 33 windows of 33 tokens
bnb4=(--data="$dir/train.bin" --world_size=3 --context=32 --batch_size=3 --max_shard_size=30KB
      --steps=3 --lr=1e-2 --warmup_steps=0 --lora_rank=4)
"$finetune" "${bnb4[@]}" --from="$dir/model_bf16_h64" --quantize=nf4 \
    --out_dir="$dir/bnb4_quantized" | tee "$dir/bnb4_quantized.log"
"$finetune" "${bnb4[@]}" --from="$dir/model_bnb4" --eval_data="$dir/eval_short.bin" \
    --out_dir="$dir/bnb4" | tee "$dir/bnb4.log"
grep -q "QLoRA: 14 projections in NF4 as the folder stores them" "$dir/bnb4.log"
plan_of() { grep -o "memory plan: parameters [0-9.]* [KMG]*i*B" "$1"; }
[ -n "$(plan_of "$dir/bnb4.log")" ] &&
  [ "$(plan_of "$dir/bnb4.log")" = "$(plan_of "$dir/bnb4_quantized.log")" ] || {
  echo "FAIL: plans: $(plan_of "$dir/bnb4.log") / $(plan_of "$dir/bnb4_quantized.log")"; exit 1; }
diff <(cut -d, -f1-3 "$dir/bnb4_quantized/metrics.csv") <(cut -d, -f1-3 "$dir/bnb4/metrics.csv")
check same "$dir/bnb4_quantized/adapter" "$dir/bnb4/adapter"
check same "$dir/bnb4_quantized/hf" "$dir/bnb4/hf"
check bnb4_peft "$dir/model_bnb4" "$dir/bnb4/adapter" "$dir/bnb4/hf" \
    "$dir/eval_short.bin" 32 "$dir/bnb4.log"
"$finetune" "${bnb4[@]}" --from="$dir/model_bnb4" --quantize=nf4 --steps=0 \
    --out_dir="$dir/bnb4_quantize" | tee "$dir/bnb4_quantize.log"
grep -q "QLoRA: 14 projections in NF4 as the folder stores them" "$dir/bnb4_quantize.log"
set +e
"$finetune" "${bnb4[@]}" --from="$dir/model_bnb4" --lora_rank=0 --out_dir="$dir/bnb4_full" \
    2> "$dir/bnb4_full.err"
status=$?
set -e
[ $status -eq 2 ] && [ "$(cat "$dir/bnb4_full.err")" = "finetune: --from=$dir/model_bnb4 holds 4-bit weights (its quantization_config: bitsandbytes' NF4), which cannot be trained: fine-tune it with LoRA (--lora_rank=R)" ] || {
  echo "FAIL: full fine-tune of a 4-bit folder: status $status, $(cat "$dir/bnb4_full.err")"; exit 1; }
"$finetune" "${common[@]}" --out_dir="$dir/qlora" --steps=10 --lr=1e-2 --warmup_steps=0 \
    --lora_rank=4 --quantize=nf4 --eval_data="$dir/eval.bin" | tee "$dir/qlora.log"
qlora_before=$(sed -n 's/.*eval loss before: //p' "$dir/qlora.log")
qlora_after=$(sed -n 's/.*eval loss after: //p' "$dir/qlora.log")
awk -v b="$qlora_before" -v a="$qlora_after" 'BEGIN { exit !(a < b) }' || {
  echo "FAIL: QLoRA eval loss did not fall: $qlora_before -> $qlora_after"; exit 1; }
check qlora "$dir/model" "$dir/qlora/adapter" "$dir/qlora/hf"
check eval "$dir/qlora/hf" 32 "$dir/qlora.log"

"$finetune" "${common[@]}" --out_dir="$dir/out20" --steps=20 --lr=3e-3 --warmup_steps=2 \
    --checkpoint_interval=10 --eval_data="$dir/eval.bin" | tee "$dir/out20.log"
grep -q "] step 20/20 | loss" "$dir/out20.log"
before=$(sed -n 's/.*eval loss before: //p' "$dir/out20.log")
after=$(sed -n 's/.*eval loss after: //p' "$dir/out20.log")
awk -v b="$before" -v a="$after" 'BEGIN { exit !(a < b) }' || {
  echo "FAIL: eval loss did not fall: $before -> $after"; exit 1; }
[ "$(wc -l < "$dir/out20/metrics.csv")" -eq 21 ] || { echo "FAIL: metrics.csv rows"; exit 1; }
ls "$dir/out20/checkpoints/step_00000020/.metadata" > /dev/null  # a DCP folder (the default)
check differ "$dir/model" "$dir/out20/hf"
check eval "$dir/out20/hf" 32 "$dir/out20.log"
"$logits" "$dir/out20/hf" "$dir/ids.pt" "$dir/out20_logits.pt" 2
check logits "$dir/out20/hf" "$dir/out20_logits.pt"

# LoRA (rank 4 on q_proj and v_proj, the rest frozen): OUT/hf holds the merged weights,
# which from_pretrained loads with the eval loss fsdp printed; OUT/adapter loads in PEFT
# onto the base model with the merged model's logits.
"$finetune" "${common[@]}" --out_dir="$dir/lora" --steps=10 --lr=1e-2 --warmup_steps=0 \
    --lora_rank=4 --lora_dropout=0.1 --eval_data="$dir/eval.bin" | tee "$dir/lora.log"
grep -q "LoRA: adapters on 4 modules" "$dir/lora.log"
grep -q "38688 parameters (896 trainable;" "$dir/lora.log"
check lora "$dir/model" "$dir/lora/hf"
check eval "$dir/lora/hf" 32 "$dir/lora.log"
check peft "$dir/model" "$dir/lora/adapter" "$dir/lora/hf"

check_queued  # before the resume below writes out20 again

# A second run in the same folder needs --resume (or --overwrite); --resume continues.
if "$finetune" "${common[@]}" --out_dir="$dir/out20" --steps=20 2> "$dir/again.err"; then
  echo "FAIL: a rerun over another run's checkpoints was accepted"; exit 1
fi
grep -q "holds another run's checkpoints" "$dir/again.err"
"$finetune" "${common[@]}" --out_dir="$dir/out20" --steps=25 --resume --max_shard_size=1GB \
    | tee "$dir/resume.log"
grep -q "resumed from .*step_00000020 at step 20" "$dir/resume.log"
grep -q "] step 25/25 | loss" "$dir/resume.log"
# That run wrote OUT/hf again in one file (no --max_shard_size): no old shard is left.
[ "$(ls "$dir/out20/hf" | grep -c safetensors)" -eq 1 ] || {
  echo "FAIL: stale files in out20/hf: $(ls "$dir/out20/hf")"; exit 1; }

# Bad flags: one line, status 2.
set +e
"$finetune" --from="$dir/model" --data="$dir/train.bin" --out_dir="$dir/x" --context=65 2> "$dir/bad.err"
status=$?
set -e
[ $status -eq 2 ] && grep -q "^finetune: --context=65: expected 1 to max_position_embeddings = 64$" "$dir/bad.err" || {
  echo "FAIL: bad --context: status $status, $(cat "$dir/bad.err")"; exit 1; }
for bad in "--weight_decay=nan:--weight_decay=nan: expected a finite value >= 0" \
           "--lora_target_modules=q_proj:--lora_target_modules=q_proj: adapters need --lora_rank=R (R >= 1); without it every weight is fine-tuned"; do
  set +e
  "$finetune" --from="$dir/model" --data="$dir/train.bin" --out_dir="$dir/x" --context=32 \
    "${bad%%:*}" 2> "$dir/bad.err"
  status=$?
  set -e
  [ $status -eq 2 ] && [ "$(cat "$dir/bad.err")" = "finetune: ${bad#*:}" ] || {
    echo "FAIL: ${bad%%:*}: status $status, $(cat "$dir/bad.err")"; exit 1; }
done
# A uint32 token file: tokenize.py names the flag it needs, and under --data_dtype=auto
# finetune refuses it rather than read every second id as 0.
"$python" "$tokenize" --model="$dir/model" --dtype=uint32 --out="$dir/train32.bin" \
    "$dir/train.txt" | grep -q "; finetune reads it with --data_dtype=uint32$" || {
  echo "FAIL: tokenize.py --dtype=uint32 does not name --data_dtype=uint32"; exit 1; }
set +e
"$finetune" --from="$dir/model" --data="$dir/train32.bin" --out_dir="$dir/x" --context=32 \
    2> "$dir/bad.err"
status=$?
set -e
[ $status -eq 2 ] && [ "$(cat "$dir/bad.err")" = "finetune: --data=$dir/train32.bin: every second 16-bit id is 0, as when a file of uint32 ids (tokenize.py --dtype=uint32) is read as uint16; pass --data_dtype=uint32, or --data_dtype=uint16 if it does hold 16-bit ids" ] || {
  echo "FAIL: a uint32 file under --data_dtype=auto: status $status, $(cat "$dir/bad.err")"; exit 1; }
echo "PASS: finetune writes what it read at --steps=0 and a trained folder transformers loads"
