#!/usr/bin/env bash
# examples/llama/prepare_chat.py on tiny offline tokenizer folders (a chat template with
# and one without {% generation %} markers): every shape (messages, ShareGPT, Alpaca,
# prompt/completion in text and as messages) gives the exact token ids, loss mask and
# offsets written out in prepare_chat.py, with the metadata; --mask=all; --format; a bad
# line stops it with "FILE:LINE: ..." and exit status 1 and writes nothing; and
# examples/llama/show_samples.py prints finetune's samples.jsonl as text.
#   prepare_chat_test.sh PREPARE_CHAT_PY TEST_PY PYTHON SHOW_SAMPLES_PY
set -euo pipefail
tool=${1:?usage: prepare_chat_test.sh PREPARE_CHAT_PY TEST_PY PYTHON}
script=${2:?usage: prepare_chat_test.sh PREPARE_CHAT_PY TEST_PY PYTHON}
python=${3:?usage: prepare_chat_test.sh PREPARE_CHAT_PY TEST_PY PYTHON SHOW_SAMPLES_PY}
show=${4:?usage: prepare_chat_test.sh PREPARE_CHAT_PY TEST_PY PYTHON SHOW_SAMPLES_PY}
dir=${TEST_TMPDIR:-$(mktemp -d)}/prepare_chat
rm -rf "$dir" && mkdir -p "$dir"
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$python" "$script" "$tool" "$dir" "$show"
