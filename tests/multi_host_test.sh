#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces joined by a veth pair (10.201.0.1 and
# 10.201.0.2; created here, removed on exit; needs root), 2 ranks each, train the GPT
# example for a few steps. For each strategy the losses must equal a 4-rank run on one
# host exactly; the bytes crossing the host link (the veth counters) are reported, and
# for the hybrid strategies (a shard group per host) compared with REFERENCE §4's
# 2 (Psi/F) s (R-1)/R per rank, i.e. Psi x 4 bytes per step from host A's 2 ranks.
#   multi_host_test.sh PATH/TO/examples/gpt/train STRATEGY...
set -uo pipefail
train=${1:?usage: multi_host_test.sh TRAIN STRATEGY...}
shift
strategies=("$@")
root=${TEST_TMPDIR:-$(mktemp -d)}/multi_host
mkdir -p "$root"
tag=$$
ns=(fsdp_a_$tag fsdp_b_$tag)
dev=(fva$tag fvb$tag)
addr=(10.201.0.1 10.201.0.2)
cleanup() { for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null; done; }
trap cleanup EXIT
set -e
for h in 0 1; do ip netns add "${ns[$h]}"; done
ip link add "${dev[0]}" type veth peer name "${dev[1]}"
for h in 0 1; do
  ip link set "${dev[$h]}" netns "${ns[$h]}"
  ip -n "${ns[$h]}" addr add "${addr[$h]}/24" dev "${dev[$h]}"
  ip -n "${ns[$h]}" link set "${dev[$h]}" up
  ip -n "${ns[$h]}" link set lo up
done
set +e

flags=(--layers=2 --width=48 --heads=2 --context=32 --batch_size=16 --steps=6
  --warmup_steps=2 --log_interval=1 --eval_interval=100 --eval_batches=1 --sample_length=0
  --checkpoint_interval=0 --timeout_s=60 --hybrid_shard_group_size=2)
tx_bytes() { ip netns exec "${ns[0]}" cat "/sys/class/net/${dev[0]}/statistics/tx_bytes"; }
losses() { grep -oE "^\[rank 0\] step [0-9]+/[0-9]+ \| loss [0-9.]+" "$1" | awk '{print $3, $6}'; }

failed=0
for strategy in "${strategies[@]}"; do
  "$train" "${flags[@]}" --world_size=4 --sharding_strategy="$strategy" \
    --out_dir="$root/one_$strategy" >"$root/one_$strategy.log" 2>&1
  before=$(tx_bytes)
  pids=()
  for rank in 0 1 2 3; do
    h=$((rank / 2))
    ip netns exec "${ns[$h]}" env RANK=$rank LOCAL_RANK=$((rank % 2)) WORLD_SIZE=4 \
      LOCAL_WORLD_SIZE=2 MASTER_ADDR=${addr[0]} MASTER_PORT=29511 GLOO_SOCKET_IFNAME=${dev[$h]} \
      "$train" "${flags[@]}" --sharding_strategy="$strategy" --out_dir="$root/two_$strategy" \
      >"$root/two_${strategy}_$rank.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  crossed=$(($(tx_bytes) - before))
  one=$(losses "$root/one_$strategy.log")
  two=$(sed 's/^/[rank 0] /' "$root/two_${strategy}_0.log" | losses /dev/stdin)
  sent=$(grep -oE "rank 0: peak memory [0-9.]+ MB, sent [0-9.]+ MB per step" "$root/two_${strategy}_0.log")
  formula=""
  if [[ $strategy == hybrid* ]]; then
    psi=$(grep -oE "model: [0-9]+ parameters" "$root/two_${strategy}_0.log" | awk '{print $2}')
    formula=", formula $((6 * psi * 4 / 1000)) kB: ratio $(awk -v a=$crossed -v b=$((6 * psi * 4)) 'BEGIN { printf "%.3f", a / b }')"
  fi
  if [[ $status -eq 0 && -n "$one" && "$one" == "$two" ]]; then
    echo "ok $strategy: 6 losses equal the one-host run; host link carried $((crossed / 1000)) kB A->B$formula ($sent)"
  else
    echo "FAIL $strategy (status $status)"; echo "one host: $one"; echo "two hosts: $two"
    tail -5 "$root/two_${strategy}_0.log"
    failed=$((failed + 1))
  fi
done
[[ $failed -eq 0 ]]
