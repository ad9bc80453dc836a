#!/usr/bin/env bash
# Installs what fsdp builds and tests against, then checks the versions:
# - Debian bookworm packages (Bazel 4.2.3, Abseil, GoogleTest, Google Benchmark, Gloo's
#   headers, zlib, the data sets, gnuplot, clang with libFuzzer, clang-format, iproute2,
#   and for tests only Open MPI's mpirun and Slurm (tests/launchers_trainers_test.sh));
# - LibTorch 2.11.0: the PyPI wheel torch==2.11.0 (its CUDA 13.0 build) and
#   torchvision==0.26.0 with every dependency, exactly as tools/requirements.lock pins
#   them (--require-hashes), and for tests only transformers, safetensors, peft and
#   tokenizers (Hugging Face interop), into a Python environment outside the work tree:
#   $FSDP_TORCH_PREFIX, by default ~/.cache/fsdp/torch-2.11.0 (about 4.7 GB). Bazel's
#   @libtorch repository (bazel/libtorch.bzl) finds it there.
# Checks (does not install) the CUDA 13.0 and NCCL headers in /usr/local/cuda/include that
# the NCCL backend compiles against; the libraries it links are the wheel's.
# Idempotent and quiet when everything is present. Needs root (or sudo) only when a Debian
# package must be installed.
set -euo pipefail
cd "$(dirname "$0")/.."

readonly TORCH_VERSION=2.11.0
readonly TORCHVISION_VERSION=0.26.0
readonly PREFIX=${FSDP_TORCH_PREFIX:-$HOME/.cache/fsdp/torch-$TORCH_VERSION}

# package=upstream version the build was made for (Debian revisions may differ).
readonly REQUIRED=(
  bazel-bootstrap=4.2.3
  bazel-rules-java=4.0.0
  libabsl-dev=20220623.1
  libgtest-dev=1.12.1
  libgmock-dev=1.12.1
  libbenchmark-dev=1.7.1
  libgloo-dev=0.0~git20220518.5b14351
  zlib1g-dev=1.2.13.dfsg
  python3-venv=3.11
  fortunes=1.99.1
  dataset-fashion-mnist=0.0~git20200523.55506a9
  gnuplot-nox=5.4.4
  clang=14.0
  clang-format=14.0
  libclang-rt-14-dev=14.0.6
  iproute2=6.1.0
  nlohmann-json3-dev=3.11.2
  openmpi-bin=4.1.4
  slurm-wlm=22.05.8
)

installed_version() {
  dpkg-query -W -f='${db:Status-Abbrev} ${Version}' "$1" 2>/dev/null |
    awk '$1 == "ii" { print $2 }'
}

missing=()
for entry in "${REQUIRED[@]}"; do
  pkg=${entry%%=*}
  [[ -n "$(installed_version "$pkg")" ]] || missing+=("$pkg")
done

