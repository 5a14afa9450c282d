"""Useful work per step: samples and tokens from batches, model FLOPs counted once per
input shape, and the math dtype MFU's peak is for (see docs/useful-work.md).

- :func:`batch_work` reads a batch's shape: nothing else, so no device synchronization.
- :class:`ModelWork` is the forward pre-hook that :meth:`steptrace.Profiler.watch` (and
  ``steptrace run``) installs on a model: each training forward adds its samples, tokens
  and FLOPs to the step in progress (several forwards: gradient accumulation). The FLOPs
  of the first training forward of each input shape are counted on that forward, as it
  runs, with the formulas of ``torch.utils.flop_counter`` (matrix products,
  convolutions, attention); backward is taken as twice the forward: each of those
  products has two gradients of its own size (the 6·N·T convention nanoGPT's MFU uses).
  A few microseconds per operator, once per shape; nothing per step after that.
- :func:`count_flops` counts forward and backward exactly, on a copy of the model whose
  tensors are meta tensors (no memory, no device work; seconds of Python on first use).
- :class:`BatchWork` counts a framework's real batch, forward and backward, from its
  start to its end (Lightning's batch callbacks).
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any, Callable, Optional

from steptrace.live._torch_compat import dispatch_mode_base, pytree

logger = logging.getLogger("steptrace")

# The sources of the core's WorkCount (include/steptrace/work.hpp): a higher one wins.
SOURCE_MODEL, SOURCE_BATCH, SOURCE_OPTION, SOURCE_USER = 1, 2, 3, 4
MAX_SHAPES = 256  # distinct input shapes counted per model; later new ones go uncounted


_TORCH: Any = None  # (torch.Tensor, the integer dtypes) once torch is imported


def _torch_types() -> Any:
    global _TORCH
    if _TORCH is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        ints = frozenset(d for d in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                                     getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                                     getattr(torch, "uint64", None)) if d is not None)
        _TORCH = (torch.Tensor, ints)
    return _TORCH


def _tokens_of(ids: Any, mask: Any, tensor: Any) -> int:
    """Token count of an id tensor: the mask's non-padding positions where the mask is on
    the CPU (counting a GPU mask would synchronize the device), else every position."""
    if isinstance(mask, tensor) and mask.device.type == "cpu" and mask.shape == ids.shape:
        return int(mask.count_nonzero())
    return int(ids.numel())


def batch_work(batch: Any) -> tuple[int, int]:
    """``(samples, tokens)`` of a batch, -1 where the batch does not say unambiguously:

    - a tensor: samples = its leading dimension; tokens = its size when it holds integer
      ids of shape (batch, sequence);
    - a mapping with ``input_ids`` (a Hugging Face batch): samples from it, tokens from
      ``attention_mask`` where given (non-padding; on a GPU every position);
    - a tuple or list: as its first element (inputs first, targets after).

    It reads shapes and dtypes only (this runs for every batch)."""
    types = _torch_types()
    if types is None:
        return -1, -1
    tensor, ints = types
    cls = type(batch)
    if cls is tuple or cls is list:
        batch = batch[0] if batch else None
    if isinstance(batch, tensor):
        shape = batch.shape
        if not shape:
            return -1, -1
        if len(shape) == 2 and batch.dtype in ints:
            return shape[0], shape[0] * shape[1]
        return shape[0], -1
    if isinstance(batch, dict) or (hasattr(batch, "keys") and hasattr(batch, "get")):
        ids = batch.get("input_ids")
        if isinstance(ids, tensor) and ids.dim() >= 1:
            tokens = _tokens_of(ids, batch.get("attention_mask"), tensor) if ids.dim() == 2 else -1
            return int(ids.shape[0]), tokens
    return -1, -1


def data_fast_path() -> tuple[Any, tuple[Any, ...]]:
    """``(torch.Tensor, integer dtypes)`` for the C loader iterator (``_core.Profiler.data``),
    which counts a tensor batch, or an exact tuple or list led by one, as :func:`batch_work`
    would without calling it; ``(None, ())`` before torch is imported (then every batch goes
    to :func:`batch_counter`)."""
    types = _torch_types()
    if types is None:
        return None, ()
    tensor, ints = types
    return tensor, tuple(ints)


def batch_counter(core: Any) -> Callable[[Any], None]:
    """``on_item`` for ``prof.data()``: adds each batch's samples and tokens to the step
    the batch is for (the next one begun)."""
    add = core.add_work

    def count(batch: Any) -> None:
        samples, tokens = batch_work(batch)
        if samples >= 0 or tokens >= 0:
            add(samples, tokens, -1.0, SOURCE_BATCH)

    return count


def unwrap_model(model: Any) -> Any:
    """The module that does the math: DistributedDataParallel's ``module``, a compiled
    model's ``_orig_mod``."""
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None) or (
            getattr(model, "module", None) if type(model).__name__ in ("DistributedDataParallel", "DataParallel")
            else None)
        if inner is None:
            return model
        model = inner
    return model


