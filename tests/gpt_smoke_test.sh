#!/usr/bin/env bash
# A short run of the GPT example on 2 ranks: it must finish, write its metrics, a
# checkpoint every 20 steps (a Distributed Checkpoint folder that PyTorch's
# dcp_to_torch_save reads) and model.pt (which torch.load reads), print a sample, and
# end with a validation loss below the starting one. Then the processes restart from
# the step-20 checkpoint (written in the background, the default --async_save): steps
# 21-40 must repeat the uninterrupted run's losses and learning rates exactly, and again
# from that checkpoint rewritten by PyTorch's DCP writer (--resume=DIR).
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
# The step-20 checkpoint rewritten by PyTorch's own DCP writer (dcp_to_torch_save, then
# torch_save_to_dcp), resumed with --resume=DIR: the same losses again.
"$python" -c "import sys; from torch.distributed.checkpoint.format_utils import *
dcp_to_torch_save(sys.argv[1], sys.argv[2] + '.pt'); torch_save_to_dcp(sys.argv[2] + '.pt', sys.argv[2])" \
  "$out/checkpoints/step_00000020" "$out/pytorch_step_20"
rm -rf "$out/checkpoints/step_00000040"
cp "$out/metrics.csv" "$out/resumed.csv"
pytorch_log=$(run --resume="$out/pytorch_step_20")
pytorch_status=$?
echo "$pytorch_log"

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
check checkpoints_written "[[ -f '$out/checkpoints/step_00000020/.metadata' ]]"
check checkpoint_loads_in_pytorch "'$python' -c \"import sys, torch; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as c; c('$out/checkpoints/step_00000020', '$out/dcp.pt'); sd = torch.load('$out/dcp.pt'); sys.exit(sd['step'] != 20 or len(sd['model']) != 28 or sd['optim']['param_groups'][0]['lr'] <= 0)\""
check model_loads_in_pytorch "'$python' -c \"import torch, sys; sd = torch.load('$out/model.pt'); sys.exit(len(sd) != 28)\""
check resumed_exit_status "[[ $resumed_status -eq 0 ]]"
check resumed_from_step_20 "grep -q 'resumed from .*step_00000020 at step 20' <<<\"\$resumed_log\""
check resumed_losses_and_lrs_equal "diff <(cut -d, -f1-4 '$out/uninterrupted.csv') <(cut -d, -f1-4 '$out/resumed.csv')"
check pytorch_folder_resumed "[[ $pytorch_status -eq 0 ]] && grep -q 'resumed from $out/pytorch_step_20 at step 20' <<<\"\$pytorch_log\""
check pytorch_folder_losses_and_lrs_equal "diff <(cut -d, -f1-4 '$out/uninterrupted.csv') <(cut -d, -f1-4 '$out/metrics.csv')"
# The checkpoint carries the LR schedule's position as PyTorch trainers save a
# scheduler's state_dict: {"lr_scheduler": {"last_epoch": 20, "_last_lr": [lr]}}.
check checkpoint_holds_the_schedule "'$python' -c \"import torch, sys; s = torch.load('$out/dcp.pt')['lr_scheduler']; sys.exit(not (s['last_epoch'] == 20 and len(s['_last_lr']) == 1 and s['_last_lr'][0] > 0))\""
echo "$((checks - failed)) passed, $failed failed"
[[ $failed -eq 0 ]]
