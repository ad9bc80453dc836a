#!/usr/bin/env bash
# Both trainers (the GPT trainer and the Llama fine-tune) under the launchers users start
# them with, against their own launch (--world_size=2, fsdp_run's launcher): 3 steps at
# W = 2 under torchrun (--standalone; the GPT also over two hosts, network namespaces
# joined by a veth pair, with torchrun's c10d rendezvous), Open MPI's mpirun and Slurm's
# srun (the GPT also from README's batch script, on one node) must write the same
# metrics.csv (steps, losses, learning rates) exactly. comm_smoke must rendezvous from
# Open MPI's and Slurm's variables. Under each launcher, rank 1 of a GPT run killed with
# SIGKILL must end the job, non-zero with a line naming the rank, within the collective
# timeout (5 s) + 5 s.
# Slurm is a one-node cluster started here: slurmctld and slurmd with a slurm.conf made in
# the test's folder (auth/none, no cgroups), stopped on exit. Needs root (namespaces, the
# Slurm daemons), so it runs outside the sandbox. mpirun, srun, slurmctld and slurmd come
# from tools/setup.sh (openmpi-bin, slurm-wlm); a missing one fails its checks.
#   launchers_trainers_test.sh TRAIN FINETUNE COMM_SMOKE TORCHRUN PYTHON
set -uo pipefail
usage="usage: launchers_trainers_test.sh TRAIN FINETUNE COMM_SMOKE TORCHRUN PYTHON"
train=$(realpath "${1:?$usage}") finetune=$(realpath "${2:?$usage}")
smoke=$(realpath "${3:?$usage}") torchrun=$(realpath "${4:?$usage}") python=${5:?$usage}
root=${TEST_TMPDIR:-$(mktemp -d)}/launchers_trainers
rm -rf "$root" && mkdir -p "$root"
PATH=$PATH:/usr/sbin  # slurmctld, slurmd
passed=0
failed=0
ok() { echo "ok $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1"; failed=$((failed + 1)); }
free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# The two hosts and the Slurm daemons go away on exit.
tag=$$
ns=("fsdp_la_$tag" "fsdp_lb_$tag")
dev=("fla$tag" "flb$tag")
addr=(10.202.0.1 10.202.0.2)
# slurmd's step sockets live in its spool folder, whose path must be short (108 bytes).
slurm=$(mktemp -d /tmp/fsdp_slurm.XXXXXX)
cleanup() {
  for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null; done
  local daemon pid
  for daemon in slurmctld slurmd; do
    [[ -s $slurm/$daemon.pid ]] || continue
    pid=$(cat "$slurm/$daemon.pid")
    kill "$pid" 2>/dev/null
    for _ in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  done
  rm -rf "$slurm"
}
trap cleanup EXIT

# A one-node Slurm cluster on this machine (Slurm 22.05: auth/none still exists).
mkdir -p "$slurm/state" "$slurm/spool"
cat >"$slurm/slurm.conf" <<EOF
ClusterName=fsdptest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/builtin
StateSaveLocation=$slurm/state
SlurmdSpoolDir=$slurm/spool
SlurmctldPidFile=$slurm/slurmctld.pid
SlurmdPidFile=$slurm/slurmd.pid
SlurmctldLogFile=$root/slurmctld.log
SlurmdLogFile=$root/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=fsdpnode NodeAddr=127.0.0.1 CPUs=$(getconf _NPROCESSORS_ONLN) State=UNKNOWN
PartitionName=debug Nodes=fsdpnode Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
export SLURM_CONF=$slurm/slurm.conf
if command -v slurmctld slurmd >/dev/null && slurmctld -i && slurmd -N fsdpnode; then
  for _ in $(seq 1 100); do
    [[ $(sinfo -h -o %t 2>/dev/null) == idle ]] && break
    sleep 0.1
  done
fi
if [[ $(sinfo -h -o %t 2>/dev/null) == idle ]]; then
  ok "slurm: slurmctld and slurmd up ($(srun --version))"
else
  fail "slurm: no idle one-node cluster (tools/setup.sh installs slurm-wlm): $(tail -3 "$root"/slurm*.log 2>&1)"
fi

