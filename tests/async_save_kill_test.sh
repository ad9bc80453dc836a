#!/usr/bin/env bash
# Every rank SIGKILLed at a random point while the GPT trainer saves asynchronously (the
# default --async_save; a checkpoint every 2 steps, so a background write is nearly always
# in flight): as after a crash, a power cut or Ctrl-C, every step_* folder left must be
# complete (its .metadata or metadata.pt, published last), and the newest must load and
# train on (at W = 1, with --resume, which also removes the partial folders of the killed
# write). Odd trials save Distributed Checkpoint folders (the default
# --checkpoint_format=dcp), even ones fsdp's format (--checkpoint_format=fsdp).
# Prints how many trials killed a write mid-way (a partial folder was left).
#   async_save_kill_test.sh PATH/TO/examples/gpt/train [TRIALS [W]]
set -uo pipefail
train=${1:?usage: async_save_kill_test.sh TRAIN [TRIALS [W]]}
trials=${2:-4}
world_size=${3:-2}
root=${TEST_TMPDIR:-$(mktemp -d)}/async_save_kill
flags=(--layers=2 --width=128 --heads=2 --context=32 --batch_size=8 --steps=100000
  --warmup_steps=5 --log_interval=1 --eval_interval=100000 --eval_batches=1 --sample_length=0
  --checkpoint_interval=2 --timeout_s=10)
free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

clean=0
mid_write=0
for trial in $(seq 1 "$trials"); do
  dir=$root/$trial
  rm -rf "$dir"
  if ((trial % 2)); then
    format=dcp
    complete=.metadata
  else
    format=fsdp
    complete=metadata.pt
  fi
  mkdir -p "$dir"
  port=$(free_port)
  pids=()
  for rank in $(seq 0 $((world_size - 1))); do
    RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$world_size LOCAL_WORLD_SIZE=$world_size \
      MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$train" "${flags[@]}" --checkpoint_format=$format --out_dir="$dir" >"$dir/rank$rank.log" 2>&1 &
    pids+=($!)
  done
  # Wait until the save of step 4, 6 or 8 returns (its write has just begun in the
  # background), then kill every rank 0-20 ms later: inside the write, or just after.
  target=$(printf "step_%08d" $((4 + 2 * (trial % 3))))
  for _ in $(seq 1 6000); do
    grep -q "checkpoint: .*$target" "$dir/rank0.log" 2>/dev/null && break
    sleep 0.01
  done
  sleep "$(awk -v r=$RANDOM 'BEGIN { printf "%.3f", 0.02 * r / 32767 }')"
  kill -KILL "${pids[@]}"
  wait "${pids[@]}" 2>/dev/null
  ok=1
  step=$(grep -oE "^step [0-9]+/" "$dir/rank0.log" | tail -1)
  partials() { find "$dir/checkpoints" -maxdepth 1 -name '.*.partial-*' | wc -l; }
  partial=$(partials)
  [[ $partial -gt 0 ]] && mid_write=$((mid_write + 1))
  for ckpt in "$dir"/checkpoints/step_*; do
    if [[ ! -f $ckpt/$complete ]]; then
      echo "trial $trial ($format): ${ckpt##*/} is incomplete (no $complete)"
      ok=0
    fi
  done
  latest=$(ls -d "$dir"/checkpoints/step_* 2>/dev/null | tail -1)
  if [[ -z $latest ]]; then
    echo "trial $trial: no complete checkpoint after ${step%/}"
    ok=0
  else
    resumed=$("$train" "${flags[@]}" --world_size=1 --resume --steps=$((10#${latest##*_} + 2)) \
      --checkpoint_interval=0 --out_dir="$dir" 2>&1)
    if grep -q "resumed from $latest" <<<"$resumed" && grep -q "step $((10#${latest##*_} + 2))/" <<<"$resumed" &&
      [[ $(partials) -eq 0 ]]; then
      echo "trial $trial ($format): killed after ${step%/} with $partial partial folder(s);" \
        "resumed from ${latest##*/} at W = 1 and trained on"
    else
      echo "trial $trial: ${latest##*/} did not resume: $(tail -3 <<<"$resumed")"
      ok=0
    fi
  fi
  clean=$((clean + ok))
done
echo "$clean of $trials trials left a loadable newest checkpoint; $mid_write killed a write mid-way"
[[ $clean -eq $trials ]]
