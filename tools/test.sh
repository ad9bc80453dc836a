#!/usr/bin/env bash
# The test command (README.md, docs/main-job.md): installs what is missing, then builds and
# runs every test (the NCCL backend's among them: its GPU tests skip without a GPU), the
# consumer workspace (examples/consumer: fsdp used from another workspace), fsdp's unit
# tests and its 2-rank parity test over Gloo under clang's ASan + UBSan (--config=asan),
# the clang-format check of every C++ source, and fuzzing of the checkpoint, safetensors,
# .pt2 and pickle readers and of whole checkpoint folders (tools/fuzz.sh). Prints
# "N passed, M failed" last; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
# Seconds each stage took, printed before the counts (docs/main-job.md: what a cold run costs).
stage_times=()
stage_start=$SECONDS
end_stage() {
  stage_times+=("$1 $((SECONDS - stage_start)) s")
  stage_start=$SECONDS
}
tools/setup.sh
end_stage setup

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# Test results are not taken from the cache: every run really runs the tests. fsdp's own
# unit tests (//fsdp/...) and the real-process test below run once, under ASan + UBSan
# further down, not also here: compiling them twice cost minutes of a cold run. The
# trainers' runs (the GPT smoke test among them) run here only: under ASan they would
# compile the trainer libraries a second time (about 400 s of compiling in a cold run).
# fsdp's tests tagged "gpu" run here instead (without a GPU their CUDA cases skip, and
# clang's ASan build of those large files took the longest compiles of the stage).
asan_tests=(//fsdp/... //tests:fsdp_gloo_test)
fsdp_gpu_tests=($(bazel query 'attr(tags, "\bgpu\b", tests(//fsdp/...))' 2>/dev/null))
# fsdp's benchmarks are compiled here, not under ASan, where nothing would run them
# (--build_tests_only there; the fuzzers build in the fuzz configuration only, below).
fsdp_binaries=($(bazel query 'filter("_benchmark$", kind("cc_binary", //fsdp/...))' 2>/dev/null))
bazel test --nocache_test_results "$@" -- //... "${asan_tests[@]/#/-}" "${fsdp_gpu_tests[@]}" \
  "${fsdp_binaries[@]}" 2>&1 |
  tee -a "$log" ||
  status=$?
end_stage gcc
(cd examples/consumer && bazel test //... --nocache_test_results "$@") 2>&1 |
  tee -a "$log" || status=$?
end_stage consumer
# sed drops gold's warning for each ASan symbol (__asan_check_*, __asan_extra_spill_area)
# that clang 14's runtime lists for export but keeps local: thousands of harmless lines.
bazel test --config=asan --build_tests_only --test_tag_filters=-gpu --nocache_test_results "$@" \
  -- "${asan_tests[@]}" 2>&1 |
  sed -E -e "/warning: Cannot export local symbol '__asan_/d" -e 's#^(//[^ ]+) #\1 (asan) #' |
  tee -a "$log" || status=$?
end_stage asan
# House style: every C++ source as .clang-format says (clang-format 14, tools/setup.sh).
if find fsdp models examples benchmarks tests tools \( -name '*.cc' -o -name '*.h' \) -print0 |
  xargs -0 clang-format --dry-run -Werror; then
  format_result=PASSED
else
  format_result=FAILED
  status=1
fi
echo "//:clang_format $format_result (clang-format --dry-run -Werror)" | tee -a "$log"
# 20 s of the checkpoint file reader, of whole checkpoint folders, of the safetensors
# reader and of the pickle reader, 15 s of the .pt2 reader; built in the ASan stage's
# configuration (.bazelrc: --config=fuzz is --config=asan), whose libraries are already
# compiled.
for fuzz in "torch_file 20 //fsdp/state:torch_file_fuzzer" \
  "checkpoint_folder 20 //fsdp/state:checkpoint_folder_fuzzer" \
  "safetensors 20 //fsdp/formats:safetensors_fuzzer" \
  "exported_program 15 //fsdp/formats:exported_program_fuzzer" \
  "pickle 20 //fsdp/formats:pickle_fuzzer"; do
  read -r fuzz_target fuzz_seconds fuzz_label <<<"$fuzz"
  fuzz_log=$(mktemp)
  if bash tools/fuzz.sh "$fuzz_seconds" "$fuzz_target" >"$fuzz_log" 2>&1; then
    fuzz_result="PASSED ($(grep -oE 'Done [0-9]+ runs' "$fuzz_log"))"
  else
    tail -40 "$fuzz_log"
    fuzz_result=FAILED
    status=1
  fi
  echo "$fuzz_label $fuzz_result" | tee -a "$log"
  rm -f "$fuzz_log"
done
end_stage "format and fuzzers"
echo "stage times: $(printf '%s, ' "${stage_times[@]}" | sed 's/, $//')"
passed=$(grep -cE '^//[^ ]+( \(asan\))? +PASSED' "$log" || true)
failed=$(grep -cE '^//[^ ]+( \(asan\))? +(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log" || true)
if [[ $status -ne 0 && $failed -eq 0 ]]; then failed=1; fi  # e.g. a build error
echo "$passed passed, $failed failed"
exit "$status"
