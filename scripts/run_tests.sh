#!/usr/bin/env bash
# Installs everything, then runs every test: the C++ suite (GoogleTest via ctest, which
# also builds an outside find_package consumer and the LibTorch example), the same C++
# tests under ASan+UBSan and TSan (scripts/run_sanitizers.sh), the release wheel
# (scripts/build_wheel.sh, then scripts/check_wheel.sh installs it into a fresh venv and
# profiles a loop with it), and the Python suite (pytest). Fails when any of them fails
# or when pytest collects no test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${STEPTRACE_VENV:-$HOME/.cache/steptrace/venv}
PY="$VENV/bin/python"
TORCH_CMAKE=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
JOBS=$(nproc)

echo "[tests] C++: configure and build build/dev"
cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" \
  -DSTEPTRACE_BUILD_TESTS=ON -DSTEPTRACE_BUILD_EXAMPLES=ON -DSTEPTRACE_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build/dev -j "$JOBS"
echo "[tests] C++: ctest"
(cd build/dev && ctest --output-on-failure -j "$JOBS")
echo "[tests] C++: sanitizers (ASan+UBSan, TSan)"
bash scripts/run_sanitizers.sh

echo "[tests] release wheel: build it, check it, install it into a fresh venv and profile a loop"
bash scripts/build_wheel.sh
bash scripts/check_wheel.sh

echo "[tests] Python: pytest"
set +e
"$PY" -m pytest tests/python -q -p no:cacheprovider --durations=25  # the slowest, to keep CI short
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[tests] pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
