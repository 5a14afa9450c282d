"""Process-wide hooks every open Profiler shares: the set of live profilers, SIGTERM
(a Python-level handler and the core's C-level one under it), a forked child (its copies
of the parent's profilers are abandoned) and interpreter exit (the profilers nobody
closed end with the reason the process ends)."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any, Optional

from steptrace import _core

if TYPE_CHECKING:
    from steptrace.live.profiler import Profiler

logger = logging.getLogger("steptrace")

_live: "weakref.WeakSet[Profiler]" = weakref.WeakSet()
_previous_sigterm: Any = None
_sigterm_installed = False


def _on_sigterm(signum: int, frame: Any) -> None:
    previous = _previous_sigterm
    if callable(previous):
        # The program handles SIGTERM itself (e.g. checkpoint, then exit): get the records
        # out now and let the eventual close say the run ended by a signal.
        for prof in list(_live):
            prof._signalled = True
            prof.flush()
        previous(signum, frame)
        return
    for prof in list(_live):
        prof.close(reason="signal")
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of SIGTERM as the process would have without us


def _install_sigterm_handler(grace_s: float) -> None:
    """The Python-level handler (runs between bytecodes, lossless: it ends the open step
    and drains the device), and under it a C-level one whose watcher thread acts even while
    the main thread is blocked in native code: it flushes at once and, when SIGTERM would
    otherwise have its default action, gives the Python handler ``grace_s`` before it
    writes run_end itself (no device call) and re-raises SIGTERM."""
    global _previous_sigterm, _sigterm_installed
    if threading.current_thread() is not threading.main_thread():
        return
    if not _sigterm_installed:
        _previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
        _sigterm_installed = True
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # else the program took SIGTERM over since
        terminate = _previous_sigterm in (signal.SIG_DFL, None)
        if not _core.install_sigterm_handler(terminate, float(grace_s)):
            logger.warning("steptrace could not install its C-level SIGTERM handler; SIGTERM is "
                           "handled between Python bytecodes only")


def _after_fork_in_child() -> None:
    """A forked child (os.fork, multiprocessing's fork start method) inherits the parent's
    profilers but none of their threads: abandon them (nothing written, close a no-op,
    steps not recorded), and give SIGTERM back the handling it had before steptrace."""
    global _previous_sigterm, _sigterm_installed
    for prof in list(_live):
        prof._abandon()
    _live.clear()
    if _sigterm_installed:
        try:
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                previous = _previous_sigterm
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        except (ValueError, TypeError, OSError):
            pass
        _sigterm_installed = False
        _previous_sigterm = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _exception_text(exc_type: type, exc: Optional[BaseException]) -> str:
    """``Type: message`` for run_end, whatever the exception holds: a message with a lone
    surrogate (``ValueError("\\udcff")``) cannot cross into C++ as UTF-8, and a ``__str__``
    may raise."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails still ends the run
        message = f"<{exc_type.__name__}: str() failed>"
    text = f"{exc_type.__name__}: {message}"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _exit_reason() -> tuple[str, str]:
    """Why the interpreter is ending, for the profilers nobody closed: an uncaught
    exception leaves ``sys.last_exc`` (3.12+) / ``sys.last_value`` set before atexit runs
    (a framework without an exception hook, such as the Hugging Face Trainer, then still
    ends its run with reason ``exception``)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if isinstance(exc, KeyboardInterrupt):
        return "signal", "KeyboardInterrupt"
    if isinstance(exc, BaseException) and not isinstance(exc, SystemExit):
        return "exception", _exception_text(type(exc), exc)
    return "exit", ""


@atexit.register
def _close_at_exit() -> None:
    if not _live:
        return
    reason, error = _exit_reason()
    for prof in list(_live):
        prof.close(reason=reason, error=error)
