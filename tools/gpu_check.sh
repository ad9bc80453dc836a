#!/usr/bin/env bash
# The GPU check, in two halves (docs/GPU.md, "Running the GPU check"):
#   bash tools/gpu_check.sh build   here, with Bazel and no GPU: writes .gpu_bundle/
#   bash .gpu_bundle/run.sh         on any machine with an NVIDIA GPU whose python3 has
#                                   torch 2.11 (CUDA 13 build); no Bazel, no network
# (`bash tools/gpu_check.sh run` runs the bundle in place, as run.sh does.)
#
# The bundle holds every test tagged "gpu" (tests with cases that need a CUDA device;
# tag a new one and it is bundled), built with --config=gpu: optimised, with our code,
# Abseil and GoogleTest linked in and no run path into this machine's torch; run.sh
# (tools/gpu_bundle_run.sh), tests.tsv (label and binary of each test) and BUILD_INFO.
# For the GPT on the GPU that run.sh runs after the tests (issue 18; and the checkpoint
# and CPU-offload runs of issue 39), also the trainer
# (bin/examples/gpt/train), benchmarks/peer's two sides (bin/benchmarks/gpt_fsdp and
# peer/fsdp2_gpt.py) and the text they train on (fortunes/: this machine's Debian fortune
# files, 2.5 MB); for the Llama fine-tune on the GPU (issue 39), the fine-tune trainer
# (bin/examples/llama/finetune) and a random tiny Llama written here by transformers
# (llama/: model_bf16/ and 16384 random token ids, tests/memory_levers.py make; 0.7 MB).
# LibTorch, NCCL and the CUDA runtime are the GPU machine's own, found through its
# python3. The build fails if a binary needs a shared library that neither the C/C++
# runtime nor the torch wheel provides, or if the bundle is over 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
readonly BUNDLE=.gpu_bundle
readonly MAX_BYTES=$((64 * 1024 * 1024))

case "${1:-}" in
  build) ;;
  run) exec bash "$BUNDLE/run.sh" "${@:2}" ;;
  *)
    echo "usage: bash tools/gpu_check.sh build   (then bash $BUNDLE/run.sh on the GPU machine)" >&2
    exit 2
    ;;
esac

tools/setup.sh
prefix=${FSDP_TORCH_PREFIX:-$HOME/.cache/fsdp/torch-2.11.0}

mapfile -t targets < <(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null | sort)
if ((${#targets[@]} == 0)); then
  echo "gpu_check: no test is tagged \"gpu\"" >&2
  exit 1
fi
readonly TRAINER_BINARIES=(//examples/gpt:train //benchmarks:gpt_fsdp //examples/llama:finetune)
bazel build --config=gpu "${targets[@]}" "${TRAINER_BINARIES[@]}"
bin_dir=$(bazel info --config=gpu bazel-bin 2>/dev/null)

# What a bundled binary may load: the C and C++ runtime of the GPU machine, and the
# shared libraries of the torch wheel (torch/lib, nvidia/*/lib), which run.sh puts on
# LD_LIBRARY_PATH there.
site=$("$prefix/bin/python3" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
wheel_libs=$(find "$site/torch/lib" "$site"/nvidia/*/lib -maxdepth 1 -name '*.so*' -printf '%f\n')
readonly SYSTEM_LIBS='^((libc|libm|libdl|librt|libpthread|libgcc_s)\.so\.[0-9]+|libstdc\+\+\.so\.6|ld-linux-x86-64\.so\.2)$'

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin"
status=0
# Copies the binary of `label` to bin/PACKAGE/NAME and checks the libraries it needs.
bundle_binary() {
  local label=$1 path lib
  path=${label#//}
  path=${path/://}
  mkdir -p "$(dirname "$BUNDLE/bin/$path")"
  install -m 755 "$bin_dir/$path" "$BUNDLE/bin/$path"
  while read -r lib; do
    if ! [[ $lib =~ $SYSTEM_LIBS ]] && ! grep -qxF "$lib" <<<"$wheel_libs"; then
      echo "gpu_check: $label needs $lib, which a GPU machine with torch 2.11 need not" \
           "have; link it statically (see --config=gpu in .bazelrc)" >&2
      status=1
    fi
  done < <(readelf -d "$BUNDLE/bin/$path" | sed -n 's/.*Shared library: \[\(.*\)\]$/\1/p')
}
for label in "${targets[@]}"; do
  bundle_binary "$label"
  path=${label#//}
  printf '%s\tbin/%s\n' "$label" "${path/://}" >>"$BUNDLE/tests.tsv"
done
for label in "${TRAINER_BINARIES[@]}"; do bundle_binary "$label"; done
install -m 755 tools/gpu_bundle_run.sh "$BUNDLE/run.sh"
mkdir -p "$BUNDLE/peer" "$BUNDLE/fortunes"
install -m 644 benchmarks/peer/fsdp2_gpt.py benchmarks/peer/hf_fsdp2_finetune.py "$BUNDLE/peer/"
install -m 644 tools/real_size_check.py "$BUNDLE/"
# The fortune files as load_fortunes reads them (no .dat indexes, no .u8 copies).
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.*' -exec install -m 644 {} "$BUNDLE/fortunes/" \;
# The Llama the fine-tune step trains (the GPU machine needs no transformers).
mkdir -p "$BUNDLE/llama"
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error "$prefix/bin/python3" tests/memory_levers.py make "$BUNDLE/llama" >/dev/null 2>&1 ||
  { echo "gpu_check: cannot write the tiny Llama (tests/memory_levers.py make)" >&2; exit 1; }
rm -rf "$BUNDLE/llama/model"  # the step trains the bf16 copy

# The newest glibc and libstdc++ symbol versions the binaries use: the GPU machine's C
# and C++ runtime must be at least as new.
needs=$(find "$BUNDLE/bin" -type f -exec objdump -T {} + | grep -oE '(GLIBC|GLIBCXX)_[0-9.]+' |
  sort -u -V | awk -F_ '{ last[$1] = $0 } END { print last["GLIBC"], last["GLIBCXX"] }')
{
  echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu_bundle' || echo ' (with uncommitted changes)')"
  echo "built: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m) by tools/gpu_check.sh build"
  echo "torch: $("$prefix/bin/python3" -c 'import torch; print(torch.__version__)') (the binaries need torch 2.11 with CUDA 13)"
  echo "needs: $needs or newer"
} >"$BUNDLE/BUILD_INFO"

bytes=$(du -sb "$BUNDLE" | cut -f1)
if ((bytes > MAX_BYTES)); then
  echo "gpu_check: $BUNDLE is $bytes bytes, over the 64 MiB limit" >&2
  status=1
fi
((status == 0)) || exit "$status"
echo "gpu_check: wrote $BUNDLE: ${#targets[@]} test binaries, the GPT trainer and side by side, the Llama fine-tune, $(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }') MiB;" \
     "copy it to a machine with an NVIDIA GPU and torch 2.11 and run: bash $BUNDLE/run.sh"
