"""Automatic phases: hooks that open and close the forward / loss / backward / clip /
optimizer phases of the step in progress, so that ``with prof.step():`` alone is enough.

Where each phase comes from:

- forward: a forward pre-hook and an always-called forward hook on the watched module
  (:class:`PhaseHooks`), or on the outermost module call of the training thread
  (:class:`GlobalPhaseHooks`, for ``steptrace run``).
- loss: the same hooks on an ``nn.Module`` loss; a plain loss function is wrapped in the
  module that defines it (see :class:`PhaseHooks`).
- backward: ``torch.autograd.backward`` (which ``Tensor.backward`` calls) is wrapped while
  something is watched. The call is synchronous on the calling thread, so its return is
  the end of backward with everything the engine runs at the end included (DDP's
  reducer finalizes, and waits for its all-reduces, in an engine callback). Engine-side
  hooks (a pre-hook on the loss's ``grad_fn`` with ``queue_callback`` for the end) would
  run on the autograd device threads under CUDA, miss the engine's set-up, and need a
  re-queued callback to land after DDP's; they cost a registration per step too.
- clip: ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` are wrapped while
  something is watched, and restored when the last watcher is removed.
- optimizer: ``Optimizer.register_step_pre_hook`` / ``register_step_post_hook`` (or the
  global optimizer step hooks). A closure optimizer (LBFGS runs forward and backward in
  ``optimizer.step(closure)``, up to ``max_iter`` times a step) gets its closure wrapped
  by the pre-hook: the optimizer phase is closed while the closure runs and reopened
  after it, so the closure's forward, loss and backward are timed as such, inside the
  optimizer call, and ``optimizer`` holds the optimizer's own work (LBFGS's line search
  and direction). The step still ends once, when ``step()`` returns.

Phases never nest: a hook opens its phase only inside a step, on the training thread
(the one that created the hooks), and while no other phase is open, so the user's own
``with prof.phase(...)`` blocks win and a loss computed inside ``forward`` (a Hugging
Face model given labels) stays part of forward. Outside a step a forward with gradients
disabled, or of a module in eval mode, opens an evaluation interval
(:meth:`steptrace.live.intervals.IntervalWatch.evaluation_forward`), which the next step ends;
other calls outside a step do nothing. (Under ``steptrace run``, where the hooks draw the
steps, a forward in eval mode with gradients is training after all when a backward
follows it: :class:`GlobalPhaseHooks`.) A phase that runs several times in one step (gradient
accumulation: several forward / backward micro-steps before one optimizer step)
accumulates its time in the step record, and from the second outermost forward of the
same module on, the record's ``meta`` says how many there were (``micro_steps``).

Hooks that dynamo traces (a module hooked, then compiled) check
``torch.compiler.is_compiling()`` first and so add nothing to the graph: no graph break,
``fullgraph=True`` still compiles, and that module's forward is not timed; hooks on the
compiled wrapper (``watch(torch.compile(model))``) run outside the compiled frame.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable, Optional

from steptrace.errors import ConfigError, UsageError

PHASES = ("forward", "loss", "backward", "clip", "optimizer")


def _not_compiling() -> bool:
    return False


try:  # dynamo folds it to True while tracing, so a traced hook is empty: no graph break
    from torch.compiler import is_compiling as _compiling
except ImportError:  # torch < 2.3: no dynamo-aware check
    _compiling = _not_compiling


_INDEX = {name: i for i, name in enumerate(PHASES)}


class PhaseGate:
    """Opens and closes the phases of one profiler core on behalf of hooks: at most one
    phase of ours at a time, only on the thread that made the gate (the training thread),
    only inside a step, only while no phase is open; :meth:`end` closes only the phase
    :meth:`begin` opened. Every test is in the C core (:attr:`gates`, one call per
    boundary); this class adds the dynamo check and the names. Phases are those of
    :data:`PHASES`; any other name raises KeyError.

    The framework integrations and :class:`PhaseHooks` use it; it is public for hooks of
    your own (a framework callback that brackets a phase)."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self.gates = core.phase_gates(list(PHASES))  # steptrace._core.PhaseGates

    def begin(self, name: str, module: Any = None) -> bool:
        """Opens phase ``name`` when allowed; True when it did (then call :meth:`end`).
        ``module``: count this as one more outermost forward of that module in the step
        (``meta.micro_steps`` from the second on)."""
        if _compiling():
            return False  # traced by dynamo (a module compiled after it was hooked): add nothing to the graph
        return self.gates.begin(_INDEX[name], module)

    def end(self, name: str) -> None:
        """Closes phase ``name`` if :meth:`begin` opened it (else nothing)."""
        if not _compiling():
            self.gates.end(_INDEX[name])

    def end_open(self) -> None:
        """Closes the phase of ours that is open, if any."""
        opened = self.gates.opened
        if opened is not None:
            self.gates.end(_INDEX[opened])

    @property
    def opened(self) -> Optional[str]:
        """The phase :meth:`begin` opened and :meth:`end` did not close yet, or None."""
        return self.gates.opened

    @property
    def micro_steps(self) -> int:
        """Outermost forward calls counted in the step in progress (or the last one)."""
        return self.gates.micro_steps

    @property
    def closed(self) -> bool:
        return self.gates.closed

    def close(self) -> None:
        """From now on :meth:`begin` opens nothing (a phase still open ends with its step)."""
        self.gates.close()


