#!/usr/bin/env bash
# fsdp's GPU check: run.sh of the bundle that `bash tools/gpu_check.sh build` writes to
# .gpu_bundle/ (this file is tools/gpu_bundle_run.sh in the fsdp tree). On any machine
# with an NVIDIA GPU whose python3 has torch 2.11 (CUDA 13 build), no Bazel needed:
#
#   bash .gpu_bundle/run.sh          # PYTHON=/path/to/python3 picks the interpreter
#   bash .gpu_bundle/run.sh real_size [CASES]   # only the fine-tunes at real size (issue
#                                    # 51: real_size_check.py, 9 minutes at most)
#
# LibTorch, NCCL and the CUDA runtime are that torch's own: run.sh asks python3 where
# torch is and puts torch/lib and site-packages/nvidia/*/lib on LD_LIBRARY_PATH. It runs
# every bundled test binary (tests.tsv) under one deadline (7.5 minutes in all), prints a
# line per binary, the reasons of skipped cases, then "K skipped" and, last, "N passed, M
# failed" counting GoogleTest cases (a skipped case is not a pass; a case that crashed,
# timed out or never ran is a failure). Then, with a CUDA device, the GPT on the GPU
# (issue 18): a 30-step training run of examples/gpt (bin/examples/gpt/train, one rank on
# cuda:0, its CUDA defaults: a GPT-2-small-sized model in bf16; it passes if the
# validation loss falls); checkpoints and CPU offload (issue 39: a small GPT at W = 1, or
# W = 2 with two devices, saving in the background and resumed from its step-10 checkpoint
# to the same loss at step 20, and trained with --cpu_offload to the same loss at step
# 10); the Llama fine-tune (issue 39: bin/examples/llama/finetune on the bundled tiny bf16
# Llama, llama/, full and LoRA, bf16 compute with fp32 master weights, 5 steps at the same
# W, each step's loss within 2% of the same command with --device=cpu); the memory levers
# (the small GPT and the full Llama fine-tune with --activation_checkpointing and with
# --grad_accumulation_steps=2, within 1e-4 and 1e-3 relative of the same run without the
# lever at every step, and the fine-tune with --cpu_offload, within 2%); and the side by
# side at W = 1 on cuda:0 of the same GPT (width 768, 12 layers, 12 heads, context 256,
# bf16, batch 32, from the same weights on the same batches) trained by fsdp
# (bin/benchmarks/gpt_fsdp), by plain LibTorch without FSDP (gpt_fsdp --mode=plain,
# autocast bf16) and by PyTorch FSDP2 eager (peer/fsdp2_gpt.py): tokens/s, peak memory
# (the caching allocator's), MFU and the ratios ours/FSDP2 and ours/plain, and fsdp once
# more with TORCH_NCCL_BLOCKING_WAIT=1 (the host waiting for every collective) for the
# host-side time per step with and without. Each failed run counts as one failure in the
# last line. Then one summary table: test binaries, GPU main job (tokens/s, MFU, peak
# memory, last loss), async save and resume, CPU offload, the Llama fine-tune and the
# memory levers (the losses compared), the W = 1 side by side (tokens/s, peak memory, MFU,
# ratios), host ms/step; it is also written to .gpu_bundle/logs/summary.txt and, when $OUT
# names a folder (the device machine returns what is there), to $OUT/gpu_check_summary.txt
# with the logs in $OUT/gpu_check_logs/ (docs/GPU.md says how to record it). Without a
# CUDA device a last line says so. Logs go to .gpu_bundle/logs/. Each step has its own
# time limit (timeout, then SIGKILL 10 s later; a launched rank dies with its launcher),
# all within BUDGET_S.
# Exit status: 0 every case passed with a device; 1 a failure; 2 nothing failed but no
# CUDA device was found (the GPU cases were skipped); 3 no usable torch 2.11.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
readonly BUDGET_S=450
deadline=$((SECONDS + BUDGET_S))

echo "fsdp GPU check: $(sed -n 's/^commit: //p' "$here/BUILD_INFO" 2>/dev/null)," \
     "$(wc -l <"$here/tests.tsv") test binaries"

