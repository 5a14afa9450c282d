"""A process group that behaves, on the host, as NCCL's does (a Python c10d backend, one
rank): each collective's work takes ``work_s`` to complete, but

- its future is complete as soon as the work is enqueued: ProcessGroupNCCL's futures are
  "marked complete immediately upon construction" (PyTorch PR #48499; their callbacks are
  ordered on the CUDA streams, not on the host);
- ``Work.is_completed()`` says whether the work has finished, without blocking ("Checks if
  request has completed. Non-blocking operation.", torch.distributed's Work docs);
- ``Work.wait()`` does not block the host for device collectives ("In the case of CUDA
  collectives, will block the currently active CUDA stream until the operation is
  completed (but will not block the process)", same docs);
- the program's ``async_op`` reaches the backend (``opts.asyncOp``, torch >= 2.8), and
  ProcessGroupNCCL's collective() acts on it: "in asyncOp=false [default] mode, we use
  currentStream as ncclStream; otherwise, we use separate ncclStream and let it sync on
  currentStream" (syncStream: an event recorded on the current stream that NCCL's stream
  waits for; Work.wait() then makes the current stream wait for NCCL's), and it ends with
  ``return asyncOp ? work : nullptr``: a synchronous call has no Work, and returns once the
  collective is enqueued. ``launches`` logs each call as (op, "current" or "internal");
- ``is_completed()`` can hold the GIL: it is bound without releasing it
  (torch/csrc/distributed/c10d/init.cpp: ``.def("is_completed", &::c10d::Work::isCompleted)``)
  and its cudaEventQuery "can hang if another thread is holding the CUDA global context
  lock" (ProcessGroupNCCL.cpp, WorkNCCL::finishedGPUExecutionInternal). ``set_query_s(s)``
  makes the works launched from then on spend ``s`` in it, in a Python busy loop (shorter
  than the interpreter's 5 ms switch interval, it keeps the GIL throughout, as the C++ call
  does; time.sleep would release it);
- under a CUDA graph capture (``FakeCuda``, below) ``is_completed()`` is cudaEventQuery, a
  call CUDA forbids during a capture and that invalidates it.

One rank. The results come from a real one-rank gloo group (so a future's value is a
TensorList, as the C++ backends' are, which DDP takes from a comm hook as it is);
only the completion is NCCL's. ``init(work_s)`` registers the backend (once) and
initializes the default group with it.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

BACKEND = "steptrace_fake_nccl"
_work_s = [0.05]
_query_s = [0.0]
#: is_completed() calls, all works together
queries = [0]
#: (op, the stream it runs on: "current" or NCCL's "internal") per collective call, in order
launches: list[tuple[str, str]] = []


class NcclLikeWork(dist._Work):
    def __init__(self, done: dist._Work) -> None:
        super().__init__()
        self.done_at = time.monotonic() + _work_s[0]
        self.query_s = _query_s[0]
        self.queried_by: set[str] = set()  # names of the threads that asked is_completed()
        # launched while its thread captures: its end event is a node of the graph
        self.in_capture = cuda is not None and cuda.capturing_here()
        done.wait()
        self.future = done.get_future()  # complete at enqueue, as NCCL's

    def is_completed(self) -> bool:
        queries[0] += 1
        self.queried_by.add(threading.current_thread().name)
        if cuda is not None:
            cuda.event_query(self.in_capture, self.query_s)
        elif self.query_s:
            _hold_gil(self.query_s)
        return time.monotonic() >= self.done_at

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True  # the stream would wait; the host goes on

    def get_future(self) -> Future:
        return self.future


def _hold_gil(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class NcclLikeGroup(dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
        super().__init__(rank, world_size)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, timeout)

    def getBackendName(self) -> str:
        return BACKEND

    def _collective(self, op: str, opts: Any, work: dist._Work) -> Optional[NcclLikeWork]:
        if getattr(opts, "asyncOp", True):
            launches.append((op, "internal"))  # after syncStream's event record and wait
            return NcclLikeWork(work)
        launches.append((op, "current"))
        work.wait()  # (one gloo rank: the result, at once) the host goes on after the enqueue
        return None  # "return asyncOp ? work : nullptr"

    def allreduce(self, tensors, opts=None):  # type: ignore[no-untyped-def]
        return self._collective("allreduce", opts, self.gloo.allreduce(tensors))

    def broadcast(self, tensors, opts=None):  # type: ignore[no-untyped-def]
        return self._collective("broadcast", opts, self.gloo.broadcast(tensors))

    def allgather(self, output_lists, inputs, opts=None):  # type: ignore[no-untyped-def]
        return self._collective("allgather", opts, self.gloo.allgather(output_lists, inputs))

    def _allgather_base(self, output, tensor, opts=None):  # type: ignore[no-untyped-def]
        return self._collective("_allgather_base", opts, self.gloo._allgather_base(output, tensor))

    def barrier(self, opts=None):  # type: ignore[no-untyped-def]
        return self._collective("barrier", opts, self.gloo.barrier())


def _create(store, rank, world_size, timeout):  # type: ignore[no-untyped-def]
    return NcclLikeGroup(store, rank, world_size, timeout)


def init(work_s: float = 0.05) -> None:
    _work_s[0] = work_s
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)


def set_query_s(seconds: float) -> None:
    """Works launched from now on hold the GIL ``seconds`` in each is_completed()."""
    _query_s[0] = seconds


class CaptureViolation(RuntimeError):
    pass


class FakeCuda:
    """CUDA graph capture as CUDA and PyTorch document it, for a machine without a GPU.

    - ``torch.cuda.CUDAGraph.capture_begin(capture_error_mode=...)``: '"global" will error
      on actions in other threads, "thread_local" will only error for actions in the
      current thread, and "relaxed" will not error on these actions' (torch.cuda docs;
      cudaStreamCaptureMode: in the default global mode a thread "is prohibited from
      potentially unsafe API calls" while it captures or while any other thread has a
      capture begun in global mode). cudaEventQuery, which ``Work.is_completed()`` makes on
      NCCL, is such a call; a prohibited call fails and invalidates the capture, which
      capture_end then reports.
    - Even in relaxed mode "the thread is still prohibited from API calls which necessarily
      conflict with stream capture, for example, attempting cuEventQuery on an event that
      was last recorded inside a capture sequence" (cuThreadExchangeStreamCaptureMode): the
      Work of a collective launched during a capture may not be asked at all.
    - A global-mode capture must not begin while another thread's event query is under way
      (the query would then run inside it): PyTorch's capture_begin waits for the NCCL
      watchdog's ("a pre-condition of starting a capture is to check the event query count
      is 0", ProcessGroupNCCL's Note [cuda graph capture and workEnqueue]).

    ``install()`` makes torch.cuda report an initialized CUDA whose current stream captures
    while this thread is in a capture, and puts ``FakeCUDAGraph`` in place of
    torch.cuda.CUDAGraph. Every prohibited call is in ``violations``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()  # .mode: this thread's capture's, or None
        self.global_captures: dict[int, str] = {}  # graph id -> name of the capturing thread
        self.invalidated: set[int] = set()
        self.in_flight: dict[int, str] = {}  # the queries under way: number -> thread name
        self._keys = itertools.count()
        self.violations: list[str] = []
        self.violated = threading.Event()
        self.query_started = threading.Event()  # set as a query begins
        self.queries_in_capture = 0

    def install(self) -> "FakeCuda":
        global cuda
        cuda = self
        torch.cuda.is_initialized = lambda: True  # type: ignore[assignment]
        torch.cuda.is_current_stream_capturing = self.capturing_here  # type: ignore[assignment]
        torch.cuda.CUDAGraph = FakeCUDAGraph  # type: ignore[misc]
        return self

    def capturing_here(self) -> bool:
        return getattr(self._local, "mode", None) is not None

    def _violate(self, why: str, graphs: list[int]) -> None:
        with self._lock:
            self.violations.append(why)
            self.invalidated.update(graphs)
        self.violated.set()
        raise CaptureViolation(f"CUDA error: operation not permitted when stream is capturing ({why})")

    def event_query(self, recorded_in_capture: bool, hold_s: float = 0.0) -> None:
        me = threading.current_thread().name
        mine = getattr(self._local, "graph", None)
        if recorded_in_capture:
            self._violate(f"{me}: query of an event recorded inside a capture", [mine] if mine else [])
        if self.capturing_here() and self._local.mode != "relaxed":
            self._violate(f"{me}: unsafe call while its own stream captures", [mine])
        with self._lock:
            others = [g for g, who in self.global_captures.items() if who != me]
            key = next(self._keys)
            if not others:
                self.in_flight[key] = me
                self.query_started.set()
        if others:
            self.queries_in_capture += 1
            self._violate(f"{me}: unsafe call during a global-mode capture on another thread", others)
        try:
            if hold_s:
                _hold_gil(hold_s)
        finally:
            with self._lock:
                del self.in_flight[key]

    def begin(self, graph: "FakeCUDAGraph", mode: str) -> None:
        me = threading.current_thread().name
        with self._lock:  # a query still under way on another thread would run inside a global capture
            racing = [who for who in self.in_flight.values() if who != me] if mode == "global" else []
            if mode == "global":
                self.global_captures[id(graph)] = me
        self._local.mode, self._local.graph = mode, id(graph)
        if racing:
            with self._lock:
                self.violations.append(f"a capture began during an event query on {racing}")
                self.invalidated.add(id(graph))
            self.violated.set()

    def end(self, graph: "FakeCUDAGraph") -> None:
        self._local.mode = self._local.graph = None
        with self._lock:
            self.global_captures.pop(id(graph), None)
            bad = id(graph) in self.invalidated
        if bad:
            raise CaptureViolation("CUDA error: operation failed due to a previous error during capture")


