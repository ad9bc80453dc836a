#!/usr/bin/env bash
# The GPT trainer under bad input and interruption (issue 15): bad flags are refused
# before anything starts or is written (exit 2, one line); records survive SIGTERM;
# one run per out_dir; a new run does not splice into another run's checkpoints nor
# replace its results; a diverging run stops; ranks
# started with different flags stop at once naming the flag; HYBRID traffic is counted;
# unreadable and too-small corpora are named; a failed start (a damaged checkpoint to
# resume, an error found late) leaves the previous run's records byte for byte; loss.png
# is plotted, and a missing or failing gnuplot is told apart.
#   trainer_inputs_test.sh PATH/TO/examples/gpt/train
set -uo pipefail
train=${1:?usage: trainer_inputs_test.sh TRAIN}
root=${TEST_TMPDIR:-$(mktemp -d)}/trainer_inputs
mkdir -p "$root"
# fsdp's own checkpoint format: these checks name its files (metadata.pt, rank_NNNNN.pt).
small=(--layers=1 --width=32 --heads=2 --context=16 --batch_size=4 --warmup_steps=1
  --eval_batches=1 --sample_length=0 --timeout_s=20 --checkpoint_format=fsdp)
passed=0
failed=0
check() {  # check NAME CONDITION
  if eval "$2"; then echo "ok $1"; passed=$((passed + 1)); else echo "FAIL $1"; failed=$((failed + 1)); fi
}

# 1. Bad flags: exit 2, one line naming the flag, nothing created.
for flag in --heads=0 --eval_interval=0 --log_interval=0 --world_size=0 --world_size=-1 \
            --world_size=1000 --lr=nan --lr=inf --lr=-1 --batch_size=0 --context=0 \
            --width=-65 --timeout_s=0 --context=100000000; do
  out=$("$train" "$flag" --out_dir="$root/never" 2>&1)
  status=$?
  name=${flag%%=*}
  check "refuses $flag" "[[ $status -eq 2 && \$(wc -l <<<\"\$out\") -eq 1 && \"\$out\" == 'train: '*\"$name=\"* ]]"
done
# Path flags, checked before any rank starts (before, a bad --out_dir gave "train:
# filesystem error: cannot create directories: No such file or directory [/proc/x]" with
# status 1, and a bad --data_dir was found by the ranks).
check_refusal() {  # check_refusal NAME EXPECTED_LINE COMMAND...: status 2, exactly that line
  local name=$1 want=$2 out status
  shift 2
  out=$("$@" 2>&1)
  status=$?
  check "$name (status $status): $out" "[[ $status -eq 2 && \"\$out\" == \"\$want\" ]]"
}
check_refusal "refuses --out_dir=/proc/x" \
  "train: --out_dir=/proc/x: expected a folder that can be written, or made (metrics.csv, the model and the checkpoints go there); cannot make a folder in '/proc': No such file or directory" \
  "$train" --world_size=1 --out_dir=/proc/x
check_refusal "refuses a --checkpoint_dir under a file" \
  "train: --checkpoint_dir=/etc/passwd/checkpoints: expected a folder that can be written, or made (the checkpoints go there); '/etc/passwd' is not a folder" \
  "$train" --checkpoint_dir=/etc/passwd/checkpoints --out_dir="$root/never"
check_refusal "refuses a missing --data_dir" \
  "train: --data_dir=$root/no_data: expected a folder of readable fortune files (files without an extension, as Debian's fortunes package installs them: tools/setup.sh); cannot open it: No such file or directory" \
  "$train" --data_dir="$root/no_data" --out_dir="$root/never"
check "nothing written for bad flags" "[[ ! -e $root/never ]]"

# 2. SIGTERM mid-run: metrics.csv holds every row up to the last progress line.
dir=$root/interrupted
"$train" "${small[@]}" --world_size=2 --steps=100000 --log_interval=1 --eval_interval=100000 \
  --checkpoint_interval=0 --out_dir="$dir" >"$root/interrupted.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do grep -q "^\[rank 0\] step 30/" "$root/interrupted.log" && break; sleep 0.1; done
kill -TERM "$pid"
wait "$pid"
last=$(sed -nE 's#^\[rank 0\] step ([0-9]+)/.*#\1#p' "$root/interrupted.log" | tail -1)
rows=$(($(wc -l <"$dir/metrics.csv") - 1))
check "metrics.csv keeps every row after SIGTERM ($rows rows, last progress line $last)" \
  "[[ -n '$last' && $rows -ge $last ]]"

