"""What the framework integrations share: early option checks, the profiler of one rank,
and the phases a framework's hooks open and close."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional


def check_options(log_dir: "str | os.PathLike[str]", options: dict) -> None:
    """Raises ConfigError / UnknownOptionError for a bad log_dir or option now, when the
    callback is made, rather than when training starts (nothing is written)."""
    from steptrace.live.profiler import build_config

    build_config(log_dir, options)


def open_profiler(log_dir: "str | os.PathLike[str]", options: dict, rank: int, world_size: int,
                  cls: Any = None) -> Any:
    """A profiler (``cls``, default :class:`steptrace.Profiler`) for this rank: the
    framework's rank and world size unless the options name them."""
    from steptrace.live.profiler import Profiler

    options = dict(options)
    options.setdefault("rank", int(rank))
    options.setdefault("world_size", int(world_size))
    return (cls or Profiler)(log_dir, **options)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer): step hooks fire on the inner one."""
    for _ in range(4):  # wrappers of wrappers, bounded
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            return optimizer
        optimizer = inner
    return optimizer


def first_lr(optimizer: Any) -> Optional[float]:
    """The learning rate of the first parameter group, when it is a plain number (or a
    CPU tensor); None otherwise."""
    try:
        lr = optimizer.param_groups[0]["lr"]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None
    if isinstance(lr, (int, float)):
        return float(lr)
    device = getattr(lr, "device", None)
    if device is not None and device.type == "cpu" and lr.numel() == 1:
        return float(lr.item())
    return None  # a device tensor: reading it would synchronize


def cpu_scalar(value: Any) -> Optional[float]:
    """A loss as a float when that is free: a number, or a one-element CPU tensor. A
    device tensor gives None (``.item()`` would wait for the device every step)."""
    if isinstance(value, (int, float)):
        return float(value)
    device = getattr(value, "device", None)
    if device is not None and device.type == "cpu" and value.numel() == 1:
        return float(value.detach().item())
    return None


class FrameworkPhases:
    """Opens and closes the named phases a framework's hooks bracket, through the gate of
    :mod:`steptrace.live.autophase`: one phase of ours at a time, on the training thread, only
    inside a step and only while no other phase is open (so phases never nest, and the
    user's own ``prof.phase`` blocks and watch()'s hooks do not collide with ours)."""

    def __init__(self, prof: Any) -> None:
        from steptrace.live.autophase import PhaseGate

        self._gate = gate = PhaseGate(prof._core)
        self.end, self.end_open, self.close = gate.end, gate.end_open, gate.close

    @property
    def open(self) -> Optional[str]:
        """The phase of ours that is open, or None."""
        return self._gate.opened

    def begin(self, name: str) -> None:
        """Opens ``name`` after closing ours that is open (a framework hook whose end
        never came, such as a step skipped by the framework)."""
        self._gate.end_open()
        self._gate.begin(name)


def wrap_method(obj: Any, attr: str, begin: "Callable[..., bool]", end: "Callable[[], None]", *,
                with_args: bool = False) -> "Callable[[], None]":
    """Replaces ``obj.<attr>`` (a bound method, or someone's wrapper of it) by an instance
    attribute that calls ``begin()`` (``begin(*args, **kwargs)`` of the call with
    ``with_args``) before it and, when that returned True, ``end()`` after it (also when
    it raises). Returns the undo, which leaves a later wrapper in place."""
    original = getattr(obj, attr)
    had_own = attr in vars(obj)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        opened = begin(*args, **kwargs) if with_args else begin()
        try:
            return original(*args, **kwargs)
        finally:
            if opened:
                end()

    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(obj, attr, wrapped)

    def undo() -> None:
        if vars(obj).get(attr) is wrapped:
            if had_own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)

    return undo