def _meta_copy(model: Any) -> Any:
    """A copy of ``model`` whose parameters and buffers are meta tensors (no data copied)
    and which has none of the original's hooks."""
    import torch

    memo: dict = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else meta
    clone = copy.deepcopy(model, memo)
    for m in clone.modules():
        for attr in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            hooks = getattr(m, attr, None)
            if hooks is not None:
                hooks.clear()
    return clone


def _to_meta(value: Any) -> Any:
    import torch

    tree_map = pytree().tree_map

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_like(x, device="meta").requires_grad_(x.requires_grad)
        return x

    return tree_map(meta, value)


def _differentiable(out: Any) -> list:
    """The output tensors a backward starts from: the loss when the model returns one
    (a Hugging Face output's ``loss``), else every floating output that needs a gradient."""
    import torch

    tree_leaves = pytree().tree_leaves
    loss = getattr(out, "loss", None) if not isinstance(out, (torch.Tensor, tuple, list, dict)) else None
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return [loss]
    if hasattr(out, "to_tuple"):  # a ModelOutput without a loss
        out = out.to_tuple()
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
            and t.is_floating_point()]


def _backward_flops(outputs: list, params: list) -> None:
    import torch

    # torch.autograd.grad, not backward(): the same graph, and none of the wrappers that
    # time a training backward (steptrace.live.autophase) run
    grads = [torch.ones_like(t) for t in outputs]
    torch.autograd.grad(outputs, params, grads, allow_unused=True)


_REGISTRY: Optional[dict] = None


def _flop_registry() -> dict:
    """``torch.utils.flop_counter``'s formulas by operator, plus the CPU's own attention
    kernel (``_scaled_dot_product_flash_attention_for_cpu``, which the registry lacks in
    torch 2.9: the same two products as the CUDA kernels' ``sdpa_flop``)."""
    global _REGISTRY
    if _REGISTRY is None:
        import torch
        from torch.utils import flop_counter

        registry = dict(flop_counter.flop_registry)
        aten = torch.ops.aten
        cpu_flash = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu_flash is not None and cpu_flash not in registry:
            def cpu_attention(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None,
                              **kwargs: Any) -> int:
                return flop_counter.sdpa_flop_count(tuple(query.shape), tuple(key.shape), tuple(value.shape))

            registry[cpu_flash] = cpu_attention
        cpu_flash_bw = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
        if cpu_flash_bw is not None and cpu_flash_bw not in registry:
            def cpu_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
                                       out_val: Any = None, **kwargs: Any) -> int:
                return flop_counter.sdpa_backward_flop_count(tuple(grad_out.shape), tuple(query.shape),
                                                             tuple(key.shape), tuple(value.shape))

            registry[cpu_flash_bw] = cpu_attention_backward
        _REGISTRY = registry
    return _REGISTRY