# --- torch 2.11 and its libraries ------------------------------------------------------
probe_err=$(mktemp)
probe=$("$python" - 2>"$probe_err" <<'PY'
import glob, os
import torch
torch_dir = os.path.dirname(torch.__file__)
site = os.path.dirname(torch_dir)
libs = [os.path.join(torch_dir, "lib")] + sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))
count = torch.cuda.device_count()
print(torch.__version__)
print(torch.version.cuda or "none")
print(count)
print(", ".join(torch.cuda.get_device_name(i) for i in range(count)))
print(":".join(libs))
PY
)
probe_status=$?
if ((probe_status != 0)); then
  tail -3 "$probe_err"
  rm -f "$probe_err"
  echo "cannot run the check: '$python' cannot import torch (set PYTHON to a python3 with torch 2.11)"
  exit 3
fi
rm -f "$probe_err"
{
  read -r torch_version
  read -r torch_cuda
  read -r devices
  read -r device_names
  read -r lib_path
} <<<"$probe"
if [[ $torch_version != 2.11.* || $torch_cuda != 13.* ]]; then
  echo "cannot run the check: $python has torch $torch_version (CUDA $torch_cuda); the" \
       "bundle needs torch 2.11 built for CUDA 13 (its libtorch_cpu, libnccl, libcudart)"
  exit 3
fi
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS=1  # as under bazel test (bazel/fsdp.bzl)
TEST_TMPDIR=$(mktemp -d)
export TEST_TMPDIR
trap 'rm -rf "$TEST_TMPDIR"' EXIT
echo "torch $torch_version (CUDA $torch_cuda) from $python; CUDA devices: $devices${device_names:+ ($device_names)}"
first=$(head -1 "$here/tests.tsv" | cut -f2)
if command -v ldd >/dev/null; then
  ldd "$here/$first" | awk '$1 ~ /^lib(torch_cpu|c10|nccl|cudart)\.so/ { print "  " $1 " => " $3 }'
fi

# --- fine-tunes at real size (issue 51), instead of everything below --------------------
# `run.sh real_size [CASES]`: real_size_check.py's cases (comma-separated; its default:
# llama1b_full,qwen3_8b_lora) against transformers + PEFT + FSDP2 on this device, within 9
# minutes; the table goes to $OUT/real_size.md (or logs/), rewritten after every run.
if [[ ${1:-} == real_size ]]; then
  if ((devices == 0)); then
    echo "real_size: no CUDA device"
    exit 2
  fi
  table_dir=${OUT:-$here/logs}
  mkdir -p "$table_dir"
  "$python" "$here/real_size_check.py" --finetune="$here/bin/examples/llama/finetune" \
    --peer="$here/peer/hf_fsdp2_finetune.py" --work="${REAL_SIZE_WORK:-/tmp/fsdp_real_size}" \
    --out="$table_dir/real_size.md" ${2:+--cases="$2"}
  exit $?
fi

# --- the test binaries -----------------------------------------------------------------
logs="$here/logs"
rm -rf "$logs"
mkdir -p "$logs"
passed=0 failed=0 skipped=0

# Test cases a binary would run (not the DISABLED_ ones).
count_cases() {
  "$1" --gtest_list_tests 2>/dev/null | awk '
    /^[^ ]/ { suite_disabled = ($1 ~ /^DISABLED_/ || $1 ~ /\/DISABLED_/) }
    /^  / { if (!suite_disabled && $1 !~ /^DISABLED_/) n++ }
    END { print n + 0 }'
}

