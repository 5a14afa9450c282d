#!/usr/bin/env bash
# Device check for a machine with an NVIDIA GPU: one command, offline. Builds steptrace from
# this tree into a scratch folder with the interpreter in $PYTHON (no network, no apt, no
# Debian -dev packages: fmt and nlohmann/json come from third_party/), then runs each script
# below on the real device. Each prints a table of PASS / FAIL / SKIP (cannot run here: one
# GPU, no NVLink, counters not readable, ...) / INFO (a figure recorded, no verdict); the run
# exits non-zero when any check fails (or a script stops at its time limit). On a machine
# without a GPU every script says `SKIP  <script>  no GPU` and the run exits 0: the dry run
# that CI does (tests/python/test_gpu_check_offline.py).
#
#   bash tests/gpu/run.sh OUT_DIR        # results: OUT_DIR/summary.txt (the table),
#                                        # run.log, build.log, env.txt, logs/<script>/ (JSONL)
#   PYTHON=/opt/torch/.venv/bin/python3 bash tests/gpu/run.sh "$OUT"
#
#   check_cuda_timing.py   CUDA-event phase times against torch.cuda.Event pairs, the host
#                          running ahead, host cost per phase (INFO), per-step peak memory
#   check_streams.py       side-stream coverage joined / not joined, mem_get_info latency
#                          with 200 ms queued (INFO), DDP comm_ms against nccl_ms (1 rank)
#   check_graphs.py        whole-network CUDA graph capture (Profiler, step around and
#                          inside the capture; `steptrace run`), torch.compile
#                          reduce-overhead, a global-mode capture on another thread, steps on
#                          a fresh thread, in torch.cuda.device(i), a model on cuda:1
#   check_nvml_devices.py  NVML call latencies (INFO), NVLink per-link sum against the
#                          all-links total (INFO), CUDA_VISIBLE_DEVICES forms against the GPU
#   check_cupti.py         the CUPTI backends: counters, kernel activity, torch.profiler
#                          and Kineto coexistence, attribution across threads
#   check_nvml.py          NVML telemetry: power and energy against nvidia-smi, sampler cost
#   check_work.py          the datasheet peak found for this GPU, FLOPs of a bf16 MLP step
#                          against 6·N·B, mfu_pct against CUDA events around the same steps
#
# Environment:
#   PYTHON                    the interpreter holding torch (default python3); it must have
#                             pip, scikit-build-core, pybind11, cmake (and ninja) installed
#   STEPTRACE_GPU_SKIP_SETUP  1: no build; the steptrace that $PYTHON imports is checked
#   STEPTRACE_GPU_BUILD_CAP_S the build's time limit (default 150 s; the 2-core CI machine's
#                             dry run gives it more)
#   STEPTRACE_GPU_PREFIX      where the build and the installed package go (default: a new
#                             temporary folder; not inside OUT_DIR, which is kept small)
# Time: the build has BUILD_CAP_S; the scripts' caps below add up to the run's budget, so
# the whole run ends within about 8 minutes. Each script's deadline is passed down as
# STEPTRACE_GPU_DEADLINE so that its child processes get time limits that fit.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash tests/gpu/run.sh OUT_DIR   (the folder the table and the logs are written to)" >&2
  exit 2
fi
OUT=$1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" >/dev/null; then
  echo "PYTHON=$PYTHON: not found (give the interpreter that holds torch)" >&2
  exit 2
fi
BUILD_CAP_S=${STEPTRACE_GPU_BUILD_CAP_S:-150}  # sized for the GPU machine (16 cores)
# script:cap in seconds; the caps add up to the budget
SCRIPTS=(check_cuda_timing.py:25 check_streams.py:35 check_graphs.py:65 check_nvml_devices.py:25
         check_cupti.py:85 check_nvml.py:40 check_work.py:25)
BUDGET=0
for entry in "${SCRIPTS[@]}"; do BUDGET=$((BUDGET + ${entry##*:})); done

exec > >(tee "$OUT/run.log") 2>&1
run_start=$(date +%s)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
  "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 || true
  echo "cpus: $(nproc)"
} | tee "$OUT/env.txt"

if [ "${STEPTRACE_GPU_SKIP_SETUP:-0}" != 1 ]; then
  PREFIX=${STEPTRACE_GPU_PREFIX:-$(mktemp -d -t steptrace-gpu-XXXXXX)}
  echo
  echo "== build: $PYTHON -m pip install --no-index --no-build-isolation into $PREFIX/site (at most ${BUILD_CAP_S} s) =="
  status=0
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout --kill-after=5 "$BUILD_CAP_S" \
    "$PYTHON" -m pip install -v --no-index --no-build-isolation --no-deps --disable-pip-version-check \
    --target "$PREFIX/site" --upgrade \
    --config-settings=build-dir="$PREFIX/build" \
    --config-settings=cmake.define.STEPTRACE_TEST_HOOKS=ON \
    --config-settings=cmake.define.CMAKE_DISABLE_FIND_PACKAGE_fmt=TRUE \
    --config-settings=cmake.define.CMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=TRUE \
    . >"$OUT/build.log" 2>&1 || status=$?
  if [ "$status" != 0 ]; then
    tail -n 30 "$OUT/build.log"
    echo "FAIL  build  exit $status after $(( $(date +%s) - run_start )) s (build.log)" | tee "$OUT/summary.txt"
    exit 1
  fi
  grep -E -- "-- steptrace: " "$OUT/build.log" | sed 's/^ *-- /  /' || true
  export PYTHONPATH="$PREFIX/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$PREFIX/site/bin:$PATH"
  echo "built in $(( $(date +%s) - run_start )) s"
fi
"$PYTHON" -c 'import steptrace; print("steptrace", steptrace.__version__, "from", steptrace.__file__)'

start=$(date +%s)
end=$((start + BUDGET))
rc=0
for entry in "${SCRIPTS[@]}"; do
  script=${entry%%:*}
  cap=${entry##*:}
  now=$(date +%s)
  left=$((end - now))
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  echo
  echo "== $script (at most ${cap} s; $((now - start)) s into the checks) =="
  if [ "$cap" -lt 10 ]; then
    echo "FAIL  $script  not run: the checks' ${BUDGET} s budget is spent"
    rc=1
    continue
  fi
  status=0
  STEPTRACE_GPU_LOGS="$OUT/logs/${script%.py}" STEPTRACE_GPU_DEADLINE=$((now + cap - 2)) \
    timeout --kill-after=5 "$cap" "$PYTHON" "tests/gpu/$script" || status=$?
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "FAIL  $script  stopped at its ${cap} s limit (the lines above are what it had checked)"
  fi
  [ "$status" = 0 ] || rc=1
done
echo
# the logs stay small enough to copy back: a file over 4 MB (a trace) is dropped, and said
find "$OUT/logs" -type f -size +4M -print -delete 2>/dev/null | sed 's/^/dropped (over 4 MB): /' || true
# the table: every script's rows, in run order
grep -E '^(PASS|FAIL|SKIP|INFO)  ' "$OUT/run.log" >"$OUT/summary.txt" || true
echo "device check: $(( $(date +%s) - run_start )) s in all, $(( $(date +%s) - start )) s of checks, exit $rc" \
  | tee -a "$OUT/summary.txt"
exit $rc
