"""steptrace.live._torch_compat: the private torch API steptrace touches, each version-dependent
branch taken once: with this torch (the newest release in the test command) and with
stand-ins shaped as older or newer releases have it."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from steptrace.live import _torch_compat as compat


def test_flight_recorder_dump_takes_the_newest_name_then_the_older():
    new, old = (lambda: "new"), (lambda: "old")
    assert compat.flight_recorder_dump(SimpleNamespace(_dump_fr_trace_json=new, _dump_nccl_trace_json=old)) is new
    # torch before 2.6: only the NCCL-named dump
    assert compat.flight_recorder_dump(SimpleNamespace(_dump_nccl_trace_json=old)) is old
    assert compat.flight_recorder_dump(SimpleNamespace()) is None


def test_flight_recorder_dump_of_this_torch():
    import torch.distributed  # noqa: F401 - loads torch._C._distributed_c10d's Python side

    fn = compat.flight_recorder_dump()
    assert fn is not None and fn.__name__ in compat.FLIGHT_RECORDER_DUMPS


def test_dynamo_handler_is_looked_up_never_imported():
    handler = SimpleNamespace(register_start_callback=lambda cb: None, register_end_callback=lambda cb: None)
    assert compat.dynamo_callback_handler({}) is None  # not loaded: not imported either
    assert compat.dynamo_callback_handler({"torch._dynamo.callback": SimpleNamespace()}) is None  # mid-import
    old = SimpleNamespace(callback_handler=SimpleNamespace())  # a release without start callbacks
    assert compat.dynamo_callback_handler({"torch._dynamo.callback": old}) is None
    current = SimpleNamespace(callback_handler=handler)
    assert compat.dynamo_callback_handler({"torch._dynamo.callback": current}) is handler


def test_dynamo_handler_of_this_torch():
    import torch._dynamo.callback  # noqa: F401

    handler = compat.dynamo_callback_handler()
    assert handler is not None and callable(handler.register_end_callback)


def test_cuda_memory_stats_both_or_neither():
    stats, reset = (lambda d: {}), (lambda d: None)
    both = SimpleNamespace(_C=SimpleNamespace(_cuda_memoryStats=stats, _cuda_resetPeakMemoryStats=reset))
    assert compat.cuda_memory_stats(both) == (stats, reset)
    # one without the other is no use: the public functions are taken instead
    assert compat.cuda_memory_stats(SimpleNamespace(_C=SimpleNamespace(_cuda_memoryStats=stats))) == (None, None)
    assert compat.cuda_memory_stats(SimpleNamespace()) == (None, None)  # a stand-in torch without _C
    mine = compat.cuda_memory_stats(torch)
    assert mine[0] is torch._C._cuda_memoryStats and mine[1] is torch._C._cuda_resetPeakMemoryStats


def test_pytree_maps_and_flattens_nested_outputs():
    tree = compat.pytree()
    value = {"a": torch.ones(2), "b": [torch.zeros(1), 3]}
    doubled = tree.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, value)
    assert doubled["a"].tolist() == [2.0, 2.0] and doubled["b"][1] == 3
    assert len([x for x in tree.tree_leaves(value) if isinstance(x, torch.Tensor)]) == 2


def test_dispatch_mode_and_future_bases():
    assert issubclass(torch.futures.Future, compat.future_base())
    mode = compat.dispatch_mode_base()
    seen = []

    class Record(mode):  # type: ignore[misc,valid-type]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2, 2) @ torch.ones(2, 2)
    assert any("mm" in name for name in seen), seen


def test_ddp_private_members_exist_in_this_torch():
    from torch.nn.parallel import DistributedDataParallel

    assert callable(getattr(DistributedDataParallel, compat.DDP_BUILTIN_HOOK_REGISTRAR))
    assert callable(getattr(DistributedDataParallel, compat.DDP_CHECK_COMM_HOOK))
    # the instance members, on a one-rank gloo DDP model
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
        assert isinstance(getattr(ddp, compat.DDP_COMM_HOOKS), list)
        assert getattr(ddp, compat.DDP_REDUCER) is not None
        assert callable(getattr(ddp.logger, compat.DDP_LOGGER_HOOK_NAME))
    finally:
        dist.destroy_process_group()
