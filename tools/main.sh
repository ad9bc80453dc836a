#!/usr/bin/env bash
# The main job (README.md, docs/main-job.md): trains a character-level GPT on Debian's
# fortunes with FSDP, 2 local ranks over Gloo, FULL_SHARD, on the CPU; where a CUDA device
# is visible, on the GPU instead (the trainer's --device=auto: one rank per GPU over NCCL,
# bf16, a GPT-2-small-sized model). Installs what is missing first.
# Extra arguments go to the trainer (e.g. --steps=100, --world_size=4); see
# `bazel run -c opt //examples/gpt:train -- --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel run -c opt //examples/gpt:train -- --out_dir="$PWD/gpt_run" "$@"
