#!/usr/bin/env bash
# Checks the release wheel in dist/ (scripts/build_wheel.sh) the way a user installs it:
#   1. `auditwheel show`: a manylinux tag, and the one in the wheel's file name;
#      no library grafted into the wheel (steptrace.libs/);
#   2. a fresh virtual environment (python -m venv, no --system-site-packages), outside
#      the clone: it sees neither the build tree nor the development venv, and so no torch;
#      `pip install dist/steptrace-*.whl` into it (the wheel's declared dependencies come
#      from PyPI or pip's cache);
#   3. `ldd` on the installed extension: every library it needs, directly or not, must be
#      one of glibc's, libstdc++ or libgcc_s (the manylinux set), and found;
#   4. from outside the clone, with that environment's Python: a short profiled training
#      loop without torch (scripts/wheel_smoke.py: steptrace never imports torch itself),
#      one scrape of its Prometheus endpoint, then `steptrace summary` and
#      `steptrace --version` from that environment's `steptrace` command.
# Exits non-zero at the first failure.
#   STEPTRACE_VENV  the development venv; only its base interpreter is used, to make the
#                   fresh environment with the Python version the wheel was built for
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STEPTRACE_VENV:-$HOME/.cache/steptrace/venv}
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"

log() { echo "[check-wheel] $*"; }
die() { echo "[check-wheel] FAIL: $*" >&2; exit 1; }

version=$(sed -n 's/^project(steptrace VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
[ -n "$version" ] || die "no project(steptrace VERSION ...) in CMakeLists.txt"
wheel=$(ls dist/steptrace-"$version"-*.whl 2>/dev/null || true)
[ -n "$wheel" ] && [ "$(echo "$wheel" | wc -l)" = 1 ] || die "want one dist/steptrace-$version-*.whl (run scripts/build_wheel.sh)"
wheel=$PWD/$wheel
[ -f "dist/steptrace-$version.tar.gz" ] || die "no sdist dist/steptrace-$version.tar.gz"

# ---- 1. auditwheel ----
log "auditwheel show $(basename "$wheel")"
show=$("$PY" -m auditwheel show "$wheel" 2>&1) || { echo "$show"; die "auditwheel show failed"; }
echo "$show"
tag=$(basename "$wheel" .whl | awk -F- '{print $NF}')
case "$tag" in manylinux_*) ;; *) die "platform tag $tag is not manylinux" ;; esac
echo "$show" | grep -q "\"$tag\"" || die "auditwheel show does not confirm the tag $tag"
if "$PY" -m zipfile -l "$wheel" | grep -q "steptrace.libs/"; then
  die "auditwheel grafted shared libraries into the wheel: the extension needs more than the manylinux set"
fi

# ---- 2. a fresh virtual environment ----
tmp=$(mktemp -d -t steptrace-wheel.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
base=$("$PY" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
log "fresh virtual environment $tmp/venv (from $base)"
"$base" -m venv "$tmp/venv"
fresh="$tmp/venv/bin/python"
(cd "$tmp" && env -u PYTHONPATH PYTHONNOUSERSITE=1 "$fresh" -m pip install -q --disable-pip-version-check "$wheel")

# ---- 3. ldd on the installed extension ----
ext=$(cd "$tmp" && env -u PYTHONPATH PYTHONNOUSERSITE=1 "$fresh" -c \
  'import importlib.util as u; print(u.find_spec("steptrace._core").origin)')
case "$ext" in "$tmp"/venv/*) ;; *) die "steptrace._core resolves to $ext, outside the fresh environment" ;; esac
log "ldd $(basename "$ext")"
ldd_out=$(ldd "$ext")
echo "$ldd_out"
bad=$(echo "$ldd_out" | awk '{print $1}' | grep -v -E '^(linux-vdso\.so\.1|/lib64/ld-linux-x86-64\.so\.2|ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libpthread\.so\.0|libdl\.so\.2|librt\.so\.1)$' || true)
[ -z "$bad" ] || die "the extension needs libraries outside glibc/libstdc++/libgcc: $(echo $bad)"
! echo "$ldd_out" | grep -q "not found" || die "ldd: a library is not found"

# ---- 4. a profiled loop, its summary and the version, from outside the clone ----
cp scripts/wheel_smoke.py "$tmp/"
log "profiled loop (no torch) in the fresh environment"
(cd "$tmp" && env -u PYTHONPATH PYTHONNOUSERSITE=1 "$fresh" wheel_smoke.py "$tmp/run" "$version")
log "steptrace summary"
(cd "$tmp" && env -u PYTHONPATH PYTHONNOUSERSITE=1 "$tmp/venv/bin/steptrace" summary "$tmp/run")
got=$(cd "$tmp" && env -u PYTHONPATH PYTHONNOUSERSITE=1 "$tmp/venv/bin/steptrace" --version)
[ "$got" = "steptrace $version" ] || die "steptrace --version says '$got', CMakeLists.txt $version"
log "ok: $(basename "$wheel") ($tag) installs with pip alone and profiles a loop"
