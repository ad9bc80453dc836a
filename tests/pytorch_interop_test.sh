#!/usr/bin/env bash
# Checkpoints move both ways between fsdp and PyTorch (Debian's python3-torch): fsdp's
# full checkpoint loads strictly into the same model written in PyTorch and gives the
# same logits; PyTorch's torch.save(model.state_dict()) loads into fsdp and does too.
#   pytorch_interop_test.sh PATH/TO/pytorch_interop PATH/TO/pytorch_interop.py
set -euo pipefail
interop=${1:?usage: pytorch_interop_test.sh INTEROP SCRIPT}
script=${2:?usage: pytorch_interop_test.sh INTEROP SCRIPT}
dir=${TEST_TMPDIR:-$(mktemp -d)}/interop
mkdir -p "$dir"
"$interop" write "$dir"
/usr/bin/python3 "$script" "$dir"
"$interop" check "$dir"
echo "PASS: checkpoints load both ways"
