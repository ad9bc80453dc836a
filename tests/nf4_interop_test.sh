#!/usr/bin/env bash
# fsdp's NF4 (fsdp/formats/nf4.h) against bitsandbytes 0.50.2's (the pinned environment):
# bitsandbytes' bytes dequantize to its values bit for bit, double quantized and not, and
# fsdp quantizes to the same bytes, on bf16, fp16 and fp32 tensors with a short last
# block, an odd element count, more than 256 blocks and an all-zero block.
#   nf4_interop_test.sh PATH/TO/nf4_interop PATH/TO/nf4_interop.py PYTHON
set -euo pipefail
usage="usage: nf4_interop_test.sh INTEROP SCRIPT PYTHON"
interop=${1:?$usage}
script=${2:?$usage}
python=${3:?$usage}
dir=${TEST_TMPDIR:-$(mktemp -d)}/nf4_interop
rm -rf "$dir" && mkdir -p "$dir"
"$python" "$script" "$dir/nf4.safetensors" 2> >(grep -v "kernels-community\|pip install kernels" >&2)
"$interop" "$dir/nf4.safetensors"