def _suspending_closure(gates: Any, index: int, closure: Callable[..., Any]) -> Callable[..., Any]:
    """``closure`` run with the optimizer phase (gate ``index``, open) closed, and
    reopened after it: the phases of its forward and backward open inside it, and each
    phase's time stays its own (phases never nest: they add up to at most the step)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        suspended = gates.opened == "optimizer"
        if suspended:
            gates.end(index)
        try:
            return closure(*args, **kwargs)
        finally:
            if suspended:
                gates.begin(index)

    run.__wrapped__ = closure  # type: ignore[attr-defined]
    return run


def _with_closure_phases(gates: Any, index: int, args: Any, kwargs: Any) -> Any:
    """For an optimizer step pre-hook that opened the optimizer phase: ``(args, kwargs)``
    with the step's closure (``step(closure)`` / ``step(closure=...)``) wrapped by
    :func:`_suspending_closure`, or None (torch keeps its own) when there is none. torch
    passes the hooks ``step``'s own arguments, the optimizer first; called only when there
    is more than it: a plain ``step()`` costs a length test."""
    if len(args) > 1:
        if not callable(args[1]):
            return None
        return (args[0], _suspending_closure(gates, index, args[1]), *args[2:]), kwargs
    closure = kwargs.get("closure")
    if not callable(closure):
        return None
    return args, {**kwargs, "closure": _suspending_closure(gates, index, closure)}


class _GlobalWrap:
    """One function of a torch module replaced, while at least one gate listens, by a
    wrapper that times each outermost call as a phase of every listening gate. Installed
    at most once per function for any number of profilers."""

    def __init__(self, modules: tuple[str, ...], attr: str, phase: str) -> None:
        self.modules, self.attr, self.phase = modules, attr, phase
        self.gates: list[Any] = []  # steptrace._core.PhaseGates of the listening PhaseGates
        self.original: Optional[Callable[..., Any]] = None
        self.wrapper: Optional[Callable[..., Any]] = None
        self.depth = 0  # calls of the wrapper in progress (reentrant backward, clip in clip)
        self.before: list[Callable[[], None]] = []  # run first at each outermost call (step starters)

    def add(self, gate: PhaseGate) -> None:
        if self.original is None:
            first = sys.modules[self.modules[0]]
            self.original = getattr(first, self.attr)
            self.wrapper = self._make_wrapper(self.original)
            for name in self.modules:
                module = sys.modules.get(name)
                if module is not None and getattr(module, self.attr, None) is self.original:
                    setattr(module, self.attr, self.wrapper)
        self.gates.append(gate.gates)

    def discard(self, gate: PhaseGate) -> None:
        if gate.gates in self.gates:
            self.gates.remove(gate.gates)
        if self.gates or self.original is None:
            return
        for name in self.modules:
            module = sys.modules.get(name)
            # someone who wrapped it after us keeps theirs (ours then passes through)
            if module is not None and getattr(module, self.attr, None) is self.wrapper:
                setattr(module, self.attr, self.original)
        self.original = self.wrapper = None

    def _make_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        index, gates = _INDEX[self.phase], self.gates  # the lists themselves: they change in place

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth or not gates or _compiling():
                return original(*args, **kwargs)
            for start in self.before:
                start()
            for g in gates:
                g.begin(index)
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1
                for g in gates:
                    g.end(index)  # closes only what its begin opened

        timed.__wrapped__ = original  # type: ignore[attr-defined]
        timed.__name__ = getattr(original, "__name__", "timed")
        timed.__doc__ = getattr(original, "__doc__", None)
        return timed


_BACKWARD = _GlobalWrap(("torch.autograd",), "backward", "backward")
_CLIPS = (_GlobalWrap(("torch.nn.utils.clip_grad", "torch.nn.utils"), "clip_grad_norm_", "clip"),
          _GlobalWrap(("torch.nn.utils.clip_grad", "torch.nn.utils"), "clip_grad_value_", "clip"),
          # the two halves of clip_grad_norm_ (torch >= 2.6), which accelerate (and so the
          # Hugging Face Trainer) calls instead of it; inside clip_grad_norm_ they are nested
          # and so add nothing (a phase never opens inside another)
          _GlobalWrap(("torch.nn.utils",), "get_total_norm", "clip"),
          _GlobalWrap(("torch.nn.utils",), "clip_grads_with_norm_", "clip"))
_wraps_lock = threading.Lock()


#: The attributes under which training wrappers register the module they run: ``module``
#: (DistributedDataParallel, DataParallel, DeepSpeed's engine) and FSDP's own name.
_WRAPPED_ATTRS = ("module", "_fsdp_wrapped_module")


def _wrapped_modules(module: Any) -> list[Any]:
    """The modules ``module`` wraps, outermost first: each one registered as a submodule
    under a wrapper's attribute name, followed down (FSDP around DDP around a model)."""
    found: list[Any] = []
    seen = {id(module)}
    while True:
        children = getattr(module, "_modules", None) or {}
        inner = next((children[a] for a in _WRAPPED_ATTRS if children.get(a) is not None), None)
        if inner is None or id(inner) in seen:
            return found
        seen.add(id(inner))
        found.append(inner)
        module = inner