if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Upstream version = Debian version without epoch and Debian revision.
status=0
for entry in "${REQUIRED[@]}"; do
  pkg=${entry%%=*}
  want=${entry#*=}
  have=$(installed_version "$pkg")
  upstream=${have#*:}
  upstream=${upstream%-*}
  if [[ "$upstream" != "$want"* ]]; then
    echo "setup: $pkg is ${have:-not installed}, but fsdp is built for $want" \
         "(Debian bookworm); install that version or expect build differences" >&2
    status=1
  fi
done

# The torch wheel. A venv cannot move, so it is built in place. Setup deletes and remakes
# only a prefix it made itself: one holding .fsdp-setup (written before the install
# starts) or .fsdp-lock (the lock's checksum, written last, so an interrupted install is
# redone; older setups wrote only .fsdp-lock); one from an older lock that already holds
# the pinned torch is updated in place instead. A missing or empty folder is installed
# into. Any other folder is the user's and is never touched: it is used as it is if it
# holds the pinned torch and torchvision, else setup stops with one line.
lock_sum=$(sha256sum tools/requirements.lock | cut -d' ' -f1)
versions() {  # "TORCH TORCHVISION" in the prefix's Python (no +local tags), or nothing
  "$PREFIX/bin/python3" -c 'import importlib.metadata as m;
print(*(m.version(p).split("+")[0] for p in ("torch", "torchvision")))' 2>/dev/null || true
}
made_here=false
if [[ -e "$PREFIX/.fsdp-setup" || -e "$PREFIX/.fsdp-lock" ]]; then made_here=true; fi
if [[ "$(cat "$PREFIX/.fsdp-lock" 2>/dev/null)" == "$lock_sum" ]]; then
  :  # installed by this setup from this lock
elif [[ -e "$PREFIX/.fsdp-lock" && "$(versions)" == "$TORCH_VERSION $TORCHVISION_VERSION" ]]; then
  # A complete install from an older lock that already holds the pinned torch: pip brings
  # it to this lock in place (only what changed is downloaded, not torch's 4.7 GB again).
  echo "setup: updating $PREFIX to tools/requirements.lock" >&2
  touch "$PREFIX/.fsdp-setup"  # interrupted from here on: remade next time
  rm -f "$PREFIX/.fsdp-lock"
  "$PREFIX/bin/pip" install -q --disable-pip-version-check --no-cache-dir \
    --require-hashes --only-binary=:all: -r tools/requirements.lock
  echo "$lock_sum" >"$PREFIX/.fsdp-lock"
elif $made_here || [[ ! -e "$PREFIX" ]] || [[ -d "$PREFIX" && -z "$(ls -A "$PREFIX")" ]]; then
  python=$(command -v python3.11 || command -v python3 || true)
  if [[ -z "$python" ]] ||
     [[ "$("$python" -c 'import sys; print(sys.version_info[:2] == (3, 11))')" != True ]]; then
    echo "setup: tools/requirements.lock (torch==$TORCH_VERSION) is for CPython 3.11, found" \
         "${python:-no python3}; install Debian bookworm's python3 (3.11)" >&2
    exit 1
  fi
  echo "setup: installing torch==$TORCH_VERSION and torchvision==$TORCHVISION_VERSION" \
       "into $PREFIX" >&2
  if $made_here; then rm -rf "$PREFIX"; fi
  mkdir -p "$PREFIX"
  echo "made by fsdp's tools/setup.sh, which deletes and remakes this folder when" \
       "tools/requirements.lock changes" >"$PREFIX/.fsdp-setup"
  "$python" -m venv "$PREFIX"
  "$PREFIX/bin/pip" install -q --disable-pip-version-check --no-cache-dir \
    --require-hashes --only-binary=:all: -r tools/requirements.lock
  echo "$lock_sum" >"$PREFIX/.fsdp-lock"
elif [[ "$(versions)" != "$TORCH_VERSION $TORCHVISION_VERSION" ]]; then
  # Someone else's folder: setup neither deletes nor installs into it.
  name=$PREFIX
  if [[ -n "${FSDP_TORCH_PREFIX:-}" ]]; then name="FSDP_TORCH_PREFIX=$PREFIX"; fi
  echo "setup: $name is not empty, was not made by tools/setup.sh (no .fsdp-setup in it)" \
       "and has no torch==$TORCH_VERSION with torchvision==$TORCHVISION_VERSION, so setup" \
       "leaves it alone; point FSDP_TORCH_PREFIX at a new or empty folder (setup installs" \
       "there) or at a Python environment that has those versions" >&2
  exit 1
fi
have=$(versions)
if [[ "$have" != "$TORCH_VERSION $TORCHVISION_VERSION" ]]; then
  echo "setup: $PREFIX holds torch and torchvision '$have', but fsdp is built for" \
       "$TORCH_VERSION and $TORCHVISION_VERSION; remove $PREFIX and run tools/setup.sh" >&2
  status=1
fi

# CUDA and NCCL headers (fsdp/comm:nccl; building needs no GPU). The libraries linked are
# the wheel's (bazel/libtorch.bzl), so the headers must be of the same versions.
readonly CUDA_INCLUDE=/usr/local/cuda/include
wheel_versions=$("$PREFIX/bin/python3" -c \
  'import importlib.metadata as m; print(m.version("nvidia-cuda-runtime"), m.version("nvidia-nccl-cu13"))')
read -r wheel_cudart wheel_nccl <<<"$wheel_versions"
if [[ ! -f $CUDA_INCLUDE/cuda_runtime_api.h || ! -f $CUDA_INCLUDE/crt/host_defines.h ||
      ! -f $CUDA_INCLUDE/nccl.h ]]; then
  echo "setup: the NCCL backend needs CUDA ${wheel_cudart%.*}'s runtime headers" \
       "(cuda_runtime_api.h, crt/) and NCCL $wheel_nccl's nccl.h in $CUDA_INCLUDE;" \
       "install NVIDIA's CUDA ${wheel_cudart%.*} toolkit and NCCL $wheel_nccl there" \
       "(no GPU needed)" >&2
  status=1
else
  cudart=$(awk '$2 == "CUDART_VERSION" { print int($3 / 1000) "." int($3 % 1000 / 10) }' \
    "$CUDA_INCLUDE/cuda_runtime_api.h")
  nccl=$(awk '$2 ~ /^NCCL_(MAJOR|MINOR|PATCH)$/ { v = v (v ? "." : "") $3 } END { print v }' \
    "$CUDA_INCLUDE/nccl.h")
  if [[ "$wheel_cudart" != "$cudart".* || "$nccl" != "$wheel_nccl" ]]; then
    echo "setup: $CUDA_INCLUDE has CUDA $cudart and NCCL $nccl headers, but the torch" \
         "wheel's libraries are CUDA $wheel_cudart and NCCL $wheel_nccl; install" \
         "headers of those versions" >&2
    status=1
  fi
fi
exit "$status"
