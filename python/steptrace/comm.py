"""Timing of collectives by their completion, not their launch, with no call from the
program: while a Profiler is open, the ``torch.distributed`` collectives (``all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``, ...) are timed from
launch to completion, and every DistributedDataParallel model, made before or after the
Profiler, sends its gradient buckets through them.

Completion is ``Work.is_completed()``, the documented non-blocking query ("Checks if
request has completed. Non-blocking operation."), asked every 0.5 ms by one thread while
work is outstanding; nothing synchronizes the device. Not the future: where it completes
with the work (gloo) that would do, but where it is complete as soon as the work is
enqueued (NCCL: "marked complete immediately upon construction", PyTorch PR #48499; its
callbacks are ordered on the CUDA streams, not the host) it would time the launch. Which
of the two the backend does tells whether the host waits for the work (gloo: DDP waits for
its buckets) or goes on (NCCL): only the first is blocked time. No Python callback is
attached to a backend's future: one left to be destroyed on a backend thread needs the
GIL, and at exit that can deadlock against a main thread joining that backend's threads.

The core's collective timer (core/collective_timer.hpp) turns begin / end pairs into the
step record's ``comm`` object: time with communication outstanding, time blocked after the
last launch, compute.

Not seen: collectives issued from C++ or through ``torch.distributed._functional_collectives``
(FSDP2, DTensor), a function bound before the Profiler opened (``from torch.distributed
import all_reduce``), and a DDP model with a built-in C++ comm hook registered before the
Profiler opened.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional

#: The torch.distributed collectives timed (those that take ``async_op``).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")
#: How often outstanding work whose future completed at launch is polled (seconds).
POLL_S = 0.0005

_lock = threading.Lock()
_active: list["CollectiveTiming"] = []  # open timings, newest last: the newest times
_originals: dict[str, Callable[..., Any]] = {}  # the patched functions' originals
_wrappers: dict[str, Callable[..., Any]] = {}


def _current() -> Optional["CollectiveTiming"]:
    return _active[-1] if _active else None


def _async_index(original: Callable[..., Any]) -> int:
    """Position of ``async_op`` among the positional parameters, -1 when it has none."""
    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return -1
    return names.index("async_op") if "async_op" in names else -1


# nccl-tests' bus factors (doc/PERFORMANCE.md: busbw = algbw x factor), by the size of the
# group n, for the collectives whose payload S is known: the argument that holds S, and
# whether it is a list (summed) or one tensor given per rank (times n).
def _all_reduce_factor(n: int) -> float:
    return 2.0 * (n - 1) / n


def _gather_factor(n: int) -> float:
    return (n - 1) / n


_PAYLOAD = {
    "all_reduce": ("tensor", "one", _all_reduce_factor),
    "all_gather_into_tensor": ("output_tensor", "one", _gather_factor),
    "all_gather": ("tensor", "per_rank", _gather_factor),
    "reduce_scatter_tensor": ("input", "one", _gather_factor),
    "reduce_scatter": ("input_list", "list", _gather_factor),
    "all_to_all_single": ("input", "one", _gather_factor),
    "all_to_all": ("input_tensor_list", "list", _gather_factor),
    "broadcast": ("tensor", "one", lambda n: 1.0),
    "reduce": ("tensor", "one", lambda n: 1.0),
}


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _arguments(sig: Optional[inspect.Signature], args: tuple, kwargs: dict) -> dict:
    """A call's arguments by name ({} where they do not bind)."""
    try:
        return dict(sig.bind_partial(*args, **kwargs).arguments) if sig is not None else {}
    except TypeError:
        return {}


def payload(name: str, sig: Optional[inspect.Signature], args: tuple, kwargs: dict) -> tuple[int, int]:
    """(S, S x bus factor) of one collective call, as nccl-tests counts them; (0, 0) where
    unknown."""
    return _payload_of(name, _arguments(sig, args, kwargs))


def _payload_of(name: str, bound: dict) -> tuple[int, int]:
    spec = _PAYLOAD.get(name)
    if spec is None or not bound:
        return 0, 0
    try:
        import torch.distributed as dist

        n = dist.get_world_size(bound.get("group"))
        held = bound[spec[0]]
        size = (sum(_nbytes(t) for t in held) if spec[1] == "list"
                else _nbytes(held) * (n if spec[1] == "per_rank" else 1))
    except Exception:  # noqa: BLE001 - an odd call: its size is simply unknown
        return 0, 0
    return size, int(size * spec[2](n)) if n > 1 else 0


