#!/usr/bin/env bash
# Distributed Checkpoint folders move both ways between fsdp and torch 2.11's
# fully_shard (the pinned environment's torch): fsdp at W = 2 saves, PyTorch loads at
# W = 3 and 1 with identical tensors and a loss curve within 1e-4 of fsdp's over 20 more
# AdamW steps, and dcp_to_torch_save of the folder gives fsdp's full state dict;
# PyTorch at W = 2 saves and fsdp loads at W = 3 and 1 the same way.
#   dcp_interop_test.sh PATH/TO/dcp_interop PATH/TO/dcp_interop.py PYTHON
set -euo pipefail
interop=${1:?usage: dcp_interop_test.sh INTEROP SCRIPT PYTHON}
script=${2:?usage: dcp_interop_test.sh INTEROP SCRIPT PYTHON}
python=${3:?usage: dcp_interop_test.sh INTEROP SCRIPT PYTHON}
dir=${TEST_TMPDIR:-$(mktemp -d)}/dcp_interop
rm -rf "$dir"
mkdir -p "$dir"
export OMP_NUM_THREADS=1
"$interop" save "$dir"
"$python" "$script" "$dir"
"$interop" load "$dir"
echo "PASS: Distributed Checkpoint folders load both ways"
