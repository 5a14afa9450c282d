"""Timing of collectives by their completion, not their launch, with no call from the
program: while a Profiler is open, the ``torch.distributed`` collectives (``all_reduce``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``broadcast``, ...) are timed, and
every DistributedDataParallel model, made before or after the Profiler, sends its gradient
buckets through them.

Each call runs as the program made it. A synchronous call (``async_op=False``) is timed from
its launch to its return, as time the host spent in it: on gloo the whole collective (its
call waits for the work), on NCCL the launch only (since torch 2.8 ProcessGroupNCCL runs a
synchronous collective on the current stream and returns no Work; turning it into an
asynchronous one would move it to NCCL's internal stream, with an event record and wait on
each side: the profiler would change how the program synchronizes). An asynchronous call
is timed from its launch to its work's completion:

- where its future completes with the work (gloo, MPI), by that future (``done()``, a flag);
- where the future is complete as soon as the work is enqueued (NCCL: "marked complete
  immediately upon construction", PyTorch PR #48499; its callbacks are ordered on the CUDA
  streams, not the host), by ``Work.is_completed()``, the documented non-blocking query,
  asked by one thread (never the program's): only the first kind is blocked time.

``is_completed()`` is bound without releasing the GIL (torch/csrc/distributed/c10d/init.cpp)
and its cudaEventQuery "can hang if another thread is holding the CUDA global context lock"
(ProcessGroupNCCL.cpp, finishedGPUExecutionInternal): while it waits, the training thread
cannot run Python. So the poller spaces its rounds by what they cost: at most every POLL_S,
and never more than POLL_SHARE of the wall clock (a round that held the GIL 2 ms is followed
by 100 ms without one). Completion times are then coarser, never earlier.

CUDA graphs: a collective launched while its thread captures (torch.cuda.graph) is a node
of the graph, not work; it is left alone and not timed (asking its Work or future would be
a query PyTorch keeps out of captures: ProcessGroupNCCL's Note [cuda graph capture and
workEnqueue]). While a capture in CUDA's global mode (torch.cuda.graph's default) is in
progress on any thread, no thread may make such a query ('"global" will error on actions in
other threads', torch.cuda.CUDAGraph.capture_begin): the poller makes none from just before
that capture begins (its capture_begin waits for a round of queries in progress) to its end.

No Python callback is attached to a backend's future: one left to be destroyed on a backend
thread needs the GIL, and at exit that can deadlock against a main thread joining that
backend's threads.

The core's collective timer (core/collective_timer.hpp) turns begin / end pairs into the
step record's ``comm`` object: time with communication outstanding, time blocked after the
last launch, compute.

Not seen: collectives issued from C++ or through ``torch.distributed._functional_collectives``
(FSDP2, DTensor), a function bound before the Profiler opened (``from torch.distributed
import all_reduce``), a DDP model with a built-in C++ comm hook registered before the
Profiler opened, and CUDA graph captures begun from C++ or before the Profiler opened.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Optional

from steptrace.live._torch_compat import (DDP_BUILTIN_HOOK_REGISTRAR, DDP_CHECK_COMM_HOOK, DDP_COMM_HOOKS,
                                     DDP_LOGGER_HOOK_NAME, DDP_REDUCER, future_base)

#: The torch.distributed collectives timed (those that take ``async_op``).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")
#: The shortest pause between two rounds of the completion poller (seconds).
POLL_S = 0.0005
#: The largest share of the wall clock the poller's rounds may take: they hold the GIL.
POLL_SHARE = 0.02

_lock = threading.Lock()
_active: list["CollectiveTiming"] = []  # open timings, newest last: the newest times
_originals: dict[str, Callable[..., Any]] = {}  # the patched functions' originals
_wrappers: dict[str, Callable[..., Any]] = {}

# CUDA graph captures in CUDA's global mode in progress (ids of their torch.cuda.CUDAGraph),
# counted from just before their capture begins to its end: while there is one, the poller
# asks no Work whether it completed. _capture_gate is held through each round of queries, so
# a capture waits for the round in progress before it begins (as CUDAGraph::capture_begin
# waits for the NCCL watchdog's pending event queries), and no query is made until it ends.
_capture_gate = threading.Lock()
_global_captures: set[int] = set()
_capture_undo: list[Callable[[], None]] = []


def _after_fork_in_child() -> None:
    # the parent's poller may have held the gate at the fork: a child has no such thread
    global _capture_gate
    _capture_gate = threading.Lock()
    _global_captures.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _current() -> Optional["CollectiveTiming"]:
    return _active[-1] if _active else None


def _capturing_here() -> bool:
    """Whether this thread's current CUDA stream is capturing a CUDA graph. Asked only once
    CUDA is initialized: a capture needs it, and the question could initialize it (on a
    machine without a driver it raises)."""
    cuda = sys.modules.get("torch.cuda")
    if cuda is None:
        return False
    try:
        return bool(cuda.is_initialized() and cuda.is_current_stream_capturing())
    except Exception:  # noqa: BLE001 - CUDA in a bad state: no capture of ours to protect
        return False


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
        if _capturing_here():  # a node of the graph being captured, not work: left alone
            timing.captured += 1
            return original(*args, **kwargs)
        # the call goes on as the program made it: async_op is never changed
        async_op = bool(args[index]) if len(args) > index else bool(kwargs.get("async_op", False))
        bound = _arguments(sig, args, kwargs)  # bound once: the size and the group
        if not async_op:
            return timing.call(original, args, kwargs, _payload_of(name, bound))
        return timing.launch(original, args, kwargs, _payload_of(name, bound), bound.get("group"))

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
    _patch_capture()


def _unpatch_collectives() -> None:
    dist = sys.modules.get("torch.distributed")
    for name, original in _originals.items():
        if dist is not None and getattr(dist, name, None) is _wrappers[name]:  # a later patch keeps its own
            setattr(dist, name, original)
    _originals.clear()
    _wrappers.clear()
    _unpatch_capture()


def _patch_capture() -> None:
    """Counts the CUDA graph captures in CUDA's global mode (torch.cuda.CUDAGraph's
    capture_begin / capture_end, which torch.cuda.graph and make_graphed_callables call)."""
    cuda = sys.modules.get("torch.cuda")
    graph_class = getattr(cuda, "CUDAGraph", None)
    if graph_class is None or _capture_undo or not isinstance(graph_class, type):
        return
    begin = getattr(graph_class, "capture_begin", None)
    if begin is None:
        return
    try:
        sig: Optional[inspect.Signature] = inspect.signature(begin)
    except (TypeError, ValueError):
        sig = None

    @functools.wraps(begin)
    def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "global"  # torch.cuda.graph's default, and the safe guess
        if sig is not None:
            try:
                bound = sig.bind(graph, *args, **kwargs)
                bound.apply_defaults()
                mode = str(bound.arguments.get("capture_error_mode", mode))
            except TypeError:
                pass  # the original says what is wrong with the call
        counted = mode == "global"
        if counted:
            with _capture_gate:  # after the round of queries in progress, and before the capture
                _global_captures.add(id(graph))
        try:
            return begin(graph, *args, **kwargs)
        except BaseException:
            if counted:
                _global_captures.discard(id(graph))
            raise

    def wrap_end(end: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(end)
        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return end(graph, *args, **kwargs)
            finally:
                _global_captures.discard(id(graph))  # once the capture is over; twice is harmless

        return capture_end

    # torch 2.15's capture_end ends the capture in capture_end_pre; earlier ones in capture_end
    wrappers = {"capture_begin": capture_begin}
    for name in ("capture_end_pre", "capture_end"):
        end = getattr(graph_class, name, None)
        if end is not None:
            wrappers[name] = wrap_end(end)
    for name, wrapper in wrappers.items():
        own = graph_class.__dict__.get(name)  # None: inherited, given back by deleting ours
        setattr(graph_class, name, wrapper)

        def undo(name: str = name, wrapper: Callable[..., Any] = wrapper, own: Any = own) -> None:
            if graph_class.__dict__.get(name) is not wrapper:  # someone who patched after us keeps theirs
                return
            if own is None:
                delattr(graph_class, name)
            else:
                setattr(graph_class, name, own)

        _capture_undo.append(undo)


def _unpatch_capture() -> None:
    for undo in _capture_undo:
        undo()
    _capture_undo.clear()
    _global_captures.clear()


class _Item:
    """What the poller waits for: a collective (``token`` set) whose ``future`` completes
    with its work, or, where that is None, whose ``work`` is asked; or a join (``token``
    None): the program's ``future``, after the ``inner`` items."""

    __slots__ = ("token", "work", "future", "host_blocked", "size", "result", "value", "inner")

    def __init__(self, token: Optional[int], work: Any, future: Any, host_blocked: bool,
                 size: tuple[int, int] = (0, 0), result: Any = None, value: Any = None, inner: tuple = ()) -> None:
        self.token = token
        self.work = work
        self.future = future
        self.host_blocked = host_blocked
        self.size = size
        self.result = result  # a future to complete with ``value`` once the work has (a DDP bucket)
        self.value = value
        self.inner = inner


