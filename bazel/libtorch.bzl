"""A repository rule that exposes a LibTorch 2.11 install (the PyPI wheel's torch/) to Bazel.

The LibTorch fsdp builds with is the `torch` package of the pinned PyPI wheel
(tools/requirements.lock), installed by tools/setup.sh into a Python environment outside
the work tree. This rule finds that package, checks its version and links its `include`
and `lib` folders into the repository; the BUILD file (third_party/libtorch.BUILD) puts
the absolute `lib` folder in every binary's run path, so nothing needs LD_LIBRARY_PATH.
It also writes `bin/python3` and `bin/torchrun`, which run that environment's Python and
torchrun (tests compare fsdp with PyTorch through them).

Where LibTorch is looked for, first match wins:
  1. `path`: a folder holding `include/` and `lib/` of LibTorch (a wheel's
     site-packages/torch, or an unpacked libtorch archive of the same version);
  2. the environment variable FSDP_TORCH_PREFIX: a Python environment with torch;
  3. $HOME/.cache/fsdp/torch-<version>, where tools/setup.sh installs it.
"""

_SETUP_HINT = "run `bash tools/setup.sh` in the fsdp checkout to install it"

def _find_torch_dir(ctx):
    """Returns (the torch folder, the Python interpreter that imports it or None)."""
    if ctx.attr.path:
        return ctx.path(ctx.attr.path), None
    prefix = ctx.os.environ.get("FSDP_TORCH_PREFIX", "")
    if not prefix:
        home = ctx.os.environ.get("HOME", "")
        prefix = "%s/.cache/fsdp/torch-%s" % (home, ctx.attr.version)
    python = ctx.path(prefix + "/bin/python3")
    if not python.exists:
        fail(("LibTorch %s not found: expected a Python environment at %s holding " +
              "torch==%s (FSDP_TORCH_PREFIX overrides the place); %s") %
             (ctx.attr.version, prefix, ctx.attr.version, _SETUP_HINT))
    found = ctx.execute([
        python,
        "-c",
        "import importlib.util as u; s = u.find_spec('torch'); " +
        "print(s.submodule_search_locations[0] if s else '')",
    ])
    if found.return_code != 0 or not found.stdout.strip():
        fail("LibTorch %s not found: %s has no `torch` package; %s" %
             (ctx.attr.version, python, _SETUP_HINT))
    return ctx.path(found.stdout.strip()), python

def _read_version(ctx, torch_dir):
    """The version recorded in the install: torch/version.py, or libtorch's build-version."""
    for name in ["version.py", "build-version"]:
        f = torch_dir.get_child(name)
        if f.exists:
            for line in ctx.read(f).splitlines():
                if name == "build-version":
                    return line.strip()
                if line.startswith("__version__"):
                    return line.split("=")[1].strip().strip("'\"")
    return "unknown"

# Note [One NCCL per process]
# libtorch_cuda (in the CUDA wheel) loads NCCL and the CUDA runtime from the wheel's own
# NVIDIA packages (its RPATH names $ORIGIN/../../nvidia/nccl/lib, .../nvidia/cu13/lib),
# and the dynamic loader keeps one library per SONAME in a process: whichever libnccl.so.2
# comes first serves both fsdp and LibTorch. So fsdp links exactly the files LibTorch
# loads (nvidia-nccl-cu13 2.28.9 and nvidia-cuda-runtime 13.0 in the pinned environment),
# not /usr/local/cuda's copies: a process never mixes two NCCL builds, whatever the
# toolkit on the machine. Only the headers come from /usr/local/cuda (@cuda). LibTorch
# given as an unpacked archive holds these libraries in its own lib/; a LibTorch without
# them (a CPU-only build, which loads no NCCL) falls back to /usr/local/cuda.
_SYSTEM_CUDA_LIB = "/usr/local/cuda/lib64"

def _nvidia_lib_dir(torch_dir, package, library):
    """The folder holding `library` as LibTorch loads it (Note [One NCCL per process])."""
    wheel = torch_dir.dirname.get_child("nvidia").get_child(package).get_child("lib")
    for folder in [wheel, torch_dir.get_child("lib")]:
        if folder.get_child(library).exists:
            return str(folder)
    return _SYSTEM_CUDA_LIB

def _libtorch_repository_impl(ctx):
    torch_dir, python = _find_torch_dir(ctx)
    for child in ["include", "lib"]:
        if not torch_dir.get_child(child).exists:
            fail(("LibTorch at %s has no %s/ folder: expected the torch package of the " +
                  "PyPI wheel or an unpacked libtorch archive; %s") %
                 (torch_dir, child, _SETUP_HINT))
    version = _read_version(ctx, torch_dir)
    if version.split("+")[0] != ctx.attr.version:
        fail(("LibTorch at %s is version %s, but fsdp is built for %s; %s " +
              "(or point FSDP_TORCH_PREFIX at an environment with torch==%s)") %
             (torch_dir, version, ctx.attr.version, _SETUP_HINT, ctx.attr.version))
    ctx.symlink(torch_dir.get_child("include"), "include")
    ctx.symlink(torch_dir.get_child("lib"), "lib")
    ctx.template(
        "BUILD.bazel",
        ctx.attr.build_file,
        substitutions = {
            "%{lib_dir}": str(torch_dir.get_child("lib")),
            "%{nccl_lib_dir}": _nvidia_lib_dir(torch_dir, "nccl", "libnccl.so.2"),
            "%{cudart_lib_dir}": _nvidia_lib_dir(torch_dir, "cu13", "libcudart.so.13"),
        },
        executable = False,
    )
    ctx.file("VERSION", version + "\n")

    # The Python that has this torch (for tests that compare with PyTorch) and its torchrun.
    if python:
        run_python = 'exec "%s" "$@"' % python
    else:
        run_python = ('echo "LibTorch was given as a folder (%s): no Python with torch ' +
                      '%s is known; set FSDP_TORCH_PREFIX instead" >&2; exit 2') % (
            torch_dir,
            ctx.attr.version,
        )
    ctx.file("bin/python3", "#!/bin/sh\n" + run_python + "\n")
    ctx.file(
        "bin/torchrun",
        "#!/bin/sh\n" + run_python.replace('"$@"', '-m torch.distributed.run "$@"') + "\n",
    )

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    attrs = {
        "build_file": attr.label(mandatory = True, allow_single_file = True),
        "path": attr.string(doc = "A folder with LibTorch's include/ and lib/; optional."),
        "version": attr.string(mandatory = True, doc = "The torch version required."),
    },
    environ = ["FSDP_TORCH_PREFIX", "HOME"],
    local = True,
)
