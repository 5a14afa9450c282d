"""The Python profiler: a thin layer over the C++ core (``steptrace._core``).

``prof.step()`` and ``prof.phase(name)`` are bound C++ methods returning reusable scope
objects whose ``__enter__``/``__exit__`` run in C++, so the hot path has no contextlib
and no Python frames of ours. Everything else here (the loader wrapper, the alert thread,
close) runs once per run or once per batch. Its parts live beside it: the options in
:mod:`steptrace.live._config`, the CUDA step hooks in :mod:`steptrace.live._cuda_hooks`, SIGTERM,
fork and exit handling in :mod:`steptrace.live._process_hooks`, torch.profiler coexistence in
:mod:`steptrace.live._torch_profiler_hooks`.
"""

from __future__ import annotations

import gc
import logging
import operator
import os
import platform
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from steptrace import _core
# build_config and the option names are imported from here by replay, launcher and the
# integrations; the process-wide hooks register SIGTERM, fork and atexit handling on import
from steptrace.live._config import _CORE_OPTIONS, _PYTHON_OPTIONS, ALLOWED_OPTIONS, build_config  # noqa: F401
from steptrace.live._cuda_hooks import _cuda_live_bytes, _cuda_step_hooks
from steptrace.live._process_hooks import _exception_text, _install_sigterm_handler, _live
from steptrace.live._torch_profiler_hooks import _torch_profiler_running
from steptrace.live.graph_capture import CaptureWatch
from steptrace.cluster import ClusterExchange, wants_exchange
from steptrace.errors import ConfigError

T = TypeVar("T")

logger = logging.getLogger("steptrace")


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    torch = sys.modules.get("torch")  # never import torch ourselves: the user's loop did
    if torch is not None:
        versions["torch"] = str(getattr(torch, "__version__", "unknown"))
    return versions


def _warn_write_errors(core: Any, pending: list) -> None:
    """Once per run (``pending`` holds one item until then): the log cannot be written."""
    if not pending or not core.write_errors:
        return
    try:
        pending.pop()  # atomic: one thread wins
    except IndexError:
        return
    logger.warning("steptrace cannot write its log %s (%s); records are being lost, and run_end "
                   "counts the failed writes in write_errors", core.log_path, core.write_error)


# Hang stacks from faulthandler: it reads the thread states without the GIL, so it also
# answers while the hung thread holds the GIL in native code (where the alert thread,
# asked for _thread_stacks, never runs). Armed once per process: a real-time signal nobody
# handles, whose faulthandler handler the watchdog raises on its own thread, writing into
# an unlinked temporary file the watchdog reads back.
_stack_dump: Optional[tuple] = None  # (pid, signum, file) once armed


def _arm_stack_dump() -> None:
    global _stack_dump
    armed = _stack_dump
    kept = None  # the file of this process's dump, when its handler is to be installed again
    if armed is not None and armed[0] == os.getpid():
        # Armed, unless something put the signal back to its default since: Lightning's
        # Trainer does, for every signal, at the end of fit (it restores what
        # signal.getsignal saw, SIG_DFL for a handler faulthandler installed).
        if not _core.stack_dump_signal_reset():
            return
        kept = armed[2]
    try:
        import faulthandler
        import tempfile

        # A forked child keeps the parent's signal but needs a file of its own.
        signum = armed[1] if armed is not None else _core.spare_signal()
        if signum < 0:
            return
        if kept is not None:
            faulthandler.unregister(signum)  # it still counts the signal as registered
        f = kept if kept is not None else tempfile.TemporaryFile()
        # chain=False: the previous action is the default one, which would end the process.
        faulthandler.register(signum, file=f, all_threads=True, chain=False)
    except (ImportError, AttributeError, OSError, RuntimeError, ValueError):
        return  # no faulthandler here: the alert thread answers with _thread_stacks
    if not _core.set_stack_dump_signal(signum, f.fileno()):
        faulthandler.unregister(signum)
        f.close()
        return
    _stack_dump = (os.getpid(), signum, f)


