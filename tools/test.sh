#!/usr/bin/env bash
# The test command (README.md, docs/main-job.md): installs what is missing, then builds and
# runs every test with gcc (the NCCL backend's among them: its GPU tests skip without a
# GPU); then, in the consumer workspace (examples/consumer: fsdp used from another
# workspace, as @fsdp), fsdp's unit tests, its 2-rank parity test over Gloo and the
# consumer's own programs under clang's ASan + UBSan (--config=asan); the clang-format check
# of every C++ source; and fuzzing of the checkpoint, safetensors, .pt2 and pickle readers
# and of whole checkpoint folders (tools/fuzz.sh, in the same workspace and configuration).
# Prints "N passed, M failed" last; exits non-zero on any failure.
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
query_err=$(mktemp)
trap 'rm -f "$log" "$query_err"' EXIT
status=0
# Test results are not taken from the cache: every run really runs the tests. fsdp's own
# unit tests (//fsdp/...) and the real-process test below run once, under ASan + UBSan in
# the consumer workspace further down, not also here: compiling them twice cost minutes
# of a cold run. The trainers' runs (the GPT smoke test among them) run here only: under
# ASan they would compile the trainer libraries a second time (about 400 s of compiling
# in a cold run). fsdp's tests tagged "gpu" run here instead (without a GPU their CUDA
# cases skip, and clang's ASan build of those large files took the longest compiles).
asan_tests=(//fsdp/... //tests:fsdp_gloo_test)
# The labels a query finds, one per line; a failing query ends the run rather than
# leaving its targets out unseen.
labels() {
  if ! bazel query "$1" 2>"$query_err"; then
    cat "$query_err" >&2
    echo "test.sh: bazel query '$1' failed" >&2
    return 1
  fi
}
fsdp_gpu_tests=$(labels 'attr(tags, "\bgpu\b", tests(//fsdp/...))')
# fsdp's benchmarks are compiled here, not under ASan, where nothing would run them
# (--build_tests_only there; the fuzzers build in the fuzz configuration only, below).
fsdp_binaries=$(labels 'filter("_benchmark$", kind("cc_binary", //fsdp/...))')
# Both lists expand unquoted, one word per label (labels hold no spaces or wildcards).
# shellcheck disable=SC2086
bazel test --nocache_test_results "$@" -- //... "${asan_tests[@]/#/-}" $fsdp_gpu_tests \
  $fsdp_binaries 2>&1 |
  tee -a "$log" ||
  status=$?
end_stage gcc
# The consumer workspace builds fsdp as an external repository, @fsdp; its ASan build
# there is the only other compile of fsdp's libraries (Bazel keys actions by path, so
# external/fsdp/... never shares the main build's), and it serves fsdp's unit tests, the
# consumer's two programs and the fuzzers below. The sed expression drops gold's warning
# for each ASan symbol (__asan_check_*, __asan_extra_spill_area) that clang 14's runtime
# lists for export but keeps local: thousands of harmless lines in each ASan link.
drop_asan_export_warnings="/warning: Cannot export local symbol '__asan_/d"
(cd examples/consumer &&
  bazel test --config=asan --build_tests_only --test_tag_filters=-gpu --nocache_test_results \
    "$@" -- //... "${asan_tests[@]/#/@fsdp}") 2>&1 |
  sed -E -e "$drop_asan_export_warnings" -e 's#^((@fsdp)?//[^ ]+) #\1 (asan) #' |
  tee -a "$log" || status=$?
end_stage "consumer and asan"
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
# reader and of the pickle reader, 15 s of the .pt2 reader, two at a time (each fuzzer is
# one process). Built in the consumer workspace in the ASan stage's configuration
# (bazel/sanitizers.bazelrc: --config=fuzz is --config=asan), whose libraries are already
# compiled.
fuzzers=("torch_file 20 //fsdp/state:torch_file_fuzzer"
  "checkpoint_folder 20 //fsdp/state:checkpoint_folder_fuzzer"
  "safetensors 20 //fsdp/formats:safetensors_fuzzer"
  "exported_program 15 //fsdp/formats:exported_program_fuzzer"
  "pickle 20 //fsdp/formats:pickle_fuzzer")
fuzz_labels=($(printf '@fsdp%s\n' "${fuzzers[@]##* }"))
(cd examples/consumer && bazel build --config=fuzz "$@" -- "${fuzz_labels[@]}") 2>&1 |
  sed -E "$drop_asan_export_warnings" || status=$?
fuzz_dir=$(mktemp -d)
running=()
report_fuzzers() {
  local pid label fuzz_log
  for entry in "${running[@]}"; do
    read -r pid label fuzz_log <<<"$entry"
    if wait "$pid"; then
      fuzz_result="PASSED ($(grep -oE 'Done [0-9]+ runs' "$fuzz_log"))"
    else
      tail -40 "$fuzz_log"
      fuzz_result=FAILED
      status=1
    fi
    echo "$label $fuzz_result" | tee -a "$log"
  done
  running=()
}
for fuzz in "${fuzzers[@]}"; do
  read -r fuzz_target fuzz_seconds fuzz_label <<<"$fuzz"
  FSDP_FUZZ_WORKSPACE=examples/consumer bash tools/fuzz.sh "$fuzz_seconds" "$fuzz_target" \
    >"$fuzz_dir/$fuzz_target.log" 2>&1 &
  running+=("$! $fuzz_label $fuzz_dir/$fuzz_target.log")
  if ((${#running[@]} == 2)); then report_fuzzers; fi
done
report_fuzzers
rm -rf "$fuzz_dir"
end_stage "format and fuzzers"
echo "stage times: $(printf '%s, ' "${stage_times[@]}" | sed 's/, $//')"
passed=$(grep -cE '^(@fsdp)?//[^ ]+( \(asan\))? +PASSED' "$log" || true)
failed=$(grep -cE '^(@fsdp)?//[^ ]+( \(asan\))? +(FAILED|TIMEOUT|NO STATUS|INCOMPLETE)' "$log" || true)
if [[ $status -ne 0 && $failed -eq 0 ]]; then failed=1; fi  # e.g. a build error
echo "$passed passed, $failed failed"
exit "$status"
