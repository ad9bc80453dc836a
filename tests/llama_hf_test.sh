#!/usr/bin/env bash
# fsdp's LlamaForCausalLM (examples/llama) against transformers' on random small Llama
# folders written by save_pretrained in several shards (untied and tied embeddings,
# grouped-query attention): loaded at W = 1, 2, 3, the logits are within 1e-5 of
# transformers' on the same ids.
#   llama_hf_test.sh PATH/TO/llama_logits PATH/TO/llama_hf.py PYTHON
set -euo pipefail
logits=${1:?usage: llama_hf_test.sh LLAMA_LOGITS SCRIPT PYTHON}
script=${2:?usage: llama_hf_test.sh LLAMA_LOGITS SCRIPT PYTHON}
python=${3:?usage: llama_hf_test.sh LLAMA_LOGITS SCRIPT PYTHON}
dir=${TEST_TMPDIR:-$(mktemp -d)}/llama_hf
mkdir -p "$dir"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$python" "$script" make "$dir"
for variant in untied tied; do
  "$logits" "$dir/$variant" "$dir/ids.pt" "$dir/$variant/logits.pt" 1 2 3
done
"$python" "$script" check "$dir"
echo "PASS: fsdp's Llama logits match transformers' at W = 1, 2, 3"
