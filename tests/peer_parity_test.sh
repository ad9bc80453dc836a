#!/usr/bin/env bash
# Loss parity with PyTorch: the GPT of examples/gpt trained for 50 fp32 steps from the
# same weights on the same batches by fsdp (benchmarks/peer/gpt_fsdp.cc) and by PyTorch
# 2.11 (benchmarks/peer/fsdp2_gpt.py), at W = 2 over Gloo, both under torchrun:
# FULL_SHARD and SHARD_GRAD_OP against fully_shard (reshard_after_forward True / False),
# NO_SHARD against DistributedDataParallel. Every step's loss (mean over ranks, before
# the update) must agree within a relative 1e-4, and training must have lowered it.
#
#   peer_parity_test.sh GPT_FSDP FSDP2_GPT_PY TORCHRUN PYTHON3
set -euo pipefail

ours=${1:?usage: peer_parity_test.sh GPT_FSDP FSDP2_GPT_PY TORCHRUN PYTHON3}
peer=${2:?} torchrun=${3:?} python=${4:?}
dir=${TEST_TMPDIR:-$(mktemp -d)}/peer_parity
mkdir -p "$dir"

"$ours" --prepare="$dir" --width=64 --heads=4 --layers=3 --context=64 --batch_size=8 --steps=50

failed=0
for strategy in full_shard shard_grad_op no_shard; do
  launch=("$torchrun" --standalone --nproc_per_node=2 -r 1 -t 1)
  "${launch[@]}" --no_python "$ours" --data="$dir" --heads=4 --strategy="$strategy" \
    --out="$dir/ours_$strategy.json" >"$dir/ours_$strategy.log" 2>&1 ||
    { cat "$dir/ours_$strategy.log"; failed=1; continue; }
  "${launch[@]}" "$peer" --data="$dir" --heads=4 --strategy="$strategy" \
    --out="$dir/peer_$strategy.json" >"$dir/peer_$strategy.log" 2>&1 ||
    { cat "$dir/peer_$strategy.log"; failed=1; continue; }
  "$python" - "$dir/ours_$strategy.json" "$dir/peer_$strategy.json" <<'PY' || failed=1
import json, sys
ours, peer = (json.load(open(path)) for path in sys.argv[1:])
name = f"{ours['strategy']} at W = {ours['world_size']} against {peer['side']}"
a, b = ours["losses"], peer["losses"]
assert len(a) == len(b) == 50, f"{name}: expected 50 losses each, got {len(a)} and {len(b)}"
gaps = [abs(x - y) / abs(y) for x, y in zip(a, b)]
worst = max(range(50), key=gaps.__getitem__)
print(f"{name}: loss {a[0]:.6f} -> {a[-1]:.6f} (peer {b[0]:.6f} -> {b[-1]:.6f}), "
      f"largest relative gap {gaps[worst]:.2e} at step {worst + 1}")
assert gaps[worst] <= 1e-4, f"{name}: the losses differ by more than 1e-4"
assert a[-1] < a[0] - 0.5, f"{name}: 50 steps should lower the loss by > 0.5 nats"
PY
done
exit "$failed"
