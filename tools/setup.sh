#!/usr/bin/env bash
# Installs the Debian bookworm packages fsdp builds and tests against, then checks that
# their versions are the ones the build was made for. Idempotent; silent when everything
# is already present. Needs root (or sudo) only when something must be installed.
set -euo pipefail

# package=upstream version the build was made for (Debian revisions may differ).
readonly REQUIRED=(
  bazel-bootstrap=4.2.3
  bazel-rules-java=4.0.0
  libtorch-dev=1.13.1
  libabsl-dev=20220623.1
  libgtest-dev=1.12.1
  libgmock-dev=1.12.1
  libbenchmark-dev=1.7.1
  libgloo-dev=0.0~git20220518.5b14351
  zlib1g-dev=1.2.13.dfsg
  python3-torch=1.13.1
  python3-torchvision=0.14.1
  fortunes=1.99.1
  dataset-fashion-mnist=0.0~git20200523.55506a9
  gnuplot-nox=5.4.4
  clang=14.0
  libclang-rt-14-dev=14.0.6
  iproute2=6.1.0
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
exit "$status"