class _CompletionPoller:
    """One thread that asks outstanding collectives whether they have completed and sleeps
    while there are none. A round holds the GIL (``Work.is_completed()`` does not release it,
    and may wait for the CUDA context lock): the pause after a round is at least POLL_S and at
    least the round's own length / POLL_SHARE. No Work is asked anything while a CUDA graph
    capture in global mode is in progress (see _patch_capture); futures are host flags, asked
    always."""

    def __init__(self, end: Callable[..., None]) -> None:
        self._end = end
        self._cond = threading.Condition()
        self._pending: list[_Item] = []
        self._stop = False
        self._stopped = threading.Event()  # ends a pause at once
        self._thread: Optional[threading.Thread] = None
        self.queries = 0  # Work.is_completed() calls made
        self.deferred = 0  # queries not made: a capture in global mode was in progress

    def add(self, token: Optional[int], work: Any, future: Any, host_blocked: bool,
            size: tuple[int, int] = (0, 0), result: Any = None, value: Any = None) -> _Item:
        """Returns the item (to join on, see add_join). ``future``: one that completes with
        the work, asked instead of it; None: ``work.is_completed()`` is asked."""
        return self._add(_Item(token, work, future, host_blocked, size, result, value))

    def add_join(self, program_future: Any, inner: list, result: Any) -> None:
        """``result`` completes with ``program_future``'s value once that is done, after
        the ``inner`` items (the collectives launched while it was made) have ended: the
        future a DDP comm hook of the program returns may complete before the poller has
        seen its collective's work complete, and DDP goes on when it does."""
        self._add(_Item(None, None, program_future, False, result=result, inner=tuple(inner)))

    def _add(self, item: _Item) -> _Item:
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

    def _finish(self, item: _Item, wait: bool) -> None:
        if item.token is None:  # a join: its collectives end first, then DDP's future
            with self._cond:
                inner = [p for p in self._pending if any(p is q for q in item.inner)]
                self._pending = [p for p in self._pending if not any(p is q for q in inner)]
            for q in inner:
                self._finish(q, wait)
            try:
                item.result.set_result(item.future.wait() if wait else item.future.value())
            except Exception as exc:  # noqa: BLE001 - the program's hook failed: DDP sees why
                item.result.set_exception(exc)
            return
        self._end(item.token, item.host_blocked, *item.size)
        if item.result is None:
            return
        try:
            if wait:
                item.work.wait()  # the profiler closed: the program still needs its result
            elif item.future is not None:
                item.future.value()  # raises the collective's error, for DDP to see
            item.result.set_result(item.value)
        except Exception as exc:  # noqa: BLE001 - the collective failed: DDP sees why
            item.result.set_exception(exc)

    def _poll(self, pending: list[_Item]) -> list[_Item]:
        done = []
        with _capture_gate:
            may_query = not _global_captures
            for item in pending:
                try:
                    if item.future is not None:
                        completed = item.future.done()
                    elif may_query:
                        self.queries += 1
                        completed = item.work.is_completed()
                    else:
                        self.deferred += 1
                        continue
                except Exception:  # noqa: BLE001 - an aborted group: the work is over
                    completed = True
                if completed:
                    done.append(item)
        return done

    def _run(self) -> None:
        next_round = 0.0
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
            pause = next_round - time.perf_counter()
            if pause > 0 and self._stopped.wait(pause):
                return
            with self._cond:
                pending = list(self._pending)
            start = time.perf_counter()
            done = self._poll(pending)
            if done:
                with self._cond:  # stop() may have ended some already
                    ids = {id(p) for p in self._pending}
                    done = [d for d in done if id(d) in ids]
                    ids = {id(d) for d in done}
                    self._pending = [p for p in self._pending if id(p) not in ids]
                for item in done:
                    self._finish(item, wait=False)
            now = time.perf_counter()
            next_round = now + max(POLL_S, (now - start) / POLL_SHARE)

    def stop(self) -> None:
        """Ends what is outstanding now (a run's last figures; results still come when
        their work completes) and the thread."""
        with self._cond:
            self._stop = True
            pending, self._pending = self._pending, []
            self._cond.notify()
        self._stopped.set()
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
        self.polled = 0  # asynchronous collectives whose future completed at launch (NCCL-like)
        self.by_future = 0  # asynchronous collectives whose future completes with the work (gloo-like)
        self.synchronous = 0  # async_op=False calls: timed from launch to return
        self.captured = 0  # launched inside a CUDA graph capture: not timed

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

    def call(self, original: Callable[..., Any], args: tuple, kwargs: dict,
             size: tuple[int, int] = (0, 0)) -> Any:
        """Calls ``original`` synchronously, as the program did, timed from its launch to its
        return as time the host spent in it: on gloo / MPI the collective (the call waits for
        its work), on NCCL its launch (the collective runs later on the current stream)."""
        token = self._begin()
        try:
            return original(*args, **kwargs)
        finally:
            self._end(token, True, *size)
            self.synchronous += 1

    def launch(self, original: Callable[..., Any], args: tuple, kwargs: dict,
               size: tuple[int, int] = (0, 0), group: Any = None) -> Any:
        """Calls ``original`` (``async_op=True``, the program's) and times its work to completion."""
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

    def _track(self, token: int, work: Any, fut: Any, size: tuple[int, int], group: Any) -> None:
        # Nothing here asks the work (is_completed() holds the GIL and may wait for the CUDA
        # context lock): the future, a host flag, is read once. gloo's work may complete
        # between two reads, and a future done at the second read only would pass for
        # NCCL's (complete at launch), leaving the collective to end after DDP went on.
        fut_done = fut is not None and fut.done()
        if fut_done and _future_is_completion(group):  # gloo: already over
            self.by_future += 1
            self._end(token, True, *size)
            return
        # a future complete before its work is: the host does not wait for it (NCCL), and
        # the work is asked; else the future completes with the work, and is asked
        host_blocked = not fut_done
        if host_blocked:
            self.by_future += 1
        else:
            self.polled += 1
        item = self._poller.add(token, work, fut if host_blocked else None, host_blocked, size)
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
        if not inner or not isinstance(fut, future_base()):  # torch.futures.Future's base too
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
        self._poller.add(token, work, fut, True, size, result, tensor)
        return result

    def describe(self) -> str:
        """How the collectives were timed, for the records."""
        parts = []
        if self.polled and self.by_future:
            parts.append("completion (Work.is_completed); some futures complete at launch: host not blocked")
        elif self.polled:
            parts.append("completion (Work.is_completed); futures complete at launch: host not blocked")
        elif self.by_future:
            parts.append("completion (Work.is_completed); futures complete with the work: host blocked")
        if self.synchronous:
            parts.append("synchronous calls (async_op=False) from launch to return: host blocked")
        if self.captured:
            parts.append(f"{self.captured} launched inside a CUDA graph capture: not timed")
        return "; ".join(parts) if parts else "no collective seen"


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
    polled = (f"completion polling of Work.is_completed() at most every {POLL_S * 1000:g} ms and "
              f"{POLL_SHARE * 100:g}% of the time")
    sync = "synchronous calls (async_op=False) from their launch to their return"
    if not backend:
        return (f"{polled} where a collective's future completes at launch (NCCL), its future where it "
                f"completes with the work (gloo); {sync}; no process group yet"), ""
    if "nccl" not in backend:
        return (f"completion of each collective's future, which completes with the work ({backend}: the host "
                f"waits, blocked time), and {polled}; {sync}"), ""
    return (f"{polled} ({backend}: the future completes at launch; the host does not wait), "
            f"and the future where a backend completes it with the work; {sync} (on {backend}: the launch)"), ""


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
    original_builtin = getattr(ddp_class, DDP_BUILTIN_HOOK_REGISTRAR)

    def register_comm_hook(ddp: Any, state: Any, hook: Callable[..., Any]) -> None:
        box = _adopted.get(ddp)
        if box is None or box[0] is not None:  # not ours, or a second hook: DDP's own rules
            return original_register(ddp, state, hook)
        getattr(ddp, DDP_CHECK_COMM_HOOK)(hook)
        if ddp.logger is not None:
            getattr(ddp.logger, DDP_LOGGER_HOOK_NAME)(hook.__qualname__)
        getattr(ddp, DDP_COMM_HOOKS).append((hook, state))
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
    setattr(ddp_class, DDP_BUILTIN_HOOK_REGISTRAR, register_builtin)


def adopt_ddp(ddp: Any) -> bool:
    """Gives ``ddp`` the dispatcher (DDP's own all-reduce, averaged, through the timed
    ``dist.all_reduce``, or the program's hook once it registers one) unless it has a
    comm hook already (then that hook's collectives are timed where they go through
    torch.distributed). False where it was not given (already, or a built-in C++ hook)."""
    if ddp in _adopted or getattr(ddp, DDP_COMM_HOOKS, None) or getattr(ddp, DDP_REDUCER, None) is None:
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
        if timing is not None and _capturing_here():  # a graph being captured: DDP's own way, untimed
            if chosen is None:
                timing.captured += 1  # (a hook's collectives count themselves)
            timing = None
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
    getattr(ddp, DDP_COMM_HOOKS).clear()  # the program has registered nothing
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