# launch LAUNCHER PROGRAM FLAGS...: 2 ranks of PROGRAM for at most 2 minutes; LAUNCHER is
# fsdp (the trainers' own, --world_size=2), torchrun, mpirun or srun.
launch() {
  local launcher=$1
  shift
  case $launcher in
    fsdp) timeout 120 "$@" --world_size=2 ;;
    torchrun) timeout 120 "$torchrun" --standalone --nproc_per_node=2 -r 1 -t 1 --no_python "$@" ;;
    mpirun)
      command -v mpirun >/dev/null || { echo "mpirun not found: tools/setup.sh installs openmpi-bin"; return 127; }
      timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 \
        -x MASTER_PORT="$(free_port)" "$@" ;;
    srun)
      command -v srun >/dev/null || { echo "srun not found: tools/setup.sh installs slurm-wlm"; return 127; }
      MASTER_PORT=$(free_port) timeout 120 srun --ntasks=2 --overcommit "$@" ;;
  esac
}
# metrics.csv without its tokens_per_s column.
curve() { cut -d, -f1-4 "$1/metrics.csv" 2>/dev/null; }

# A random 2-layer Llama folder and 2,000 training tokens for the fine-tune.
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$python" - "$root" <<'PY' || fail "cannot make the Llama folder"
import sys
import numpy as np
import torch
import transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=128, max_position_embeddings=64)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1] + "/model")
np.random.default_rng(0).integers(0, 128, 2000, dtype=np.uint16).tofile(sys.argv[1] + "/train.bin")
PY

run_flags=(--context=16 --batch_size=4 --warmup_steps=1 --log_interval=1 --checkpoint_interval=0)
gpt_flags=(--layers=1 --width=32 --heads=2 --eval_batches=1 --sample_length=0 "${run_flags[@]}")
llama_flags=(--from="$root/model" --data="$root/train.bin" "${run_flags[@]}")

# 1. The same curve under every launcher.
for name in train finetune; do
  if [[ $name == train ]]; then
    program=("$train" "${gpt_flags[@]}" --eval_interval=3)
  else
    program=("$finetune" "${llama_flags[@]}")
  fi
  for launcher in fsdp torchrun mpirun srun; do
    out=$root/${name}_$launcher
    launch "$launcher" "${program[@]}" --steps=3 --timeout_s=20 --out_dir="$out" >"$out.log" 2>&1
    status=$?
    reference=$(curve "$root/${name}_fsdp")
    if [[ $launcher == fsdp ]]; then
      if [[ $status -eq 0 && $(wc -l <<<"$reference") -eq 4 ]]; then
        ok "$name: its own launch, 3 steps ($(tail -1 <<<"$reference"))"
      else
        fail "$name: its own launch (status $status): $(tail -5 "$out.log")"
      fi
    elif [[ $status -eq 0 && -n $reference && $(curve "$out") == "$reference" ]]; then
      ok "$name under $launcher: metrics.csv's losses and learning rates equal its own launch's"
    else
      fail "$name under $launcher (status $status): got '$(curve "$out")', want '$reference': $(tail -5 "$out.log")"
    fi
  done
done

# 2. comm_smoke reads Open MPI's and Slurm's variables.
for launcher in mpirun srun; do
  out=$(launch "$launcher" "$smoke" 2>&1)
  status=$?
  variables=$([[ $launcher == mpirun ]] && echo "Open MPI" || echo Slurm)
  oks=$(grep -c "launcher $variables): ok$" <<<"$out")
  if [[ $status -eq 0 && $oks -eq 2 ]]; then
    ok "comm_smoke under $launcher: 2 ranks from $variables's variables"
  else
    fail "comm_smoke under $launcher (status $status, $oks ok lines): $out"
  fi
done

# 3. README's Slurm batch script (on one node): sbatch, then srun in the script; then a
# step of 1 task, which inherits SLURM_NTASKS_PER_NODE=2 from the job.
cat >"$root/job.sh" <<EOF
#!/bin/bash
#SBATCH --nodes=1 --ntasks-per-node=2
export MASTER_PORT=$(free_port)
srun $train ${gpt_flags[*]} --eval_interval=3 --steps=3 --timeout_s=20 --out_dir=$root/train_sbatch
srun --ntasks=1 $smoke
EOF
out=$(timeout 120 sbatch --wait --output="$root/sbatch.log" "$root/job.sh" 2>&1)
status=$?
reference=$(curve "$root/train_fsdp")
if [[ $status -eq 0 && -n $reference && $(curve "$root/train_sbatch") == "$reference" ]] &&
  grep -qx "rank 0 of 1 (local 0 of 1, launcher Slurm): ok" "$root/sbatch.log"; then
  ok "train in a batch script (sbatch --nodes=1 --ntasks-per-node=2, srun): metrics.csv equals its own launch's; a 1-task step after it runs"