# 3. One run per out_dir: a second trainer is refused naming the holder's pid.
dir=$root/locked
"$train" "${small[@]}" --world_size=1 --steps=100000 --eval_interval=100000 \
  --checkpoint_interval=0 --out_dir="$dir" >"$root/first.log" 2>&1 &
first=$!
for _ in $(seq 1 300); do grep -q "step 10/" "$root/first.log" && break; sleep 0.1; done
second=$("$train" "${small[@]}" --world_size=1 --steps=10 --out_dir="$dir" 2>&1)
check "a second run in one out_dir is refused" \
  "grep -q \"is in use by another run (pid $first)\" <<<\"\$second\""
kill -TERM "$first"
wait "$first"

# 4. A new run does not mix with another run's checkpoints; --overwrite starts over.
dir=$root/checkpoints
"$train" "${small[@]}" --world_size=1 --steps=4 --eval_interval=100 --checkpoint_interval=2 \
  --out_dir="$dir" >/dev/null 2>&1
again=$("$train" "${small[@]}" --world_size=1 --steps=4 --checkpoint_interval=2 --out_dir="$dir" 2>&1)
check "a rerun without --resume is refused" \
  "grep -q \"holds another run's checkpoints (newest .*step_00000004); continue that run with --resume, or start over with --overwrite\" <<<\"\$again\""
"$train" "${small[@]}" --world_size=1 --steps=2 --eval_interval=100 --checkpoint_interval=2 \
  --overwrite --out_dir="$dir" >/dev/null 2>&1
check "--overwrite starts over" \
  "[[ -d $dir/checkpoints/step_00000002 && ! -d $dir/checkpoints/step_00000004 ]]"

# ... nor replaces the results of a run too short to checkpoint; --resume and --overwrite
# together are refused before anything starts.
dir=$root/no_checkpoints
"$train" "${small[@]}" --world_size=1 --steps=2 --eval_interval=100 --checkpoint_interval=0 \
  --out_dir="$dir" >/dev/null 2>&1
again=$("$train" "${small[@]}" --world_size=1 --steps=2 --checkpoint_interval=0 --out_dir="$dir" 2>&1)
check "a rerun over a run without checkpoints is refused" \
  "grep -q \"train: --out_dir=$dir holds another run's results (metrics.csv, no checkpoint to continue from); pass another --out_dir, or --overwrite to replace them\" <<<\"\$again\""
"$train" "${small[@]}" --world_size=1 --steps=3 --eval_interval=100 --checkpoint_interval=0 \
  --overwrite --out_dir="$dir" >/dev/null 2>&1
check "--overwrite replaces its results" "[[ \$(grep -c . $dir/metrics.csv) -eq 4 ]]"
check_refusal "refuses --resume with --overwrite" \
  "train: --resume=latest and --overwrite: expected one of them (--resume continues the run in --out_dir, --overwrite starts it over)" \
  "$train" "${small[@]}" --resume --overwrite --out_dir="$dir"

# A diverging run stops at the first step whose loss is not finite, naming it, and writes
# neither that step's checkpoint nor a model.
dir=$root/diverged
out=$("$train" "${small[@]}" --world_size=2 --steps=20 --lr=1e30 --warmup_steps=0 \
  --eval_interval=100 --checkpoint_interval=1 --out_dir="$dir" 2>&1)
status=$?
bad=$(sed -nE 's#^\[rank 0\] train: step ([0-9]+): the training loss is (nan|inf|-inf): the run diverged; try a lower --lr or more --warmup_steps\. Stopped before writing this step.s checkpoint or the model; the earlier checkpoints are kept$#\1#p' <<<"$out")
check "a diverging run stops naming the step (status $status, step ${bad:-none})" \
  "[[ $status -eq 1 && -n '$bad' && ! -e $dir/model.pt && ! -e $dir/checkpoints/step_\$(printf %08d $bad) ]]"

# 5. Ranks started with different --steps stop at once, naming the flag.
port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for rank in 0 1; do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$port timeout 60 "$train" "${small[@]}" --steps=$((20 + 20 * rank)) \
    --out_dir="$root/steps" >"$root/steps$rank.log" 2>&1 &
done
wait
check "ranks with different --steps name it" \
  "grep -q 'rank 1 was started with --steps=40 but rank 0 with --steps=20' $root/steps0.log"

