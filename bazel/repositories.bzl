"""The external repositories fsdp builds with, for this workspace and for consumers.

A consumer's WORKSPACE:

    local_repository(name = "fsdp", path = "/path/to/fsdp")
    load("@fsdp//bazel:repositories.bzl", "fsdp_dependencies")
    fsdp_dependencies(fsdp_path = "/path/to/fsdp")   # a trailing "/" is optional

Everything is local (Debian packages, the pinned torch wheel installed by
tools/setup.sh, and this tree): nothing is downloaded. Repositories the consumer already
declared are left alone.

Bringing your own LibTorch (it must be 2.11, the version fsdp is built and tested with):
either pass `libtorch_path`, a folder with LibTorch's include/ and lib/ (a wheel's
site-packages/torch or an unpacked libtorch archive), or set FSDP_TORCH_PREFIX to a
Python environment that has torch 2.11, or declare a repository named `libtorch` before
calling fsdp_dependencies whose targets `:torch` and `:c10d_gloo` match
third_party/libtorch.BUILD.
"""

load("//bazel:libtorch.bzl", "libtorch_repository")

# The LibTorch version fsdp is built for (tools/requirements.lock pins the same wheel).
TORCH_VERSION = "2.11.0"

def _add(rule, name, **kwargs):
    if name not in native.existing_rules():
        rule(name = name, **kwargs)

def _system_library(name, build_file, path = "/usr"):
    _add(native.new_local_repository, name, build_file = build_file, path = path)

def fsdp_dependencies(fsdp_path = "", libtorch_path = ""):
    """Declares fsdp's repositories.

    Args:
      fsdp_path: fsdp's root, with or without a trailing "/" ("" inside fsdp itself).
      libtorch_path: optional folder with LibTorch 2.11's include/ and lib/ (see above).
    """
    prefix = fsdp_path if fsdp_path == "" or fsdp_path.endswith("/") else fsdp_path + "/"

    # Bazel's rule sets as Debian ships them; rules_cc forwards to the native rules
    # (Debian's bazel-rules-cc is too new for Bazel 4.2.3).
    _add(native.local_repository, "platforms", path = "/usr/share/bazel/platforms")
    _add(native.local_repository, "rules_java", path = "/usr/share/bazel/rules/java")
    _add(native.local_repository, "rules_cc", path = prefix + "third_party/rules_cc")

    # `bazel test` asks for these even without --collect_code_coverage.
    _add(
        native.local_repository,
        "remote_coverage_tools",
        path = prefix + "third_party/remote_coverage_tools",
    )

    _add(
        libtorch_repository,
        "libtorch",
        build_file = Label("//third_party:libtorch.BUILD"),
        path = libtorch_path,
        version = TORCH_VERSION,
    )

    # System libraries from Debian packages (versions checked by tools/setup.sh).
    _system_library("com_google_absl", str(Label("//third_party:absl.BUILD")))
    _system_library("com_google_googletest", str(Label("//third_party:googletest.BUILD")))
    _system_library("com_github_google_benchmark", str(Label("//third_party:benchmark.BUILD")))
    _system_library("gloo", str(Label("//third_party:gloo.BUILD")))
    _system_library("zlib", str(Label("//third_party:zlib.BUILD")))
    _system_library("nlohmann_json", str(Label("//third_party:nlohmann_json.BUILD")))

    # CUDA 13.0 and NCCL headers (the libraries are LibTorch's: third_party/cuda.BUILD).
    _system_library("cuda", str(Label("//third_party:cuda.BUILD")), path = "/usr/local/cuda")
