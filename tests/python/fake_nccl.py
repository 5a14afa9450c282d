"""A process group that behaves, on the host, as NCCL's does (a Python c10d backend, one
rank): each collective's work takes ``work_s`` to complete, but

- its future is complete as soon as the work is enqueued: ProcessGroupNCCL's futures are
  "marked complete immediately upon construction" (PyTorch PR #48499; their callbacks are
  ordered on the CUDA streams, not on the host);
- ``Work.is_completed()`` says whether the work has finished, without blocking ("Checks if
  request has completed. Non-blocking operation.", torch.distributed's Work docs);
- ``Work.wait()`` does not block the host for device collectives ("In the case of CUDA
  collectives, will block the currently active CUDA stream until the operation is
  completed (but will not block the process)", same docs).

One rank. The results come from a real one-rank gloo group (so a future's value is a
TensorList, as the C++ backends' are, which DDP takes from a comm hook as it is);
only the completion is NCCL's. ``init(work_s)`` registers the backend (once) and
initializes the default group with it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
from torch.futures import Future

BACKEND = "steptrace_fake_nccl"
_work_s = [0.05]


class NcclLikeWork(dist._Work):
    def __init__(self, done: dist._Work) -> None:
        super().__init__()
        self.done_at = time.monotonic() + _work_s[0]
        done.wait()
        self.future = done.get_future()  # complete at enqueue, as NCCL's

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True  # the stream would wait; the host goes on

    def get_future(self) -> Future:
        return self.future


class NcclLikeGroup(dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
        super().__init__(rank, world_size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, timeout)

    def getBackendName(self) -> str:
        return BACKEND

    def allreduce(self, tensors, opts=None):  # type: ignore[no-untyped-def]
        return NcclLikeWork(self.gloo.allreduce(tensors))

    def broadcast(self, tensors, opts=None):  # type: ignore[no-untyped-def]
        return NcclLikeWork(self.gloo.broadcast(tensors))

    def allgather(self, output_lists, inputs, opts=None):  # type: ignore[no-untyped-def]
        return NcclLikeWork(self.gloo.allgather(output_lists, inputs))

    def _allgather_base(self, output, tensor, opts=None):  # type: ignore[no-untyped-def]
        return NcclLikeWork(self.gloo._allgather_base(output, tensor))

    def barrier(self, opts=None):  # type: ignore[no-untyped-def]
        return NcclLikeWork(self.gloo.barrier())


def _create(store, rank, world_size, timeout):  # type: ignore[no-untyped-def]
    return NcclLikeGroup(store, rank, world_size, timeout)


def init(work_s: float = 0.05) -> None:
    _work_s[0] = work_s
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
