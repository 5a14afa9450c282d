"""Hugging Face transformers: ``SteptraceCallback(log_dir, **options)`` profiles
``Trainer.train``.

    from steptrace.integrations.transformers import SteptraceCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SteptraceCallback("runs/exp1")])
    trainer.train()

One step record per optimizer step (``on_step_begin`` to ``on_step_end``); with
``gradient_accumulation_steps=k`` its k micro-batches are one record: their forward and
backward times add up and ``meta.micro_steps`` says how many forward passes it held.
Phases:

- forward, backward, clip: HF callbacks do not expose them; :meth:`steptrace.Profiler.watch`
  hooks the model (forward, with the loss a model given labels computes inside it),
  ``torch.autograd.backward`` (``accelerator.backward``) and the clip functions
  (``clip_grad_norm_``, and the ``get_total_norm`` / ``clip_grads_with_norm_`` halves
  accelerate calls), see :mod:`steptrace.live.autophase`.
- optimizer: ``on_pre_optimizer_step`` to ``on_optimizer_step``.
- data: the train DataLoader's fetches between steps (the Trainer fetches a step's
  micro-batches before ``on_step_begin``), see :mod:`steptrace.live.intervals`.
- eval and checkpoint intervals (never data, never part of a step's iteration for the
  detectors): ``Trainer.evaluate`` and ``Trainer.predict`` are evaluation and
  ``Trainer._save_checkpoint`` is a checkpoint, timed by wrappers on the Trainer class
  that act only for a Trainer with this callback (HF's ``on_evaluate`` / ``on_predict`` /
  ``on_save`` come after the work, so they only end what is open). With ``watch``, a
  model forward without gradients between steps opens evaluation too.
- restore intervals: a resume, ``train(resume_from_checkpoint=...)``: each call of
  ``Trainer._load_from_checkpoint`` (the model's weights, loaded in ``train()`` before
  ``on_train_begin``: the profiler opens there), ``_load_optimizer_and_scheduler``,
  ``_load_scaler`` and ``_load_rng_state``; and ``_load_best_model``
  (``load_best_model_at_end``) while the profiler is open. HF has no hook for them.
- other: the rest of the time between steps (logging, other callbacks).

``progress``: ``state.global_step`` at ``on_step_begin`` (the optimizer steps completed,
restored by a resume). ``meta``: ``global_step`` and ``epoch`` (``state.global_step`` / ``state.epoch`` at
``on_step_end``, after the update; epoch is fractional), ``lr`` (the first parameter
group's at ``on_pre_optimizer_step``), and ``loss``: the mean training loss the Trainer
logs every ``logging_steps`` (``on_log``), with ``loss_global_step``: the global step it
was logged at. The Trainer computes it after ``on_step_end`` (ending the step later
would add the logging's device sync to the step time), so it lands in the record of the
step after the logged one, and ``loss_global_step`` says which step it belongs to (the
last log of a run has no next step). steptrace never reads the loss tensor itself: on
a GPU that would synchronize every step.

An exception out of ``train()`` (HF has no callback for it) ends the run when the
interpreter exits, with ``run_end.reason`` ``exception`` and its text when it was not
caught; call :meth:`SteptraceCallback.close` in your ``except`` to end it at once.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from steptrace.integrations._common import (
    FrameworkPhases,
    check_options,
    first_lr,
    open_profiler,
    unwrap_optimizer,
)

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError("steptrace.integrations.transformers needs Hugging Face transformers: pip install "
                      "'steptrace[transformers]'") from None


class SteptraceCallback(TrainerCallback):
    """Profiles ``Trainer.train`` into ``<log_dir>/rank<N>.jsonl`` (rank and world size
    from ``TrainingArguments`` unless ``rank=`` / ``world_size=`` are given). ``options``
    are :class:`steptrace.Profiler`'s; a bad one raises here, before anything is written.
    ``watch=False`` leaves the model unhooked (then only the optimizer phase is
    recorded). The profiler opens at ``on_train_begin`` (:attr:`profiler`), or before it
    at a resume's first load, and closes at ``on_train_end``; HF has no hook for an exception inside ``train()``: call
    :meth:`close` in your ``except`` (else it closes at exit: reason ``exception`` for
    an uncaught one, ``exit`` otherwise)."""

    def __init__(self, log_dir: "str | os.PathLike[str]", *, watch: bool = True, **profiler_options: Any) -> None:
        check_options(log_dir, profiler_options)
        self.log_dir = log_dir
        self.watch = watch
        self.profiler_options = profiler_options
        self.profiler: Optional[Any] = None
        self._phases: Optional[FrameworkPhases] = None
        self._intervals: Optional[Any] = None
        self._watched = False  # watch(model) done for the open profiler
        _resume_intervals.install()

    def _open(self, args: Any) -> None:
        """Opens the profiler (at ``on_train_begin``, or earlier at a resume's first load)."""
        if self.profiler is not None and not self.profiler.closed:
            return
        self.profiler = open_profiler(self.log_dir, self.profiler_options, args.process_index, args.world_size)
        self._phases = FrameworkPhases(self.profiler)
        self._watched = False
        from steptrace.live.intervals import IntervalWatch

        self._intervals = IntervalWatch(self.profiler._core, checkpoints=False, data=True)
        _trainer_intervals.add(self)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._open(args)
        if self.watch and model is not None and not self._watched:
            # the optimizer phase comes from the callbacks below, so watch() gets no optimizer
            self._watched = True
            self.profiler.watch(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        prof = self.profiler
        if prof is not None and not prof.closed and not prof._core.in_step:
            core = prof._core
            core.begin_step()
            core.set_progress(int(state.global_step))  # optimizer steps completed: continues after a resume

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                              **kwargs: Any) -> None:
        prof = self.profiler
        if prof is None or prof.closed or not prof._core.in_step:
            return
        lr = first_lr(unwrap_optimizer(optimizer)) if optimizer is not None else None
        if lr is not None:
            prof._core.set_step_value("lr", lr)
        self._phases.begin("optimizer")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._phases is not None:
            self._phases.end("optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        prof = self.profiler
        if prof is None or prof.closed or not prof._core.in_step:
            return
        self._phases.end_open()
        core = prof._core
        core.set_step_value("global_step", state.global_step)
        if state.epoch is not None:
            core.set_step_value("epoch", float(state.epoch))
        core.end_step()

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        prof = self.profiler
        loss = (logs or {}).get("loss")
        if prof is not None and not prof.closed and isinstance(loss, (int, float)):
            core = prof._core  # between steps: the next step's record, saying which step it is from
            core.set_step_value("loss", float(loss))
            core.set_step_value("loss_global_step", state.global_step)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_interval("eval")

    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_interval("eval")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._end_interval("checkpoint")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def _begin_interval(self, kind: str) -> bool:
        watch = self._intervals
        return watch is not None and self.profiler is not None and not self.profiler.closed and watch.begin(kind)

    def _end_interval(self, kind: str) -> None:
        if self._intervals is not None:
            self._intervals.end(kind)

    def close(self, reason: str = "normal", error: str = "") -> None:
        """Closes the profiler (idempotent); ``close("exception", str(e))`` after a failed
        ``train()``."""
        prof = self.profiler
        if prof is None or prof.closed:
            return
        if self._phases is not None:
            self._phases.close()
        _trainer_intervals.discard(self)
        if self._intervals is not None:
            self._intervals.remove()
        prof.close(reason, error)


class _TrainerIntervals:
    """Wrappers on ``transformers.Trainer``'s evaluate / predict / _save_checkpoint that
    time each call as an interval of the SteptraceCallback registered with that Trainer;
    installed while at least one callback is open."""

    METHODS = (("evaluate", "eval"), ("predict", "eval"), ("_save_checkpoint", "checkpoint"))

    def __init__(self) -> None:
        self.callbacks: list[SteptraceCallback] = []
        self.originals: dict[str, Any] = {}

    def add(self, cb: SteptraceCallback) -> None:
        if cb in self.callbacks:
            return
        self.callbacks.append(cb)
        if len(self.callbacks) == 1:
            from transformers import Trainer

            for name, kind in self.METHODS:
                original = Trainer.__dict__.get(name)
                if original is not None:
                    self.originals[name] = original
                    setattr(Trainer, name, self._wrap(original, kind))

    def discard(self, cb: SteptraceCallback) -> None:
        if cb not in self.callbacks:
            return
        self.callbacks.remove(cb)
        if not self.callbacks:
            from transformers import Trainer

            for name, original in self.originals.items():
                if getattr(Trainer.__dict__.get(name), "__wrapped__", None) is original:
                    setattr(Trainer, name, original)  # someone who wrapped it after us keeps theirs
            self.originals.clear()

    def _wrap(self, original: Any, kind: str) -> Any:
        callbacks = self.callbacks

        def timed(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            handler = getattr(trainer, "callback_handler", None)
            ours = [cb for cb in getattr(handler, "callbacks", ()) if cb in callbacks]
            opened = [cb for cb in ours if cb._begin_interval(kind)]
            try:
                return original(trainer, *args, **kwargs)
            finally:
                for cb in opened:
                    cb._end_interval(kind)

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        timed.__name__ = getattr(original, "__name__", "timed")
        timed.__doc__ = getattr(original, "__doc__", None)
        return timed


_trainer_intervals = _TrainerIntervals()


class _ResumeIntervals:
    """Wrappers on the ``transformers.Trainer`` methods that load a checkpoint when
    ``train(resume_from_checkpoint=...)`` resumes: each call is a restore interval of
    the SteptraceCallbacks registered with that Trainer. The first of them runs in
    ``train()`` before ``on_train_begin``, so the callback's profiler opens there.
    Installed once, when the first SteptraceCallback is made (a callback can be added
    after the Trainer is made, when no hook tells us); a Trainer without one of ours
    calls straight through."""

    #: (method, whether it opens the profiler): the resume's loads run before on_train_begin
    METHODS = (("_load_from_checkpoint", True), ("_load_optimizer_and_scheduler", True), ("_load_scaler", True),
               ("_load_rng_state", True), ("_load_best_model", False))

    def __init__(self) -> None:
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        from transformers import Trainer

        for name, opens in self.METHODS:
            original = Trainer.__dict__.get(name)
            if original is not None:
                setattr(Trainer, name, self._wrap(original, opens))

    @staticmethod
    def _wrap(original: Any, opens: bool) -> Any:
        def timed(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            handler = getattr(trainer, "callback_handler", None)
            ours = [cb for cb in getattr(handler, "callbacks", ()) if isinstance(cb, SteptraceCallback)]
            opened = []
            for cb in ours:
                if opens:
                    try:
                        cb._open(trainer.args)
                    except Exception:  # noqa: BLE001 - on_train_begin opens it (and raises) as it always did
                        continue
                if cb._begin_interval("restore"):
                    opened.append(cb)
            try:
                return original(trainer, *args, **kwargs)
            finally:
                for cb in opened:
                    cb._end_interval("restore")

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        timed.__name__ = getattr(original, "__name__", "timed")
        timed.__doc__ = getattr(original, "__doc__", None)
        return timed


_resume_intervals = _ResumeIntervals()
