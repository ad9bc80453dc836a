#!/usr/bin/env bash
# fsdp's GPU check: run.sh of the bundle that `bash tools/gpu_check.sh build` writes to
# .gpu_bundle/ (this file is tools/gpu_bundle_run.sh in the fsdp tree). On any machine
# with an NVIDIA GPU whose python3 has torch 2.11 (CUDA 13 build), no Bazel needed:
#
#   bash .gpu_bundle/run.sh          # PYTHON=/path/to/python3 picks the interpreter
#
# LibTorch, NCCL and the CUDA runtime are that torch's own: run.sh asks python3 where
# torch is and puts torch/lib and site-packages/nvidia/*/lib on LD_LIBRARY_PATH. It runs
# every bundled test binary (tests.tsv) under one deadline (7.5 minutes in all), prints a
# line per binary, the reasons of skipped cases, then "K skipped" and, last,
# "N passed, M failed" counting GoogleTest cases (a skipped case is not a pass; a case
# that crashed, timed out or never ran is a failure). Without a CUDA device a last line
# says so. Logs go to .gpu_bundle/logs/.
# Exit status: 0 every case passed with a device; 1 a failure; 2 nothing failed but no
# CUDA device was found (the GPU cases were skipped); 3 no usable torch 2.11.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
readonly BUDGET_S=450
deadline=$((SECONDS + BUDGET_S))

echo "fsdp GPU check: $(sed -n 's/^commit: //p' "$here/BUILD_INFO" 2>/dev/null)," \
     "$(wc -l <"$here/tests.tsv") test binaries"

# --- torch 2.11 and its libraries ------------------------------------------------------
probe_err=$(mktemp)
probe=$("$python" - 2>"$probe_err" <<'PY'
import glob, os
import torch
torch_dir = os.path.dirname(torch.__file__)
site = os.path.dirname(torch_dir)
libs = [os.path.join(torch_dir, "lib")] + sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))
count = torch.cuda.device_count()
print(torch.__version__)
print(torch.version.cuda or "none")
print(count)
print(", ".join(torch.cuda.get_device_name(i) for i in range(count)))
print(":".join(libs))
PY
)
probe_status=$?
if ((probe_status != 0)); then
  tail -3 "$probe_err"
  rm -f "$probe_err"
  echo "cannot run the check: '$python' cannot import torch (set PYTHON to a python3 with torch 2.11)"
  exit 3
fi
rm -f "$probe_err"
{
  read -r torch_version
  read -r torch_cuda
  read -r devices
  read -r device_names
  read -r lib_path
} <<<"$probe"
if [[ $torch_version != 2.11.* || $torch_cuda != 13.* ]]; then
  echo "cannot run the check: $python has torch $torch_version (CUDA $torch_cuda); the" \
       "bundle needs torch 2.11 built for CUDA 13 (its libtorch_cpu, libnccl, libcudart)"
  exit 3
fi
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS=1  # as under bazel test (bazel/fsdp.bzl)
TEST_TMPDIR=$(mktemp -d)
export TEST_TMPDIR
trap 'rm -rf "$TEST_TMPDIR"' EXIT
echo "torch $torch_version (CUDA $torch_cuda) from $python; CUDA devices: $devices${device_names:+ ($device_names)}"
first=$(head -1 "$here/tests.tsv" | cut -f2)
if command -v ldd >/dev/null; then
  ldd "$here/$first" | awk '$1 ~ /^lib(torch_cpu|c10|nccl|cudart)\.so/ { print "  " $1 " => " $3 }'
fi

# --- the test binaries -----------------------------------------------------------------
logs="$here/logs"
rm -rf "$logs"
mkdir -p "$logs"
passed=0 failed=0 skipped=0

# Test cases a binary would run (not the DISABLED_ ones).
count_cases() {
  "$1" --gtest_list_tests 2>/dev/null | awk '
    /^[^ ]/ { suite_disabled = ($1 ~ /^DISABLED_/ || $1 ~ /\/DISABLED_/) }
    /^  / { if (!suite_disabled && $1 !~ /^DISABLED_/) n++ }
    END { print n + 0 }'
}

while IFS=$'\t' read -r label rel; do
  bin="$here/$rel"
  log="$logs/$(tr '/:' '__' <<<"${label#//}").log"
  if command -v ldd >/dev/null && missing=$(ldd "$bin" 2>&1 | grep -E 'not found') ; then
    echo "$label: FAILED: cannot load:"
    sed 's/^[[:space:]]*/    /' <<<"$missing"
    failed=$((failed + 1))
    continue
  fi
  left=$((deadline - SECONDS))
  if ((left < 10)); then
    echo "$label: FAILED: not run, the ${BUDGET_S} s budget is spent"
    failed=$((failed + 1))
    continue
  fi
  cases=$(count_cases "$bin")
  start=$SECONDS
  timeout --kill-after=10 "$left" "$bin" --gtest_color=no >"$log" 2>&1
  rc=$?
  ok=$(grep -cE '^\[       OK \] .* \([0-9]+ ms\)$' "$log")
  bad=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log")
  skip=$(grep -cE '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$log")
  ran=$(grep -cE '^\[ RUN      \]' "$log")
  unfinished=$((ran - ok - bad - skip))  # crashed or killed mid-case
  never=$((cases > ran ? cases - ran : 0))
  bad=$((bad + unfinished + never))
  if ((rc != 0 && bad == 0)); then bad=1; fi  # failed outside any case
  note=""
  if ((rc == 124 || rc == 137)); then note=", killed at the deadline"; fi
  if ((unfinished + never > 0)); then note+=", $unfinished case(s) did not finish and $never never started"; fi
  echo "$label: $ok passed, $bad failed, $skip skipped ($((SECONDS - start)) s, exit $rc$note)"
  if ((skip > 0)); then
    grep -A1 -E ': Skipped$' "$log" | grep -vE ': Skipped$|^--$' | sort | uniq -c |
      awk '{ n = $1; $1 = ""; print "    skipped " n ":" $0 }'
  fi
  if ((bad > 0)); then
    grep -E '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log" | sed 's/^/    /'
    echo "    last lines of $log:"
    tail -20 "$log" | sed 's/^/      /'
  fi
  passed=$((passed + ok))
  failed=$((failed + bad))
  skipped=$((skipped + skip))
done <"$here/tests.tsv"

echo "training run: none in this bundle: examples/gpt trains on the CPU only (it has no" \
     "device option yet, though FullyShardedDataParallelOptions::device_id exists)"
echo "$skipped skipped (not counted as passed)"
echo "$passed passed, $failed failed"
if ((devices == 0)); then
  echo "no CUDA device found: torch.cuda.device_count() is 0 on this machine, so the GPU" \
       "cases were skipped, not run"
  ((failed > 0)) && exit 1
  exit 2
fi
((failed > 0)) && exit 1
exit 0
