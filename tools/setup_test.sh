#!/usr/bin/env bash
# tools/setup.sh and the torch prefix: it deletes and remakes only a prefix it made itself
# (.fsdp-setup or .fsdp-lock in it), installs into a missing or empty folder, uses a
# user's environment that has the pinned versions as it is, and refuses any other
# non-empty folder with one line, leaving it untouched. Before, setup ran `rm -rf` on any
# FSDP_TORCH_PREFIX without its lock marker. Hermetic: dpkg-query, python3.11, the venv's
# pip and python3 are stand-ins; nothing is downloaded.
#   setup_test.sh PATH/TO/tools/setup.sh
set -uo pipefail
setup=${1:?usage: setup_test.sh SETUP_SH}
setup=$(cd "$(dirname "$setup")" && pwd)/$(basename "$setup")
lock_sum=$(sha256sum "$(dirname "$setup")/requirements.lock" | cut -d' ' -f1)
root=${TEST_TMPDIR:-$(mktemp -d)}/setup_test
rm -rf "$root"
mkdir -p "$root/shims"
log=$root/calls.log
passed=0
failed=0
check() {  # check NAME CONDITION
  if eval "$2"; then echo "ok $1"; passed=$((passed + 1)); else echo "FAIL $1"; failed=$((failed + 1)); fi
}

# Every Debian package installed at the version setup.sh wants.
cat >"$root/shims/dpkg-query" <<EOF
#!/bin/sh
pkg=\$(eval echo "\\\${\$#}")
version=\$(sed -nE "s/^  \$pkg=([^ ]+)\$/\\1/p" "$setup")
[ -n "\$version" ] && printf 'ii  %s' "\$version"
EOF
# Not to be called: the packages are "installed".
for tool in apt-get sudo; do
  printf '#!/bin/sh\necho "%s $*" >>%s\nexit 1\n' "$tool" "$log" >"$root/shims/$tool"
