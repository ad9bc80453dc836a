#!/usr/bin/env bash
# A rank SIGKILLed at a random point of training (forward, backward, optimizer step or
# checkpoint save: the run saves a checkpoint every 2 steps) with W ranks (3 by default):
# every other rank must exit non-zero within the collective timeout (10 s) plus 5 s,
# naming the lost rank (its global rank, also when the failing collective is a
# subgroup's) and the collective; no partial checkpoint folder is left; the newest
# complete checkpoint must still load (resumed at W = 1). Trial t kills rank t mod W.
#   rank_failure_test.sh PATH/TO/examples/gpt/train [TRIALS [W [TRAINER FLAGS...]]]
set -uo pipefail
train=${1:?usage: rank_failure_test.sh TRAIN [TRIALS [W [TRAINER FLAGS...]]]}
trials=${2:-6}
world_size=${3:-3}
shift $(($# < 3 ? $# : 3))
root=${TEST_TMPDIR:-$(mktemp -d)}/rank_failure
timeout_s=10
flags=(--layers=2 --width=48 --heads=2 --context=32 --batch_size=12 --steps=100000
  --warmup_steps=5 --log_interval=1 --eval_interval=100000 --eval_batches=1 --sample_length=0
  --checkpoint_interval=2 --timeout_s=$timeout_s "$@")
ranks=$(seq 0 $((world_size - 1)))
free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

clean=0
for trial in $(seq 1 "$trials"); do
  dir=$root/$trial
  mkdir -p "$dir"
  victim=$((trial % world_size))
  port=$(free_port)
  pids=()
  for rank in $ranks; do
    RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$world_size LOCAL_WORLD_SIZE=$world_size \
      MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port "$train" "${flags[@]}" --out_dir="$dir" >"$dir/rank$rank.log" 2>&1 &
    pids+=($!)
  done
  # Wait until training runs, then kill the victim a random 0.2-2 s later.
  for _ in $(seq 1 600); do
    grep -q "^step 4/" "$dir/rank0.log" 2>/dev/null && break
    sleep 0.1
  done
  sleep "$(awk -v r=$RANDOM 'BEGIN { printf "%.2f", 0.2 + 1.8 * r / 32767 }')"
  kill -KILL "${pids[$victim]}"
  killed_at=$(date +%s.%N)
  ok=1
  for rank in $ranks; do
    [[ $rank -eq $victim ]] && continue
    deadline=$((timeout_s + 5))
    status=124
    for _ in $(seq 1 $((deadline * 10))); do
      if ! kill -0 "${pids[$rank]}" 2>/dev/null; then
        wait "${pids[$rank]}"
        status=$?
        break
      fi
      sleep 0.1
    done
    elapsed=$(awk -v a="$killed_at" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    message=$(grep -m1 "^train:" "$dir/rank$rank.log")
    group="( in group \[[0-9, ]+\])?"
    expected="^train: [a-z_]+ #[0-9]+$group failed on rank $rank \(peer rank $victim\)"
    if [[ $status -eq 124 ]]; then
      kill -KILL "${pids[$rank]}" 2>/dev/null
      echo "trial $trial: rank $rank still running ${deadline} s after rank $victim died"
      ok=0
    elif [[ $status -eq 0 ]] || ! grep -qE "$expected" <<<"$message"; then
      echo "trial $trial: rank $rank exited $status after ${elapsed} s, not naming rank $victim" \
        "as in \"$expected\": $message"
      ok=0
    else
      echo "trial $trial: rank $rank exited $status after ${elapsed} s: $message"
    fi
  done
  wait "${pids[$victim]}" 2>/dev/null
  # A save the kill interrupted is cleaned up by the survivors (no hidden partial folder).
  leftover=$(ls -A "$dir/checkpoints" 2>/dev/null | grep partial)
  if [[ -n "$leftover" ]]; then
    echo "trial $trial: partial checkpoint folders left after the failure: $leftover"
    ok=0
  fi
  step=$(grep -oE "^step [0-9]+/" "$dir/rank0.log" | tail -1)
  latest=$(ls -d "$dir"/checkpoints/step_* 2>/dev/null | tail -1)
  resumed=$("$train" "${flags[@]}" --world_size=1 --resume --steps=$((10#${latest##*_} + 1)) \
    --checkpoint_interval=0 --out_dir="$dir" 2>&1)
  if grep -q "resumed from $latest" <<<"$resumed"; then
    echo "trial $trial: killed rank $victim after ${step%/}; resumed from ${latest##*/} at W = 1"
  else
    echo "trial $trial: newest checkpoint ${latest:-none} did not load: $(tail -3 <<<"$resumed")"
    ok=0
  fi
  clean=$((clean + ok))
done
echo "$clean of $trials runs ended cleanly"
[[ $clean -eq $trials ]]