def _future_is_completion(group: Any) -> bool:
    """Whether the group's backend completes a work's future when the work is done (gloo,
    MPI: CPU work), so that a done future is a finished collective even while
    ``is_completed()`` has not flipped yet (gloo marks the future first)."""
    try:
        import torch.distributed as dist

        backend = str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - no group: nothing to trust
        return False
    return backend in ("gloo", "mpi")


def _timed(original: Callable[..., Any]) -> Callable[..., Any]:
    index = _async_index(original)
    name = original.__name__
    try:
        sig: Optional[inspect.Signature] = inspect.signature(original)
    except (TypeError, ValueError):
        sig = None

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        timing = _current()
        if timing is None or index < 0:
            return original(*args, **kwargs)
        if len(args) > index:
            async_op = bool(args[index])
            args = args[:index] + (True,) + args[index + 1:]
        else:
            async_op = bool(kwargs.get("async_op", False))
            kwargs["async_op"] = True
        bound = _arguments(sig, args, kwargs)  # bound once: the size and the group
        group = bound.get("group")
        if not async_op and _future_is_completion(group):
            # gloo / MPI, called synchronously: wait() returns once the work is done (CPU
            # work), so it ends the timing here, without the completion poller
            timing.launch_and_wait(original, args, kwargs, _payload_of(name, bound))
            return None
        work = timing.launch(original, args, kwargs, _payload_of(name, bound), group)
        if async_op or work is None:
            return work
        work.wait()  # what the synchronous call does (on NCCL: the current stream waits)
        return None

    return collective


def _patch_collectives() -> None:
    import torch.distributed as dist

    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or name in _originals:
            continue
        _originals[name] = fn
        _wrappers[name] = _timed(fn)
        setattr(dist, name, _wrappers[name])


def _unpatch_collectives() -> None:
    dist = sys.modules.get("torch.distributed")
    for name, original in _originals.items():
        if dist is not None and getattr(dist, name, None) is _wrappers[name]:  # a later patch keeps its own
            setattr(dist, name, original)
    _originals.clear()
    _wrappers.clear()


