"""The callables the core runs around each step on the CUDA path (the stream to time, the
caching allocator's figures and the device's memory) and at phase boundaries (the live
bytes memory_growth attributes). They run on the training thread, once per step.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from steptrace.live._torch_compat import cuda_memory_stats

#: The most often a step hook calls torch.cuda.mem_get_info (seconds between calls).
_MEM_GET_INFO_INTERVAL_S = 1.0


def _cuda_step_hooks(torch: Any, memory: bool, device_index: int = -1,
                     device_memory_sampled: bool = False,
                     step_began: Callable[[], None] = lambda: None) -> tuple:
    """Callables the core runs around each step on the CUDA path: the stream to time as
    (handle, device) (None until CUDA is initialized: host clock), and the caching
    allocator's figures with the per-step peak, which it resets.

    The stream is the current stream of the rank's device: ``device_index`` when set,
    else ``$LOCAL_RANK`` when it names a device (a model on ``cuda:LOCAL_RANK`` without
    ``torch.cuda.set_device`` is timed on its own GPU, like the hardware figures), else
    the current device at each step's start. With ``device_memory_sampled`` (NVML reads
    device-wide memory on its sampler thread) the hook makes no mem_get_info call."""
    cuda = torch.cuda
    local_rank = os.environ.get("LOCAL_RANK", "")
    fixed: list = []  # [the rank's device or None], decided once CUDA is up

    def step_device() -> int:
        if not fixed:
            if device_index >= 0:
                fixed.append(device_index)
            elif local_rank.isdigit() and int(local_rank) < cuda.device_count():
                fixed.append(int(local_rank))
            else:
                fixed.append(None)
        return fixed[0] if fixed[0] is not None else cuda.current_device()

    def begin() -> Optional[tuple]:
        if not cuda.is_initialized():
            return None
        step_began()  # this thread's step: a capture it begins marks the step (graph_capture)
        d = step_device()
        return cuda.current_stream(d).cuda_stream, d

    memory_stats, reset_peak = cuda_memory_stats(torch)  # one dict, not four
    device_memory: dict = {}  # device -> (when mem_get_info was read, used, total)
    capturing = getattr(cuda, "is_current_stream_capturing", lambda: False)

    def end() -> Optional[tuple]:
        if not cuda.is_initialized():
            return None
        device = step_device()
        if memory_stats is not None and reset_peak is not None:
            stats = memory_stats(device)
            allocated = stats["allocated_bytes"]["all"]["current"]
            reserved = stats["reserved_bytes"]["all"]["current"]
            peak = stats["allocated_bytes"]["all"]["peak"]
            reset_peak(device)
        else:
            allocated, reserved = cuda.memory_allocated(device), cuda.memory_reserved(device)
            peak = cuda.max_memory_allocated(device)
            cuda.reset_peak_memory_stats(device)
        if device_memory_sampled or capturing():  # the core has NVML's; no driver call
            return allocated, reserved, peak, -1, -1  # inside a capture (it could invalidate it)
        # device-wide (NCCL and raw cudaMalloc too), at most once a second: some stacks
        # sync the host in mem_get_info; the steps between hold the last figure, and with
        # NVML the core takes the sampler thread's fresher one (docs/gpu.md)
        now = time.monotonic()
        last = device_memory.get(device)
        if last is None or now - last[0] >= _MEM_GET_INFO_INTERVAL_S:
            free, total = cuda.mem_get_info(device)
            last = device_memory[device] = (now, total - free, total)
        return allocated, reserved, peak, last[1], last[2]

    return begin, (end if memory else None)


def _cuda_live_bytes(torch: Any) -> Callable[[], Optional[int]]:
    """The allocator's live bytes now (None before CUDA is initialized): the level that
    memory_growth attributes to phases, read at phase boundaries for a few steps after
    the alert."""
    cuda = torch.cuda

    def live() -> Optional[int]:
        return cuda.memory_allocated() if cuda.is_initialized() else None

    return live
