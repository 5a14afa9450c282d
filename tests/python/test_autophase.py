"""Automatic phases (prof.watch / steptrace.live.autophase) on real CPU training loops: a plain
loop, gradient accumulation, the user's own phases, steps that are not open, removal,
DDP over gloo with two spawned ranks, and torch.compile'd modules."""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from torch import nn

import steptrace
from steptrace.live.autophase import PHASES
from steptrace.errors import ConfigError

from support.training import batches


class Work(nn.Module):
    """An MLP whose forward also holds ``sleep_s`` of host time (work of known length)."""

    def __init__(self, sleep_s: float = 0.0, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 4))
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)  # stands for compute whose length the test knows
        return self.net(x)


def module_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss function defined at module level: watch(loss_fn=...) times it in place."""
    return nn.functional.cross_entropy(out, y)


def steps_of(path) -> list[dict]:
    return [r for r in steptrace.read(path, validate=True) if r["kind"] == "step"]


def train(prof, model, opt, loss_fn, data, *, clip=True, accumulate=1):
    for i in range(0, len(data), accumulate):
        with prof.step():
            for x, y in data[i:i + accumulate]:
                loss = loss_fn(model(x), y) / accumulate
                loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()


def test_step_alone_gets_the_five_phases_in_order_summing_to_the_step(tmp_path):
    model = Work(width=512)  # steps of a few ms: the loop's own code between phases is small beside them
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        assert prof.watch(model, opt, nn.CrossEntropyLoss()) is model
        train(prof, model, opt, prof.phase_hooks[0].loss_fn, batches(30, batch_size=256))
    records = steps_of(prof.log_path)
    assert len(records) == 30 and all(r["status"] == "ok" for r in records)
    for r in records:
        assert list(r["phases_ms"]) == list(PHASES)  # first-start order: the loop's order
        assert all(v > 0 for v in r["phases_ms"].values())
        assert sum(r["phases_ms"].values()) <= r["step_ms"] * 1.0001  # no nesting, no double counting
    # the hooks cover nearly the whole step (the rest is the loop's own bookkeeping)
    coverage = statistics.median(sum(r["phases_ms"].values()) / r["step_ms"] for r in records[5:])
    print(f"coverage {coverage:.3f}")
    assert coverage > 0.75, coverage


def test_a_module_level_loss_function_is_timed_where_the_loop_finds_it(tmp_path):
    model = Work()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    original = module_loss
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        prof.watch(model, opt, loss_fn=module_loss)
        assert globals()["module_loss"] is not original  # looked up by name in this module
        train(prof, model, opt, lambda out, y: module_loss(out, y), batches(5), clip=False)
    assert globals()["module_loss"] is original  # restored at close
    assert all(list(r["phases_ms"]) == ["forward", "loss", "backward", "optimizer"] for r in steps_of(prof.log_path))


def test_bad_arguments_are_refused_before_anything_is_hooked(tmp_path):
    model = Work()
    backward = torch.autograd.backward
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        with pytest.raises(ConfigError, match="cannot be hooked"):
            prof.watch(model, loss_fn=lambda out, y: out.sum())
        with pytest.raises(ConfigError, match="torch.optim.Optimizer"):
            prof.watch(model, optimizer=object())
        with pytest.raises(ConfigError, match="hook=") :
            prof.watch(model, lambda state, bucket: None)  # a comm hook where the optimizer goes
        with pytest.raises(ConfigError, match="DistributedDataParallel"):
            prof.watch(model, hook=lambda state, bucket: None)
        with pytest.raises(ConfigError, match="nn.Module"):
            prof.watch("model")
        assert torch.autograd.backward is backward
        assert not model._forward_hooks and not model._forward_pre_hooks


def test_gradient_accumulation_adds_up_the_micro_steps(tmp_path):
    model = Work(sleep_s=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        prof.watch(model, opt, nn.CrossEntropyLoss())
        hooks = prof.phase_hooks[0]
        loss_fn = hooks.loss_fn
        train(prof, model, opt, loss_fn, batches(12), accumulate=4)
        assert hooks.micro_steps == 4
    records = steps_of(prof.log_path)
    assert len(records) == 3  # one record per optimizer step
    for r in records:
        assert list(r["phases_ms"]) == list(PHASES)
        assert r["phases_ms"]["forward"] >= 4 * 2.0  # four forwards of >= 2 ms each, summed
        assert sum(r["phases_ms"].values()) <= r["step_ms"] * 1.0001
        assert r["meta"]["micro_steps"] == 4


def test_an_ordinary_step_says_nothing_about_micro_steps(tmp_path):
    model = Work()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        prof.watch(model, opt)
        train(prof, model, opt, nn.CrossEntropyLoss(), batches(3))
        with prof.step():
            with torch.no_grad():
                model(batches(1)[0][0])  # a second model's call would not count either
    assert all("micro_steps" not in r.get("meta", {}) for r in steps_of(prof.log_path))


def test_the_users_own_phases_win_and_nothing_nests(tmp_path):
    model = Work()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        prof.watch(model, opt, loss_fn)
        for x, y in batches(5):
            with prof.step():
                with prof.phase("forward"):  # same name as the hook's: no "nested in itself" error
                    out = model(x)
                with prof.phase("my_loss"):  # another name: the loss hook stays out
                    loss = loss_fn(out, y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    for r in steps_of(prof.log_path):
        assert list(r["phases_ms"]) == ["forward", "my_loss", "backward", "optimizer"]
        assert sum(r["phases_ms"].values()) <= r["step_ms"] * 1.0001


def test_hooks_outside_a_step_do_nothing_and_close_removes_them(tmp_path):
    model = Work()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    clip, backward = torch.nn.utils.clip_grad_norm_, torch.autograd.backward
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        prof.watch(model, opt, nn.CrossEntropyLoss())
        assert torch.nn.utils.clip_grad_norm_ is not clip and torch.autograd.backward is not backward
        x, y = batches(1)[0]
        loss = nn.functional.cross_entropy(model(x), y)  # outside any step: ignored
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            model(x)
        with prof.step():
            model(x).sum().backward()
        model(x).sum().backward()  # after the step
        assert prof.step_index == 1
    assert torch.nn.utils.clip_grad_norm_ is clip and torch.nn.utils.clip_grad.clip_grad_norm_ is clip
    assert torch.autograd.backward is backward
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    records = steps_of(prof.log_path)
    assert [list(r["phases_ms"]) for r in records] == [["forward", "backward"]]
    model(x).sum().backward()  # after close: plain torch again


def test_a_watched_models_forward_in_eval_mode_between_steps_is_an_evaluation(tmp_path):
    # With the program's own steps, a forward of the model between them in eval mode is an
    # evaluation also with gradients enabled (model.eval() without no_grad); in training
    # mode it is nothing steptrace can name (other host work).
    model = Work()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, _ = batches(1)[0]
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        prof.watch(model, opt)
        for i in range(4):
            if i in (1, 3):
                model.eval()
                model(x)  # gradients enabled
                model.train()
            if i == 2:
                model(x)  # training mode, outside a step: no interval
            with prof.step():
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
    recs = list(steptrace.read(prof.log_path, validate=True))
    assert [(r["interval"], r["step"]) for r in recs if r["kind"] == "interval"] == [("eval", 1), ("eval", 3)]


def test_the_gate_opens_only_on_its_thread_inside_a_step_and_closes_only_its_own(tmp_path):
    import threading

    from steptrace.live.autophase import PhaseGate

    with steptrace.Profiler(tmp_path, detect=False) as prof:
        gate = PhaseGate(prof._core)
        assert not gate.begin("forward")  # outside a step
        with pytest.raises(KeyError):
            gate.begin("not_a_phase")
        with prof.step():
            elsewhere = []
            t = threading.Thread(target=lambda: elsewhere.append(gate.begin("forward")))
            t.start()
            t.join()
            assert elsewhere == [False]  # another thread: nothing opened
            with prof.phase("data_prep"):
                assert not gate.begin("forward")  # inside the user's phase: phases never nest
            assert gate.begin("forward") and gate.opened == "forward"
            assert not gate.begin("loss")  # one of ours at a time
            gate.end("loss")  # not the one it opened: nothing
            assert gate.opened == "forward" and prof._core.current_phase == "forward"
            gate.end("forward")
            assert gate.opened is None and prof._core.current_phase == ""
            assert gate.begin("optimizer")
        assert gate.opened == "optimizer"  # the end of the step closed it in the core
        gate.end("optimizer")  # and a late end is harmless
        with prof.step():
            gate.close()
            assert gate.closed and not gate.begin("forward")
    phases = [list(r["phases_ms"]) for r in steps_of(prof.log_path)]
    assert phases == [["data_prep", "forward", "optimizer"], []]


def test_two_profilers_share_the_wrapped_functions(tmp_path):
    a, b = Work(), Work()
    backward = torch.autograd.backward
    with steptrace.Profiler(tmp_path / "a", detect=False) as pa:
        pa.watch(a)
        with steptrace.Profiler(tmp_path / "b", detect=False) as pb:
            pb.watch(b)
            x, _ = batches(1)[0]
            with pa.step(), pb.step():
                b(x).sum().backward()
        assert torch.autograd.backward is not backward  # still watched by pa
    assert torch.autograd.backward is backward
    assert [list(r["phases_ms"]) for r in steps_of(pb.log_path)] == [["forward", "backward"]]
    assert [list(r["phases_ms"]) for r in steps_of(pa.log_path)] == [["backward"]]  # a's forward did not run


def test_a_compiled_module_is_timed_and_compiling_a_watched_one_adds_no_graph_break(tmp_path):
    # aot_eager: dynamo and AOTAutograd as in production without inductor's C++ build,
    # which takes tens of seconds on this machine and changes nothing about the hooks
    torch._dynamo.reset()
    model = Work()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with steptrace.Profiler(tmp_path / "a", detect=False) as prof:
        prof.watch(compiled, opt, nn.CrossEntropyLoss())
        train(prof, compiled, opt, prof.phase_hooks[0].loss_fn, batches(4))
    assert all(list(r["phases_ms"]) == list(PHASES) for r in steps_of(prof.log_path))

    # hooks on a module compiled afterwards are traced: they must stay out of the graph
    # (fullgraph=True fails on any graph break); that module's forward is then not timed
    torch._dynamo.reset()
    model = Work()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with steptrace.Profiler(tmp_path / "b", detect=False) as prof:
        prof.watch(model, opt)
        full = torch.compile(model, backend="aot_eager", fullgraph=True)
        for x, y in batches(3):
            with prof.step():
                nn.functional.cross_entropy(full(x), y).backward()
                opt.step()
    assert [list(r["phases_ms"]) for r in steps_of(prof.log_path)] == [["backward", "optimizer"]] * 3


def _ddp_rank(rank: int, folder: str, init_file: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = DistributedDataParallel(Work(width=64))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with steptrace.Profiler(folder, rank=rank, world_size=2, cluster="off", detect=False) as prof:
            prof.watch(model, opt, nn.CrossEntropyLoss())  # comm timing and phases
            train(prof, model, opt, prof.phase_hooks[0].loss_fn, batches(10, seed=rank), accumulate=1)
            with model.no_sync():  # an accumulation micro-step without the all-reduce
                with prof.step():
                    nn.functional.cross_entropy(model(batches(1)[0][0]), batches(1)[0][1]).backward()
    finally:
        dist.destroy_process_group()


def test_ddp_over_gloo_two_spawned_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_rank, args=(str(tmp_path), str(tmp_path / "init")), nprocs=2, join=True)
    for rank in (0, 1):
        records = steps_of(tmp_path / f"rank{rank}.jsonl")
        assert len(records) == 11
        for r in records[:10]:
            assert list(r["phases_ms"]) == list(PHASES)
            assert r["comm"]["collectives"] >= 1  # the comm hook of watch() still times the all-reduce
            assert sum(r["phases_ms"].values()) <= r["step_ms"] * 1.0001
        assert list(records[10]["phases_ms"]) == ["forward", "backward"]
        assert "comm" not in records[10] or records[10]["comm"]["collectives"] == 0
    assert os.path.exists(tmp_path / "rank1.jsonl")