class _CompletionPoller:
    """One thread that asks outstanding work whether it has completed, every POLL_S, and
    sleeps while there is none. An item may carry a future to complete with a value once
    its work has (a DDP bucket's result: see CollectiveTiming.reduce_bucket)."""

    def __init__(self, end: Callable[[int, bool], None]) -> None:
        self._end = end
        self._cond = threading.Condition()
        self._pending: list[tuple] = []  # (token, work, host_blocked, result or None, value, size)
        self._stop = False
        self._thread: Optional[threading.Thread] = None

    def add(self, token: Optional[int], work: Any, host_blocked: bool, size: tuple[int, int] = (0, 0),
            result: Any = None, value: Any = None) -> tuple:
        """Returns the item (to join on, see add_join)."""
        item = (token, work, host_blocked, result, value, size)
        with self._cond:
            if not self._stop:
                self._pending.append(item)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="steptrace-collectives", daemon=True)
                    self._thread.start()
                self._cond.notify()
                return item
        self._finish(item, wait=True)
        return item

    def add_join(self, program_future: Any, inner: list, result: Any) -> None:
        """``result`` completes with ``program_future``'s value once that is done, after
        the ``inner`` items (the collectives launched while it was made) have ended: the
        future a DDP comm hook of the program returns may complete before the poller has
        seen its collective's work complete, and DDP goes on when it does."""
        self.add(None, program_future, False, (0, 0), result, inner)

    def _finish(self, item: tuple, wait: bool) -> None:
        token, work, host_blocked, result, value, size = item
        if token is None:  # a join: its collectives end first, then DDP's future
            with self._cond:
                inner = [p for p in self._pending if any(p is q for q in value)]
                self._pending = [p for p in self._pending if not any(p is q for q in inner)]
            for q in inner:
                self._finish(q, wait)
            try:
                result.set_result(work.wait() if wait else work.value())
            except Exception as exc:  # noqa: BLE001 - the program's hook failed: DDP sees why
                result.set_exception(exc)
            return
        self._end(token, host_blocked, *size)
        if result is None:
            return
        try:
            if wait:
                work.wait()  # the profiler closed: the program still needs its result
            result.set_result(value)
        except Exception as exc:  # noqa: BLE001 - the collective failed: DDP sees why
            result.set_exception(exc)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                pending = list(self._pending)
            done = []
            for item in pending:
                try:  # a join waits on a torch future, a collective on its work
                    completed = item[1].done() if item[0] is None else item[1].is_completed()
                except Exception:  # noqa: BLE001 - an aborted group: the work is over
                    completed = True
                if completed:
                    done.append(item)
            if done:
                with self._cond:
                    self._pending = [p for p in self._pending if not any(p is d for d in done)]
                for item in done:
                    self._finish(item, wait=False)
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Ends what is outstanding now (a run's last figures; results still come when
        their work completes) and the thread."""
        with self._cond:
            self._stop = True
            pending, self._pending = self._pending, []
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        for item in pending:
            self._finish(item, wait=True)


class CollectiveTiming:
    """The timing of one Profiler's collectives: installed at its start when
    torch.distributed is available, removed at its close."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._begin, self._end = core.collective_begin, core.collective_end
        self._poller = _CompletionPoller(core.collective_end)
        self._ddp = _DdpAdoption()
        # per thread (DDP calls comm hooks on the autograd engine's threads): the poller
        # items launched inside the program's comm hook in progress
        self._hook_calls = threading.local()
        self.polled = 0  # collectives whose future completed at launch (NCCL-like)
        self.by_future = 0  # collectives whose future completed with the work (gloo-like)

    def install(self) -> "CollectiveTiming":
        import torch.distributed as dist

        if not dist.is_available():
            return self
        with _lock:
            if not _active:
                _patch_collectives()
            _active.append(self)
        self._ddp.install()
        return self

    def uninstall(self) -> None:
        with _lock:
            if self not in _active:
                return
            _active.remove(self)
            if not _active:
                _unpatch_collectives()
        self._ddp.uninstall()
        self._poller.stop()

    def forget(self) -> None:
        """In a forked child: stop timing into the parent's profiler (its poller thread
        does not exist here), without joining anything."""
        with _lock:
            if self in _active:
                _active.remove(self)
                if not _active:
                    _unpatch_collectives()
        self._ddp.uninstall()

    def launch(self, original: Callable[..., Any], args: tuple, kwargs: dict,
               size: tuple[int, int] = (0, 0), group: Any = None) -> Any:
        """Calls ``original`` (with ``async_op=True``) and times its work to completion."""
        token = self._begin()
        try:
            work = original(*args, **kwargs)
        except BaseException:
            self._end(token)
            raise
        if work is None:  # not a member of the group, or queued in a coalescing manager
            self._end(token)
            return None
        try:
            fut = work.get_future()
        except Exception:  # noqa: BLE001 - a backend without futures: as a blocking one
            fut = None
        self._track(token, work, fut, size, group)
        return work

    def launch_and_wait(self, original: Callable[..., Any], args: tuple, kwargs: dict,
                        size: tuple[int, int] = (0, 0)) -> None:
        """Calls ``original`` (``async_op=True``) and waits for its work, on a backend whose
        wait returns once the work is done (gloo, MPI): timed from launch to that return,
        blocked time."""
        token = self._begin()
        try:
            work = original(*args, **kwargs)
            if work is not None:
                work.wait()
        finally:
            self._end(token, True, *size)
        self.by_future += 1

    def _track(self, token: int, work: Any, fut: Any, size: tuple[int, int], group: Any) -> None:
        # The future is read once: gloo's work may complete between two reads, and a future
        # done at the second read only would pass for NCCL's (complete at launch), leaving
        # the collective to end after DDP went on, in the next step (1 in 8 runs beside a hog).
        fut_done = fut is not None and fut.done()
        try:
            completed = work.is_completed() or (fut_done and _future_is_completion(group))
        except Exception:  # noqa: BLE001 - an aborted group: the work is over
            completed = True
        if completed:
            self._end(token, True, *size)
            return
        # a future complete before its work is: the host does not wait for it (NCCL)
        host_blocked = not fut_done
        if host_blocked:
            self.by_future += 1
        else:
            self.polled += 1
        item = self._poller.add(token, work, host_blocked, size)
        captured = getattr(self._hook_calls, "items", None)
        if captured is not None and host_blocked:  # NCCL-like work ends on the device, later
            captured.append(item)

    def run_hook(self, hook: Callable[..., Any], state: Any, bucket: Any) -> Any:
        """The program's comm hook, behind the dispatcher. Its collectives are timed where
        they go through torch.distributed; where one whose future is its completion (gloo)
        is still outstanding when the hook returns, DDP gets a future that completes after
        that collective has ended, so that it ends in the step that launched it. (A
        collective whose future completed at launch (NCCL) is left to the poller: DDP does
        not wait for its work on the host.)"""
        import torch

        calls = self._hook_calls
        outer = getattr(calls, "items", None)
        calls.items = []
        try:
            fut = hook(state, bucket)
        finally:
            inner, calls.items = calls.items, outer
        if not inner or not isinstance(fut, torch._C.Future):  # torch.futures.Future's base too
            return fut
        result = torch.futures.Future()
        self._poller.add_join(fut, inner, result)
        return result

    def reduce_bucket(self, all_reduce: Callable[..., Any], tensor: Any, group: Any) -> Any:
        """A DDP bucket's all-reduce, timed, and the future DDP waits for. Where the
        backend's future is complete at launch (NCCL), that future's ``then`` runs here, on
        this thread; else the result is a future this module completes once the work has,
        so that no Python callback waits on a backend thread (torch 2.9's DDP wants a
        Python object from a Python hook, which takes a ``then``)."""
        import torch

        token = self._begin()
        try:
            work = all_reduce(tensor, group=group, async_op=True)
            fut = work.get_future()
        except BaseException:
            self._end(token)
            raise
        n = group.size()
        size = (_nbytes(tensor), int(_nbytes(tensor) * _all_reduce_factor(n)) if n > 1 else 0)
        if fut.done():
            self._track(token, work, fut, size, group)
            return fut.then(_first_tensor)
        self.by_future += 1
        result = torch.futures.Future()
        self._poller.add(token, work, True, size, result, tensor)
        return result

    def describe(self) -> str:
        """How the collectives were timed, for the records."""
        if self.polled and self.by_future:
            return "completion (Work.is_completed); some futures complete at launch: host not blocked"
        if self.polled:
            return "completion (Work.is_completed); futures complete at launch: host not blocked"
        if self.by_future:
            return "completion (Work.is_completed); futures complete with the work: host blocked"
        return "no collective seen"


