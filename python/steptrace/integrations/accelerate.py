"""Hugging Face accelerate: ``profile(accelerator, log_dir, model=..., optimizer=...)``
returns a :class:`steptrace.Profiler` for this process.

    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    with steptrace.integrations.accelerate.profile(accelerator, "runs/exp1", model=model, optimizer=opt) as prof:
        for batch in prof.data(loader):
            with prof.step():
                accelerator.backward(loss_fn(model(batch["x"]), batch["y"])); opt.step(); opt.zero_grad()

Rank and world size come from the accelerator (``process_index`` / ``num_processes``).
While it is open, ``accelerator.backward`` is timed as the backward phase and
``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` as clip (all put back at close);
``model`` and ``optimizer`` are watched (:meth:`steptrace.Profiler.watch`) for the
forward and optimizer phases, ``accelerator.save_state`` is a checkpoint interval and
``accelerator.load_state`` (between steps) a restore interval (:meth:`steptrace.Profiler.interval`).
accelerate keeps no training-step count across ``load_state``: call ``prof.set_step(n)``
after it, and the steps get ``progress`` n, n+1, ... and ``meta.global_step`` counts on
from n. ``meta``: ``global_step`` (optimizer steps
taken, counted by the optimizer's step post-hook: under ``accelerator.accumulate`` only
the steps that update) and ``lr`` (the first parameter group's after the step). The
step boundaries are yours: ``with prof.step():`` around each optimizer step (a
step's micro-batches in one record) or each batch.
"""

from __future__ import annotations

import os
from typing import Any

from steptrace.integrations._common import FrameworkPhases, first_lr, open_profiler, unwrap_optimizer, wrap_method
from steptrace.live.profiler import Profiler


class _AcceleratorProfiler(Profiler):
    """A Profiler that puts the accelerator's backward back and removes its step hook at close."""

    _accelerate_undo: list
    _optimizer_steps: list  # [optimizer steps taken], the global_step meta

    def set_step(self, step: int) -> None:
        """:meth:`steptrace.Profiler.set_step`, and ``meta.global_step`` counts on from
        ``step`` too (accelerate keeps no step count across ``load_state``: the program
        says where it resumed)."""
        super().set_step(step)
        counter = getattr(self, "_optimizer_steps", None)
        if counter is not None:
            counter[0] = int(step)

    def close(self, reason: str = "normal", error: str = "") -> None:
        undo, self._accelerate_undo = getattr(self, "_accelerate_undo", []), []
        for fn in reversed(undo):
            fn()
        super().close(reason, error)


def profile(accelerator: Any, log_dir: "str | os.PathLike[str]", *, model: Any = None, optimizer: Any = None,
            **options: Any) -> Profiler:
    """A profiler for this process of ``accelerator``'s run (see the module docstring).
    ``options`` are :class:`steptrace.Profiler`'s; ``rank=`` / ``world_size=`` override
    the accelerator's. Raises ConfigError for a bad option or argument before anything is
    written."""
    from steptrace.errors import ConfigError

    backward = getattr(accelerator, "backward", None)
    if not callable(backward) or not hasattr(accelerator, "process_index"):
        raise ConfigError(f"profile(accelerator, ...): accelerator must be an accelerate.Accelerator, "
                          f"got {type(accelerator).__name__}")
    inner = unwrap_optimizer(optimizer) if optimizer is not None else None
    if inner is not None and not hasattr(inner, "register_step_post_hook"):
        raise ConfigError(f"profile(optimizer=...): a torch.optim.Optimizer (or accelerate's wrapper of one) "
                          f"is needed, got {type(optimizer).__name__}")
    prof = open_profiler(log_dir, options, accelerator.process_index, accelerator.num_processes,
                         cls=_AcceleratorProfiler)
    prof._accelerate_undo = []
    prof._optimizer_steps = [0]
    try:
        if model is not None:
            prof.watch(model, inner)
        _time_method(prof, accelerator, "backward", "backward")
        # accelerate clips with get_total_norm / clip_grads_with_norm_, which watch() does not see
        for attr in ("clip_grad_norm_", "clip_grad_value_"):
            if callable(getattr(accelerator, attr, None)):
                _time_method(prof, accelerator, attr, "clip")
        if callable(getattr(accelerator, "save_state", None)) or callable(getattr(accelerator, "load_state", None)):
            _time_state(prof, accelerator)
        if inner is not None:
            _count_optimizer_steps(prof, inner)
    except BaseException:
        prof.close("exception", "steptrace.integrations.accelerate.profile failed")
        raise
    return prof


def _time_method(prof: _AcceleratorProfiler, accelerator: Any, attr: str, phase: str) -> None:
    """Times ``accelerator.<attr>`` as ``phase`` until the profiler closes."""
    phases = FrameworkPhases(prof)

    def begin() -> bool:
        if phases.open is not None:
            return False
        phases.begin(phase)  # does nothing outside a step or inside another phase
        return True

    unwrap = wrap_method(accelerator, attr, begin, lambda: phases.end(phase))

    def undo() -> None:
        phases.close()
        unwrap()

    prof._accelerate_undo.append(undo)


def _time_state(prof: _AcceleratorProfiler, accelerator: Any) -> None:
    """``accelerator.save_state`` is a checkpoint interval and ``accelerator.load_state``
    (outside a step) a restore interval, until the profiler closes."""
    from steptrace.live.intervals import IntervalWatch

    intervals = IntervalWatch(prof._core, checkpoints=False)
    for attr, kind in (("save_state", "checkpoint"), ("load_state", "restore")):
        if callable(getattr(accelerator, attr, None)):
            prof._accelerate_undo.append(
                wrap_method(accelerator, attr, lambda kind=kind: intervals.begin(kind),
                            lambda kind=kind: intervals.end(kind)))


def _count_optimizer_steps(prof: _AcceleratorProfiler, optimizer: Any) -> None:
    steps = prof._optimizer_steps
    set_value = prof._core.set_step_value

    def after_step(opt: Any, args: Any, kwargs: Any) -> None:
        steps[0] += 1
        set_value("global_step", steps[0])
        lr = first_lr(opt)
        if lr is not None:
            set_value("lr", lr)

    handle = optimizer.register_step_post_hook(after_step)
    prof._accelerate_undo.append(handle.remove)
