#!/usr/bin/env bash
# Fuzzes a file reader (clang + libFuzzer + ASan + UBSan) for a bounded time, from a seed
# corpus: the checkpoint reader (fsdp/state:torch_file_fuzzer, torch.save pickles), the
# safetensors reader (fsdp/formats:safetensors_fuzzer, files written by the safetensors
# library), the .pt2 reader's JSON side (fsdp/formats:exported_program_fuzzer,
# model.json and model_weights_config.json written by torch.export.save) or the pickle
# reader (fsdp/formats:pickle_fuzzer, Distributed Checkpoint metadata and plain values
# pickled by Python) or whole checkpoint folders (fsdp/state:checkpoint_folder_fuzzer: DCP
# and fsdp sharded folders, metadata fuzzed beside real data files; seeds with deep nesting
# and a memo bomb, and, written by the target from a real save, with overlapping chunks,
# holes and huge sizes). A crash, a sanitizer report or a hang fails the run; libFuzzer writes
# the input to crash-*/timeout-* in the current directory: turn it into a test
# (checkpoint_test.cc, fsdp/formats/safetensors_test.cc, exported_program_test.cc,
# fsdp/formats/pickle_test.cc, dcp_checkpoint_test.cc).
#   bash tools/fuzz.sh [SECONDS] [torch_file|safetensors|exported_program|pickle|checkpoint_folder]
#   (default 60 torch_file)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
target=${2:-torch_file}
python="${FSDP_TORCH_PREFIX:-$HOME/.cache/fsdp/torch-2.11.0}/bin/python3"
corpus=$(mktemp -d)
trap 'rm -rf "$corpus"' EXIT
case "$target" in
  torch_file)
    "$python" tools/fuzz_seeds.py "$corpus"
    label=//fsdp/state:torch_file_fuzzer
    ;;
  safetensors)
    "$python" tools/safetensors_fuzz_seeds.py "$corpus"
    label=//fsdp/formats:safetensors_fuzzer
    ;;
  exported_program)
    "$python" tools/exported_program_fuzz_seeds.py "$corpus"
    label=//fsdp/formats:exported_program_fuzzer
    ;;
  pickle)
    "$python" tools/pickle_fuzz_seeds.py "$corpus"
    label=//fsdp/formats:pickle_fuzzer
    ;;
  checkpoint_folder)
    "$python" tools/checkpoint_folder_fuzz_seeds.py "$corpus"
    export FSDP_FUZZ_SEED_DIR="$corpus"  # the target adds seeds from a real save
    label=//fsdp/state:checkpoint_folder_fuzzer
    ;;
  *)
    echo "fuzz.sh: unknown target '$target'; expected torch_file, safetensors," \
      "exported_program, pickle or checkpoint_folder" >&2
    exit 2
    ;;
esac
# With FSDP_FUZZ_WORKSPACE, the fuzzer is built in that workspace, which depends on fsdp
# as @fsdp (tools/test.sh names examples/consumer, where its ASan stage compiled the
# libraries); the seeds above are made here either way.
if [[ -n "${FSDP_FUZZ_WORKSPACE:-}" ]]; then
  label="@fsdp$label"
  cd "$FSDP_FUZZ_WORKSPACE"
fi
bazel run --config=fuzz "$label" -- -max_total_time="$seconds" \
  -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 "$corpus"