def _flop_mode() -> Any:
    """A dispatch mode that sums the FLOPs of the operators run under it. Unlike
    ``FlopCounterMode`` it tracks no modules (that installs global module hooks) and
    decomposes nothing: it only looks each operator up."""
    TorchDispatchMode = dispatch_mode_base()  # noqa: N806 - a class
    registry = _flop_registry()

    class FlopSum(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = registry.get(func._overloadpacket)
            if formula is not None:
                self.total += int(formula(*args, **kwargs, out_val=out))
            return out

    return FlopSum()


def count_flops(model: Any, *args: Any, **kwargs: Any) -> float:
    """Model FLOPs of one training step on these inputs, forward plus backward, with the
    formulas of ``torch.utils.flop_counter`` (matrix products, convolutions and
    attention; elementwise work is not counted, as in the 6·N·T estimate). Runs on a
    meta copy of the model: no memory and no device work. Raises what the model raises
    when it cannot run on meta tensors."""
    import torch

    clone = _meta_copy(unwrap_model(model))
    clone.train(getattr(model, "training", True))
    params = [p for p in clone.parameters() if p.requires_grad]
    mode = _flop_mode()
    with torch.enable_grad(), mode:
        outputs = _differentiable(clone(*_to_meta(args), **_to_meta(kwargs)))
        if outputs and params:
            _backward_flops(outputs, params)
    return float(mode.total)


def math_dtype(model: Any) -> Optional[str]:
    """The dtype a model's matrix products run in, for MFU's peak: autocast's where it is
    on, else the parameters' (fp32 counts as tf32 where torch allows TF32 matmuls)."""
    import torch

    params = next((p for p in unwrap_model(model).parameters() if p.is_floating_point()), None)
    device = params.device.type if params is not None else "cpu"
    try:
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    except (TypeError, RuntimeError, AttributeError):  # an older torch without the device argument
        pass
    if params is None:
        return None
    dtype = params.dtype
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        return "fp8"
    if dtype == torch.float32:
        tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
        return "tf32" if tf32 else "fp32"
    return None


def _shape_key(args: Any, kwargs: Any, tensor: Any) -> Any:
    """What a forward's FLOPs depend on: its tensors' shapes and dtypes, its other plain
    arguments, and the types of the rest."""
    key = [(v.shape, v.dtype) if isinstance(v, tensor) else v if isinstance(v, (int, float, str, type(None)))
           else type(v) for v in args]
    if kwargs:
        key += [(k, (v.shape, v.dtype) if isinstance(v, tensor) else v if isinstance(v, (int, float, str, type(None)))
                 else type(v)) for k, v in kwargs.items()]
    return tuple(key)


class ModelWork:
    """Adds each training forward's work to the step in progress of ``core``: samples and
    tokens from its inputs (:func:`batch_work` of the first argument, or of the keyword
    arguments for a Hugging Face model), and FLOPs: the first training forward of each
    input shape is counted as it runs (:func:`_flop_mode`, a forward hook registered for
    that call only), backward taken as twice it. A forward without gradients
    (evaluation) adds nothing. The first count also tells the core the model's math dtype
    (``mfu_dtype="auto"``). A compiled model (``torch.compile``) is not counted: a
    dispatch mode would change what it runs; and a hook that dynamo traces (the model
    compiled after it was watched) does nothing, so that it adds nothing to the graph."""

    def __init__(self, core: Any, model: Any, flops: bool = True) -> None:
        import torch

        from steptrace.live.autophase import _compiling

        self._add = core.add_work
        self._core = core
        self._model = model
        self._flops: dict = {}  # input shape key -> FLOPs of one forward and its backward
        self._count_flops = flops and not hasattr(model, "_orig_mod")
        self._dtype_told = False
        self._mode: Any = None  # the count running over the forward in progress
        self._post_handle: Any = None
        self._key: Any = None
        self._adding = True  # the count's FLOPs go to the step (else they are only kept)
        self._nested = 0  # calls of the model inside the counted one
        self._warned_shapes = False
        self._grad_enabled = torch.is_grad_enabled
        self._compiling = _compiling
        self._tensor = torch.Tensor

    def hooks(self, module: Any) -> list:
        """Registers the forward pre-hook on ``module``; returns its handle in a list."""
        return [module.register_forward_pre_hook(self.pre, with_kwargs=True)]

    def pre(self, module: Any, args: Any, kwargs: Any, count: bool = True, add: bool = True) -> None:
        """A training forward begins: its work is added to the step. Under ``steptrace run``
        a forward in eval mode may be training or evaluation, which a backward tells
        afterwards (:class:`steptrace.live.autophase.GlobalPhaseHooks`): it comes with
        ``add=False`` (a new input shape is counted as it runs and kept, nothing is added)
        and, once it shows it was training, again with ``count=False`` (its samples and
        tokens, and its FLOPs where its shape was counted)."""
        if self._compiling() or not self._grad_enabled():
            return
        if self._mode is not None:  # the model called inside its own counted forward
            self._nested += 1
            return
        samples, tokens = batch_work(args[0] if args else kwargs) if add else (-1.0, -1.0)
        flops = -1.0
        if self._count_flops:
            key = _shape_key(args, kwargs, self._tensor)
            flops = self._flops.get(key, -1.0)
            if flops < 0 and count:
                self._start_count(module, key, add)
        if add and (samples >= 0 or tokens >= 0 or flops >= 0):
            self._add(samples, tokens, flops, SOURCE_MODEL)

    def _start_count(self, module: Any, key: Any, add: bool) -> None:
        if len(self._flops) >= MAX_SHAPES:
            if not self._warned_shapes:
                self._warned_shapes = True
                logger.warning("steptrace: %s input shapes counted for FLOPs; steps with new shapes have no "
                               "FLOPs (set flops_per_step, or prof.add_work(flops=...))", MAX_SHAPES)
            return
        self._tell_dtype()
        self._key = key
        self._adding = add
        # runs when this forward returns, or raises
        self._post_handle = module.register_forward_hook(self.post, with_kwargs=True, always_call=True)
        self._mode = _flop_mode()
        self._mode.__enter__()

    def post(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if self._nested:
            self._nested -= 1
            return
        mode, self._mode = self._mode, None
        handle, self._post_handle = self._post_handle, None
        if handle is not None:
            handle.remove()
        if mode is None:
            return
        mode.__exit__(None, None, None)
        flops = 3.0 * mode.total  # forward, and backward as twice it
        self._flops[self._key] = flops
        if self._adding:
            self._add(-1.0, -1.0, flops, SOURCE_MODEL)

    def _tell_dtype(self) -> None:
        if self._dtype_told:
            return
        self._dtype_told = True
        dtype = math_dtype(self._model)
        if dtype is not None:
            self._core.set_mfu_dtype(dtype)


class TopLevelWork:
    """:class:`ModelWork` for the models ``steptrace run`` finds (the outermost module calls,
    :class:`steptrace.live.autophase.GlobalPhaseHooks`): one per module, fed by its hooks."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._models: dict = {}  # id(module) -> ModelWork

    def pre(self, module: Any, args: Any, count: bool = True, add: bool = True) -> None:
        work = self._models.get(id(module))
        if work is None:
            work = self._models[id(module)] = ModelWork(self._core, module)
        work.pre(module, args, {}, count, add)


class BatchWork:
    """Work of each batch a framework hands its callbacks (Lightning's
    ``on_train_batch_start`` / ``on_train_batch_end``): samples and tokens from the batch,
    and FLOPs counted on the real forward and backward of the first batch of each shape
    (:func:`_flop_mode` from the batch's start to its end), then reused."""

    def __init__(self, core: Any, flops: bool = True) -> None:
        self._core = core
        self._flops: dict = {}  # batch shape key -> FLOPs
        self._count_flops = flops
        self._counter: Any = None
        self._key: Any = None

    def begin(self, batch: Any) -> None:
        samples, tokens = batch_work(batch)
        flops = -1.0
        if self._count_flops:
            key = _shape_key(batch if isinstance(batch, (tuple, list)) else (batch,), None,
                             _torch_types()[0])
            flops = self._flops.get(key, -1.0)
            if flops < 0 and self._counter is None and len(self._flops) < MAX_SHAPES:
                self._counter, self._key = _flop_mode(), key
                self._counter.__enter__()
        if samples >= 0 or tokens >= 0 or flops >= 0:
            self._core.add_work(samples, tokens, flops, SOURCE_BATCH)

    def end(self) -> None:
        """The batch's forward and backward are done: its counted FLOPs go to the step."""
        counter, self._counter = self._counter, None
        if counter is None:
            return
        counter.__exit__(None, None, None)
        flops = float(counter.total)
        self._flops[self._key] = flops
        self._core.add_work(-1.0, -1.0, flops, SOURCE_BATCH)
