#!/usr/bin/env bash
# fsdp's LoRA adapter, trained under FSDP, loads in PEFT 0.21 (PeftModel.from_pretrained)
# with the same logits, and merges to the same weights (peft_interop.py).
#   peft_interop_test.sh PATH/TO/peft_interop PATH/TO/peft_interop.py PYTHON
set -euo pipefail
interop=${1:?usage: peft_interop_test.sh INTEROP SCRIPT PYTHON}
script=${2:?usage: peft_interop_test.sh INTEROP SCRIPT PYTHON}
python=${3:?usage: peft_interop_test.sh INTEROP SCRIPT PYTHON}
dir=${TEST_TMPDIR:-$(mktemp -d)}/peft
mkdir -p "$dir"
"$interop" "$dir"
HF_HUB_OFFLINE=1 "$python" "$script" "$dir"
