#!/usr/bin/env bash
# benchmarks/finetune_ab.py end to end on a tiny random Llama (2 layers, hidden 64, written
# by transformers): examples/llama:finetune and transformers + PyTorch FSDP2
# (benchmarks/peer/hf_fsdp2_finetune.py) fine-tune it fully at W = 2 over Gloo for 3 steps
# from the same weights on the same windows; every step's loss (mean over the ranks, before
# the update) must agree within a relative 1e-5 (measured: 1e-7, the printed precision).
#
#   finetune_ab_test.sh FINETUNE FINETUNE_AB_PY PYTHON3
set -euo pipefail
finetune=${1:?usage: finetune_ab_test.sh FINETUNE FINETUNE_AB_PY PYTHON3}
runner=${2:?} python=${3:?}
dir=${TEST_TMPDIR:-$(mktemp -d)}/finetune_ab
rm -rf "$dir"
"$python" "$runner" --cases=tiny --steps=3 --cache="$dir" --finetune="$finetune" \
    --check_losses=1e-5
