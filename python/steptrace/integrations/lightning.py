"""PyTorch Lightning: ``SteptraceCallback(log_dir, **options)`` profiles ``trainer.fit``.

    from steptrace.integrations.lightning import SteptraceCallback
    trainer = lightning.pytorch.Trainer(callbacks=[SteptraceCallback("runs/exp1")])
    trainer.fit(model, loader)

It subclasses the ``Callback`` of ``lightning.pytorch`` or of ``pytorch_lightning``:
whichever the program imported first, else whichever is installed (``lightning`` first).

One step record per optimizer step. With ``accumulate_grad_batches=k`` the k batches of
one optimizer step make one record: their forward and backward times add up, and
``meta.micro_steps`` says how many batches it held. Phases, from Lightning's hooks (in
the order Lightning 2.x calls them under automatic optimization, where training_step
and backward run inside the optimizer's closure):

- forward: the end of ``on_train_batch_start`` to ``on_before_zero_grad`` /
  ``on_before_backward``: ``training_step`` with the loss (and the module's own
  ``on_train_batch_start`` hook).
- backward: ``on_before_backward`` to ``on_after_backward``.
- optimizer: ``on_before_optimizer_step`` to the optimizer's step post-hook (gradient
  clipping, which Lightning runs after that hook, included).
- data: the time between one step's last ``on_train_batch_end`` and the next batch's
  ``on_train_batch_start`` (fetching the batch, moving it to the device, epoch-end
  hooks), less the intervals run in between:
- eval: ``on_validation_start`` to ``on_validation_end`` (the sanity check included);
- checkpoint: each ``trainer.save_checkpoint`` call (``ModelCheckpoint`` saves through it).
- restore: a resume (``fit(ckpt_path=...)``, or Lightning's SLURM requeue checkpoint):
  the checkpoint's load with the model's and callbacks' state, then the optimizers' and
  loops' state, two intervals before the first step. The profiler opens at fit's
  ``setup`` hook, which Lightning calls before it restores.

Under manual optimization (``automatic_optimization = False``; one step record per
batch) the same hooks fire from inside ``training_step``: forward from the batch start
to the first ``manual_backward``, backward, optimizer from ``on_before_optimizer_step``
to the optimizer's step post-hook, and forward again after each optimizer step (the next
optimizer's loss, a discriminator's) until the next ``manual_backward`` or the batch end.

``progress``: ``trainer.global_step`` when the step begins: optimizer steps completed, all
optimizers' (two a batch in a GAN's manual loop: 0, 2, 4, ...), restored by a resume.
``meta``: ``global_step`` (``trainer.global_step`` after the step), ``epoch``
(``trainer.current_epoch``), ``lr`` (``trainer.optimizers[0].param_groups[0]["lr"]`` at
``on_before_optimizer_step``: the rate the update used), ``loss`` (the step's training
loss, the sum of its micro-batches' normalized losses: only when it is on the CPU, where
reading it costs nothing; never on a GPU, where it would synchronize).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from steptrace.integrations._common import (
    FrameworkPhases,
    check_options,
    cpu_scalar,
    first_lr,
    open_profiler,
    unwrap_optimizer,
    wrap_method,
)


def _callback_base() -> type:
    for name in ("lightning.pytorch", "pytorch_lightning"):  # the one the program uses
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "Callback"):
            return module.Callback
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError:
            raise ImportError("steptrace.integrations.lightning needs PyTorch Lightning: pip install "
                              "'steptrace[lightning]' (or lightning / pytorch_lightning)") from None
    return Callback


class SteptraceCallback(_callback_base()):  # type: ignore[misc]
    """Profiles ``trainer.fit`` into ``<log_dir>/rank<N>.jsonl``, one file per rank (rank
    and world size from the trainer unless ``rank=`` / ``world_size=`` are given).
    ``options`` are :class:`steptrace.Profiler`'s; a bad one raises here, before
    anything is written. The profiler opens at fit's ``setup`` (:attr:`profiler`), before
    a checkpoint is restored, and closes at ``on_fit_end`` / ``teardown``, or with reason exception (signal for Ctrl+C)
    in ``on_exception``."""

    def __init__(self, log_dir: "str | os.PathLike[str]", **profiler_options: Any) -> None:
        super().__init__()
        check_options(log_dir, profiler_options)
        self.log_dir = log_dir
        self.profiler_options = profiler_options
        self.profiler: Optional[Any] = None  # the steptrace.Profiler while fit runs
        self._phases: Optional[FrameworkPhases] = None
        self._handles: list = []  # optimizer step post-hooks
        self._global_step_at_begin = 0
        self._micro_steps = 0
        self._loss: Optional[float] = 0.0  # sum over the step's micro-batches; None: not on the CPU
        self._data_open = False  # a begin_data without its end_data: the wait for the next step
        self._manual = False  # the module uses manual optimization
        self._intervals: Optional[Any] = None  # steptrace.live.intervals.IntervalWatch while fit runs
        self._unwrap_save: Optional[Any] = None  # puts trainer.save_checkpoint back
        self._unwrap: list = []  # puts the checkpoint connector's restore methods back
        self._work: Optional[Any] = None  # steptrace.live.work.BatchWork while fit runs

    # ---- lifecycle ----
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # fit's setup hook comes before Lightning restores a checkpoint (ckpt_path): open
        # here, so that the restore is recorded
        if stage == "fit":
            self._open(trainer, pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._open(trainer, pl_module)

    def _open(self, trainer: Any, pl_module: Any) -> None:
        if self.profiler is not None and not self.profiler.closed:
            return  # a second fit with the same callback appends to the same run
        self.profiler = open_profiler(self.log_dir, self.profiler_options, trainer.global_rank, trainer.world_size)
        self._phases = FrameworkPhases(self.profiler)
        self._manual = not getattr(pl_module, "automatic_optimization", True)
        self._work = None
        if self.profiler._count_work:
            from steptrace.live.work import BatchWork

            self._work = BatchWork(self.profiler._core)
        from steptrace.live.intervals import IntervalWatch

        self._intervals = IntervalWatch(self.profiler._core, checkpoints=False)
        self._time_checkpoints(trainer)
        self._time_restore(trainer)

    def _time_checkpoints(self, trainer: Any) -> None:
        """Every ``trainer.save_checkpoint`` call (ModelCheckpoint's too) is a checkpoint
        interval: an instance attribute wraps the method until the run closes."""
        intervals = self._intervals
        self._unwrap_save = wrap_method(trainer, "save_checkpoint", lambda: intervals.begin("checkpoint"),
                                        lambda: intervals.end("checkpoint"))

    def _time_restore(self, trainer: Any) -> None:
        """A resume (``fit(ckpt_path=...)``, or Lightning's own SLURM requeue checkpoint) is
        restore intervals: the checkpoint's load with the model's and callbacks' state
        (``_restore_modules_and_callbacks``, before the strategy's setup), then the
        optimizers', schedulers' and loops' state (``restore_training_state``, after
        ``on_fit_start``). Both are called on every fit: only one that has a checkpoint
        to load is timed."""
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is None:
            return
        intervals = self._intervals

        def has_path(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> bool:
            try:
                resuming = checkpoint_path is not None or connector._hpc_resume_path is not None
            except Exception:  # noqa: BLE001 - a private property of another version
                resuming = checkpoint_path is not None
            return resuming and intervals.begin("restore")

        def has_loaded(*args: Any, **kwargs: Any) -> bool:
            return bool(getattr(connector, "_loaded_checkpoint", None)) and intervals.begin("restore")

        end = lambda: intervals.end("restore")  # noqa: E731
        for attr, begin in (("_restore_modules_and_callbacks", has_path), ("restore_training_state", has_loaded)):
            if callable(getattr(connector, attr, None)):
                self._unwrap.append(wrap_method(connector, attr, begin, end, with_args=True))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._remove_hooks()
        for optimizer in trainer.optimizers:  # set up by now (strategy.setup)
            opt = unwrap_optimizer(optimizer)
            register = getattr(opt, "register_step_post_hook", None)
            if register is not None:
                self._handles.append(register(self._after_optimizer_step))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close("normal")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close("normal")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        reason = "signal" if isinstance(exception, KeyboardInterrupt) else "exception"
        self._close(reason, f"{type(exception).__name__}: {exception}")

    # ---- steps ----
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        prof = self.profiler
        if prof is None or prof.closed:
            return
        core = prof._core
        if not core.in_step:
            # An epoch's first batch waited for the loader's start (its workers start), and
            # its last for the loader's end (Lightning fetches a batch ahead, so the fetch
            # that ends the iterator, where a DataLoader joins its workers, comes before it):
            # data, but the loader's own periodic cost, not a slow step (data_start_ms).
            progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "batch_progress", None)
            self._end_data(loader_start=batch_idx == 0 or bool(getattr(progress, "is_last_batch", False)))
            core.begin_step()
            self._global_step_at_begin = trainer.global_step
            # optimizer steps completed (all optimizers'), restored by a resume: the progress
            core.set_progress(int(trainer.global_step))
            self._micro_steps, self._loss = 0, 0.0
        self._micro_steps += 1
        if self._work is not None:
            self._work.begin(batch)  # samples, tokens; FLOPs of the first batch of a shape
        self._phases.begin("forward")

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._phases is not None and self._phases.open == "forward":
            self._phases.end("forward")  # the closure zeroes gradients between training_step and backward

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._phases is not None:
            self._phases.begin("backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if self._phases is not None:
            self._phases.end("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._phases is None or self.profiler.closed:
            return
        opt = unwrap_optimizer(optimizer)
        first = trainer.optimizers[0] if trainer.optimizers else optimizer
        lr = first_lr(opt) if opt is unwrap_optimizer(first) else None  # several optimizers: the first one's
        if lr is not None:
            self.profiler._core.set_step_value("lr", lr)
        self._phases.begin("optimizer")

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._phases is not None and self._phases.open == "optimizer":
            self._phases.end("optimizer")
            if self._manual:
                # training_step goes on after opt.step() (a second model's loss, a GAN's
                # discriminator): forward again, until the next backward or the batch end
                self._phases.begin("forward")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        prof = self.profiler
        if prof is None or prof.closed or not prof._core.in_step:
            return
        self._phases.end_open()
        if self._work is not None:
            self._work.end()
        if self._loss is not None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            value = cpu_scalar(loss) if loss is not None else None
            self._loss = None if value is None else self._loss + value
        if trainer.global_step == self._global_step_at_begin:
            return  # accumulating gradients: the optimizer step that ends this step is still to come
        self._end_step(trainer)
        core = prof._core
        core.begin_data()  # bracketed waits, so that validation can be left out of data_ms
        self._data_open = True

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._intervals is not None:
            self._intervals.begin("eval")  # pauses the data wait in progress

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._intervals is not None:
            self._intervals.end("eval")

    def _end_step(self, trainer: Any, failed: bool = False) -> None:
        core = self.profiler._core
        set_value = core.set_step_value
        set_value("global_step", trainer.global_step)
        set_value("epoch", trainer.current_epoch)
        if self._loss is not None:
            set_value("loss", self._loss)
        if self._micro_steps > 1:
            set_value("micro_steps", self._micro_steps)
        core.end_step(failed)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        prof = self.profiler
        if prof is not None and not prof.closed and prof._core.in_step:
            self._phases.end_open()
            self._end_step(trainer)  # batches accumulated when training stopped: no optimizer step followed

    # ---- internals ----
    def _end_data(self, loader_start: bool = False) -> None:
        if self._data_open:
            self._data_open = False
            self.profiler._core.end_data(loader_start)

    def _remove_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()

    def _close(self, reason: str, error: str = "") -> None:
        self._remove_hooks()
        if self._unwrap_save is not None:
            self._unwrap_save()
            self._unwrap_save = None
        unwrap, self._unwrap = self._unwrap, []
        for undo in reversed(unwrap):
            undo()
        prof = self.profiler
        if prof is None or prof.closed:
            return
        self._end_data()
        if self._work is not None:
            self._work.end()  # a FLOP count left running by an exception stops here
        if self._phases is not None:
            self._phases.close()
        prof.close(reason, error)  # an open step ends as failed
