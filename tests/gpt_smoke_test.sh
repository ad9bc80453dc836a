#!/usr/bin/env bash
# A short run of the GPT example on 2 ranks: it must finish, write its metrics, print a
# sample, and end with a validation loss below the starting one.
#   gpt_smoke_test.sh PATH/TO/examples/gpt/train
set -uo pipefail
train=${1:?usage: gpt_smoke_test.sh TRAIN}
out=${TEST_TMPDIR:-$(mktemp -d)}/gpt
log=$("$train" --world_size=2 --steps=40 --warmup_steps=5 --layers=2 --width=48 --heads=2 \
  --context=32 --batch_size=16 --log_interval=20 --eval_interval=40 --eval_batches=4 \
  --sample_length=20 --out_dir="$out" 2>&1)
status=$?
echo "$log"
first=$(grep -oE "step 0: validation loss [0-9.]+" <<<"$log" | awk '{print $5}')
last=$(grep -oE "step 40: validation loss [0-9.]+" <<<"$log" | awk '{print $5}')
failed=0
check() {  # check NAME CONDITION
  if eval "$2"; then echo "ok $1"; else echo "FAIL $1"; failed=$((failed + 1)); fi
}
check exit_status "[[ $status -eq 0 ]]"
check validation_loss_falls "[[ -n '$first' && -n '$last' ]] && awk 'BEGIN { exit !($last < $first - 0.5) }'"
check metrics_written "[[ \$(wc -l < '$out/metrics.csv') -eq 41 ]]"
check sample_printed "grep -q '^\\[rank 0\\] sample:' <<<\"\$log\""
check every_rank_reports "[[ \$(grep -c 'peak memory' <<<\"\$log\") -eq 2 ]]"
echo "$((5 - failed)) passed, $failed failed"
[[ $failed -eq 0 ]]