while IFS=$'\t' read -r label rel; do
  bin="$here/$rel"
  log="$logs/$(tr '/:' '__' <<<"${label#//}").log"
  if command -v ldd >/dev/null && missing=$(ldd "$bin" 2>&1 | grep -E 'not found') ; then
    echo "$label: FAILED: cannot load:"
    sed 's/^[[:space:]]*/    /' <<<"$missing"
    failed=$((failed + 1))
    continue
  fi
  left=$((deadline - SECONDS))
  if ((left < 10)); then
    echo "$label: FAILED: not run, the ${BUDGET_S} s budget is spent"
    failed=$((failed + 1))
    continue
  fi
  cases=$(count_cases "$bin")
  start=$SECONDS
  timeout --kill-after=10 "$left" "$bin" --gtest_color=no >"$log" 2>&1
  rc=$?
  ok=$(grep -cE '^\[       OK \] .* \([0-9]+ ms\)$' "$log")
  bad=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log")
  skip=$(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$log")
  ran=$(grep -cE '^\[ RUN      \]' "$log")
  unfinished=$((ran - ok - bad - skip))  # crashed or killed mid-case
  never=$((cases > ran ? cases - ran : 0))
  bad=$((bad + unfinished + never))
  if ((rc != 0 && bad == 0)); then bad=1; fi  # failed outside any case
  note=""
  if ((rc == 124 || rc == 137)); then note=", killed at the deadline"; fi
  if ((unfinished + never > 0)); then note+=", $unfinished case(s) did not finish and $never never started"; fi
  echo "$label: $ok passed, $bad failed, $skip skipped ($((SECONDS - start)) s, exit $rc$note)"
  if ((skip > 0)); then
    grep -A1 -E ': Skipped$' "$log" | grep -vE ': Skipped$|^--$' | sort | uniq -c |
      awk '{ n = $1; $1 = ""; print "    skipped " n ":" $0 }'
  fi
  if ((bad > 0)); then
    grep -E '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log" | sed 's/^/    /'
    echo "    last lines of $log:"
    tail -20 "$log" | sed 's/^/      /'
  fi
  passed=$((passed + ok))
  failed=$((failed + bad))
  skipped=$((skipped + skip))
done <"$here/tests.tsv"

# --- the GPT on the GPU (issue 18 items 4 and 6) ---------------------------------------
# One rank of `command` at W = 1 under the torchrun variables (a fresh port each).
run_rank0() {
  local port
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout --kill-after=10 "$@"
}

# Runs `name` with a time limit of at most `cap` seconds of what is left of the budget;
# prints FAILED with the log's last lines (and counts a failure) unless it exits 0.
gpu_step() {
  local name=$1 cap=$2 log="$logs/gpu_$1.log"
  shift 2
  local left=$((deadline - SECONDS))
  if ((left < 20)); then
    echo "  $name: FAILED: not run, the ${BUDGET_S} s budget is spent"
    failed=$((failed + 1))
    return 1
  fi
  ((left > cap)) && left=$cap
  local start=$SECONDS
  "$@" "$left" >"$log" 2>&1
  local rc=$?
  if ((rc != 0)); then
    echo "  $name: FAILED (exit $rc$( ((rc == 124 || rc == 137)) && echo ", killed after $left s"))"
    tail -15 "$log" | sed 's/^/      /'
    failed=$((failed + 1))
    return 1
  fi
  echo "  $name: ok ($((SECONDS - start)) s)"
}

if ((devices > 0)); then
  gpu=$TEST_TMPDIR/gpu
  mkdir -p "$gpu"
  echo "GPT on the GPU:"
  train_run() {
    timeout --kill-after=10 "$1" "$here/bin/examples/gpt/train" --world_size=1 --steps=30 \
      --eval_interval=30 --eval_batches=2 --checkpoint_interval=30 --sample_length=0 \
      --data_dir="$here/fortunes" --out_dir="$gpu/train" --timeout_s=120
  }
  if gpu_step training_run 150 train_run; then
    log="$logs/gpu_training_run.log"
    grep -E '^(model|device):|^step 30/|validation loss|^rank 0: peak' "$log" | sed 's/^/      /'
    first=$(sed -n 's/^step 0: validation loss //p' "$log")
    last=$(sed -n 's/^step 30: validation loss //p' "$log")
    if ! awk -v a="$first" -v b="$last" 'BEGIN { exit !(a != "" && b != "" && b < a) }'; then
      echo "  training run: FAILED: the validation loss did not fall ($first at step 0, $last at step 30)"
      failed=$((failed + 1))
    fi
    # For the table: "step 30/30 | loss L | lr R | T tok/s | MFU M% | ETA 0 s".
    line=$(grep -E '^step 30/30 ' "$log" | tail -1)
    main_loss=$(sed -n 's/.*| loss \([0-9.]*\) .*/\1/p' <<<"$line")
    main_tokens=$(sed -n 's/.*| \([0-9]*\) tok\/s.*/\1/p' <<<"$line")
    main_mfu=$(sed -n 's/.*| MFU \([0-9.]*\)%.*/\1/p' <<<"$line")
    main_peak=$(sed -n 's/^rank 0: peak memory \([0-9.]*\) MB.*/\1/p' "$log")
  fi
  # Checkpoints and CPU offload on the GPU (issue 39): a small GPT (width 128, 2 layers,
  # context 64, bf16) at W = 1, or W = 2 where two devices are visible (NCCL, and the
  # checkpoint writes' own Gloo group). Run A trains 20 steps saving DCP checkpoints in the
  # background at steps 10 and 20; run B resumes from A's step-10 checkpoint and must reach
  # A's training loss at step 20 (within 1%); run C trains 10 steps with --cpu_offload and
  # must reach A's loss at step 10 (within 2%: the optimizer steps on the CPU).
  small_w=$((devices >= 2 ? 2 : 1))
  small_gpt() {  # time limit, out_dir, flags...
    local limit=$1 out=$2
    shift 2
    timeout --kill-after=10 "$limit" "$here/bin/examples/gpt/train" --world_size="$small_w" \
      --device=cuda --width=128 --layers=2 --heads=4 --context=64 --batch_size=16 \
      --log_interval=1 --eval_interval=1000 --eval_batches=1 --sample_length=0 \
      --data_dir="$here/fortunes" --out_dir="$out" --timeout_s=60 "$@"
  }
  # The training loss of step $2 in metrics.csv of out_dir $1.
  loss_at() { awk -F, -v s="$2" '$1 == s { v = $2 } END { print v }' "$1/metrics.csv" 2>/dev/null; }
  close_to() {  # a b tolerance: |a - b| <= tolerance * |a|, both present
    awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; m = a < 0 ? -a : a
      exit !(a != "" && b != "" && d <= t * m) }'
  }
  # same_losses A B TOLERANCE STEPS: every step's training loss of run A, steps 1 to STEPS,
  # within TOLERANCE (relative) of run B's.
  same_losses() {
    local s
    for ((s = 1; s <= $4; s++)); do
      close_to "$(loss_at "$gpu/$2" "$s")" "$(loss_at "$gpu/$1" "$s")" "$3" || return 1
    done
  }
  async_a() { small_gpt "$1" "$gpu/async_a" --steps=20 --checkpoint_interval=10 --async_save; }
  async_b() {
    small_gpt "$1" "$gpu/async_b" --steps=20 --checkpoint_interval=10 --async_save \
      --resume="$gpu/async_a/checkpoints/step_00000010"
  }
  offload() { small_gpt "$1" "$gpu/offload" --steps=10 --checkpoint_interval=0 --cpu_offload; }
  echo "Checkpoints and CPU offload on the GPU (W = $small_w):"
  async_result="not run" offload_result="not run"
  if gpu_step async_save_train 60 async_a && gpu_step async_save_resume 60 async_b; then
    a20=$(loss_at "$gpu/async_a" 20) b20=$(loss_at "$gpu/async_b" 20)
    async_result="W = $small_w: loss at step 20 $a20 uninterrupted, $b20 resumed from step 10"
    if [[ -f "$gpu/async_a/checkpoints/step_00000020/.metadata" ]] && close_to "$a20" "$b20" 0.01; then
      echo "  async save then resume: ok ($async_result)"
      async_result="ok, $async_result"
    else
      echo "  async save then resume: FAILED ($async_result; step 20's checkpoint" \
           "$([[ -f "$gpu/async_a/checkpoints/step_00000020/.metadata" ]] && echo complete || echo missing))"
      async_result="FAILED, $async_result"
      failed=$((failed + 1))
    fi
  fi
  if gpu_step cpu_offload 60 offload; then
    a10=$(loss_at "$gpu/async_a" 10) c10=$(loss_at "$gpu/offload" 10)
    offload_result="W = $small_w: loss at step 10 $c10 with --cpu_offload, $a10 without"
    if close_to "$a10" "$c10" 0.02; then
      echo "  CPU offload: ok ($offload_result)"
      offload_result="ok, $offload_result"
    else
      echo "  CPU offload: FAILED ($offload_result)"
      offload_result="FAILED, $offload_result"
      failed=$((failed + 1))
    fi
  fi
  # The memory levers on the GPU: the small GPT's first 10 steps again with
  # --activation_checkpointing (each block's bf16 forward recomputed in backward) and with
  # --grad_accumulation_steps=2 (each rank's share of the step's 16 rows as two
  # micro-batches, gradients summed before one reduce-scatter): every step's training loss
  # within 1e-4 and 1e-3 (relative) of run A's, which trained on the same batches in one
  # pass without recomputing. (The Llama fine-tune's levers are checked below the same way.)
  levers_ac() { small_gpt "$1" "$gpu/levers_ac" --steps=10 --checkpoint_interval=0 --activation_checkpointing; }
  levers_ga() { small_gpt "$1" "$gpu/levers_ga" --steps=10 --checkpoint_interval=0 --grad_accumulation_steps=2; }
  levers_result=""
  # lever_check NAME RUN REF TOLERANCE STEPS: RUN's steps 1 to STEPS against REF's, printed
  # and added to levers_result.
  lever_check() {
    local result="$1: loss at step $5 $(loss_at "$gpu/$2" "$5"), $(loss_at "$gpu/$3" "$5") without"
    if same_losses "$2" "$3" "$4" "$5"; then
      echo "  $1: ok ($result; steps 1-$5 within $4)"
      result="ok, $result"
    else
      echo "  $1: FAILED ($result; steps 1-$5 not within $4:" \
           "$(awk -F, 'NR > 1 { printf "%s ", $2 }' "$gpu/$2/metrics.csv" 2>/dev/null))"
      result="FAILED, $result"
      failed=$((failed + 1))
    fi
    levers_result+="${levers_result:+; }$result"
  }
  echo "Memory levers on the GPU (W = $small_w):"
  if gpu_step gpt_activation_checkpointing 60 levers_ac; then
    lever_check "GPT --activation_checkpointing" levers_ac async_a 1e-4 10
  fi
  if gpu_step gpt_grad_accumulation 60 levers_ga; then
    lever_check "GPT --grad_accumulation_steps=2" levers_ga async_a 1e-3 10
  fi
  # The Llama fine-tune on the GPU (issue 39 item 3, issue 36 item 3): the bundled random
  # tiny Llama in bf16 (llama/model_bf16, written by transformers; 2 layers, hidden 64)
  # fine-tuned 5 steps on llama/train.bin at W = small_w over NCCL with the default for a
  # bf16 folder (bf16 compute, fp32 master weights and AdamW state, fp32 gradient
  # reduction), full and LoRA (rank 4 on q_proj, v_proj), each then run again with
  # --device=cpu (Gloo, the same ranks): every step's training loss within 2% of the CPU
  # run's (bf16 kernels differ between the devices), and the folder written back in bf16.
  llama() {  # device, out_dir, time limit, flags...
    local device=$1 out=$2 limit=$3
    shift 3
    timeout --kill-after=10 "$limit" "$here/bin/examples/llama/finetune" \
      --from="$here/llama/model_bf16" --data="$here/llama/train.bin" --context=32 \
      --batch_size=8 --steps=5 --lr=3e-3 --warmup_steps=0 --log_interval=1 \
      --checkpoint_interval=0 --timeout_s=60 --world_size="$small_w" --device="$device" \
      --out_dir="$gpu/$out" "$@"
  }
  llama_full_cuda() { llama cuda llama_full_cuda "$1"; }
  llama_full_cpu() { llama cpu llama_full_cpu "$1"; }
  llama_lora_cuda() { llama cuda llama_lora_cuda "$1" --lora_rank=4; }
  llama_lora_cpu() { llama cpu llama_lora_cpu "$1" --lora_rank=4; }
  echo "Llama fine-tune on the GPU (W = $small_w, bf16 folder, fp32 master weights):"
  llama_full_result="not run" llama_lora_result="not run"
  for mode in full lora; do
    if gpu_step "llama_${mode}_cuda" 90 "llama_${mode}_cuda" &&
       gpu_step "llama_${mode}_cpu" 60 "llama_${mode}_cpu"; then
      cuda_loss=$(loss_at "$gpu/llama_${mode}_cuda" 5) cpu_loss=$(loss_at "$gpu/llama_${mode}_cpu" 5)
      result="loss at step 5 $cuda_loss on CUDA, $cpu_loss on the CPU"
      precision=$(grep -c 'precision: BFloat16 weights; bf16 mixed precision' \
                    "$logs/gpu_llama_${mode}_cuda.log")
      if same_losses "llama_${mode}_cuda" "llama_${mode}_cpu" 0.02 5 && ((precision == 1)) &&
         [[ -f "$gpu/llama_${mode}_cuda/hf/model.safetensors" ]]; then
        echo "  Llama $mode: ok ($result)"
        result="ok, $result"
      else
        echo "  Llama $mode: FAILED ($result; steps 1-5 within 2%, bf16 with fp32 masters" \
             "($precision precision line), hf/ written)"
        result="FAILED, $result"
        failed=$((failed + 1))
      fi
      if [[ $mode == full ]]; then llama_full_result=$result; else llama_lora_result=$result; fi
    fi
  done
  # The fine-tune's levers, each against the full fine-tune on CUDA above (5 steps).
  llama_full_cuda_ac() { llama cuda llama_full_cuda_ac "$1" --activation_checkpointing; }
  llama_full_cuda_ga() { llama cuda llama_full_cuda_ga "$1" --grad_accumulation_steps=2; }
  llama_full_cuda_offload() { llama cuda llama_full_cuda_offload "$1" --cpu_offload; }
  if gpu_step llama_full_cuda_activation_checkpointing 90 llama_full_cuda_ac; then
    lever_check "Llama full --activation_checkpointing" llama_full_cuda_ac llama_full_cuda 1e-4 5
  fi
  if gpu_step llama_full_cuda_grad_accumulation 90 llama_full_cuda_ga; then
    lever_check "Llama full --grad_accumulation_steps=2" llama_full_cuda_ga llama_full_cuda 1e-3 5
  fi
  if gpu_step llama_full_cuda_cpu_offload 90 llama_full_cuda_offload; then
    lever_check "Llama full --cpu_offload" llama_full_cuda_offload llama_full_cuda 2e-2 5
  fi
  peer=$gpu/peer
  mkdir -p "$peer"
  prepare() {
    timeout --kill-after=10 "$1" "$here/bin/benchmarks/gpt_fsdp" --prepare="$peer" --width=768 \
      --layers=12 --heads=12 --context=256 --batch_size=32 --steps=25 --data_dir="$here/fortunes"
  }
  side() {  # fsdp | plain | fsdp2, then the time limit
    local out="$peer/$1.json"
    case $1 in
      fsdp2) run_rank0 "$2" "$python" "$here/peer/fsdp2_gpt.py" --data="$peer" --heads=12 \
               --device=cuda --mixed_precision=bf16 --warmup_steps=5 --out="$out" ;;
      *) run_rank0 "$2" "$here/bin/benchmarks/gpt_fsdp" --data="$peer" --heads=12 \
           --device=cuda --mixed_precision=bf16 --warmup_steps=5 --mode="$1" \
           --out="$out" ;;
    esac
  }
  side_fsdp() { side fsdp "$1"; }
  side_plain() { side plain "$1"; }
  side_fsdp2() { side fsdp2 "$1"; }
  # fsdp again with the host waiting for every collective (issue 29 item 4's "without").
  side_fsdp_blocking() {
    TORCH_NCCL_BLOCKING_WAIT=1 run_rank0 "$1" "$here/bin/benchmarks/gpt_fsdp" --data="$peer" \
      --heads=12 --device=cuda --mixed_precision=bf16 --warmup_steps=5 --mode=fsdp \
      --out="$peer/fsdp_blocking.json"
  }
  if gpu_step side_by_side_prepare 90 prepare &&
     gpu_step side_by_side_fsdp 90 side_fsdp &&
     gpu_step side_by_side_plain 90 side_plain &&
     gpu_step side_by_side_fsdp2 90 side_fsdp2; then
    gpu_step side_by_side_fsdp_blocking_wait 60 side_fsdp_blocking
    "$python" - "$peer" <<'PY' || { echo "  side by side: FAILED: cannot read the results"; failed=$((failed + 1)); }
