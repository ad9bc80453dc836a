#!/usr/bin/env bash
# fashion_mnist on 2 ranks (FULL_SHARD) for 30 steps of one epoch on Debian's Fashion-MNIST:
# the run succeeds, the loss of the last step is below the first step's, and the test
# accuracy on 1000 images is far above chance (10%).
#   fashion_mnist_smoke_test.sh PATH/TO/fashion_mnist
set -uo pipefail

bin=${1:?usage: fashion_mnist_smoke_test.sh PATH/TO/fashion_mnist}
data=/usr/share/datasets/fashion-mnist
if [[ ! -r $data/train-images-idx3-ubyte.gz ]]; then
  echo "FAIL: $data/train-images-idx3-ubyte.gz is missing: install Debian's" \
    "dataset-fashion-mnist (tools/setup.sh does)"
  exit 1
fi

out=$("$bin" --world_size=2 --epochs=1 --max_steps_per_epoch=30 --test_limit=1000 \
  --log_every=10 --data_dir="$data" 2>&1)
rc=$?
echo "$out"

fail() {
  echo "FAIL: $*"
  exit 1
}

[[ $rc -eq 0 ]] || fail "fashion_mnist exited with status $rc"
first=$(sed -nE 's/^\[rank 0\] epoch 1\/1 step 1\/30: loss ([0-9.]+)$/\1/p' <<<"$out")
last=$(sed -nE 's/^\[rank 0\] epoch 1\/1 step 30\/30: loss ([0-9.]+)$/\1/p' <<<"$out")
accuracy=$(sed -nE 's/^\[rank 0\] final test accuracy: ([0-9.]+)% \(1000 test images.*/\1/p' \
  <<<"$out")
[[ -n $first && -n $last ]] || fail "no loss lines for steps 1 and 30 of 30"
[[ -n $accuracy ]] || fail "no final accuracy line for 1000 test images"
grep -qE '^\[rank 0\] epoch 1/1: train loss [0-9.]+, test accuracy [0-9.]+% \([0-9.]+ s\)$' \
  <<<"$out" || fail "no 'epoch 1/1: train loss X, test accuracy Y% (Z s)' line"
# c10d warns once per process when it cannot resolve a peer's name, as in Bazel's
# network-less sandbox; that line is LibTorch's, not the example's.
! grep -v '\[c10d\] The hostname of the client socket cannot be retrieved' <<<"$out" |
  grep -q '^\[rank 1\]' || fail "rank 1 printed something"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' ||
  fail "the loss did not fall: step 1: $first, step 30: $last"
awk -v acc="$accuracy" 'BEGIN { exit !(acc > 50) }' ||
  fail "test accuracy $accuracy% is not above 50%"
echo "ok: loss $first -> $last, test accuracy $accuracy%"