else
  fail "train in a batch script (status $status; tools/setup.sh installs slurm-wlm): $out $(tail -5 "$root/sbatch.log" 2>&1)"
fi

# 4. The GPT over two hosts under torchrun's c10d rendezvous, one rank per host. Both
# hosts have this machine's hostname, so host A is named the rendezvous host (is_host)
# and each host's address is given (--local_addr, GLOO_SOCKET_IFNAME).
if ip netns add "${ns[0]}" && ip netns add "${ns[1]}" &&
  ip link add "${dev[0]}" type veth peer name "${dev[1]}"; then
  for h in 0 1; do
    ip link set "${dev[$h]}" netns "${ns[$h]}"
    ip -n "${ns[$h]}" addr add "${addr[$h]}/24" dev "${dev[$h]}"
    ip -n "${ns[$h]}" link set "${dev[$h]}" up
    ip -n "${ns[$h]}" link set lo up
  done
  port=$(free_port)
  pids=()
  for h in 0 1; do
    host_flags=(--local_addr="${addr[$h]}")
    [[ $h -eq 0 ]] && host_flags+=(--rdzv_conf=is_host=1)
    ip netns exec "${ns[$h]}" env GLOO_SOCKET_IFNAME="${dev[$h]}" timeout 120 "$torchrun" \
      --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint="${addr[0]}:$port" \
      "${host_flags[@]}" --max_restarts=0 --no_python "$train" "${gpt_flags[@]}" --eval_interval=3 \
      --steps=3 --timeout_s=20 --out_dir="$root/train_two_hosts" >"$root/two_hosts_$h.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  reference=$(curve "$root/train_fsdp")
  if [[ $status -eq 0 && -n $reference && $(curve "$root/train_two_hosts") == "$reference" ]]; then
    ok "train under torchrun on two hosts (c10d rendezvous): metrics.csv equals its own launch's"
  else
    fail "train under torchrun on two hosts (status $status): $(grep -hv '^frame' "$root"/two_hosts_*.log | tail -8)"
  fi
else
  fail "cannot make two hosts (network namespaces need root)"
fi

# 5. Rank 1 killed: the launcher ends the job within the timeout + 5 s, naming the rank.
timeout_s=5
for launcher in fsdp torchrun mpirun srun; do
  case $launcher in
    fsdp | torchrun) variable=RANK ;;
    mpirun) variable=OMPI_COMM_WORLD_RANK ;;
    srun) variable=SLURM_PROCID ;;
  esac
  out=$root/kill_$launcher
  launch "$launcher" "$train" "${gpt_flags[@]}" --steps=100000 --eval_interval=100000 \
    --timeout_s=$timeout_s --out_dir="$out" >"$out.log" 2>&1 &
  job=$!
  for _ in $(seq 1 600); do
    grep -q "step 3/" "$out.log" && break
    sleep 0.1
  done
  victim=""
  for pid in $(pgrep -f -- "--out_dir=$out( |$)"); do
    if [[ /proc/$pid/exe -ef $train ]] && tr '\0' '\n' <"/proc/$pid/environ" | grep -qx "$variable=1"; then
      victim=$pid
    fi
  done
  if [[ -z $victim ]]; then
    fail "kill under $launcher: no rank 1 ($variable=1) running: $(tail -5 "$out.log")"
    pkill -f -- "--out_dir=$out( |$)"
    wait "$job"
    continue
  fi
  kill -KILL "$victim"
  killed_at=$(date +%s.%N)
  wait "$job"
  status=$?
  took=$(awk -v a="$killed_at" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  case $launcher in
    fsdp) pattern="^fsdp_run: rank 1 \(pid $victim\) was killed by signal 9" ;;
    torchrun) pattern="Signal 9 \(SIGKILL\) received by PID $victim$" ;;
    mpirun) pattern="process rank 1 with PID [0-9]+ on node .* exited on signal 9" ;;
    srun) pattern="^srun: error: fsdpnode: task 1: Killed$" ;;
  esac
  line=$(grep -m1 -E "$pattern" "$out.log")
  if [[ $status -ne 0 && $status -ne 124 && -n $line ]] &&
    awk -v t="$took" -v limit=$((timeout_s + 5)) 'BEGIN { exit !(t <= limit) }'; then
    ok "kill under $launcher: rank 1 killed, the job ended in $took s with status $status: $line"
  else
    fail "kill under $launcher: status $status after $took s (limit $((timeout_s + 5)) s): $(tail -8 "$out.log")"
  fi
done

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
