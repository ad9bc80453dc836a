#!/usr/bin/env bash
# The same distributed program under fsdp_run and under torch 2.11's torchrun, with 2 and
# 3 ranks: every rank must rendezvous from the launcher's variables and print "ok"; and a
# failing rank must stop the job with its exit status.
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

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
