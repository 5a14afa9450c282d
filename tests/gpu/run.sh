#!/usr/bin/env bash
# Device check for a machine with an NVIDIA GPU (one command; under 3 minutes on an H200
# after setup): builds and installs steptrace (scripts/setup.sh), then runs each script
# below on the real device. Each prints a table of PASS / FAIL / SKIP (cannot run here:
# one GPU, no NVLink, ...) / INFO (a figure recorded, no verdict); the run exits non-zero
# when any check fails (or a script stops at its time limit).
#   check_cuda_timing.py   CUDA-event phase times against torch.cuda.Event pairs, the host
#                          running ahead, host cost per phase (INFO), per-step peak memory
#   check_streams.py       side-stream coverage joined / not joined, mem_get_info latency
#                          with 200 ms queued (INFO), DDP comm_ms against nccl_ms (1 rank,
#                          no watch: timed to completion)
#   check_graphs.py        whole-network CUDA graph capture (Profiler, step around and
#                          inside the capture; `steptrace run`), torch.compile
#                          reduce-overhead, a global-mode capture on another thread beside
#                          steps with kernel activity and counters, steps on a fresh
#                          thread, in torch.cuda.device(i), a model on cuda:1
#   check_nvml_devices.py  NVML call latencies (INFO), NVLink per-link sum against the
#                          all-links total (INFO), CUDA_VISIBLE_DEVICES as a full UUID, an
#                          abbreviated UUID and an index against the telemetry's GPU
#   check_cupti.py         the CUPTI backends: counters, kernel activity, torch.profiler
#                          and Kineto coexistence, attribution across threads
#   check_nvml.py          NVML telemetry: power and energy against nvidia-smi, sampler cost
#   check_work.py          the datasheet peak found for this GPU, FLOPs of a bf16 MLP step
#                          against 6·N·B, mfu_pct against CUDA events around the same steps
# Time: the whole run has STEPTRACE_GPU_BUDGET_S (175) seconds after setup; each script
# has its own cap within it (the deadline is passed down as STEPTRACE_GPU_DEADLINE, so
# their child processes get time limits that fit) and is stopped at it.
#   bash tests/gpu/run.sh
#   STEPTRACE_GPU_SKIP_SETUP=1 bash tests/gpu/run.sh   # a rerun: steptrace already installed
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if [ "${STEPTRACE_GPU_SKIP_SETUP:-0}" != 1 ]; then bash scripts/setup.sh; fi
VENV=${STEPTRACE_VENV:-$HOME/.cache/steptrace/venv}
BUDGET=${STEPTRACE_GPU_BUDGET_S:-175}
start=$(date +%s)
end=$((start + BUDGET))
rc=0
# script, cap in seconds
for entry in check_cuda_timing.py:20 check_streams.py:30 check_graphs.py:60 check_nvml_devices.py:25 \
             check_cupti.py:75 check_nvml.py:40 check_work.py:20; do
  script=${entry%%:*}
  cap=${entry##*:}
  now=$(date +%s)
  left=$((end - now))
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  echo
  echo "== $script (at most ${cap} s; $((now - start)) s into the run) =="
  if [ "$cap" -lt 10 ]; then
    echo "FAIL  $script  not run: the run's ${BUDGET} s budget is spent"
    rc=1
    continue
  fi
  status=0
  STEPTRACE_GPU_DEADLINE=$((now + cap - 2)) timeout --kill-after=5 "$cap" \
    "$VENV/bin/python" "tests/gpu/$script" "$@" || status=$?
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    echo "FAIL  $script  stopped at its ${cap} s limit (the lines above are what it had checked)"
  fi
  [ "$status" = 0 ] || rc=1
done
echo
echo "device check: $(( $(date +%s) - start )) s after setup, exit $rc"
exit $rc