class _Hooks:
    """What :class:`PhaseHooks` and :class:`GlobalPhaseHooks` share: the gate, the
    wrapped backward and clip functions, the handles to remove."""

    def __init__(self, core: Any, backward: bool = True, clip: bool = True) -> None:
        import torch  # noqa: F401  (the wrapped functions live in torch's modules)

        self._gate = PhaseGate(core)
        self._handles: list[Any] = []
        self._wraps: list[_GlobalWrap] = []
        self._undo: list[Callable[[], None]] = []
        with _wraps_lock:
            for wrap in ((_BACKWARD,) if backward else ()) + (_CLIPS if clip else ()):
                if not hasattr(sys.modules[wrap.modules[0]], wrap.attr):
                    continue  # an older torch without it
                wrap.add(self._gate)
                self._wraps.append(wrap)

    @property
    def micro_steps(self) -> int:
        """Outermost forward calls in the step in progress (or the last one): the
        micro-steps of gradient accumulation."""
        return self._gate.micro_steps

    def _optimizer_hooks(self, optimizer: Any) -> None:
        gates, index = self._gate.gates, _INDEX["optimizer"]

        def pre(opt: Any, args: Any, kwargs: Any) -> Any:
            if not _compiling() and gates.begin(index) and (len(args) > 1 or kwargs):
                return _with_closure_phases(gates, index, args, kwargs)
            return None

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            if not _compiling():
                gates.end(index)

        self._handles += [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

    def remove(self) -> None:
        """Removes every hook and restores the wrapped functions (once no other profiler
        watches). Idempotent; a phase of ours still open ends at the end of its step."""
        if self._gate.closed:
            return
        self._gate.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        with _wraps_lock:
            for wrap in self._wraps:
                wrap.discard(self._gate)
        self._wraps.clear()


def _wrapped_eval_hooks(module: Any, evaluation: Callable[[Any], None]) -> list[Any]:
    """A forward pre-hook on each module a wrapper of ``module`` runs (DDP, DataParallel,
    FSDP, DeepSpeed's engine: ``model.module``), so that an evaluation that calls the
    unwrapped model (``model.module(x)``, ``accelerator.unwrap_model(model)``) between
    steps opens an evaluation interval too. It times nothing: inside a training forward
    (through the wrapper) a step is open, and ``evaluation`` returns at once."""

    def pre(mod: Any, args: Any) -> None:
        if not _compiling():
            evaluation(mod)

    return [inner.register_forward_pre_hook(pre) for inner in _wrapped_modules(module)]


def _outside_steps_evaluation(intervals: Any, grad_enabled: Callable[[], bool]) -> Callable[[Any], None]:
    """For steps the program draws itself (:class:`PhaseHooks`): a forward of the model
    between steps with gradients disabled, or in eval mode, is an evaluation."""

    def evaluation(mod: Any) -> None:
        if not grad_enabled() or not mod.training:
            intervals.evaluation_forward()

    return evaluation


def _module_phase_hooks(gate: PhaseGate, module: Any, phase: str, count: bool,
                        not_opened: Optional[Callable[[Any], None]] = None) -> list[Any]:
    # the C gates called directly: these run at every call of the module
    begin, end, index = gate.gates.begin, gate.gates.end, _INDEX[phase]

    if count and not_opened is not None:
        def pre(mod: Any, args: Any) -> None:  # a forward the gate did not open may be evaluation
            if not _compiling() and not begin(index, mod):
                not_opened(mod)
    elif count:
        def pre(mod: Any, args: Any) -> None:
            if not _compiling():
                begin(index, mod)
    else:
        def pre(mod: Any, args: Any) -> None:
            if not _compiling():
                begin(index)

    def post(mod: Any, args: Any, output: Any) -> None:
        if not _compiling():
            end(index)

    return [module.register_forward_pre_hook(pre),
            module.register_forward_hook(post, always_call=True)]


class PhaseHooks(_Hooks):
    """Times the phases of one model's training step in the step in progress of ``core``
    (a ``steptrace._core.Profiler``; :meth:`steptrace.Profiler.watch` makes one).

    - ``model``: any ``nn.Module`` (a ``DistributedDataParallel`` or ``torch.compile``
      wrapper included): its outermost forward calls are the forward phase.
    - ``optimizer``: a ``torch.optim.Optimizer``; its ``step()`` is the optimizer phase.
    - ``loss_fn``: an ``nn.Module`` loss (hooked in place), or a module-level function
      (``torch.nn.functional.cross_entropy``, a ``def`` in the script): that name is
      replaced in its module by a timed wrapper until :meth:`remove`, so a loop that
      calls it by that name is timed; :attr:`loss_fn` is the timed callable either way.
      Anything else (a lambda, a closure, a bound method) raises ConfigError.
    - backward (``torch.autograd.backward``, hence ``loss.backward()``) and clip
      (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``) are timed for every
      caller on the training thread while the hooks exist.

    Not thread-safe: create, use and remove it from the training thread.
    """

    def __init__(self, core: Any, model: Any, optimizer: Any = None, loss_fn: Any = None, *,
                 backward: bool = True, clip: bool = True, intervals: Any = None) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        patch = None
        if loss_fn is not None and not isinstance(loss_fn, torch.nn.Module):
            patch = _loss_site(loss_fn)  # raises before anything is installed
        super().__init__(core, backward=backward, clip=clip)
        gate = self._gate
        evaluation = _outside_steps_evaluation(intervals, torch.is_grad_enabled) if intervals is not None else None
        self._handles += _module_phase_hooks(gate, model, "forward", count=True, not_opened=evaluation)
        if evaluation is not None:
            self._handles += _wrapped_eval_hooks(model, evaluation)
        if optimizer is not None:
            self._optimizer_hooks(optimizer)
        self.loss_fn = loss_fn
        if isinstance(loss_fn, torch.nn.Module):
            self._handles += _module_phase_hooks(gate, loss_fn, "loss", count=False)
        elif patch is not None:
            self.loss_fn = _timed_call(gate, "loss", loss_fn)
            module, name = patch
            setattr(module, name, self.loss_fn)
            self._undo.append(lambda: getattr(module, name) is self.loss_fn and setattr(module, name, loss_fn))


def _loss_site(fn: Any) -> tuple[Any, str]:
    """The module and name through which a loop calls the loss function ``fn``."""
    if not callable(fn):
        raise ConfigError(f"loss_fn must be an nn.Module or a function, got {type(fn).__name__}")
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    name = getattr(fn, "__qualname__", "") or ""
    if module is None or "." in name or "<" in name or getattr(module, name, None) is not fn:
        raise ConfigError(f"loss_fn={fn!r} cannot be hooked: pass an nn.Module loss or a function defined at "
                          f"module level (it is replaced by a timed one there), or time it with "
                          f"`with prof.phase(\"loss\"):`")
    return module, name


def _timed_call(gate: PhaseGate, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        opened = gate.begin(phase)
        try:
            return fn(*args, **kwargs)
        finally:
            if opened:
                gate.end(phase)

    timed.__wrapped__ = fn  # type: ignore[attr-defined]
    timed.__name__ = getattr(fn, "__name__", "loss_fn")
    timed.__qualname__ = getattr(fn, "__qualname__", timed.__name__)
    timed.__doc__ = getattr(fn, "__doc__", None)
    return timed


#: Steps in a row before which the same module's forward without gradients opened the
#: evaluation interval, after which that module's forward opens none (_FrozenForwards).
FROZEN_AFTER_STEPS = 3


class _FrozenForwards:
    """Tells a frozen module's forward from an evaluation under ``steptrace run``. A
    distillation teacher, or a frozen encoder, runs under ``no_grad`` before the student's
    forward that begins the step: between steps with gradients disabled, as an evaluation
    does. The first such forward of a gap opens an evaluation interval; a module whose
    forward did so before FROZEN_AFTER_STEPS steps in a row, and none of whose parameters
    an optimizer steps, opens none from then on: its time between steps is the next step's
    ``other_ms``, part of the iteration the slow-step rules judge. (It does not begin the
    step: the same module may open an evaluation, teacher first, and an evaluation inside
    a step would be a stall.) An evaluation of the trained model (its parameters are
    stepped) stays an evaluation at any cadence; an EMA copy or another model stays one
    unless it runs before every step."""

    def __init__(self, on_member: Callable[[Any], None]) -> None:
        self.members: dict[int, Any] = {}  # id -> module whose forward opens no evaluation
        self._on_member = on_member  # called with each new member
        self._opener: Any = None  # the module whose forward opened this gap's interval
        self._streak_id, self._streak = 0, 0
        self._stepped: set[int] = set()  # modules found to have stepped parameters
        self._optimizers: dict[int, Any] = {}  # id -> weak reference, every optimizer that stepped

    def optimizer_stepped(self, opt: Any) -> None:
        if id(opt) not in self._optimizers:
            self._optimizers[id(opt)] = weakref.ref(opt)

    def opened_interval(self, module: Any) -> None:
        self._opener = module

    def step_began(self) -> None:
        module, self._opener = self._opener, None
        if module is None:
            self._streak = 0
            return
        self._streak = self._streak + 1 if id(module) == self._streak_id else 1
        self._streak_id = id(module)
        if self._streak >= FROZEN_AFTER_STEPS and id(module) not in self._stepped:
            if self._is_stepped(module):
                self._stepped.add(id(module))
            else:
                self.members[id(module)] = module
                self._on_member(module)

    def _is_stepped(self, module: Any) -> bool:
        stepped = {id(p) for ref in self._optimizers.values() if (opt := ref()) is not None
                   for group in opt.param_groups for p in group["params"]}
        parameters = getattr(module, "parameters", None)
        return callable(parameters) and any(id(p) in stepped for p in parameters())

    def clear(self) -> None:
        self.members.clear()
        self._opener = None
        self._optimizers.clear()


class _KeptSpan:
    """One call kept by :class:`_EvalModeForwards`: its phase, its span on the core's clock
    (``end_ns`` None while the call runs), the module and the call's arguments (for the
    work count, once the span turns out to be training)."""

    __slots__ = ("phase", "begin_ns", "end_ns", "module", "args")

    def __init__(self, phase: str, begin_ns: int, module: Any, args: Any) -> None:
        self.phase, self.begin_ns, self.end_ns = phase, begin_ns, None
        self.module, self.args = module, args


class _EvalModeForwards:
    """Under ``steptrace run``: the top-level calls, between steps, of a module in eval mode
    with gradients enabled, and the loss calls after them. Such a forward is an evaluation
    written without ``no_grad`` (``model.eval()`` alone) unless a backward follows it:
    fine-tuning with frozen batch norm, or a loop that forgot ``model.train()`` after its
    evaluation. So it begins no step; it opens an evaluation interval and its span is kept
    on the core's clock. A backward or an optimizer step then begins the step at the first
    span (the interval ends there: GlobalPhaseHooks ``begin_late``), with the spans as its
    forward and loss phases; a forward of the same module first (the next evaluation
    batch, or the training forward after ``model.train()``) shows that they were
    evaluation."""

    def __init__(self) -> None:
        self.spans: list[_KeptSpan] = []
        self.running: Optional[_KeptSpan] = None  # the span whose call has not returned

    def holds(self, module: Any) -> bool:
        return any(span.module is module for span in self.spans)

    def begin(self, phase: str, begin_ns: int, module: Any, args: Any) -> None:
        if phase == "forward" and self.holds(module):
            self.spans.clear()  # the same module again without a backward: those were evaluation
        self.running = _KeptSpan(phase, begin_ns, module, args)
        self.spans.append(self.running)

    def end(self, module: Any, end_ns: int) -> None:
        if self.running is not None and self.running.module is module:
            self.running.end_ns = end_ns
            self.running = None

    def take(self) -> list[_KeptSpan]:
        spans, self.spans, self.running = self.spans, [], None
        return spans


class GlobalPhaseHooks(_Hooks):
    """Phases for a program steptrace did not see: every outermost module call on the
    training thread is forward (a ``torch.nn.modules.loss._Loss`` one is loss); every
    optimizer's ``step()`` is the optimizer phase (the global optimizer step hooks);
    backward and clip as in :class:`PhaseHooks`.

    Outermost calls are found with the global module forward hooks, which run for every
    module call (and take every module off torch's hook-free fast path). So they are used
    only for the first ``discover_steps`` optimizer steps: then the modules seen at the
    outermost level get hooks of their own and the global ones are removed (0: keep the
    global hooks for the whole run, for programs that bring in new top-level modules
    later; a module first called at the top after the discovery is not timed). After the
    discovery a global pre-hook watches each gap between steps until its first forward, so
    that an evaluation with any module (an EMA copy, ``model.module`` of a
    DistributedDataParallel model) still opens an evaluation interval.

    With ``steps=True`` it also draws the step boundaries: a step begins at the first
    training activity (a forward with gradients enabled, a backward, an optimizer step)
    when none is open, and ends when an optimizer step returns. The time between one
    optimizer step and the next training forward (loading the batch, logging) is then the
    next step's ``other_ms`` (``data_ms`` for a DataLoader's fetch, with an
    :class:`steptrace.live.intervals.IntervalWatch` that times them); forward calls without
    gradients between steps begin no step but, given ``intervals``, an evaluation
    interval, except a frozen module's that runs before every step (a distillation teacher:
    :class:`_FrozenForwards`). A forward of a module in eval mode with gradients enabled
    opens an evaluation interval too, until a backward shows it was training: the step
    then begins where that forward began (:class:`_EvalModeForwards`). ``end_open_step()``
    ends a step left open at the end of the program.

    (The gradient all-reduces of DistributedDataParallel models are timed by the
    Profiler itself: steptrace.live.comm.)
    """

    # The hooks are methods sharing the state below as attributes; each is bound once, when
    # it is registered, so a call allocates nothing (they run on the training thread, the
    # global ones for every module call during the discovery).

    def __init__(self, core: Any, *, steps: bool = False, backward: bool = True, clip: bool = True,
                 discover_steps: int = 2, intervals: Any = None, work: Any = None) -> None:
        import torch
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optimizer_mod

        if isinstance(discover_steps, bool) or not isinstance(discover_steps, int) or discover_steps < 0:
            raise ConfigError(f"discover_steps={discover_steps!r} must be an int >= 0 (0: global hooks throughout)")
        super().__init__(core, backward=backward, clip=clip)
        self._core = core
        self._steps = steps
        self._loss_type = torch.nn.modules.loss._Loss
        self._grad_enabled = torch.is_grad_enabled
        self._module_mod = module_mod
        self._thread = threading.get_ident()  # the training thread: the hooks ignore the others
        self._begin_step = core.begin_step if steps else None
        self._intervals, self._work = intervals, work
        self._without_grad = intervals.forward_without_grad if intervals is not None else None
        self._discover_steps = discover_steps
        self._depth = 0  # module calls in progress on the training thread (global hooks)
        self._top_depth = 0  # hooked top-level calls in progress: a wrapper and the model it runs may both be
        self._tops: dict[int, Any] = {}  # id -> module called at the outermost level so far
        self._optimizer_steps = 0
        self._settled = discover_steps == 0  # True: no switch to per-module hooks (any more)
        self._between: Any = None  # the global hook that watches the time between two steps
        self._frozen = _FrozenForwards(on_member=self._frozen_member)
        self._frozen_modules = self._frozen.members
        self._eval_mode = _EvalModeForwards()
        self._global_handles = [module_mod.register_module_forward_pre_hook(self._global_pre),
                                module_mod.register_module_forward_hook(self._global_post, always_call=True)]
        self._handles += [*self._global_handles,
                          optimizer_mod.register_optimizer_step_pre_hook(self._opt_pre),
                          optimizer_mod.register_optimizer_step_post_hook(self._opt_post)]
        if steps and backward:
            before_backward = self._maybe_begin_step  # one bound method: the same object is removed
            _BACKWARD.before.append(before_backward)
            self._undo.append(lambda: _BACKWARD.before.remove(before_backward))
        self._undo.append(self._tops.clear)
        self._undo.append(self._frozen.clear)
        self._undo.append(self._eval_mode.take)  # (the spans hold the batches they saw)
        self._undo.append(self._unwatch_between)

    def _frozen_member(self, mod: Any) -> None:
        self._handles.append(mod.register_forward_hook(self._after_frozen, always_call=True))

    def _after_frozen(self, mod: Any, args: Any, output: Any) -> None:
        # The gap's watch (_between_pre) ended at this forward: it goes on after it, so
        # that an evaluation calling the teacher first is still seen.
        if not _compiling() and threading.get_ident() == self._thread and not self._core.in_step:
            self._watch_between()

    def _maybe_begin_step(self) -> None:
        core = self._core
        if (self._begin_step is not None and threading.get_ident() == self._thread and not core.in_step
                and not self._gate.closed):
            spans = self._eval_mode.take()
            try:
                if spans and core.open_interval in (None, "eval"):
                    self._begin_late(spans)
                else:
                    self._begin_step()
            except UsageError:  # closed from another thread meanwhile: never into the script
                return
            self._frozen.step_began()

    def _begin_late(self, spans: list[_KeptSpan]) -> None:
        """The forwards in eval mode were training after all: the step began at the
        first of them, and they are its forward and loss phases."""
        core, work = self._core, self._work
        core.begin_step_at(spans[0].begin_ns)
        for span in spans:
            # (end_ns None: still running, a backward inside its forward)
            end_ns = core.clock_ns if span.end_ns is None else span.end_ns
            forward = span.phase == "forward"
            self._gate.gates.add(_INDEX[span.phase], span.begin_ns, end_ns, span.module if forward else None)
            if forward and work is not None:
                work.pre(span.module, span.args, count=False)  # its samples, tokens and (counted as it ran) FLOPs

    def _eval_mode_forward(self, mod: Any, args: Any, is_loss: bool) -> bool:
        """A top-level call with gradients enabled between steps: True when it is kept
        as a span of _EvalModeForwards rather than beginning the step."""
        eval_mode = self._eval_mode
        if not eval_mode.spans and (is_loss or mod.training):
            return False  # training, as before (the cheap test first: every forward comes here)
        core = self._core
        if self._begin_step is None or core.in_step or self._gate.closed:
            return False
        if not is_loss and mod.training:
            if eval_mode.holds(mod):
                eval_mode.take()  # the evaluation is over: this module trains again
            return False  # (else it is a second model: _maybe_begin_step begins late)
        eval_mode.begin("loss" if is_loss else "forward", core.clock_ns, mod, args)
        if self._intervals is not None and not is_loss:  # read after the span's start: it is dropped
            self._intervals.evaluation_forward()         # if the step begins there
        if self._work is not None and not is_loss:
            self._work.pre(mod, args, add=False)  # a new input shape's FLOPs counted, not added
        return True

    def _forward_without_grad(self, mod: Any) -> None:
        """A top-level forward with gradients disabled: between steps it may open an
        evaluation interval, unless it is a frozen module's (_FrozenForwards)."""
        without_grad = self._without_grad
        if id(mod) not in self._frozen_modules and without_grad is not None and without_grad():
            self._frozen.opened_interval(mod)

    def _outer_pre(self, mod: Any, args: Any) -> None:
        is_loss = isinstance(mod, self._loss_type)
        if self._grad_enabled():
            if self._eval_mode_forward(mod, args, is_loss):
                return
            self._maybe_begin_step()
        else:
            self._forward_without_grad(mod)
        if is_loss:
            self._gate.begin("loss")
        else:
            self._gate.begin("forward", mod)
            if self._work is not None:
                self._work.pre(mod, args)

    def _outer_post(self, mod: Any) -> None:
        if self._eval_mode.running is not None:
            self._eval_mode.end(mod, self._core.clock_ns)
        self._gate.end("loss" if isinstance(mod, self._loss_type) else "forward")

    def _global_pre(self, mod: Any, args: Any) -> None:
        if _compiling() or threading.get_ident() != self._thread:
            return  # inside a compiled module (its calls are traced, not run) or another thread
        self._depth += 1
        if self._depth == 1:
            self._tops.setdefault(id(mod), mod)
            self._outer_pre(mod, args)

    def _global_post(self, mod: Any, args: Any, output: Any) -> None:
        if _compiling() or threading.get_ident() != self._thread or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            self._outer_post(mod)

    def _top_pre(self, mod: Any, args: Any) -> None:
        if not _compiling() and threading.get_ident() == self._thread:
            self._top_depth += 1
            if self._top_depth == 1:
                self._outer_pre(mod, args)

    def _top_post(self, mod: Any, args: Any, output: Any) -> None:
        if not _compiling() and threading.get_ident() == self._thread and self._top_depth > 0:
            self._top_depth -= 1
            if self._top_depth == 0:
                self._outer_post(mod)

    def _settle(self) -> None:
        """Discovery over: hooks on the top-level modules found, the global ones off."""
        self._settled = True
        for handle in self._global_handles:
            handle.remove()
            self._handles.remove(handle)
        top_pre, top_post = self._top_pre, self._top_post
        for mod in self._tops.values():
            self._handles += [mod.register_forward_pre_hook(top_pre),
                              mod.register_forward_hook(top_post, always_call=True)]
        self._tops.clear()

    # Between two steps, until the first forward: a global pre-hook, so that an evaluation
    # with a model never called at the top while the hooks were discovered (an EMA copy,
    # model.module of a DDP model, a separate eval model) still opens an evaluation
    # interval. The first forward removes it: with gradients (the next step's) as soon as
    # it comes, without (an evaluation) once the interval is open. Steps run without it.
    def _between_pre(self, mod: Any, args: Any) -> None:
        if _compiling() or threading.get_ident() != self._thread:
            return
        if not self._grad_enabled():
            self._forward_without_grad(mod)
        handle, self._between = self._between, None
        if handle is not None:
            handle.remove()

    def _watch_between(self) -> None:
        if self._without_grad is not None and self._between is None and not self._gate.closed:
            self._between = self._module_mod.register_module_forward_pre_hook(self._between_pre)

    def _unwatch_between(self) -> None:
        if self._between is not None:
            self._between.remove()

    def _opt_pre(self, opt: Any, args: Any, kwargs: Any) -> Any:
        if not _compiling() and threading.get_ident() == self._thread:
            self._maybe_begin_step()
            if self._gate.begin("optimizer") and (len(args) > 1 or kwargs):
                return _with_closure_phases(self._gate.gates, _INDEX["optimizer"], args, kwargs)
        return None

    def _opt_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        if _compiling() or threading.get_ident() != self._thread:
            return
        core, gate = self._core, self._gate
        gate.end("optimizer")
        self._frozen.optimizer_stepped(opt)
        if self._begin_step is not None and core.in_step and not gate.closed:
            try:
                core.end_step()
            except UsageError:
                pass
        self._optimizer_steps += 1
        if (not self._settled and self._optimizer_steps >= self._discover_steps and self._depth == 0
                and not gate.closed):
            self._settle()
        if self._discover_steps and self._settled and not core.in_step:
            self._watch_between()  # (the global hooks see every forward while they discover)

    def end_open_step(self, failed: bool = False) -> None:
        """Ends the step in progress (one begun by a forward or backward that no optimizer
        step followed), so the log does not end in a step closed as failed."""
        core = self._gate._core
        if self._steps and not core.closed and core.in_step:
            core.end_step(failed)
