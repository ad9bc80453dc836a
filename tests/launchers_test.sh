#!/usr/bin/env bash
# The same distributed program under fsdp_run and under torch 2.11's torchrun, with 2 and
# 3 ranks: every rank must rendezvous from the launcher's variables and print "ok"; a
# failing rank must stop the job with its exit status; and SIGINT/SIGTERM while fsdp_run
# is still starting ranks must stop it at once, leaving no rank running.
#   launchers_test.sh PATH/TO/fsdp_run PATH/TO/comm_smoke PATH/TO/torchrun
set -uo pipefail
run=${1:?usage: launchers_test.sh FSDP_RUN COMM_SMOKE TORCHRUN}
smoke=${2:?usage: launchers_test.sh FSDP_RUN COMM_SMOKE TORCHRUN}
torchrun=${3:?usage: launchers_test.sh FSDP_RUN COMM_SMOKE TORCHRUN}
passed=0
failed=0

check() {  # check NAME EXPECTED_OK_LINES COMMAND...
  local name=$1 want=$2
  shift 2
  local out
  out=$(timeout 120 "$@" 2>&1)
  local status=$? oks
  oks=$(grep -c ": ok$" <<<"$out")
  if [[ $status -eq 0 && $oks -eq $want ]]; then
    echo "ok $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name (status $status, $oks ok lines):"
    echo "$out" | tail -20
    failed=$((failed + 1))
  fi
}

check fsdp_run_2 2 "$run" --nproc_per_node=2 -- "$smoke"
check fsdp_run_3 3 "$run" --nproc_per_node=3 -- "$smoke"
check torchrun_2 2 "$torchrun" --standalone --nproc_per_node=2 -r 1 -t 1 --no_python "$smoke"
check torchrun_3 3 "$torchrun" --standalone --nproc_per_node=3 -r 1 -t 1 --no_python "$smoke"

# A rank that fails: the launcher stops the others and returns that rank's status.
out=$(timeout 60 "$run" --nproc_per_node=3 --grace_period_ms=1000 -- /bin/sh -c \
  'if [ "$RANK" = 2 ]; then exit 7; fi; sleep 30' 2>&1)
status=$?
if [[ $status -eq 7 && "$out" == *"rank 2 (pid "*") exited with status 7; stopped 2 other ranks"* ]]; then
  echo "ok fsdp_run_failing_rank"
  passed=$((passed + 1))
else
  echo "FAIL fsdp_run_failing_rank (status $status): $out"
  failed=$((failed + 1))
fi

# SIGINT / SIGTERM while ranks start. To make starting slow and the test deterministic,
# each rank's command is found through a PATH whose first 300 entries are each a chain of
# 39 symbolic links, 800 "d/.." hops apiece, that ends in a folder without `sh`: fsdp_run
# waits for each rank's exec (here 0.3-0.8 s per rank), so starting 4 ranks takes 1-3 s.
# The signal goes to fsdp_run once rank 0 runs. Before, it was handled only after every
# rank had started (85 s for 20,000 ranks).
root=${TEST_TMPDIR:-$(mktemp -d)}/launchers
mkdir -p "$root/slow/d"
/usr/bin/python3 - "$root/slow" <<'PYTHON'
import os, sys
hops = "d/../" * 800
for i in range(39):
    target = hops + ("L%d" % (i + 1) if i < 38 else "d")
    os.symlink(target, os.path.join(sys.argv[1], "L%d" % i))
PYTHON
slow_path=$(printf "$root/slow/L0:%.0s" $(seq 1 300))/usr/bin:/bin
for signal in TERM INT; do
  ready=$root/ready_$signal
  mkdir -p "$ready"
  PATH=$slow_path "$run" --nproc_per_node=4 --grace_period_ms=2000 -- sh -c \
    "echo \$\$ >$ready/\$RANK.tmp && /bin/mv $ready/\$RANK.tmp $ready/\$RANK; exec /bin/sleep 30" \
    >"$root/start_$signal.log" 2>&1 &
  launcher=$!
  for _ in $(seq 1 600); do [[ -e $ready/0 ]] && break; sleep 0.01; done
  kill -"$signal" "$launcher"
  sent=$(date +%s.%N)
  wait "$launcher"
  status=$?
  took=$(/usr/bin/python3 -c "import sys, time; print('%.2f' % (time.time() - float(sys.argv[1])))" "$sent")
  sleep 0.5  # a rank that fsdp_run had not started yet would show up by now
  started=$(ls "$ready" | grep -cv tmp)
  alive=0
  for pid_file in "$ready"/*; do
    [[ $pid_file == *.tmp ]] && continue
    kill -0 "$(cat "$pid_file")" 2>/dev/null && alive=$((alive + 1))
  done
  number=$([[ $signal == TERM ]] && echo 15 || echo 2)
  name=$([[ $signal == TERM ]] && echo Terminated || echo Interrupt)
  log=$(cat "$root/start_$signal.log")
  forwarded=$(sed -nE "s/^fsdp_run: got signal $number \($name\); forwarded it to ([0-9]+) running ranks?\$/\1/p" <<<"$log")
  if [[ $status -eq $((128 + number)) && $(wc -l <<<"$log") -eq 1 && -n $forwarded &&
        $forwarded -lt 4 && $started -le $forwarded && $alive -eq 0 ]]; then
    echo "ok fsdp_run_sig${signal}_while_starting (out in ${took} s, $forwarded of 4 ranks started: $log)"
    passed=$((passed + 1))
  else
    echo "FAIL fsdp_run_sig${signal}_while_starting (status $status, out in ${took} s, $started ranks ran, $alive alive): $log"
    failed=$((failed + 1))
  fi
done

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
