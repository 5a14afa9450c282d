"""The private torch API steptrace touches, in one place, each with what it falls back to
where a torch release lacks it. Nothing here imports a torch module the program has not
imported (the dynamo callbacks are looked up, never loaded).

Checked with torch 2.9.1 and 2.15.0 (the test command's, the newest release) on the CPU, and
2.11 on the GPU machine of tests/gpu/run.sh; tests/python/test_torch_compat.py takes each
branch. The public names used elsewhere (torch.cuda, torch.distributed's collectives,
torch.futures.Future, torch.autograd) are not repeated here.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

#: The flight recorder's JSON dump, newest name first: torch 2.6 renamed
#: ``_dump_nccl_trace_json`` (kept since as an alias) to ``_dump_fr_trace_json``.
FLIGHT_RECORDER_DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")


def flight_recorder_dump(c10d: Any = None) -> Optional[Callable[[], Any]]:
    """``torch._C._distributed_c10d``'s flight recorder JSON dump (``c10d`` stands in for
    that module in tests); None where this torch has none, or torch is not imported."""
    if c10d is None:
        c10d = getattr(getattr(sys.modules.get("torch"), "_C", None), "_distributed_c10d", None)
    for name in FLIGHT_RECORDER_DUMPS:
        fn = getattr(c10d, name, None)
        if fn is not None:
            return fn
    return None


def dynamo_callback_handler(modules: Any = None) -> Any:
    """dynamo's compile callback registry (``torch._dynamo.callback.callback_handler``, with
    ``register_start_callback`` / ``register_end_callback`` since torch 2.3) where that module
    is loaded; None while it is not (or is still being imported), or where it lacks them."""
    module = (sys.modules if modules is None else modules).get("torch._dynamo.callback")
    handler = getattr(module, "callback_handler", None)
    if handler is None or not callable(getattr(handler, "register_start_callback", None)):
        return None
    return handler


def cuda_memory_stats(torch: Any) -> tuple[Optional[Callable[[int], dict]], Optional[Callable[[int], None]]]:
    """The caching allocator's statistics as one dict per call and the peak reset
    (``torch._C._cuda_memoryStats`` / ``_cuda_resetPeakMemoryStats``, which
    ``torch.cuda.memory_stats`` flattens at some cost) of the ``torch`` given (the module, or
    a stand-in); (None, None) where either is missing, and the caller uses torch.cuda's public
    functions."""
    c = getattr(torch, "_C", None)
    stats = getattr(c, "_cuda_memoryStats", None)
    reset = getattr(c, "_cuda_resetPeakMemoryStats", None)
    if stats is None or reset is None:
        return None, None
    return stats, reset


def pytree() -> Any:
    """torch's pytree functions (``tree_map``, ``tree_leaves``): the public
    ``torch.utils.pytree`` where this torch has it, else ``torch.utils._pytree``."""
    try:
        from torch.utils import pytree as public  # type: ignore[attr-defined]

        if hasattr(public, "tree_map") and hasattr(public, "tree_leaves"):
            return public
    except ImportError:
        pass
    from torch.utils import _pytree

    return _pytree


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``, the base of the FLOP-summing mode (torch.utils._python_dispatch,
    the one place torch defines it in 2.x)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def future_base() -> type:
    """The C++ future type that torch.futures.Future derives from and that DDP comm hooks
    return (``torch._C.Future``)."""
    import torch

    return torch._C.Future


#: DistributedDataParallel's private members the comm timing (steptrace.live.comm) uses, all
#: present from torch 2.0 to 2.15: where a built-in C++ comm hook is registered, the list of
#: the Python hooks registered, the check DDP makes of a hook's signature, the reducer (None
#: until DDP has built it) and the logger's record of the hook's name.
DDP_BUILTIN_HOOK_REGISTRAR = "_register_builtin_comm_hook"
DDP_COMM_HOOKS = "_comm_hooks"
DDP_CHECK_COMM_HOOK = "_check_comm_hook"
DDP_REDUCER = "reducer"
DDP_LOGGER_HOOK_NAME = "_set_comm_hook_name"
