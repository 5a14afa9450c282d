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
  accelerate calls), see :mod:`steptrace.autophase`.
- optimizer: ``on_pre_optimizer_step`` to ``on_optimizer_step``.
- data: the time before ``on_step_begin`` since the last step ended (the Trainer fetches
  a step's micro-batches before it), logging, evaluation and checkpoints included.

``meta``: ``global_step`` and ``epoch`` (``state.global_step`` / ``state.epoch`` at
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
    recorded). The profiler opens at ``on_train_begin`` (:attr:`profiler`) and closes at
    ``on_train_end``; HF has no hook for an exception inside ``train()``: call
    :meth:`close` in your ``except`` (else it closes at exit: reason ``exception`` for
    an uncaught one, ``exit`` otherwise)."""

    def __init__(self, log_dir: "str | os.PathLike[str]", *, watch: bool = True, **profiler_options: Any) -> None:
        check_options(log_dir, profiler_options)
        self.log_dir = log_dir
        self.watch = watch
        self.profiler_options = profiler_options
        self.profiler: Optional[Any] = None
        self._phases: Optional[FrameworkPhases] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.profiler is not None and not self.profiler.closed:
            return
        self.profiler = open_profiler(self.log_dir, self.profiler_options, args.process_index, args.world_size)
        self._phases = FrameworkPhases(self.profiler)
        if self.watch and model is not None:
            # the optimizer phase comes from the callbacks below, so watch() gets no optimizer
            self.profiler.watch(model)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        prof = self.profiler
        if prof is not None and not prof.closed and not prof._core.in_step:
            prof._core.begin_step()

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

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self, reason: str = "normal", error: str = "") -> None:
        """Closes the profiler (idempotent); ``close("exception", str(e))`` after a failed
        ``train()``."""
        prof = self.profiler
        if prof is None or prof.closed:
            return
        if self._phases is not None:
            self._phases.close()
        prof.close(reason, error)
