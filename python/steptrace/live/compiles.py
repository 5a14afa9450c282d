"""Compiling inside a step: ``torch.compile`` builds a graph for each new input shape (the
short last batch of an epoch, a new sequence length) and may compile the backward lazily,
in the step that meets it. That takes seconds to minutes, in the training thread, once: a
step 1,000x its neighbours that is neither slow work nor a hang. Its time is the step's
``compile_ms`` (``core.begin_compile`` / ``end_compile``), which the slow-step, stall and
hang rules leave out (docs/alerts.md).

The compiles are found through dynamo's compile callbacks (``torch._dynamo.callback``:
the outermost compile's start and end, on the thread that compiles). steptrace never
imports dynamo itself (about a second): the callbacks are registered at once where it is
loaded (``torch.compile`` was called, or an optimizer stepped), else by the profiler's
alert thread once it sees it loaded (:meth:`CompileWatch.install_if_loaded`)."""

from __future__ import annotations

import threading
from typing import Any

from steptrace.live._torch_compat import dynamo_callback_handler


class CompileWatch:
    """Times the compiles of the thread that makes it into ``core`` (a
    ``steptrace._core.Profiler``) as the step's ``compile_ms``, until :meth:`remove`."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._thread = threading.get_ident()
        self._handler: Any = None
        self._lock = threading.Lock()  # the training thread installs, the alert thread may too
        self.install_if_loaded()

    def install_if_loaded(self) -> bool:
        """Registers the callbacks where dynamo's callback module is loaded (never imports
        it); True once they are. Any thread."""
        if self._handler is not None:
            return True
        handler = dynamo_callback_handler()  # None while its import is still running
        if handler is None:
            return False
        with self._lock:
            if self._handler is None:
                handler.register_start_callback(self._start)
                handler.register_end_callback(self._end)
                self._handler = handler
        return True

    def remove(self) -> None:
        """Unregisters the callbacks. Idempotent."""
        with self._lock:
            handler, self._handler = self._handler, None
        if handler is not None:
            for remove, callback in ((handler.remove_start_callback, self._start),
                                     (handler.remove_end_callback, self._end)):
                try:
                    remove(callback)
                except ValueError:  # cleared by someone else (callback_handler.clear())
                    pass

    def _start(self, args: Any) -> None:
        if threading.get_ident() == self._thread and not self._core.closed:
            self._core.begin_compile()

    def _end(self, args: Any) -> None:
        if threading.get_ident() == self._thread and not self._core.closed:
            self._core.end_compile()
