#!/usr/bin/env bash
# A short run of the GPT example on 2 ranks: it must finish, write its metrics, a
# checkpoint every 20 steps and model.pt (which torch.load reads), print a sample, and
# end with a validation loss below the starting one. Then the processes restart from
# the step-20 checkpoint (written in the background, the default --async_save): steps
# 21-40 must repeat the uninterrupted run's losses and learning rates exactly.
# With --plan_check every step is checked against the model's plan (a rank above it
# stops): the progress lines show the model state and traffic exactly as planned.
#   gpt_smoke_test.sh PATH/TO/examples/gpt/train PATH/TO/python3 (with torch 2.11)
set -uo pipefail
train=${1:?usage: gpt_smoke_test.sh TRAIN PYTHON}
python=${2:?usage: gpt_smoke_test.sh TRAIN PYTHON}
out=${TEST_TMPDIR:-$(mktemp -d)}/gpt
run() {
  "$train" --world_size=2 --steps=40 --warmup_steps=5 --layers=2 --width=48 --heads=2 \
    --context=32 --batch_size=16 --log_interval=20 --eval_interval=40 --eval_batches=4 \
    --sample_length=20 --checkpoint_interval=20 --plan_check --out_dir="$out" "$@" 2>&1
}
log=$(run)
status=$?
echo "$log"
first=$(grep -oE "step 0: validation loss [0-9.]+" <<<"$log" | awk '{print $5}')
last=$(grep -oE "step 40: validation loss [0-9.]+" <<<"$log" | awk '{print $5}')
cp "$out/metrics.csv" "$out/uninterrupted.csv"
rm -rf "$out/checkpoints/step_00000040"  # as if the run had died after step 20
resumed_log=$(run --resume)
resumed_status=$?
echo "$resumed_log"

failed=0
checks=0
check() {  # check NAME CONDITION
  checks=$((checks + 1))
  if eval "$2"; then echo "ok $1"; else echo "FAIL $1"; failed=$((failed + 1)); fi
}
check exit_status "[[ $status -eq 0 ]]"
check validation_loss_falls "[[ -n '$first' && -n '$last' ]] && awk 'BEGIN { exit !($last < $first - 0.5) }'"
check metrics_written "[[ \$(wc -l < '$out/uninterrupted.csv') -eq 41 ]]"
check sample_printed "grep -q '^\\[rank 0\\] sample:' <<<\"\$log\""
check every_rank_reports "[[ \$(grep -c 'peak memory' <<<\"\$log\") -eq 2 ]]"
check plan_checked "grep -q 'step 40/40 .*| plan: params 1.000 grads 1.000 optim 1.000 traffic 1.000 peak' <<<\"\$log\""
check checkpoints_written "[[ -f '$out/checkpoints/step_00000020/metadata.pt' ]]"
check model_loads_in_pytorch "'$python' -c \"import torch, sys; sd = torch.load('$out/model.pt'); sys.exit(len(sd) != 28)\""
check resumed_exit_status "[[ $resumed_status -eq 0 ]]"
check resumed_from_step_20 "grep -q 'resumed from .*step_00000020 at step 20' <<<\"\$resumed_log\""
check resumed_losses_and_lrs_equal "diff <(cut -d, -f1-4 '$out/uninterrupted.csv') <(cut -d, -f1-4 '$out/metrics.csv')"
# The checkpoint carries the LR schedule's position (scheduler/last_epoch and last_lr,
# as torch.optim.lr_scheduler's state_dict holds last_epoch and _last_lr).
check checkpoint_holds_the_schedule "'$python' -c \"import torch, sys; d = torch.load('$out/checkpoints/step_00000020/rank_00000.pt'); sys.exit(not (d['scheduler/last_epoch'].item() == 20 and d['scheduler/last_lr'].numel() == 1))\""
echo "$((checks - failed)) passed, $failed failed"
[[ $failed -eq 0 ]]
