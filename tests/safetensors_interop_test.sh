#!/usr/bin/env bash
# safetensors files move both ways between fsdp and the safetensors 0.8 Python library
# (the pinned environment): fsdp's files (every dtype, and a sharded Hugging Face folder
# saved from an FSDP model at W = 2) load in safetensors.torch.load_file with the exact
# values; files written by save_file and huggingface_hub's save_torch_state_dict load in
# fsdp, the folder into FSDP models at W = 1, 2, 3.
#   safetensors_interop_test.sh PATH/TO/safetensors_interop PATH/TO/safetensors_interop.py PYTHON
set -euo pipefail
usage="usage: safetensors_interop_test.sh INTEROP SCRIPT PYTHON"
interop=${1:?$usage}
script=${2:?$usage}
python=${3:?$usage}
dir=${TEST_TMPDIR:-$(mktemp -d)}/safetensors_interop
rm -rf "$dir"
mkdir -p "$dir"
"$interop" write "$dir"
HF_HUB_OFFLINE=1 "$python" "$script" "$dir"
"$interop" check "$dir"
echo "PASS: safetensors files load both ways"