def _thread_stacks() -> str:
    """The Python stack of every thread but the calling one (for hang alerts, when
    faulthandler cannot dump them)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident != me:
            parts.append(f"Thread {names.get(ident, ident)} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class _LogLimiter:
    """At most ``per_minute`` log lines per alert type in any minute; the lines it holds
    back are counted and said in the next line of that type (and at close). The JSONL
    keeps every record: this only spares the training log."""

    def __init__(self, per_minute: int = 3, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute, self.clock = per_minute, clock
        self.sent: dict[str, list[float]] = {}  # type -> times of the lines of the last minute
        self.held: dict[str, int] = {}

    def admit(self, kind: str) -> Optional[int]:
        """None: hold this line back; else how many lines of its type were held before it."""
        now = self.clock()
        times = [t for t in self.sent.get(kind, ()) if now - t < 60.0]
        if len(times) >= self.per_minute:
            self.sent[kind] = times
            self.held[kind] = self.held.get(kind, 0) + 1
            return None
        times.append(now)
        self.sent[kind] = times
        return self.held.pop(kind, 0)

    def held_back(self) -> dict[str, int]:
        held, self.held = self.held, {}
        return held


def _log_record(record: dict, limiter: _LogLimiter) -> None:
    """One log line for an alert (WARNING) or the end of its episode (INFO), rate-limited
    per type."""
    kind = record["kind"]
    label = f"{record['type']} {'alert' if kind == 'alert' else 'resolved' if kind == 'resolved' else 'update'}"
    held = limiter.admit(label)
    if held is None:
        return
    more = f" ({held} more {label} line{'s' if held != 1 else ''} held back in the last minute; all are in the log file)" if held else ""
    if kind == "alert":
        logger.warning("%s alert at step %d: %s%s", record["type"], record["step"], record["message"], more)
    elif kind == "resolved":
        repeats = record.get("repeats") or 0
        folded = f" [{repeats} repeat{'s' if repeats != 1 else ''} folded in]" if repeats else ""
        logger.info("%s resolved at step %d: %s%s%s", record["type"], record["step"], record["message"], folded, more)
    else:
        logger.info("%s at step %d: %s%s", record["type"], record["step"], record["message"], more)


def _deliver_alerts(core: Any, on_alert: Optional[Callable[[dict], Any]], write_warning: list,
                    compiles: Any = None, poll: Optional[Callable[[], None]] = None) -> None:
    """The alert thread: logs alerts to the ``steptrace`` logger (rate-limited), calls
    ``on_alert`` with every record, answers the watchdog's requests for stacks, and warns
    once when the log cannot be written; registers ``compiles``' callbacks once dynamo is
    loaded (:class:`steptrace.live.compiles.CompileWatch`). Ends once the core is closed and
    everything queued is delivered. ``poll`` (``steptrace capture``'s request file,
    :class:`steptrace.live.capture_request.RequestWatch`) runs on each wake-up."""
    limiter = _LogLimiter()
    while True:
        _warn_write_errors(core, write_warning)
        if poll is not None:
            poll()
        if compiles is not None and compiles.install_if_loaded():
            compiles = None  # dynamo was loaded after the profiler began: its compiles are timed from now
        event = core.wait_event(200)
        if event is None:
            if core.closed:
                for label, n in limiter.held_back().items():
                    logger.warning("%d more %s line%s held back at the end of the run; all are in the log file",
                                   n, label, "s" if n != 1 else "")
                return
            continue
        kind, payload = event
        if kind == "stacks":
            core.answer_stacks(_thread_stacks())
            continue
        if kind == "collectives":  # a hang: the flight recorder's last collectives, if any
            try:
                core.answer_collectives(_flight_recorder_answer())  # a dict, as a value
            except (TypeError, ValueError):  # not a JSON value (a NaN): the alert goes out without it
                core.answer_collectives(None)
            continue
        record = payload  # the alert or resolved record, a dict decoded by the core
        _log_record(record, limiter)
        if on_alert is not None:
            try:
                on_alert(record)
            except Exception:  # a faulty callback must not end alert delivery
                logger.exception("steptrace on_alert callback raised")


def _flight_recorder_answer() -> Optional[dict]:
    """The hang alert's ``details.flight_recorder`` (None without a process group): see
    :mod:`steptrace.live.flight_recorder`."""
    try:
        from steptrace.live import flight_recorder  # noqa: PLC0415

        snap = flight_recorder.snapshot()
    except Exception as exc:  # noqa: BLE001 - the alert goes out without it
        snap = {"recorder": "unavailable", "why": f"{type(exc).__name__}: {exc}", "summary": ""}
    return snap


def _step_value(name: str, value: Any, warned: set) -> Optional[float]:
    """``value`` as a float for set_step_values, or None to skip it. A one-element tensor
    is read only on the CPU: ``.item()`` on a device tensor would wait for the device
    every step, so such a value is skipped (one UsageWarning per name)."""
    if isinstance(value, (int, float)):  # bool and the numpy scalars that subclass float too
        return float(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"set_step_values({name}=...): a tensor must have one element, got shape "
                             f"{tuple(value.shape)}")
        if value.device.type == "cpu":
            return float(value.item())
        if name not in warned:
            import warnings

            from steptrace.errors import UsageWarning

            warned.add(name)
            warnings.warn(f"steptrace: set_step_values({name}=...) got a tensor on {value.device}; reading it "
                          f"would synchronize the device every step, so it is not recorded. Pass a Python "
                          f"float where you already have one (e.g. on logging steps).", UsageWarning, stacklevel=3)
        return None
    if hasattr(value, "__float__") and not isinstance(value, (str, bytes)):  # numpy scalars, Decimal, ...
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            pass
    raise TypeError(f"set_step_values({name}=...): the value must be a number (int, float or a one-element "
                    f"tensor), got {type(value).__name__}")


class IntervalScope:
    """The ``with`` block of :meth:`Profiler.interval`; reusable."""

    __slots__ = ("_core", "kind")

    def __init__(self, core: Any, kind: str) -> None:
        if kind not in INTERVAL_KINDS:
            raise ConfigError(f"interval kind {kind!r} is unknown; allowed: {', '.join(INTERVAL_KINDS)} (the "
                              "loader's wait is data: wrap the loader with prof.data())")
        self._core, self.kind = core, kind

    def __enter__(self) -> "IntervalScope":
        self._core.begin_interval(self.kind)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._core.closed:
            self._core.end_interval(self.kind)


#: What an interval between steps can be (see :meth:`Profiler.interval`).
INTERVAL_KINDS = ("eval", "checkpoint", "restore", "other")


def _seed_earlier_attempts(core: Any, log_dir: str) -> None:
    """A restart's live waste metrics continue the job's: the earlier attempts' seconds
    by cause (steptrace.analysis.goodput reads their logs) are added to the core's account, on a
    thread of their own (the logs may be long). Attempt 0 has none; a failure is said once
    and the metrics go on with this attempt alone."""
    attempt = core.attempt
    if attempt == 0:
        return

    def seed() -> None:
        try:
            from steptrace.analysis import goodput  # noqa: PLC0415

            earlier = [a for a in goodput.load_job(log_dir) if a[0] < attempt]
            if not earlier:
                return
            job = goodput.account(earlier, root=log_dir)
            for cause, seconds in job["seconds"].items():
                core.add_earlier_attempts(cause, max(0.0, float(seconds)))
            # the gap from the last earlier attempt to this process: its recovery
            started = core.process_start_unix_ns
            if started > 0:
                gap = (started - job["attempts"][-1]["end_unix_ns"]) / 1e9
                core.add_earlier_attempts("recovery", max(0.0, gap))
        except Exception as e:  # noqa: BLE001 - the training run goes on regardless
            logging.getLogger("steptrace").warning(
                "steptrace: the live waste metrics cover this attempt only: reading the earlier "
                "attempts under %s failed: %s", log_dir, e)

    threading.Thread(target=seed, name="steptrace-attempts", daemon=True).start()


def _gc_callback(begin: Callable[[int], None], end: Callable[[], None]) -> Callable[[str, dict], None]:
    """A ``gc.callbacks`` entry timing each collection into the core (by generation)."""
    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            begin(info["generation"])
        else:
            end()
    return on_gc


class Profiler:
    """Profiles a training loop into ``<log_dir>/rank<N>.jsonl``.

    Use it as a context manager (``with steptrace.Profiler("runs/exp1") as prof:``) or
    call :meth:`close` yourself. Options are keyword arguments (see docs/configuration.md); a bad
    value raises :class:`steptrace.errors.ConfigError`, an unknown name
    :class:`steptrace.errors.UnknownOptionError`, before any file is created.

    Not thread-safe: one training thread drives steps and phases; :meth:`close` and
    :meth:`flush` may come from another thread (see docs/lifecycle.md).
    """

    def __init__(self, log_dir: "str | os.PathLike[str]", _backends: Any = None, **options: Any) -> None:
        config, python_options = build_config(log_dir, options)
        torch = sys.modules.get("torch")  # never import torch ourselves: the user's loop did
        cuda = torch is not None and config.clock != "host" and torch.cuda.is_available()
        # what the counters sample; under a launcher the core takes LOCAL_RANK's GPU, which
        # is the rank's own even while the current device is still 0 (before set_device)
        if cuda and config.device_index < 0 and torch.cuda.is_initialized() and "LOCAL_RANK" not in os.environ:
            config.device_index = torch.cuda.current_device()
        # a torch profiler already running owns CUPTI's activity buffers: start yielded
        live = _cuda_live_bytes(torch) if cuda and python_options["cuda_memory"] else None
        from steptrace.live.comm import timing_method  # noqa: PLC0415

        # _backends (tests): a capsule of backends from the test build's steptrace._testing
        # (FakeDevice().backends(): fake kernel activity and counters)
        self._core = _core.Profiler(config, _versions(), external_profiler=_torch_profiler_running(torch),
                                    live_bytes=live, comm=timing_method(config.comm_timing), backends=_backends)
        self._signalled = False
        self._abandoned = False  # a forked child's copy of the parent's profiler
        self._phase_hooks: list = []  # steptrace.live.autophase hooks installed by watch()
        self._write_warning = [True]  # until the first write error is logged
        self._tensor_warned: set = set()  # set_step_values names warned about a device tensor
        self._count_work = bool(python_options["count_work"])
        self._work_handles: list = []  # steptrace.live.work.ModelWork hooks that watch() installed
        from steptrace.live.compiles import CompileWatch  # noqa: PLC0415

        self._compiles = CompileWatch(self._core)  # torch.compile's compiles in a step: compile_ms
        # Bound C++ methods: calling them runs no Python code of ours.
        self.step = self._core.step_function()
        """``with prof.step():`` times one step."""
        self.phase = self._core.phase_function()
        """``with prof.phase("forward"):`` times one phase of the current step."""
        self.start_step = self._core.begin_step
        self.end_step = self._core.end_step
        self.start_phase = self._core.begin_phase
        self.end_phase = self._core.end_phase
        self.set_step_memory = self._core.set_step_memory
        self.set_stream = self._core.set_stream
        """``set_stream(stream, device=-1)``: record device events on this stream (an int:
        ``torch.cuda.Stream.cuda_stream``, and its ``device_index``) from the next step on."""
        self._gc_callback: Any = None
        if python_options["gc_watch"]:
            # Python's collections into the steps' `gc` (issue 52): one bound C++ call per
            # collection's start and stop, nothing between collections
            self._gc_callback = _gc_callback(self._core.begin_gc, self._core.end_gc)
            gc.callbacks.append(self._gc_callback)
        self._capture: Optional[CaptureWatch] = None
        if cuda:
            # a step around a CUDA graph captured on a side stream is marked captured
            self._capture = CaptureWatch(self._core, torch.cuda).install()
            self._core.set_step_hooks(*_cuda_step_hooks(torch, python_options["cuda_memory"],
                                                        config.device_index,
                                                        self._core.device_memory_sampled,
                                                        self._capture.step_began))
        _live.add(self)
        on_alert = python_options["on_alert"]
        self.evidence: Any = None
        """The :class:`steptrace.live.evidence_capture.EvidenceCapture` with ``evidence=True``
        (``prof.evidence.request_capture()`` captures the next steps), else None."""
        if python_options["evidence"]:
            from steptrace.live.evidence_capture import EvidenceCapture, with_evidence  # noqa: PLC0415

            self.evidence = EvidenceCapture(self._core, self, python_options)
            on_alert = with_evidence(self.evidence, on_alert)  # alerts arm its captures
        poll = None
        if self.evidence is not None:
            from steptrace.live.capture_request import RequestWatch  # noqa: PLC0415

            poll = RequestWatch(self.evidence, self._core).poll  # `steptrace capture` (alert thread)
        self._alert_thread: Optional[threading.Thread] = None
        if config.detect:
            _arm_stack_dump()
            self._core.subscribe_events()
            self._alert_thread = threading.Thread(
                target=_deliver_alerts, args=(self._core, on_alert, self._write_warning,
                                              self._compiles, poll),
                name="steptrace-alerts", daemon=True)
            self._alert_thread.start()
        if python_options["handle_signals"]:
            _install_sigterm_handler(python_options["sigterm_grace_s"])
        self._comm: Any = None
        if config.comm_timing == "auto" and "torch.distributed" in sys.modules:
            from steptrace.live.comm import CollectiveTiming  # noqa: PLC0415

            # collectives timed to their completion, every DDP model included: no watch()
            self._comm = CollectiveTiming(self._core).install()
        if config.metrics_port >= 0 or config.metrics_textfile or config.metrics_pushgateway:
            _seed_earlier_attempts(self._core, config.log_dir)
        self._cluster: Optional[ClusterExchange] = None
        if wants_exchange(python_options["cluster"], int(self._core.config.world_size)):
            # the cross-rank view through torch.distributed's store (see steptrace.cluster)
            self._cluster = ClusterExchange(self._core, python_options).start()
        self._otlp: Any = None
        if python_options["metrics_otlp"]:
            from steptrace.live.otlp import OtlpExporter  # noqa: PLC0415 (the SDK loads only when asked)

            # a thread reading the log the writer wrote, exporting on the SDK's own thread
            try:
                self._otlp = OtlpExporter(self._core, python_options).start()
            except Exception as exc:  # noqa: BLE001 - the run goes on without it, as without an endpoint
                logger.warning("steptrace: no OTLP metrics export to %s: %s; the run goes on without it",
                               python_options["metrics_otlp"], exc)

    def watch(self, model: Any, optimizer: Any = None, loss_fn: Any = None, *, phases: bool = True,
              hook: Optional[Callable[[Any, Any], Any]] = None, state: Any = None) -> Any:
        """Hooks ``model`` (and ``optimizer``, ``loss_fn``) so that ``with prof.step():``
        alone records the forward / loss / backward / clip / optimizer phases (see
        :class:`steptrace.live.autophase.PhaseHooks` and docs/auto-instrumentation.md; phases
        you open yourself take precedence, ``phases=False`` installs none). For a
        DistributedDataParallel model, ``hook(state, bucket)`` is registered as its
        communication hook (``model.register_comm_hook(state, hook)``); its gradient
        all-reduces are timed without watch() (see ``comm_timing``, and
        docs/distributed.md). With ``count_work`` (the default) each training forward
        adds its samples, tokens and model FLOPs to the step (docs/useful-work.md). Call
        it once per model, before the first step;
        :meth:`close` removes the phase hooks. A forward of ``model`` with
        gradients disabled between steps opens an evaluation interval (see
        :meth:`interval`), ended by the next step. Returns ``model``."""
        if optimizer is not None and callable(optimizer):  # watch(ddp, hook) from before optimizer=
            raise ConfigError(f"watch(model, optimizer): optimizer={optimizer!r} is callable; pass a DDP "
                              f"communication hook as watch(model, hook=...)")
        register = getattr(model, "register_comm_hook", None)
        if register is None and (hook is not None or state is not None):
            raise ConfigError(f"watch(model, hook=...): a communication hook needs a torch.nn.parallel."
                              f"DistributedDataParallel model (it has register_comm_hook), got {type(model).__name__}")
        if register is None and not phases and not self._count_work:
            raise ConfigError(f"watch(model, phases=False): nothing to watch on a {type(model).__name__} "
                              f"(the communication timing needs a DistributedDataParallel model, and "
                              f"count_work=False turned the work counting off)")
        installed = None
        if phases:
            from steptrace.live.autophase import PhaseHooks

            from steptrace.live.intervals import IntervalWatch

            # a forward without gradients between steps is evaluation (no function patched)
            installed = PhaseHooks(self._core, model, optimizer, loss_fn,  # checks its arguments first
                                   intervals=IntervalWatch(self._core, checkpoints=False))
        if register is not None:
            try:
                if hook is not None:  # behind the dispatcher when the model has it
                    register(state, hook)
                elif self._comm is not None:
                    from steptrace.live.comm import adopt_ddp  # noqa: PLC0415

                    adopt_ddp(model)  # a model the Profiler has not seen (made in another way)
            except BaseException:
                if installed is not None:
                    installed.remove()
                raise
        if installed is not None:
            self._phase_hooks.append(installed)
        if self._count_work:
            from steptrace.live.work import ModelWork  # noqa: PLC0415

            # samples, tokens and FLOPs of each training forward (FLOPs counted once per shape)
            self._work_handles += ModelWork(self._core, model).hooks(model)
        return model

    @property
    def phase_hooks(self) -> tuple:
        """The :class:`steptrace.live.autophase.PhaseHooks` that :meth:`watch` installed (their
        ``loss_fn`` is the timed loss callable, ``micro_steps`` the forward calls of the
        step in progress); empty once closed."""
        return tuple(self._phase_hooks)

    # ---- progress ----
    def set_step(self, step: int) -> None:
        """Says which training step the program is at, 0-based (the steps it completed
        before: a framework's ``global_step``, or the step a restored checkpoint left off
        at), for the step in progress (between steps: the next one). Its record gets
        ``"progress"`` and the steps after it count on by one, so that the waste report
        (``steptrace goodput``) knows the steps a restart recomputed. UsageError for a
        negative step; TypeError for a non-integer."""
        if isinstance(step, bool) or not isinstance(step, int):
            try:
                step = operator.index(step)  # numpy and 0-d integer tensors
            except TypeError:
                raise TypeError(f"set_step({step!r}): the step must be an int") from None
        self._core.set_progress(step)

    # ---- per-step values ----
    def set_step_values(self, **values: Any) -> None:
        """Attaches numbers to the step in progress: its record gets ``"meta": {name:
        value}``, e.g. ``prof.set_step_values(global_step=120, epoch=1, lr=1e-3,
        loss=0.53)``. Between steps they go to the next step. A name set twice in a step
        keeps the last value; NaN is written as null. Values are ints, floats or
        one-element CPU tensors; a tensor on a GPU is skipped with one UsageWarning per
        name (reading it would synchronize the device): pass ``loss=`` a float only when
        you already have one. At most 16 distinct names per run (ConfigError for the
        17th, when first used)."""
        set_value, warned = self._core.set_step_value, self._tensor_warned
        for name, value in values.items():
            if type(value) is not float:
                value = _step_value(name, value, warned)
                if value is None:
                    continue
            set_value(name, value)

    # ---- useful work ----
    def add_work(self, samples: Optional[float] = None, tokens: Optional[float] = None,
                 flops: Optional[float] = None) -> None:
        """Adds useful work to the step in progress (between steps: to the next one): its
        record's ``work`` gets ``samples``, ``tokens`` and model ``flops`` (forward and
        backward) and what they come to per second (``tokens_per_s``, ``tflops_per_s``,
        ``mfu_pct``; see docs/useful-work.md). Calls in one step add up (one per
        micro-batch, or one per step). A figure given here replaces the one steptrace
        counts itself (from ``prof.data()``'s batches or a watched model). ValueError for a
        negative or non-finite figure."""
        figures = []
        for name, value in (("samples", samples), ("tokens", tokens), ("flops", flops)):
            if value is None:
                figures.append(-1.0)
                continue
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"add_work: {name}={value!r} is not a number; pass a count >= 0 or None") from None
            if not (0.0 <= v < float("inf")):
                raise ValueError(f"add_work: {name}={value!r} must be a finite count >= 0 (or None: unknown)")
            figures.append(v)
        self._core.add_work(figures[0], figures[1], figures[2], 4)

    # ---- the loader ----
    def data(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yields the items of ``iterable``, timing each wait for the next one as the next
        step's ``data_ms``. Advance it between steps: an item taken inside a step is still
        returned, but its wait is part of the step (one :class:`steptrace.UsageWarning` per
        run; run_end counts them in ``data_inside_step``). With ``count_work`` (the
        default) each item's samples and tokens go to the step it is for
        (:func:`steptrace.live.work.batch_work`: its shape only). (The iterator is a C type: no
        Python frame per item beyond that count.)"""
        if self._count_work:
            from steptrace.live.work import batch_counter, data_fast_path  # noqa: PLC0415

            # A tensor batch (or a tuple / list led by one) is counted in C; on_item
            # counts the others (mappings, custom batches) as batch_work does.
            return self._core.data(iterable, batch_counter(self._core), *data_fast_path())
        return self._core.data(iterable)

    # ---- time outside training work ----
    def interval(self, kind: str) -> "IntervalScope":
        """A ``with`` block of time that is not training work: ``"eval"`` (evaluation,
        validation), ``"checkpoint"`` (saving one) or ``"other"`` (other host work you
        want named, e.g. logging)::

            if it % eval_every == 0:
                with prof.interval("eval"):
                    evaluate(model)
            with prof.interval("checkpoint"):
                torch.save(state, path)

        Its time is its own kind in the next step's record (``eval_ms``,
        ``checkpoint_ms``), in an ``interval`` record, and in run_end's ``goodput``; the
        slow-step, stall and hang rules leave it out of the training iteration. Intervals
        do not nest: one begun while another is open ends that one. ValueError for an
        unknown kind (before anything is recorded)."""
        return IntervalScope(self._core, kind)

    # ---- state ----
    @property
    def log_path(self) -> str:
        """Path of this rank's log file."""
        return self._core.log_path

    @property
    def metrics_port(self) -> int:
        """Port of the Prometheus endpoint (``http://<host>:<port>/metrics``); -1 when off
        (``metrics_port=-1``, the default) or when the port could not be bound."""
        return self._core.metrics_port

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def step_index(self) -> int:
        """Steps begun so far."""
        return self._core.step_index

    @property
    def config(self) -> Any:
        """The resolved configuration (rank, world size and run id filled in)."""
        return self._core.config

    def flush(self) -> None:
        """Blocks until every finished step is written to the log file."""
        self._core.flush()
        _warn_write_errors(self._core, self._write_warning)

    def close(self, reason: str = "normal", error: str = "") -> None:
        """Ends an open step (as failed), writes ``run_end`` and closes the file.
        ``reason`` is one of normal, exception, signal, exit. Idempotent.

        From a thread other than the one driving the steps, it waits for the step in
        progress to end (at most ``close_wait_s``) and closes; that thread's later steps
        are not recorded and raise nothing. In a forked child it does nothing."""
        if self._abandoned:
            return
        if self._signalled and reason in ("normal", "exit", "exception"):
            reason = "signal"
        callback, self._gc_callback = self._gc_callback, None
        if callback is not None:
            try:
                gc.callbacks.remove(callback)
            except ValueError:  # the program replaced gc.callbacks
                pass
        hooks, self._phase_hooks = self._phase_hooks, []
        for h in hooks:
            h.remove()  # the wrapped torch functions are restored once nobody watches
        work_handles, self._work_handles = self._work_handles, []
        for handle in work_handles:
            handle.remove()
        self._compiles.remove()
        evidence, self.evidence = self.evidence, None
        if evidence is not None:
            evidence.remove()  # its last record goes in before run_end
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.remove()
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.uninstall()  # collectives still outstanding end now, in the last step
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.stop()  # its last records go in before run_end
        self._core.close(reason, error)
        otlp, self._otlp = self._otlp, None
        if otlp is not None:
            otlp.stop()  # exports what the log has, run_end included (at most its timeout)
        _live.discard(self)
        _warn_write_errors(self._core, self._write_warning)
        thread = self._alert_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)  # the last alerts reach logging and on_alert first

    def _abandon(self) -> None:
        """In a forked child: forget the parent's run (its threads do not exist here)."""
        self._abandoned = True
        self._alert_thread = None
        if self._gc_callback is not None and self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)  # the child's collections are not the run's
        self._gc_callback = None
        self._cluster = None  # its thread stayed in the parent
        self.evidence = None  # its captures were the parent's
        self._otlp = None
        if self._comm is not None:
            self._comm.forget()  # the parent's timing: the child's collectives go untimed
            self._comm = None
        try:
            self._core.close()  # the core sees the fork: it writes nothing and joins nothing
        except Exception:
            pass

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> bool:
        if exc_type is None:
            self.close("normal")
            return False
        if issubclass(exc_type, KeyboardInterrupt):
            reason, error = "signal", "KeyboardInterrupt"
        elif issubclass(exc_type, SystemExit):
            reason, error = "exit", _exception_text(exc_type, exc)
        else:
            reason, error = "exception", _exception_text(exc_type, exc)
        try:
            self.close(reason, error)
        except Exception:  # never in place of the user's exception (it would chain onto it)
            logger.exception("steptrace: closing the profiler after %s failed", exc_type.__name__)
        return False  # the exception propagates unchanged

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"step {self.step_index}"
        return f"<steptrace.Profiler {self.log_path!r} {state}>"
