#!/usr/bin/env bash
# The behaviours examples/trainer gives both trainers, checked on each (the GPT trainer
# and the fine-tune): a stray argument and a bad run flag are refused before anything
# starts (exit 2, one line); ranks started with different flags stop naming the flag;
# --checkpoint_dir and --async_save checkpoints; metrics.csv and memory_rank<R>.csv; the
# memory plan before training; the per-rank peak memory and traffic at the end; a second run in the same folder needs
# --resume or --overwrite, and --resume continues the curve.
#   trainer_parity_test.sh TRAIN FINETUNE PYTHON
set -uo pipefail
train=${1:?usage: trainer_parity_test.sh TRAIN FINETUNE PYTHON} finetune=${2:?} python=${3:?}
root=${TEST_TMPDIR:-$(mktemp -d)}/trainer_parity
rm -rf "$root" && mkdir -p "$root"
passed=0
failed=0
check() {  # check NAME CONDITION
  if eval "$2"; then echo "ok $1"; passed=$((passed + 1)); else echo "FAIL $1"; failed=$((failed + 1)); fi
}

# A random 2-layer Llama folder and 2,000 training tokens for the fine-tune.
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$python" - "$root" <<'PY' || { echo "FAIL: cannot make the Llama folder"; exit 1; }
import sys
import numpy as np
import torch
import transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=128, max_position_embeddings=64)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1] + "/model")
np.random.default_rng(0).integers(0, 128, 2000, dtype=np.uint16).tofile(sys.argv[1] + "/train.bin")
PY

gpt_args=(--layers=1 --width=32 --heads=2 --context=16 --batch_size=4 --warmup_steps=1
  --eval_batches=1 --sample_length=0 --timeout_s=20)
llama_args=(--from="$root/model" --data="$root/train.bin" --context=16 --batch_size=4
  --warmup_steps=1 --timeout_s=20)

for name in train finetune; do
  if [[ $name == train ]]; then bin=$train; args=("${gpt_args[@]}"); else bin=$finetune; args=("${llama_args[@]}"); fi
  dir=$root/$name

  # 1. A stray argument and a bad run flag: exit 2, one line, nothing made.
  out=$("$bin" "${args[@]}" --out_dir="$dir/never" stray 2>&1)
  status=$?
  check "$name refuses a stray argument (status $status): $out" \
    "[[ $status -eq 2 && \"\$out\" == \"$name: unexpected argument 'stray': the trainer takes only --flags (see --help); pass values as --name=value\" ]]"
  out=$("$bin" "${args[@]}" --out_dir="$dir/never" --checkpoint_format=zip 2>&1)
  status=$?
  check "$name refuses --checkpoint_format=zip (status $status): $out" \
    "[[ $status -eq 2 && \"\$out\" == \"$name: --checkpoint_format=zip: expected dcp (PyTorch Distributed Checkpoint) or fsdp\" ]]"
  check "$name made nothing" "[[ ! -e $dir/never ]]"

  # 2. Ranks started with different --steps stop at once, naming the flag.
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for rank in 0 1; do
    RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port timeout 60 "$bin" "${args[@]}" --steps=$((2 + rank)) \
      --out_dir="$dir/steps" >"$dir.steps$rank.log" 2>&1 &
  done
  wait
  check "$name: ranks with different --steps name it" \
    "grep -q 'rank 1 was started with --steps=3 but rank 0 with --steps=2' $dir.steps0.log"

  # 3. A run with background checkpoints in --checkpoint_dir, its records, the per-rank figures.
  "$bin" "${args[@]}" --world_size=2 --steps=2 --log_interval=1 --checkpoint_interval=1 \
    --async_save --checkpoint_dir="$dir/ckpt" --out_dir="$dir/out" >"$dir.run.log" 2>&1
  status=$?
  check "$name runs (status $status)" "[[ $status -eq 0 ]]"
  check "$name writes checkpoints in the background into --checkpoint_dir" \
    "[[ -d $dir/ckpt/step_00000001 && -d $dir/ckpt/step_00000002 ]] && grep -q 'written in the background' $dir.run.log"
  check "$name's metrics.csv holds steps 1-2" "[[ \$(cut -d, -f1 $dir/out/metrics.csv | tail -n +2 | xargs) == '1 2' ]]"
  check "$name writes memory_rank<R>.csv on every rank" \
    "[[ \$(wc -l <$dir/out/memory_rank0.csv) -eq 3 && \$(wc -l <$dir/out/memory_rank1.csv) -eq 3 ]]"
  check "$name prints its memory plan before training" "grep -q '] memory plan: .* per rank' $dir.run.log"
  check "$name prints each rank's peak memory and traffic" \
    "grep -q 'rank 1: peak memory [0-9.]* MB, sent [0-9.]* MB per step' $dir.run.log"

  # 4. The same folder again: refused without --resume; --resume continues at step 3.
  "$bin" "${args[@]}" --world_size=2 --steps=3 --checkpoint_dir="$dir/ckpt" --out_dir="$dir/out" \
    >"$dir.again.log" 2>&1
  status=$?
  check "$name refuses to mix runs in a checkpoint folder (status $status)" \
    "[[ $status -eq 1 ]] && grep -q -- '--resume' $dir.again.log"
  "$bin" "${args[@]}" --world_size=2 --steps=3 --log_interval=1 --checkpoint_dir="$dir/ckpt" \
    --out_dir="$dir/out" --resume >"$dir.resume.log" 2>&1
  status=$?
  check "$name resumes at step 3 (status $status)" \
    "[[ $status -eq 0 ]] && grep -q 'step 3/3 | loss' $dir.resume.log && [[ \$(cut -d, -f1 $dir/out/metrics.csv | tail -n +2 | xargs) == '1 2 3' ]]"
done

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
