"""Evidence behind an alert (issue 54): a torch.profiler capture of a few steps, diffed
against a baseline, written as an ``alert_update`` record whose ``details.evidence`` names
what changed (see docs/alerts.md, "Evidence").

Captures run on the training thread, at step boundaries: a torch.profiler started on
another thread records none of the training thread's ops (measured on torch 2.15: 0
events). The core calls the hook given to ``set_capture_hook`` after a step begins and
before it ends, only while ``arm_capture(True)``: between captures a step pays one relaxed
atomic load (csrc/python/scope_types.cpp), and nothing of torch.profiler is active. An
alert (on the alert thread) or :meth:`EvidenceCapture.request_capture` arms; the next
``evidence_steps`` steps are captured, with ``steptrace/step`` and ``steptrace/<phase>``
ranges (``prof.phase`` is wrapped during the capture only), and the profiler stops inside
the last captured step. Exporting the trace, summarizing and diffing
(:mod:`steptrace.analysis.trace_diff`) and writing the record happen on a worker thread.

Before the baseline is taken (at ``evidence_baseline_step``) the hook is armed and called
once per step begin; it disarms itself once the baseline is captured. Captured steps, and
the steps while the worker runs (it shares the GIL with them), are marked profiled
(``mark_step_profiled``): their records say so and the detectors do not judge them.

Bounds: ``capture_max`` captures on alerts or requests per run, at most one per
``capture_min_interval_s``; traces gzipped under ``<log_dir>/evidence/``, dropped (the
record says so) when over ``capture_max_bytes``; no capture while the program's own
torch.profiler is active (steptrace's CUPTI use yields to ours as to any other, see
:mod:`steptrace.live._torch_profiler_hooks`).
"""

from __future__ import annotations

import gzip
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from steptrace.analysis import trace_diff
from steptrace.errors import ConfigError

logger = logging.getLogger("steptrace")

#: Alert types whose next steps are captured.
CAPTURED_ALERTS = ("step_regression", "stall")


def check_evidence_options(options: dict) -> None:
    """ConfigError for an evidence option out of range (before any file is created)."""
    if not 1 <= options["evidence_steps"] <= 100:
        raise ConfigError(f"option evidence_steps={options['evidence_steps']!r} is out of range; allowed: 1..100")
    if options["evidence_baseline_step"] < -1:
        raise ConfigError(f"option evidence_baseline_step={options['evidence_baseline_step']!r} must be >= 0, "
                          "or -1 (auto: once the detectors' window is warm)")
    if not 0 <= options["capture_min_interval_s"] < 1e9:
        raise ConfigError(f"option capture_min_interval_s={options['capture_min_interval_s']!r} must be >= 0")
    if options["capture_max"] < 0:
        raise ConfigError(f"option capture_max={options['capture_max']!r} must be >= 0")
    if options["capture_max_bytes"] < 1024:
        raise ConfigError(f"option capture_max_bytes={options['capture_max_bytes']!r} must be >= 1024")


class _TracedPhase:
    """A phase scope that also opens a ``steptrace/<phase>`` range in the capture."""

    __slots__ = ("_scope", "_name", "_range")

    def __init__(self, scope: Any, name: str) -> None:
        self._scope, self._name, self._range = scope, name, None

    def __enter__(self) -> "_TracedPhase":
        self._scope.__enter__()
        from torch.autograd.profiler import record_function  # noqa: PLC0415 (only while capturing)

        self._range = record_function(trace_diff.PHASE_PREFIX + self._name)
        self._range.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        try:
            if self._range is not None:
                self._range.__exit__(*exc)
        finally:
            return self._scope.__exit__(*exc)