done
# A python3 that reports the pinned torch and torchvision versions, and for the NVIDIA
# packages those of the CUDA 13.0 / NCCL 2.28.9 headers in /usr/local/cuda (setup checks
# the headers against them).
pinned_python='#!/bin/sh
case "$*" in *nvidia*) echo "13.0.96 2.28.9" ;; *) echo "2.11.0 0.26.0" ;; esac'
# CPython 3.11 whose venv has a pip that logs its arguments and the python3 above.
cat >"$root/shims/python3.11" <<EOF
#!/bin/sh
if [ "\$1" = -c ]; then echo True; exit 0; fi
[ "\$1 \$2" = "-m venv" ] || exit 9
mkdir -p "\$3/bin"
printf '#!/bin/sh\\necho "pip \$*" >>$log\\n' >"\$3/bin/pip"
cat >"\$3/bin/python3" <<'PY'
$pinned_python
PY
chmod +x "\$3/bin/pip" "\$3/bin/python3"
EOF
chmod +x "$root/shims"/*

run_setup() {  # run_setup PREFIX: sets out (stdout and stderr) and status
  : >"$log"
  out=$(env -i HOME="$root/home" PATH="$root/shims:/usr/bin:/bin" FSDP_TORCH_PREFIX="$1" \
    bash "$setup" 2>&1)
  status=$?
}
listing() { (cd "$1" && find . -printf '%p %s %m\n' | sort && cat ./* 2>/dev/null | md5sum); }
installing="setup: installing torch==2.11.0 and torchvision==0.26.0 into"
refusal() {
  echo "setup: FSDP_TORCH_PREFIX=$1 is not empty, was not made by tools/setup.sh (no" \
       ".fsdp-setup in it) and has no torch==2.11.0 with torchvision==0.26.0, so setup" \
       "leaves it alone; point FSDP_TORCH_PREFIX at a new or empty folder (setup installs" \
       "there) or at a Python environment that has those versions"
}
installed() {  # installed PREFIX: the stand-in install, from this lock, ran once
  [[ "$(cat "$1/.fsdp-lock")" == "$lock_sum" && -f "$1/.fsdp-setup" &&
     "$(grep -c '^pip install .*--require-hashes' "$log")" -eq 1 ]]
}

# 1. A user's folder that is not a torch environment: refused, untouched.
prefix=$root/my_project
mkdir -p "$prefix/src"
echo "precious" >"$prefix/notes.txt"
echo "int main() {}" >"$prefix/src/main.cc"
before=$(listing "$prefix")
run_setup "$prefix"
check "a user's non-empty folder is refused with one line (status $status): $out" \
  "[[ $status -eq 1 && \"\$out\" == \"\$(refusal $prefix)\" ]]"
check "a user's non-empty folder is left as it was" \
  "[[ \"\$(listing $prefix)\" == \"\$before\" && ! -s $log ]]"

# 2. A user's Python environment with other versions: refused, untouched.
prefix=$root/other_torch
mkdir -p "$prefix/bin"
printf '#!/bin/sh\necho "2.10.0 0.25.0"\n' >"$prefix/bin/python3"
chmod +x "$prefix/bin/python3"
before=$(listing "$prefix")
run_setup "$prefix"
check "a user's environment with torch 2.10 is refused (status $status): $out" \
  "[[ $status -eq 1 && \"\$out\" == \"\$(refusal $prefix)\" ]]"
check "a user's environment with torch 2.10 is left as it was" \
  "[[ \"\$(listing $prefix)\" == \"\$before\" && ! -s $log ]]"

# 3. A user's Python environment with the pinned versions: used as it is, quietly.
prefix=$root/my_torch
mkdir -p "$prefix/bin"
echo "$pinned_python" >"$prefix/bin/python3"
chmod +x "$prefix/bin/python3"
before=$(listing "$prefix")
run_setup "$prefix"
check "a user's environment with the pinned versions is used quietly (status $status): $out" \
  "[[ $status -eq 0 && -z \"\$out\" ]]"
check "a user's environment with the pinned versions is left as it was" \
  "[[ \"\$(listing $prefix)\" == \"\$before\" && ! -s $log ]]"

# 4. No folder yet: installed, with one line; a second run is quiet and installs nothing.
prefix=$root/new/torch
run_setup "$prefix"
check "a missing prefix is installed into (status $status): $out" \
  "[[ $status -eq 0 && \"\$out\" == \"$installing $prefix\" ]] && installed $prefix"
run_setup "$prefix"
check "setup is idempotent and quiet (status $status): $out" \
  "[[ $status -eq 0 && -z \"\$out\" && ! -s $log ]]"

# 5. An empty folder (e.g. made for the purpose): installed into.
prefix=$root/empty
mkdir -p "$prefix"
run_setup "$prefix"
check "an empty folder is installed into (status $status): $out" \
  "[[ $status -eq 0 && \"\$out\" == \"$installing $prefix\" ]] && installed $prefix"

# 6. Setup's own prefix from an older lock (an older setup wrote only .fsdp-lock), and an
#    interrupted install (.fsdp-setup only): deleted and remade.
for case in old_lock interrupted; do
  prefix=$root/$case
  mkdir -p "$prefix/lib"
  echo "stale" >"$prefix/lib/stale.py"
  if [[ $case == old_lock ]]; then echo 0123 >"$prefix/.fsdp-lock"; else touch "$prefix/.fsdp-setup"; fi
  run_setup "$prefix"
  check "setup's own prefix ($case) is remade (status $status): $out" \
    "[[ $status -eq 0 && \"\$out\" == \"$installing $prefix\" && ! -e $prefix/lib/stale.py ]] &&
     installed $prefix"
done

# 7. Setup's own complete prefix from an older lock that holds the pinned torch (a lock that
#    gained packages): updated in place by pip, not deleted.
prefix=$root/older_lock
mkdir -p "$prefix/bin" "$prefix/lib"
echo "$pinned_python" >"$prefix/bin/python3"
printf '#!/bin/sh\necho "pip $*" >>%s\n' "$log" >"$prefix/bin/pip"
chmod +x "$prefix/bin/python3" "$prefix/bin/pip"
echo "kept" >"$prefix/lib/kept.py"
echo 0123 >"$prefix/.fsdp-lock"
run_setup "$prefix"
check "setup's own prefix with the pinned torch is updated in place (status $status): $out" \
  "[[ $status -eq 0 && \"\$out\" == \"setup: updating $prefix to tools/requirements.lock\" &&
     -e $prefix/lib/kept.py ]] && installed $prefix"

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