cuda: Optional[FakeCuda] = None


class FakeCUDAGraph:
    """torch.cuda.CUDAGraph's capture_begin / capture_end, on FakeCuda."""

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        assert cuda is not None
        cuda.begin(self, capture_error_mode)

    def capture_end(self) -> None:
        assert cuda is not None
        cuda.end(self)


class graph:  # noqa: N801 - as torch.cuda.graph
    """``with graph(g, capture_error_mode=...)``: as torch.cuda.graph, ``g.capture_begin``
    on entry and ``g.capture_end`` on exit."""

    def __init__(self, cuda_graph: Any, capture_error_mode: str = "global") -> None:
        self.cuda_graph = cuda_graph
        self.mode = capture_error_mode

    def __enter__(self) -> None:
        self.cuda_graph.capture_begin(capture_error_mode=self.mode)

    def __exit__(self, *exc: Any) -> None:
        self.cuda_graph.capture_end()


# The parent side of the tests that run each case in a fresh interpreter (a default process
# group is per process): test_comm_timing.py and test_comm_hazards.py.
CASE_PRELUDE = """
import json, statistics, sys, threading, time
import torch, torch.distributed as dist
from torch import nn
sys.path.insert(0, {here!r})
from support import fake_nccl
import steptrace
torch.set_num_threads(1)
fake_nccl.init(0.05)
def comm_of(prof):
    return [r.get("comm") for r in steptrace.read(prof.log_path) if r["kind"] == "step"]
def compute(s):
    time.sleep(s)  # stands for the device's compute while the collective runs
"""


def run_case(tmp_path: Any, body: str, timeout_s: float = 300) -> dict:
    """Runs CASE_PRELUDE + ``body`` in a child interpreter (cwd ``tmp_path``); the JSON object
    its last line prints."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/python
    code = CASE_PRELUDE.format(here=here) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