# 6. Traffic under HYBRID_SHARD counts the subgroups' bytes (shard groups of 1 rank: all
#    of it is the replicate group's all-reduce); it used to print "sent 0.00 MB".
hybrid=$("$train" "${small[@]}" --world_size=2 --steps=2 --sharding_strategy=hybrid_shard \
  --hybrid_shard_group_size=1 --eval_interval=100 --checkpoint_interval=0 --plan_check \
  --out_dir="$root/hybrid" 2>&1)
check "hybrid traffic is counted" \
  "grep -qE 'rank 0: peak memory [0-9.]+ MB, sent [0-9.]+ MB per step' <<<\"\$hybrid\" && ! grep -q 'sent 0.00 MB' <<<\"\$hybrid\""
check "hybrid traffic is as planned" \
  "grep -qE 'all_reduce bytes_sent +measured +([0-9]+) +planned +\\1 ratio 1.000' <<<\"\$hybrid\""

# 7. Corpora: an unreadable file and a corpus too small for the context.
data=$root/data
mkdir -p "$data"
for i in $(seq 1 20); do printf 'fortune number %d\n%%\n' "$i"; done >"$data/tiny"
tiny=$("$train" "${small[@]}" --world_size=1 --steps=2 --context=64 --data_dir="$data" \
  --out_dir="$root/tiny" 2>&1)
check "a corpus too small for the context is named" \
  "grep -q 'a window needs context + 2 = 66 characters in each; lower --context' <<<\"\$tiny\""
# An unreadable fortune file, found before any rank starts. Root reads a mode-000 file,
# so as root the trainer runs without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH in its
# bounding set (setpriv): then open() fails for it as for anyone.
cp "$data/tiny" "$data/locked"
chmod 000 "$data/locked"
no_dac=()
if [[ $(id -u) -eq 0 ]]; then no_dac=(setpriv --bounding-set=-dac_override,-dac_read_search --); fi
data_expected="expected a folder of readable fortune files (files without an extension, as Debian's fortunes package installs them: tools/setup.sh)"
check_refusal "an unreadable fortune file is named (as uid $(id -u))" \
  "train: --data_dir=$data: $data_expected; cannot read '$data/locked': Permission denied" \
  "${no_dac[@]}" "$train" "${small[@]}" --world_size=1 --steps=2 --data_dir="$data" \
  --out_dir="$root/unreadable"
# ... and a fortune file that no one can open: a link that loops.
loop=$root/data_loop
mkdir -p "$loop"
cp "$data/tiny" "$loop/tiny"
ln -s loop "$loop/loop"
check_refusal "a looping link in --data_dir is named" \
  "train: --data_dir=$loop: $data_expected; cannot read '$loop/loop': Too many levels of symbolic links" \
  "$train" "${small[@]}" --world_size=1 --steps=2 --data_dir="$loop" --out_dir="$root/unreadable"
check "nothing written for unreadable corpora" "[[ ! -e $root/unreadable ]]"
# Every file of a run folder but the lock (which holds the newest holder's pid), with its
# checksum.
records() { (cd "$1" && find . -type f ! -name .lock | sort | xargs md5sum); }

# 8. --resume when no checkpoint loads (rank 0's file damaged in both) fails on every rank
#    naming each damaged file, before any rank prints "resumed from" or cuts metrics.csv
#    (before: "resumed from .../step_00000004", metrics.csv cut to its header, then the
#    failure). A damaged newest checkpoint with a complete older one falls back to it:
#    trainer_recovery_test.sh.
dir=$root/damaged
"$train" "${small[@]}" --world_size=2 --steps=4 --eval_interval=100 --checkpoint_interval=2 \
  --out_dir="$dir" >"$root/damaged_first.log" 2>&1
for step in 2 4; do
  /usr/bin/python3 -c 'import sys; p = sys.argv[1]; b = bytearray(open(p, "rb").read())