def timing_method(comm_timing: str) -> tuple[str, str]:
    """How a Profiler opened now times the collectives, for run_start's ``backends.comm``:
    (method, "") where they are timed, ("", why not) where they are not."""
    if comm_timing == "off":
        return "", 'comm_timing="off": torch.distributed is left as it is'
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return "", "untimed: torch.distributed is not imported (no process group)"
    try:
        if not dist.is_available():
            return "", "untimed: this torch has no torch.distributed"
        backend = str(dist.get_backend()).lower() if dist.is_initialized() else ""
    except Exception:  # noqa: BLE001 - an odd state: described as without a group
        backend = ""
    polled = f"completion polling of Work.is_completed() every {POLL_S * 1000:g} ms"
    if not backend:
        return (f"{polled} where a collective's future completes at launch (NCCL), its future where it "
                f"completes with the work (gloo); no process group yet"), ""
    if "nccl" not in backend:
        return (f"completion of each collective's future, which completes with the work ({backend}: the host "
                f"waits, blocked time), and {polled}"), ""
    return (f"{polled} ({backend}: the future completes at launch; the host does not wait), "
            f"and the future where a backend completes it with the work"), ""


# DDP models given the dispatcher, with the program's (hook, state) once it registers one.
_adopted: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()
_register_patched = False