class EvidenceCapture:
    """Owned by a Profiler (``prof.evidence``) when ``evidence=True``. ``on_record`` is
    fed every alert record (alert thread); ``request_capture`` asks for one now (any
    thread); ``wait_idle`` waits for the capture in progress and its record; ``remove``
    (at close) disarms and waits for the worker."""

    def __init__(self, core: Any, owner: Any, options: dict, clock: Callable[[], float] = time.monotonic) -> None:
        self._core = core
        self._owner = owner  # the Python Profiler: its `phase` is wrapped during a capture
        self._steps = int(options["evidence_steps"])
        baseline_step = int(options["evidence_baseline_step"])
        if baseline_step < 0:  # once the detectors judge steps against a full window
            config = core.config
            baseline_step = int(config.warmup_steps) + int(config.window)
        self._baseline_step = baseline_step
        self._min_interval_s = float(options["capture_min_interval_s"])
        self._max = int(options["capture_max"])
        self._max_bytes = int(options["capture_max_bytes"])
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: Optional[dict] = None  # what the next capture is for (set when armed)
        self._profile: Any = None  # the torch.profiler.profile of the capture in progress
        self._step_range: Any = None
        self._done = 0  # steps captured so far in the capture in progress
        self._capture_steps = self._steps  # steps of the capture in progress (a request may ask for others)
        self._first_step = -1
        self._phase_fn: Any = None  # the owner's prof.phase while wrapped
        self._baseline: Optional[dict] = None  # {"summary", "steps", "trace"}
        self._baseline_wanted = True
        self._captures = 0  # on alerts and requests
        self._last_start = -float("inf")
        self._windows: list[tuple[int, int]] = []  # steps of our own captures (first, last)
        self._worker: Optional[threading.Thread] = None
        self._failed = False
        self._removed = False
        self.skipped: dict[str, int] = {}  # why captures were not taken, counted
        self.last_skipped = ""  # the latest reason (a request's refusal is answered with it)
        self.records: list[dict] = []  # evidence records written (newest last)
        core.set_capture_hook(self._hook)
        core.arm_capture(True)  # until the baseline: the hook waits for its step

    # ---- arming (any thread) ----
    def on_record(self, record: dict) -> None:
        """From the alert thread: an alert of a captured type arms a capture."""
        if record.get("kind") != "alert" or record.get("type") not in CAPTURED_ALERTS:
            return
        step = int(record.get("step", -1))
        if any(first <= step <= last + self._steps for first, last in self._windows):
            self._skip("own_capture")  # a capture's own steps: never evidence of themselves
            return
        self._arm({"purpose": "alert", "alert": record})

    def request_capture(self, reason: str = "request", steps: Optional[int] = None,
                        request_id: Optional[str] = None) -> bool:
        """Captures the next ``steps`` (default ``evidence_steps``, 1..100) steps within the
        bounds; False when refused (see ``skipped``, ``last_skipped``). ``request_id`` goes
        into the record (``details.evidence.request``: ``steptrace capture`` waits for it)."""
        if steps is not None and not 1 <= int(steps) <= 100:
            raise ValueError(f"steps={steps!r} is out of range; allowed: 1..100")
        return self._arm({"purpose": reason, "alert": None, "steps": steps, "request": request_id})

    def _skip(self, why: str) -> bool:
        self.skipped[why] = self.skipped.get(why, 0) + 1
        self.last_skipped = why
        return False

    def _arm(self, pending: dict) -> bool:
        with self._lock:
            if self._removed or self._failed:
                return self._skip("off")
            if self._pending is not None or self._profile is not None:
                return self._skip("busy")
            if self._captures >= self._max:
                return self._skip("capture_max")
            if self._clock() - self._last_start < self._min_interval_s:
                return self._skip("capture_min_interval_s")
            self._captures += 1
            self._last_start = self._clock()
            self._pending = pending
        self._core.arm_capture(True)
        return True

    # ---- the training thread ----
    def _hook(self, begun: bool) -> None:
        try:
            if begun:
                self._step_began()
            else:
                self._step_ending()
        except Exception as exc:  # noqa: BLE001 - never the training loop's problem
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        logger.warning("steptrace: evidence capture failed and is off for this run: %s: %s",
                       type(exc).__name__, exc)
        self._failed = True
        self._disarm_and_drop()

    def _disarm_and_drop(self) -> None:
        """No more captures armed; a capture in progress is stopped and its trace dropped."""
        self._core.arm_capture(False)
        self._restore_phase()
        prof, self._profile = self._profile, None
        if prof is not None:
            try:
                prof.stop()
            except Exception:  # noqa: BLE001 - the capture is dropped either way
                pass

    def _step_began(self) -> None:
        if self._profile is None:
            worker = self._worker
            if worker is not None and worker.is_alive():
                # the worker (export, summary) shares the GIL with this step: not judged either
                self._core.mark_step_profiled()
                return
            with self._lock:
                pending = self._pending
                if pending is None and self._baseline_wanted:
                    if self._core.step_index - 1 < self._baseline_step:
                        return  # before the baseline's step: one call per step until then
                    pending = self._pending = {"purpose": "baseline", "alert": None}
                if pending is None:
                    self._core.arm_capture(False)
                    return
            if not self._start():
                return
        self._core.mark_step_profiled()  # the detectors skip it (the profiler's start and stop)
        from torch.autograd.profiler import record_function  # noqa: PLC0415

        self._step_range = record_function(trace_diff.STEP_RANGE)
        self._step_range.__enter__()

    def _start(self) -> bool:
        torch = sys.modules.get("torch")
        if torch is None:
            return self._give_up("no_torch")
        # the program's own profiler is running (torch.autograd.profiler's flag, set by both APIs)
        if getattr(torch.autograd.profiler, "_is_profiler_enabled", False) is True:
            return self._give_up("torch_profiler_active")
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.start()
        self._profile = prof
        self._done = 0
        pending = self._pending or {}
        self._capture_steps = int(pending.get("steps") or self._steps)
        self._first_step = self._core.step_index - 1
        owner = self._owner
        phase = getattr(owner, "phase", None)
        if owner is not None and phase is not None:
            self._phase_fn = phase
            owner.phase = lambda name: _TracedPhase(phase(name), name)
        return True

    def _give_up(self, why: str) -> bool:
        """No capture this time (the pending one is dropped; a baseline is tried again at
        the next step)."""
        with self._lock:
            if self._pending is not None and self._pending["purpose"] != "baseline":
                self._pending = None
                self._core.arm_capture(self._baseline_wanted)
        self._skip(why)
        return False

    def _restore_phase(self) -> None:
        fn, self._phase_fn = self._phase_fn, None
        if fn is not None and self._owner is not None:
            self._owner.phase = fn

    def _step_ending(self) -> None:
        prof = self._profile
        if prof is None:
            return  # armed while this step ran: the capture begins with the next one
        rng, self._step_range = self._step_range, None
        if rng is not None:
            rng.__exit__(None, None, None)
        self._done += 1
        if self._done < self._capture_steps:
            return
        # the last captured step: stop here, so the stop is part of a captured step
        self._restore_phase()
        self._profile = None
        prof.stop()
        last = self._core.step_index - 1
        self._windows.append((self._first_step, last))
        del self._windows[:-16]
        with self._lock:
            pending, self._pending = self._pending, None
            if pending["purpose"] == "baseline":
                self._baseline_wanted = False
        # still armed: the steps while the worker runs are marked, then _step_began disarms
        worker = threading.Thread(target=self._finish, args=(prof, pending, self._first_step, last),
                                  name="steptrace-evidence", daemon=True)
        self._worker = worker
        worker.start()

    # ---- the worker ----
    def _trace_path(self, purpose: str, first: int) -> str:
        folder = os.path.join(os.path.dirname(self._core.log_path), "evidence")
        os.makedirs(folder, mode=0o750, exist_ok=True)
        if os.path.islink(folder):
            raise OSError(f"{folder} is a symbolic link: no trace is written through it")
        rank = int(self._core.config.rank)
        return os.path.join(folder, f"rank{rank}-step{first}-{purpose}.pt.trace.json.gz")

    def _write_trace(self, prof: Any, path: str) -> tuple[Optional[str], int, str]:
        """(path or None, bytes, why not) of the gzipped chrome trace, at most
        capture_max_bytes."""
        tmp = path[: -len(".gz")] + ".tmp"
        try:
            prof.export_chrome_trace(tmp)
            written = 0
            with open(tmp, "rb") as src, open(path, "wb") as raw:
                os.chmod(path, 0o640)
                with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as out:
                    while written <= self._max_bytes:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        out.write(chunk)
                        written = raw.tell()
                written = raw.tell()
            if written > self._max_bytes:
                os.unlink(path)
                return None, written, f"over capture_max_bytes ({self._max_bytes})"
            return path, written, ""
        except OSError as exc:
            return None, 0, f"{type(exc).__name__}: {exc}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _finish(self, prof: Any, pending: dict, first: int, last: int) -> None:
        try:
            summary = trace_diff.summarize_profile(prof, last - first + 1)
            path, size, why = self._write_trace(prof, self._trace_path(pending["purpose"], first))
            log_dir = os.path.dirname(self._core.log_path)
            rel = os.path.relpath(path, log_dir) if path else None
            if pending["purpose"] == "baseline":
                self._baseline = {"summary": summary, "steps": [first, last], "trace": rel}
                return
            self._write_record(pending, summary, first, last, rel, size, why)
        except Exception as exc:  # noqa: BLE001 - the training run goes on without it
            logger.warning("steptrace: evidence of steps %d-%d not written: %s: %s", first, last,
                           type(exc).__name__, exc)

    def _write_record(self, pending: dict, summary: dict, first: int, last: int, trace: Optional[str],
                      size: int, why: str) -> None:
        base = self._baseline
        evidence: dict = {"steps": [first, last], "trace": trace, "trace_bytes": size,
                          "baseline": None, "syncs": summary["syncs"][:10]}
        if why:
            evidence["trace_dropped"] = why
        if pending.get("request"):
            evidence["request"] = pending["request"]
        if base is not None:
            d = trace_diff.diff(base["summary"], summary)
            evidence["verdict"] = d.pop("verdict")
            evidence["baseline"] = {"steps": base["steps"], "trace": base["trace"]}
            evidence["diff"] = d
            phase = _top_phase(d)
        else:
            evidence["verdict"] = "no baseline yet: the capture's own top ops are in `ops`"
            evidence["ops"] = summary["ops"][:10]
            phase = None
        alert = pending["alert"]
        record = {
            "kind": "alert_update",
            "type": alert["type"] if alert else "capture",
            "step": last,
            "alert_step": int(alert["step"]) if alert else first,
            "phase": phase,
            "message": f"evidence: {evidence['verdict']}",
            "details": {"evidence": evidence},
        }
        if not self._core.closed:
            self._core.write_record(record)
        self.records.append(record)

    # ---- waiting and the end ----
    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Waits for the worker of the last capture (its record written); False on timeout."""
        worker = self._worker
        if worker is None:
            return True
        worker.join(timeout)
        return not worker.is_alive()

    @property
    def baseline(self) -> Optional[dict]:
        return self._baseline

    def remove(self, timeout: float = 30.0) -> None:
        """Disarms; a capture in progress is stopped and dropped; waits for the worker."""
        with self._lock:
            self._removed = True
            self._pending = None
        self._disarm_and_drop()  # disarmed before the hook goes
        self._core.set_capture_hook(None)
        self.wait_idle(timeout)


def _top_phase(d: dict) -> Optional[str]:
    rows = [*d.get("new", ()), *d.get("grew", ())]
    if not rows or not d.get("ops_changed"):
        return None
    return max(rows, key=lambda r: r.get("delta_ms", r.get("ms", 0.0)))["phase"]


def with_evidence(capture: EvidenceCapture, on_alert: Optional[Callable[[dict], Any]]) -> Callable[[dict], Any]:
    """The alert thread's callback: ``capture`` sees each record first (an alert arms it),
    then the program's ``on_alert``."""

    def deliver(record: dict) -> Any:
        try:
            capture.on_record(record)
        except Exception:  # noqa: BLE001 - the program's callback still gets the record
            logger.exception("steptrace: evidence capture could not take an alert")
        if on_alert is not None:
            return on_alert(record)
        return None

    return deliver
