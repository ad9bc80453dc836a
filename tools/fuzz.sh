#!/usr/bin/env bash
# Fuzzes the checkpoint reader (fsdp/state:torch_file_fuzzer, clang + libFuzzer + ASan +
# UBSan) for a bounded time, from a seed corpus of torch.save pickles. A crash, a
# sanitizer report or a hang fails the run; libFuzzer writes the input to crash-*/
# timeout-* in the current directory: turn it into a test in checkpoint_test.cc.
#   bash tools/fuzz.sh [SECONDS]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
corpus=$(mktemp -d)
trap 'rm -rf "$corpus"' EXIT
"${FSDP_TORCH_PREFIX:-$HOME/.cache/fsdp/torch-2.11.0}/bin/python3" tools/fuzz_seeds.py "$corpus"
bazel run --config=fuzz //fsdp/state:torch_file_fuzzer -- -max_total_time="$seconds" \
  -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 "$corpus"
