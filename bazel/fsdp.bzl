"""Macros that set compiler flags once for every fsdp target."""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library", "cc_test")

FSDP_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
]

# Who may depend on a package's public targets: each layer's BUILD.bazel declares a
# package_group `dependents` that names the layers above it (ARCHITECTURE: base <- wrap
# <- core <- state <- //fsdp, examples, tools, benchmarks, tests; comm <- core, state),
# so an upward dependency is a visibility error. Other workspaces use //fsdp:fsdp.

# libFuzzer targets: built only under --config=fuzz (clang).
FUZZ_ONLY = select({
    "//bazel:fuzz_enabled": [],
    "//conditions:default": ["//bazel:unsupported"],
})

# libFuzzer's coverage hooks under --config=asan and --config=fuzz: in the libraries (what
# the fuzzers exercise) and the fuzzers, not in the tests, whose compiles they slowed ~15%.
FUZZ_COVERAGE_COPTS = select({
    "//bazel:fuzz_enabled": ["-fsanitize=fuzzer-no-link"],
    "//conditions:default": [],
})

def fsdp_cc_library(name, copts = [], **kwargs):
    cc_library(name = name, copts = FSDP_COPTS + copts + FUZZ_COVERAGE_COPTS, **kwargs)

def fsdp_cc_binary(name, copts = [], **kwargs):
    cc_binary(name = name, copts = FSDP_COPTS + copts, **kwargs)

def fsdp_cc_test(name, copts = [], deps = [], env = {}, **kwargs):
    """A GoogleTest binary with gtest_main; one intra-op thread per process.

    LeakSanitizer suppressions for LibTorch's own leaks are linked in (//bazel:lsan_suppressions).
    """
    test_env = {"OMP_NUM_THREADS": "1"}
    test_env.update(env)
    cc_test(
        name = name,
        copts = FSDP_COPTS + copts,
        deps = deps + [
            "@com_google_googletest//:gtest_main",
            Label("//bazel:lsan_suppressions"),
        ],
        env = test_env,
        **kwargs
    )

def fsdp_cc_benchmark(name, copts = [], deps = [], custom_main = False, testonly = True, **kwargs):
    """A Google Benchmark binary (run it with bazel run -c opt).

    With custom_main, the sources define main() (e.g. to compare with a reference run
    after the benchmarks); otherwise Google Benchmark's main is linked in. testonly, like
    a test, so it may use the testonly fixtures of the testing/ folders.
    """
    main_dep = "@com_github_google_benchmark//:benchmark"
    if not custom_main:
        main_dep = "@com_github_google_benchmark//:benchmark_main"
    cc_binary(
        name = name,
        copts = FSDP_COPTS + copts,
        deps = deps + [main_dep],
        testonly = testonly,
        **kwargs
    )

def fsdp_cc_fuzzer(name, copts = [], linkopts = [], **kwargs):
    """A libFuzzer binary (LLVMFuzzerTestOneInput), built only under --config=fuzz."""
    cc_binary(
        name = name,
        copts = FSDP_COPTS + copts + FUZZ_COVERAGE_COPTS,
        linkopts = linkopts + ["-fsanitize=fuzzer"],
        target_compatible_with = FUZZ_ONLY,
        **kwargs
    )
