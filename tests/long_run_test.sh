#!/usr/bin/env bash
# A long run of the GPT example (default 2000 steps, W = 2, a sharded checkpoint every
# 200 steps): after warm-up (step 200) no rank's tracked tensor bytes may grow at all
# and its resident memory by at most 5% + 8 MB. Prints each rank's figures over time.
#   long_run_test.sh PATH/TO/examples/gpt/train [STEPS]
set -uo pipefail
train=${1:?usage: long_run_test.sh TRAIN [STEPS]}
steps=${2:-2000}
out=${TEST_TMPDIR:-$(mktemp -d)}/long_run
"$train" --world_size=2 --steps="$steps" --layers=2 --width=48 --heads=2 --context=32 \
  --batch_size=16 --log_interval=100 --eval_interval=500 --eval_batches=2 --sample_length=0 \
  --checkpoint_interval=200 --out_dir="$out" 2>&1 | grep -E "validation|checkpoint: .*step_0000(0200|1000|2000)|peak memory|Error|error"
status=${PIPESTATUS[0]}
[[ $status -eq 0 ]] || { echo "FAIL: the run exited $status"; exit 1; }
failed=0
for csv in "$out"/memory_rank*.csv; do
  rank=${csv##*rank}; rank=${rank%.csv}
  echo "rank $rank (step: RSS MB, tracked MB):" \
    "$(awk -F, 'NR > 1 && ($1 % 400 == 0 || $1 == 100) { printf "%d: %.1f, %.2f; ", $1, $2, $3 }' "$csv")"
  if ! awk -F, -v rank="$rank" '
      NR > 1 && $1 == 200 { rss = $2; tracked = $3 }
      NR > 1 && $1 > 200 {
        if ($3 > tracked + 0.005) { printf "FAIL rank %d: tracked %.2f MB at step %d > %.2f MB at step 200\n", rank, $3, $1, tracked; bad = 1 }
        if ($2 > rss * 1.05 + 8) { printf "FAIL rank %d: RSS %.1f MB at step %d > %.1f MB at step 200\n", rank, $2, $1, rss; bad = 1 }
      }
      END { exit bad }' "$csv"; then
    failed=1
  fi
done
[[ $failed -eq 0 ]] && echo "PASS: memory flat after warm-up on every rank"
