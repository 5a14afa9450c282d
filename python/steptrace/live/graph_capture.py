"""A step that wraps a CUDA graph capture is marked captured, on whichever stream the capture
runs (issue 49, point 6).

``torch.cuda.graph`` captures on a side stream of its own, a non-blocking one from the pool
("capture must not occur on the default stream"; torch/cuda/graphs.py), so a step begun on
the default stream does not see the capture there: CUDA's legacy-stream restriction applies
only to streams that synchronize with it, and events recorded on stream 0 succeed while the
pool stream captures. While a Profiler is open on the CUDA path, ``CUDAGraph.capture_begin``
(which ``torch.cuda.graph`` and ``make_graphed_callables`` call, on the capturing thread,
with the capture stream current) is wrapped: when it runs on the thread of the step in
progress, that step is given the capture stream (``set_stream``), and the core, which asks a
stream set during a step whether it captures (cudaStreamIsCapturing), times the step on the
host and marks it ``captured``. One call per capture; nothing per step or per phase.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional


class CaptureWatch:
    """Installed by a Profiler on the CUDA path; ``step_began()`` is called from its step
    begin hook (the step's thread), ``remove()`` at its close."""

    def __init__(self, core: Any, cuda: Any) -> None:
        self._core = core
        self._cuda = cuda
        self._step_thread: Optional[int] = None
        self._undo: Optional[Callable[[], None]] = None
        self._removed = False

    def step_began(self) -> None:
        self._step_thread = threading.get_ident()

    def install(self) -> "CaptureWatch":
        graph_class = getattr(self._cuda, "CUDAGraph", None)
        begin = getattr(graph_class, "capture_begin", None)
        if not isinstance(graph_class, type) or begin is None:
            return self
        watch = self

        @functools.wraps(begin)
        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            result = begin(graph, *args, **kwargs)
            watch._began()
            return result

        own = graph_class.__dict__.get("capture_begin")  # None: inherited
        setattr(graph_class, "capture_begin", capture_begin)

        def undo() -> None:
            if graph_class.__dict__.get("capture_begin") is not capture_begin:
                return  # patched again after us: that wrapper calls ours, which is now inert
            if own is None:
                delattr(graph_class, "capture_begin")
            else:
                setattr(graph_class, "capture_begin", own)

        self._undo = undo
        return self

    def _began(self) -> None:
        core = self._core
        if self._removed or self._step_thread != threading.get_ident() or core.closed or not core.in_step:
            return
        try:
            stream = self._cuda.current_stream()
            core.set_stream(stream.cuda_stream, stream.device_index)
        except Exception:  # noqa: BLE001 - the program's capture goes on whatever happens here
            pass

    def remove(self) -> None:
        self._removed = True
        if self._undo is not None:
            self._undo()
            self._undo = None
