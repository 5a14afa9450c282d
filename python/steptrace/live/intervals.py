"""Where the time between steps goes, found without the program's help.

:class:`IntervalWatch` is what ``steptrace run`` and the framework integrations install
on the training thread (the thread that makes it):

- checkpoint: each call of ``torch.save``, ``torch.distributed.checkpoint.save`` /
  ``save_state_dict`` / ``async_save`` and ``safetensors.torch.save_file`` /
  ``save_model`` is a checkpoint interval (calls inside one are part of it). Only calls
  made through those names after the watch is installed are seen: a module that did
  ``from torch import save`` earlier keeps the untimed function.
- restore: each call, outside a step and outside a DataLoader fetch, of ``torch.load``,
  ``torch.distributed.checkpoint.load`` / ``load_state_dict`` and
  ``safetensors.torch.load_file`` / ``load_model`` is a restore interval (before the
  first step too: a resume, or pretrained weights). ``nn.Module.load_state_dict`` and
  ``torch.optim.Optimizer.load_state_dict`` are restore only when they apply a load:
  after one of those loads and before the next step (``model.load_state_dict(torch.load(p))``);
  alone, between steps, they are not (a DQN's target network copied from the policy
  network every step, an EMA's weights swapped in for evaluation). A load inside a
  step is not a restore (a dataset reading its tensors). A save inside a restore, or a
  load inside a save, is one interval of the outer kind.
- data (``data=True``): each fetch of a ``torch.utils.data.DataLoader`` between steps is a
  data wait (the framework's own fetch); inside a step or an interval it is not data.
- eval: :meth:`forward_without_grad` is called by the forward hooks (see
  :mod:`steptrace.live.autophase`): a forward with gradients disabled between steps opens an
  evaluation interval, which the next step (or a checkpoint, or the end of the run) ends;
  under ``steptrace run`` a forward of a module in eval mode with gradients enabled
  (:meth:`evaluation_forward`) does too, until a backward shows it was training.

Every wrapper passes through untouched on other threads, inside dynamo tracing, and once
the profiler is closed; none raises into the program.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable

from steptrace.errors import UsageError

#: Functions whose calls are checkpoint intervals: (module, attribute).
CHECKPOINT_FUNCTIONS = (
    ("torch", "save"),
    ("torch.serialization", "save"),
    ("torch.distributed.checkpoint", "save"),
    ("torch.distributed.checkpoint", "save_state_dict"),
    ("torch.distributed.checkpoint", "async_save"),
    ("safetensors.torch", "save_file"),
    ("safetensors.torch", "save_model"),
)

#: Functions whose calls (outside a step) are restore intervals: (module, attribute).
RESTORE_FUNCTIONS = (
    ("torch", "load"),
    ("torch.serialization", "load"),
    ("torch.distributed.checkpoint", "load"),
    ("torch.distributed.checkpoint", "load_state_dict"),
    ("safetensors.torch", "load_file"),
    ("safetensors.torch", "load_model"),
)

#: Methods that apply loaded state: restore only right after a load (see the module doc).
APPLY_METHODS = (
    ("torch.nn", "Module", "load_state_dict"),
    ("torch.optim", "Optimizer", "load_state_dict"),
)

#: An interval of the key's kind begun while one of these is open joins it (one interval
#: of the outer kind) instead of ending it.
_JOINS = {"checkpoint": ("restore",), "restore": ("checkpoint",)}

try:  # dynamo folds it to True while tracing: a traced wrapper adds nothing to the graph
    from torch.compiler import is_compiling as _compiling
except ImportError:  # torch < 2.3
    def _compiling() -> bool:
        return False


class IntervalWatch:
    """Checkpoint saves and restores (and optionally DataLoader fetches) of the training
    thread timed as their own kinds in ``core`` (a ``steptrace._core.Profiler``), until
    :meth:`remove`.

    ``checkpoints=False`` leaves the save and load functions alone (an integration that
    knows its framework's checkpoints better); ``data=True`` times DataLoader fetches
    between steps as data (for programs whose loader steptrace does not wrap)."""

    def __init__(self, core: Any, *, checkpoints: bool = True, data: bool = False) -> None:
        import torch

        self._core = core
        self._thread = threading.get_ident()
        self._undo: list[Callable[[], None]] = []
        self._wrappers: dict[int, Any] = {}
        self._grad_enabled = torch.is_grad_enabled
        self._fetching = 0  # inside a DataLoader fetch we time: a load there is the dataset's
        self._restored_at = -1  # step_index when the last restore ended (a load to apply)
        if checkpoints:
            for module_name, attr in CHECKPOINT_FUNCTIONS:
                self._patch(module_name, attr, self._as_checkpoint)
            for module_name, attr in RESTORE_FUNCTIONS:
                self._patch(module_name, attr, self._as_restore)
            for module_name, owner, attr in APPLY_METHODS:
                cls = getattr(importlib.import_module(module_name), owner, None)
                if cls is not None:
                    self._patch_attr(cls, attr, self._as_apply)
        if data:
            from torch.utils.data import dataloader

            self._patch_attr(dataloader._BaseDataLoaderIter, "__next__", self._as_data)
            # making an iterator starts the loader's workers: the loader's start, like its first batch
            self._patch_attr(dataloader.DataLoader, "__iter__", self._as_loader_start)

    # ---- what the hooks call ----
    def forward_without_grad(self) -> bool:
        """A forward call began on some thread: between steps, with gradients disabled,
        on the training thread, it opens an evaluation interval (if none is open). True
        when it opened one."""
        return not self._grad_enabled() and self.evaluation_forward()

    def evaluation_forward(self) -> bool:
        """A forward call that is not training began on some thread (one in eval mode
        with gradients enabled, under ``steptrace run``, until a backward says otherwise):
        between steps, on the training thread, it opens an evaluation interval (if none is
        open). True when it opened one."""
        core = self._core
        if (threading.get_ident() != self._thread or core.in_step
                or core.open_interval is not None or core.closed):
            return False
        try:
            core.begin_interval("eval")
        except UsageError:  # closed from another thread meanwhile: never into the program
            return False
        return True

    def begin(self, kind: str) -> bool:
        """Opens an interval of ``kind`` on the training thread unless one of that kind is
        open (or, for a checkpoint save and a restore, one of the other: the outer one
        holds both); a restore only outside a step. True when it did (then :meth:`end` it)."""
        core = self._core
        if threading.get_ident() != self._thread or core.closed or _compiling():
            return False
        open_kind = core.open_interval
        if open_kind == kind or open_kind in _JOINS.get(kind, ()):
            return False
        if kind == "restore" and core.in_step:
            return False
        try:
            core.begin_interval(kind)
        except UsageError:
            return False
        return True

    def end(self, kind: str) -> None:
        core = self._core
        if not core.closed:
            core.end_interval(kind)
            if kind == "restore":
                self._restored_at = core.step_index

    # ---- installation ----
    def _patch(self, module_name: str, attr: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - not installed (safetensors) or unavailable (distributed)
            return
        self._patch_attr(module, attr, wrap)

    def _patch_attr(self, owner: Any, attr: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return
        # one wrapper per function, whatever its names (torch.load is torch.serialization.load):
        # pickle finds a function by its module and name and wants that very object back
        wrapper = self._wrappers.get(id(original))
        if wrapper is None or wrapper.__wrapped__ is not original:
            wrapper = wrap(original)
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            for name in ("__name__", "__qualname__", "__doc__", "__module__"):
                try:
                    setattr(wrapper, name, getattr(original, name))
                except (AttributeError, TypeError):
                    pass
            self._wrappers[id(original)] = wrapper
        setattr(owner, attr, wrapper)

        def undo() -> None:
            if getattr(owner, attr, None) is wrapper:  # someone who wrapped it after us keeps theirs
                setattr(owner, attr, original)

        self._undo.append(undo)

    def _timed(self, original: Callable[..., Any], kind: str, when: Callable[[], bool]) -> Callable[..., Any]:
        """``original`` timed as an interval of ``kind`` when ``when()`` and :meth:`begin` allow."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            opened = when() and self.begin(kind)
            try:
                return original(*args, **kwargs)
            finally:
                if opened:
                    self.end(kind)

        return timed

    def _as_checkpoint(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self._timed(original, "checkpoint", lambda: True)

    def _as_restore(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self._timed(original, "restore", lambda: not self._fetching)

    def _as_apply(self, original: Callable[..., Any]) -> Callable[..., Any]:
        core = self._core
        # applying what a load since the last step brought in: part of the restore
        return self._timed(original, "restore", lambda: (not self._fetching and not core.in_step
                                                         and self._restored_at == core.step_index))

    def _as_data(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self._data_wait(original, always_start=False)

    def _as_loader_start(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self._data_wait(original, always_start=True)

    def _data_wait(self, original: Callable[..., Any], always_start: bool) -> Callable[..., Any]:
        """A call that waits on the loader, timed as data between steps. The loader's start
        at an epoch boundary (``always_start``: making its iterator; a new iterator's first
        batch; the fetch that ends an iterator, where a DataLoader joins its workers) is
        data too, and its own figure (``data_start_ms``), which the slow-step rules leave out."""
        core = self._core

        def timed(it: Any) -> Any:
            if (threading.get_ident() != self._thread or core.in_step or core.open_interval is not None
                    or core.closed):
                return original(it)
            try:
                core.begin_data()
            except UsageError:  # a fetch inside a fetch (a loader in a dataset), or closed
                return original(it)
            start = always_start or getattr(it, "_num_yielded", None) == 0
            self._fetching += 1
            try:
                return original(it)
            except StopIteration:
                start = True
                raise
            finally:
                self._fetching -= 1
                if not core.closed:
                    core.end_data(start)

        return timed

    def remove(self) -> None:
        """Restores every wrapped function. Idempotent."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._wrappers.clear()
