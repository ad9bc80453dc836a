#!/usr/bin/env bash
# Checkpoints move both ways between fsdp and PyTorch 2.11 (the pinned environment's
# torch): fsdp's full checkpoint loads with torch.load's default weights_only=True,
# strictly into the same model written in PyTorch, and gives the same logits; PyTorch's
# torch.save(model.state_dict()) loads into fsdp and does too; fsdp's full Adagrad and
# RMSprop optimizer files equal torch.optim's state after the same steps and load into it.
#   pytorch_interop_test.sh PATH/TO/pytorch_interop PATH/TO/pytorch_interop.py PYTHON
set -euo pipefail
interop=${1:?usage: pytorch_interop_test.sh INTEROP SCRIPT PYTHON}
script=${2:?usage: pytorch_interop_test.sh INTEROP SCRIPT PYTHON}
python=${3:?usage: pytorch_interop_test.sh INTEROP SCRIPT PYTHON}
dir=${TEST_TMPDIR:-$(mktemp -d)}/interop
mkdir -p "$dir"
"$interop" write "$dir"
"$python" "$script" "$dir"
"$interop" check "$dir"
echo "PASS: checkpoints load both ways"