import json, os, sys
runs = {n: json.load(open(os.path.join(sys.argv[1], n + ".json"))) for n in ("fsdp", "plain", "fsdp2")}
ours = runs["fsdp"]
steps = len(ours["losses"])
print(f"  side by side, W = 1 on {ours['device']} ({ours['device_name']}): GPT of "
      f"{ours['parameters'] / 1e6:.1f} M parameters (width {ours['width']}), bf16, "
      f"{steps} steps of 32 x 256 tokens, the first 5 untimed")
# Each run's MFU is ours scaled by its tokens/s: the same model, tokens and peak.
for name, label in (("fsdp", "fsdp"), ("plain", "plain LibTorch"), ("fsdp2", "PyTorch FSDP2")):
    r = runs[name]
    mfu = ("MFU %.1f%%" % (100 * ours["mfu"] * r["tokens_per_s"] / ours["tokens_per_s"])
           if ours["mfu"] is not None else "MFU unknown (no peak for this device)")
    print(f"    {label:15s} {r['tokens_per_s']:>11,.0f} tokens/s  peak {r['peak_allocated_mb']:>8,.0f} MB"
          f"  {mfu}  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
for other, label in (("fsdp2", "FSDP2"), ("plain", "plain")):
    r = runs[other]
    print(f"    ours/{label}: {ours['tokens_per_s'] / r['tokens_per_s']:.2f}x tokens/s, "
          f"{ours['peak_allocated_mb'] / r['peak_allocated_mb']:.2f}x peak memory")
PY
  fi
else
  echo "GPT on the GPU: not run (no CUDA device): a 30-step training run of examples/gpt and" \
       "the side by side of fsdp, plain LibTorch and PyTorch FSDP2 (benchmarks/peer)"
fi

# --- one table (issue 29 item 7), also in a file (issue 39) ---------------------------------
# logs/summary.txt, and $OUT/gpu_check_summary.txt with the logs in $OUT/gpu_check_logs/
# when $OUT names a folder (the device machine returns what is there): docs/GPU.md is
# updated from it.
summary="$logs/summary.txt"
echo "fsdp GPU check of commit $(sed -n 's/^commit: //p' "$here/BUILD_INFO" 2>/dev/null)," \
     "run $(date -u '+%Y-%m-%d %H:%M UTC'): torch $torch_version (CUDA $torch_cuda)," \
     "$devices CUDA device(s)${device_names:+: $device_names}" >"$summary"
{
MAIN_TOKENS=${main_tokens:-} MAIN_MFU=${main_mfu:-} MAIN_PEAK=${main_peak:-} \
MAIN_LOSS=${main_loss:-} PEER_DIR=${peer:-} BINARIES=$(wc -l <"$here/tests.tsv") \
ASYNC_RESULT=${async_result:-} OFFLOAD_RESULT=${offload_result:-} \
LLAMA_FULL_RESULT=${llama_full_result:-} LLAMA_LORA_RESULT=${llama_lora_result:-} \
LEVERS_RESULT=${levers_result:-} \
PASSED=$passed FAILED=$failed SKIPPED=$skipped DEVICES=$devices \
"$python" - <<'PY' || echo "(the summary table could not be printed)"
import json, os
e = os.environ
def cell(v, fmt="{}"):
    return fmt.format(v) if v not in (None, "") else "-"
rows = [("test binaries", f"{e['BINARIES']} binaries: {e['PASSED']} cases passed, "
                          f"{e['FAILED']} failed, {e['SKIPPED']} skipped")]
if e["DEVICES"] == "0":
    rows.append(("GPU main job", "not run (no CUDA device)"))
    rows.append(("async save + resume", "not run (no CUDA device)"))
    rows.append(("CPU offload", "not run (no CUDA device)"))
    rows.append(("Llama fine-tune", "not run (no CUDA device)"))
    rows.append(("memory levers", "not run (no CUDA device)"))
    rows.append(("W = 1 side by side", "not run (no CUDA device)"))
else:
    rows.append(("GPU main job", f"{cell(e['MAIN_TOKENS'])} tokens/s, MFU {cell(e['MAIN_MFU'])}%, "
                                 f"peak {cell(e['MAIN_PEAK'])} MB, loss at step 30 {cell(e['MAIN_LOSS'])}"))
    rows.append(("async save + resume", cell(e["ASYNC_RESULT"])))
    rows.append(("CPU offload", cell(e["OFFLOAD_RESULT"])))
    rows.append(("Llama fine-tune, full", cell(e["LLAMA_FULL_RESULT"])))
    rows.append(("Llama fine-tune, LoRA", cell(e["LLAMA_LORA_RESULT"])))
    rows.append(("memory levers", cell(e["LEVERS_RESULT"])))
    runs = {}
    for name in ("fsdp", "plain", "fsdp2", "fsdp_blocking"):
        path = os.path.join(e["PEER_DIR"], name + ".json") if e["PEER_DIR"] else ""
        if path and os.path.exists(path):
            runs[name] = json.load(open(path))
    ours = runs.get("fsdp")
    def mfu(r):
        if not ours or ours.get("mfu") is None:
            return "-"
        return "%.1f%%" % (100 * ours["mfu"] * r["tokens_per_s"] / ours["tokens_per_s"])
    for name, label in (("fsdp", "fsdp"), ("plain", "plain LibTorch"), ("fsdp2", "PyTorch FSDP2")):
        r = runs.get(name)
        rows.append((f"W = 1 {label}", "not run" if not r else
                     f"{r['tokens_per_s']:,.0f} tokens/s, peak {r['peak_allocated_mb']:,.0f} MB, MFU {mfu(r)}"))
    for other, label in (("fsdp2", "FSDP2"), ("plain", "plain")):
        if ours and other in runs:
            r = runs[other]
            rows.append((f"ours/{label}", f"{ours['tokens_per_s'] / r['tokens_per_s']:.2f}x tokens/s, "
                                          f"{ours['peak_allocated_mb'] / r['peak_allocated_mb']:.2f}x peak memory"))
    def host(r):
        timed = r.get("host_ms", [])[5:]
        return sum(timed) / len(timed) if timed else float("nan")
    if ours and "fsdp_blocking" in runs:
        b = runs["fsdp_blocking"]
        rows.append(("host ms/step", f"{host(ours):.1f} with stream waits vs {host(b):.1f} with the host "
                                     f"waiting on each collective (TORCH_NCCL_BLOCKING_WAIT=1); "
                                     f"tokens/s {ours['tokens_per_s']:,.0f} vs {b['tokens_per_s']:,.0f}"))
    if ours:
        rows.append(("MFU formula", ours.get("mfu_formula", "-")))
width = max(len(k) for k, _ in rows)
print("summary:")
for k, v in rows:
    print(f"  {k:<{width}}  {v}")
PY

echo "$skipped skipped (not counted as passed)"
echo "$passed passed, $failed failed"
if ((devices == 0)); then
  echo "no CUDA device found: torch.cuda.device_count() is 0 on this machine, so the GPU" \
       "cases were skipped, not run"
fi
} 2>&1 | tee -a "$summary"
if [[ -n ${OUT:-} && -d $OUT ]]; then
  cp "$summary" "$OUT/gpu_check_summary.txt"
  mkdir -p "$OUT/gpu_check_logs"
  cp "$logs"/*.log "$OUT/gpu_check_logs/" 2>/dev/null
  echo "summary and logs copied to $OUT"
fi
if ((devices == 0)); then
  ((failed > 0)) && exit 1
  exit 2
fi
((failed > 0)) && exit 1
exit 0
