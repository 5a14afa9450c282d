#!/usr/bin/env bash
# Installs everything steptrace needs on a fresh Debian/Ubuntu machine and installs
# steptrace itself into a virtual environment; skips whatever is already there.
#   STEPTRACE_VENV  the virtual environment (default ~/.cache/steptrace/venv; torch is
#                   several GB, so it lives outside the clone and is installed once)
#   PYTHON          the interpreter the venv is made from (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.15.0
VENV=${STEPTRACE_VENV:-$HOME/.cache/steptrace/venv}
PYTHON=${PYTHON:-python3}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi

log() { echo "[setup] $*"; }

# ---- Debian packages ----
apt_packages=(g++ cmake ninja-build git libfmt-dev nlohmann-json3-dev libgtest-dev libgmock-dev
              libbenchmark-dev chromium prometheus prometheus-pushgateway pkg-config)
command -v "$PYTHON" >/dev/null || apt_packages+=(python3 python3-venv python3-dev)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
else
  log "Debian packages: all present"
fi

# ---- virtual environment ----
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  mkdir -p "$(dirname "$VENV")"
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PY="$VENV/bin/python"

# ---- torch (once per machine: a CUDA build of several GB, used on the CPU here) ----
if "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  log "torch $TORCH_VERSION: present"
else
  log "installing torch==$TORCH_VERSION (several GB, once per machine)"
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi

# ---- build and test dependencies ----
"$PY" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" numpy scikit-learn pytest \
  "jsonschema>=4" orjson "pandas>=1.5" "matplotlib>=3.6" "rich>=12" pyyaml
# the frameworks the integrations are tested with, and the OTLP exporter (optional for users)
"$PY" -m pip install -q lightning==2.6.6 transformers==5.25.0 accelerate==1.16.0 \
  opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2

# ---- steptrace itself (incremental: the build folder is kept under build/) ----
# The test build: STEPTRACE_TEST_HOOKS=ON adds steptrace._testing (the fake device backends
# the Python tests use). A plain `pip install .` or a release wheel leaves it out.
log "building and installing steptrace (with the test hooks)"
"$PY" -m pip install -q --no-build-isolation --no-deps \
  --config-settings=cmake.define.STEPTRACE_TEST_HOOKS=ON .
log "done: $("$PY" -c 'import steptrace; print("steptrace", steptrace.__version__)') in $VENV"