def _patch_ddp_registration(ddp_class: Any) -> None:
    """A comm hook the program registers on a model that has the dispatcher goes behind
    it (DDP takes only one). For the process's lifetime: a model keeps the dispatcher
    after the Profiler closes, and the program may still register its hook then."""
    global _register_patched
    if _register_patched:
        return
    _register_patched = True
    original_register = ddp_class.register_comm_hook
    original_builtin = ddp_class._register_builtin_comm_hook

    def register_comm_hook(ddp: Any, state: Any, hook: Callable[..., Any]) -> None:
        box = _adopted.get(ddp)
        if box is None or box[0] is not None:  # not ours, or a second hook: DDP's own rules
            return original_register(ddp, state, hook)
        ddp._check_comm_hook(hook)
        if ddp.logger is not None:
            ddp.logger._set_comm_hook_name(hook.__qualname__)
        ddp._comm_hooks.append((hook, state))
        box[0] = (hook, state)

    def register_builtin(ddp: Any, comm_hook_type: Any) -> None:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        box = _adopted.get(ddp)
        kinds = getattr(dist, "BuiltinCommHookType", None)
        if box is None or box[0] is not None or kinds is None:
            return original_builtin(ddp, comm_hook_type)
        if comm_hook_type == kinds.ALLREDUCE:
            return None  # what the dispatcher does already
        if comm_hook_type == kinds.FP16_COMPRESS:
            box[0] = (default_hooks.fp16_compress_hook, ddp.process_group)
            return None
        return original_builtin(ddp, comm_hook_type)  # DDP's own error: one hook

    register_comm_hook.__wrapped__ = original_register  # type: ignore[attr-defined]
    register_builtin.__wrapped__ = original_builtin  # type: ignore[attr-defined]
    ddp_class.register_comm_hook = register_comm_hook
    ddp_class._register_builtin_comm_hook = register_builtin


def adopt_ddp(ddp: Any) -> bool:
    """Gives ``ddp`` the dispatcher (DDP's own all-reduce, averaged, through the timed
    ``dist.all_reduce``, or the program's hook once it registers one) unless it has a
    comm hook already (then that hook's collectives are timed where they go through
    torch.distributed). False where it was not given (already, or a built-in C++ hook)."""
    if ddp in _adopted or getattr(ddp, "_comm_hooks", None) or getattr(ddp, "reducer", None) is None:
        return False
    import torch.distributed as dist

    _patch_ddp_registration(type(ddp))
    box: list = [None]
    group = ddp.process_group
    size = group.size()

    # No annotations: DDP rejects a hook whose annotations are not GradBucket / Future.
    def steptrace_dispatch(state, bucket):  # type: ignore[no-untyped-def]
        chosen = box[0]
        timing = _current()
        if chosen is not None:
            return chosen[0](chosen[1], bucket) if timing is None else timing.run_hook(chosen[0], chosen[1], bucket)
        tensor = bucket.buffer()
        tensor.div_(size)  # DDP's average, as its allreduce_hook does
        all_reduce = _originals.get("all_reduce", dist.all_reduce)
        if timing is None:  # the Profiler has closed: DDP's own allreduce_hook
            return all_reduce(tensor, group=group, async_op=True).get_future().then(_first_tensor)
        return timing.reduce_bucket(all_reduce, tensor, group)

    register = type(ddp).register_comm_hook
    try:
        getattr(register, "__wrapped__", register)(ddp, None, steptrace_dispatch)
    except Exception:  # noqa: BLE001 - a built-in C++ hook is in: its collectives are not seen
        return False
    ddp._comm_hooks.clear()  # the program has registered nothing
    _adopted[ddp] = box
    return True


class _DdpAdoption:
    """Every DistributedDataParallel model gets the dispatcher: those made before the
    Profiler, found once at its start, and those made while it is open, right after
    their construction."""

    def __init__(self) -> None:
        self._undo: Optional[Callable[[], None]] = None

    def install(self) -> None:
        nn_parallel = sys.modules.get("torch.nn.parallel")
        if nn_parallel is None:
            return
        ddp_class = nn_parallel.DistributedDataParallel
        original_init = ddp_class.__init__

        def init(ddp: Any, *args: Any, **kwargs: Any) -> None:
            original_init(ddp, *args, **kwargs)
            adopt_ddp(ddp)

        init.__wrapped__ = original_init  # type: ignore[attr-defined]
        ddp_class.__init__ = init

        def undo() -> None:
            if ddp_class.__dict__.get("__init__") is init:  # someone who patched after us keeps theirs
                ddp_class.__init__ = original_init

        self._undo = undo
        import torch.distributed as dist

        if dist.is_initialized():  # models made before the Profiler (once, at its start)
            import gc

            for obj in gc.get_objects():
                try:
                    found = isinstance(obj, ddp_class)
                except ReferenceError:  # a dead weakref.proxy (dynamo leaves some): no model
                    continue
                if found:
                    adopt_ddp(obj)

    def uninstall(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None


def _first_tensor(fut: Any) -> Any:
    return fut.value()[0]
