#!/usr/bin/env bash
# Device check for a machine with an NVIDIA GPU (one command, a few minutes on H100/H200):
# builds and installs steptrace, then checks CUDA-event timing, the CUPTI backends
# (counters, kernel activity, torch.profiler coexistence) and NVML telemetry (power and
# energy against nvidia-smi) on the real device and prints a table for each. Exits
# non-zero when a check fails.
#   bash tests/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
bash scripts/setup.sh
VENV=${STEPTRACE_VENV:-$HOME/.cache/steptrace/venv}
rc=0
"$VENV/bin/python" tests/gpu/check_cuda_timing.py "$@" || rc=1
"$VENV/bin/python" tests/gpu/check_cupti.py "$@" || rc=1
"$VENV/bin/python" tests/gpu/check_nvml.py "$@" || rc=1
exit $rc