b[len(b) // 2] ^= 0xFF; open(p, "wb").write(b)' "$dir/checkpoints/step_0000000$step/rank_00000.pt"
done
before=$(records "$dir")
resumed=$("$train" "${small[@]}" --world_size=2 --steps=6 --eval_interval=100 \
  --checkpoint_interval=2 --resume --out_dir="$dir" 2>&1)
status=$?
crc() { echo "ranks 0, 1: checkpoint file '$dir/checkpoints/step_0000000$1/rank_00000.pt' fails its CRC-32 check: it is damaged; use another checkpoint"; }
check "no checkpoint that loads: every damaged file is named (status $status)" \
  "[[ $status -eq 1 ]] && grep -qE \"^\\[rank 0\\] train: --resume: no checkpoint under '$dir/checkpoints' loads on every rank: '$dir/checkpoints/step_00000004': $(crc 4); '$dir/checkpoints/step_00000002': $(crc 2); every file is as it was: restore a checkpoint or start a new run with --overwrite\\\$\" <<<\"\$resumed\""
check "a failed --resume prints no 'resumed from'" "! grep -q 'resumed from' <<<\"\$resumed\""
check "a failed --resume leaves metrics.csv, memory_rank*.csv, model.pt, loss.png as they were" \
  "[[ \"\$(records $dir)\" == \"\$before\" && \$(grep -c . $dir/metrics.csv) -eq 5 ]]"

# 9. An error found late (after the ranks started and took the out_dir's lock) leaves the
#    previous run's records byte for byte, also with --overwrite (its checkpoints too).
#    Before, metrics.csv and memory_rank*.csv were cut first.
dir=$root/late
"$train" "${small[@]}" --world_size=2 --steps=2 --eval_interval=100 --checkpoint_interval=2 \
  --out_dir="$dir" >"$root/late_first.log" 2>&1
before=$(records "$dir")
few=$root/data_few
mkdir -p "$few"
printf 'one\n%%\ntwo\n' >"$few/two"
rm -f "$data/locked"  # section 7's: here the corpus itself must pass the start-up checks
for late in "--context=64 --data_dir=$data:[rank 0] train: --context=64: the corpus in '$data' has 333 training and 38 validation characters (every 10th fortune); a window needs context + 2 = 66 characters in each; lower --context or add text" \
            "--data_dir=$few:[rank 0] train: the fortune files in '$few' hold 2 fortunes; the trainer needs at least 10 (every 10th is held out for validation)"; do
  args=${late%%:*}
  want=${late#*:}
  # shellcheck disable=SC2086  # $args: two flags
  out=$("$train" "${small[@]}" --world_size=2 --steps=2 --checkpoint_interval=2 --overwrite \
    $args --out_dir="$dir" 2>&1)
  status=$?
  check "a late error is named (status $status): ${want#*train: }" \
    "[[ $status -eq 1 ]] && grep -qFx \"\$want\" <<<\"\$out\""
  check "a late error (${args%% *}) leaves the previous run's records byte for byte" \
    "[[ \"\$(records $dir)\" == \"\$before\" && -n \"\$before\" ]]"
done
check "the previous run wrote memory_rank0.csv, memory_rank1.csv and a checkpoint" \
  "grep -q memory_rank1.csv <<<\"\$before\" && grep -q step_00000002/rank_00001.pt <<<\"\$before\""

# 10. loss.png: plotted when gnuplot is installed (tools/setup.sh installs gnuplot-nox);
#     "gnuplot not found" only when it is not, "could not plot" when it fails.
dir=$root/plot
if command -v gnuplot >/dev/null; then
  out=$("$train" "${small[@]}" --world_size=1 --steps=2 --out_dir="$dir" 2>&1)
  check "gnuplot makes loss.png (a PNG), with no gnuplot message" \
    "[[ \"\$(head -c 4 $dir/loss.png | od -An -tx1 | tr -d ' ')\" == 89504e47 ]] &&
     ! grep -q gnuplot <<<\"\$out\""
else
  echo "note: gnuplot is not installed here (tools/setup.sh installs gnuplot-nox): loss.png not checked"
fi
out=$(PATH=/nonexistent "$train" "${small[@]}" --world_size=1 --steps=2 \
  --out_dir="$root/no_gnuplot" 2>&1)
check "without gnuplot: one line says so and no loss.png" \
  "grep -qFx 'gnuplot not found: no loss.png (tools/setup.sh installs it)' <<<\"\$out\" && [[ ! -e $root/no_gnuplot/loss.png ]]"
mkdir -p "$root/bad_gnuplot"
printf '#!/bin/sh\nexit 1\n' >"$root/bad_gnuplot/gnuplot"
chmod +x "$root/bad_gnuplot/gnuplot"
out=$(PATH="$root/bad_gnuplot:/usr/bin:/bin" "$train" "${small[@]}" --world_size=1 --steps=2 \
  --out_dir="$root/gnuplot_fails" 2>&1)
check "a failing gnuplot is told from a missing one" \
  "grep -qFx 'gnuplot could not plot $root/gnuplot_fails/metrics.csv: no loss.png' <<<\"\$out\" && ! grep -q 'not found' <<<\"\$out\""

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
