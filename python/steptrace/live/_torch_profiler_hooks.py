"""torch.profiler (Kineto) and steptrace's kernel activity share CUPTI's process-wide
activity buffers: while a torch profiler is prepared or recording, every open Profiler's
kernel activity yields (``set_external_profiler``), and resumes once the last one ends.
"""

from __future__ import annotations

from typing import Any

from steptrace.live._process_hooks import _live

_torch_profilers_active = 0
_torch_profiler_hooked = False
_unhooked_profiler_running = False  # one started before the hooks: its exit resumes us


def _set_external_profiler(active: bool) -> None:
    for prof in list(_live):
        if not prof.closed:
            prof._core.set_external_profiler(active)


def _hook_torch_profiler(torch: Any) -> None:
    """Wraps torch.autograd.profiler.profile (behind torch.profiler.profile too) so that
    steptrace yields before Kineto sets up CUPTI and resumes after it has torn down."""
    global _torch_profiler_hooked
    if _torch_profiler_hooked:
        return
    profile = getattr(getattr(torch, "autograd", None), "profiler", None)
    profile = getattr(profile, "profile", None)
    prepare = getattr(profile, "_prepare_trace", None)
    exit_ = getattr(profile, "__exit__", None)
    if prepare is None or exit_ is None:  # another torch layout: no coexistence hooks
        return

    def _prepare_trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _torch_profilers_active
        if not getattr(self, "_steptrace_yielded", False):
            self._steptrace_yielded = True
            _torch_profilers_active += 1
            if _torch_profilers_active == 1:
                _set_external_profiler(True)
        return prepare(self, *args, **kwargs)

    def __exit__(self: Any, *args: Any) -> Any:
        global _torch_profilers_active, _unhooked_profiler_running
        try:
            return exit_(self, *args)
        finally:
            ours = getattr(self, "_steptrace_yielded", False)
            if ours:
                self._steptrace_yielded = False
                _torch_profilers_active -= 1
            if (ours or _unhooked_profiler_running) and _torch_profilers_active == 0:
                _unhooked_profiler_running = False
                _set_external_profiler(False)

    profile._prepare_trace = _prepare_trace
    profile.__exit__ = __exit__
    _torch_profiler_hooked = True


def _torch_profiler_running(torch: Any) -> bool:
    """Hooks torch's profiler, and says whether one is running (one started before the
    hooks were installed is seen by torch's own flag, and resumes us when it exits)."""
    global _unhooked_profiler_running
    if torch is None:
        return False
    _hook_torch_profiler(torch)
    if _torch_profilers_active > 0:
        return True
    flag = getattr(getattr(getattr(torch, "autograd", None), "profiler", None), "_is_profiler_enabled", False)
    _unhooked_profiler_running = _unhooked_profiler_running or flag is True
    return _unhooked_profiler_running
