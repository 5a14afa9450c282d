"""``steptrace run``: an unmodified script (examples/train_plain.py, no steptrace in it)
profiled with steps from its optimizer steps and phases from global hooks; its exit status
and exceptions are its own; bad arguments fail before anything is written; torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import steptrace
from steptrace.live import flight_recorder
from steptrace.live.autophase import PHASES
from steptrace.cli import main as cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_plain.py"


def records(folder: Path, rank: int = 0) -> list[dict]:
    return list(steptrace.read(folder / f"rank{rank}.jsonl", validate=True))


def steps(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["kind"] == "step"]


def test_an_unmodified_script_gets_steps_and_phases(tmp_path, capsys):
    backward = torch.autograd.backward
    assert "import steptrace" not in EXAMPLE.read_text()
    assert cli(["run", "--log-dir", str(tmp_path), str(EXAMPLE), "--steps", "30"]) == 0
    assert "30 steps" in capsys.readouterr().out  # the script's own arguments reached it
    recs = records(tmp_path)
    found = steps(recs)
    # one step per optimizer step; the evaluation pass after training (no_grad) adds none
    assert [r["step"] for r in found] == list(range(30))
    for r in found:
        assert r["status"] == "ok"
        assert list(r["phases_ms"]) == list(PHASES)  # nn.CrossEntropyLoss is a loss module: "loss"
        assert sum(r["phases_ms"].values()) <= r["step_ms"] * 1.0001
    assert recs[-1]["kind"] == "run_end" and recs[-1]["reason"] == "normal"
    assert torch.autograd.backward is backward  # the hooks are gone after the run


def test_micro_steps_fall_into_the_optimizer_step(tmp_path):
    assert cli(["run", "--log-dir", str(tmp_path), str(EXAMPLE), "--steps", "6", "--accumulate", "3"]) == 0
    found = steps(records(tmp_path))
    assert len(found) == 6
    assert all(list(r["phases_ms"]) == list(PHASES) for r in found)
    assert all(r["meta"]["micro_steps"] == 3 for r in found)


def test_a_failing_script_propagates_its_exception_and_exit_status(tmp_path, capsys):
    assert cli(["run", "--log-dir", str(tmp_path / "a"), str(EXAMPLE), "--steps", "20", "--fail-at", "5"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: failing at step 5 as asked" in err and "train_plain.py" in err
    assert "runpy" not in err  # the traceback starts in the script
    recs = records(tmp_path / "a")
    assert [r["status"] for r in steps(recs)] == ["ok"] * 5
    assert recs[-1]["reason"] == "exception" and "failing at step 5" in recs[-1]["error"]

    assert cli(["run", "--log-dir", str(tmp_path / "b"), str(EXAMPLE), "--steps", "3", "--exit-code", "3"]) == 3
    recs = records(tmp_path / "b")
    assert len(steps(recs)) == 3 and recs[-1]["reason"] == "exit"


def test_the_exit_status_of_the_command_is_the_scripts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "steptrace.cli", "run", "--log-dir", str(tmp_path), str(EXAMPLE),
                           "--steps", "2", "--fail-at", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "RuntimeError: failing at step 1 as asked"
    assert records(tmp_path)[-1]["reason"] == "exception"


@pytest.mark.parametrize("case", ["missing script", "log dir is a file", "bad option", "script is a folder"])
def test_bad_inputs_give_one_line_and_exit_2_before_anything_is_written(tmp_path, capsys, case):
    log_dir, script, extra = tmp_path / "logs", str(EXAMPLE), []
    if case == "missing script":
        script = str(tmp_path / "nope.py")
    elif case == "log dir is a file":
        (tmp_path / "file").write_text("x")
        log_dir = tmp_path / "file" / "logs"
    elif case == "bad option":
        extra = ["--option", "no_such_option=1"]
    else:
        script = str(tmp_path)
    assert cli(["run", "--log-dir", str(log_dir), *extra, script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("steptrace: error: "), err
    assert not (tmp_path / "logs").exists()


DDP_SCRIPT = """
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    for i in range(8):
        x = torch.randn(8, 16)
        loss_fn(model(x), x[:, :4].argmax(dim=1)).backward()
        opt.step()
        opt.zero_grad()
    import json, os
    from steptrace.live import flight_recorder
    snap = flight_recorder.snapshot()  # the recorder that steptrace run turned on
    # one write() per line: the two ranks share the pipe, and print()'s pieces interleave
    os.write(1, f"FR {os.environ.get('TORCH_FR_BUFFER_SIZE')} {json.dumps(flight_recorder.compact(snap))}\\n".encode())
    dist.destroy_process_group()
"""


def test_nproc_per_node_runs_every_rank_under_the_launcher(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in flight_recorder.ENV_VARS}
    proc = subprocess.run([sys.executable, "-m", "steptrace.cli", "run", "--log-dir", str(tmp_path / "logs"),
                           "--nproc-per-node", "2", "--torchrun=--standalone", str(script)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # steptrace run turned PyTorch's flight recorder on: each rank recorded DDP's set-up
    # collectives and its 8 buckets, the last an all-reduce, all completed
    fr = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("FR ")]
    assert len(fr) == 2 and fr[0][2] == fr[1][2] and {size for _, size, _ in fr} == {"2000"}, proc.stdout
    [(enqueued, completed, pending, op)] = json.loads(fr[0][2]).values()
    assert enqueued == completed >= 8 and pending is None and op == "gloo:all_reduce"
    starts = []
    for rank in (0, 1):
        recs = records(tmp_path / "logs", rank)
        starts.append(recs[0])
        assert len(steps(recs)) == 8
        assert all(list(r["phases_ms"]) == list(PHASES[:3]) + ["optimizer"] for r in steps(recs))
        # the DDP model's all-reduces are timed from its first backward on: one bucket a step
        assert all(r["comm"]["collectives"] == 1 and r["comm"]["comm_ms"] > 0 for r in steps(recs)), steps(recs)
        assert recs[-1]["reason"] == "normal"
    assert sorted((s["rank"], s["world_size"]) for s in starts) == [(0, 2), (1, 2)]


HOOKS_SCRIPT = """
    import sys
    import torch
    from torch import nn
    from torch.nn.modules import module
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for i in range(5):
        out = model(torch.randn(4, 8))
        during = len(module._global_forward_pre_hooks)  # in the step, after its first forward
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        # global hooks while discovering, then hooks on the top-level module only, and one
        # global hook between two steps until the next forward (evaluation with any module)
        seen.append((during, len(module._global_forward_pre_hooks), len(model._forward_pre_hooks),
                     len(model[0]._forward_pre_hooks)))
    print(seen)
"""


@pytest.mark.parametrize("discover, expected", [
    ("2", [(1, 1, 0, 0), (1, 1, 1, 0), (0, 1, 1, 0), (0, 1, 1, 0), (0, 1, 1, 0)]),
    ("0", [(1, 1, 0, 0)] * 5),
])
def test_global_hooks_only_while_discovering_the_top_level_modules(tmp_path, capsys, discover, expected):
    script = tmp_path / "hooks.py"
    script.write_text(textwrap.dedent(HOOKS_SCRIPT))
    assert cli(["run", "--log-dir", str(tmp_path / "logs"), "--discover-steps", discover, str(script)]) == 0
    assert capsys.readouterr().out.strip() == str(expected)
    found = steps(records(tmp_path / "logs"))
    assert [list(r["phases_ms"]) for r in found] == [["forward", "backward", "optimizer"]] * 5
    assert not torch.nn.modules.module._global_forward_pre_hooks  # all gone after the run


def test_ddp_all_reduces_are_timed_under_global_hooks_and_the_programs_own_hook_still_runs(tmp_path):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from steptrace.live.autophase import GlobalPhaseHooks

    init = DDP.__init__
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        prof = steptrace.Profiler(tmp_path, detect=False)
        hooks = GlobalPhaseHooks(prof._core, steps=True)  # as steptrace run; the Profiler times DDP
        own_calls = []

        def own_hook(state, bucket):
            own_calls.append(1)
            return allreduce_hook(state, bucket)

        torch.manual_seed(0)
        plain = DDP(nn.Linear(8, 2))  # gets DDP's own all-reduce, timed
        custom = DDP(nn.Linear(8, 2))
        custom.register_comm_hook(None, own_hook)  # the program's own hook: behind ours, still called
        for model in (plain, custom):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
        hooks.remove()
        prof.close()
        assert len(own_calls) == 3
        assert DDP.__init__ is init  # (registration stays patched: a model keeps steptrace's hook)
        recs = steps(steptrace.read(prof.log_path))
        assert len(recs) == 6
        assert all(r.get("comm", {}).get("collectives") == 1 for r in recs), recs
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("how, evaluated", [("steptrace run", "module"), ("steptrace run", "copy"),
                                            ("watch", "module")])
def test_evaluating_the_model_inside_the_ddp_wrapper_is_an_evaluation(tmp_path, how, evaluated):
    # Scripts often evaluate (or sample, or save) with the unwrapped model: model.module,
    # accelerator.unwrap_model(model), or with a copy (an EMA of the weights). Only the
    # wrapper is a top-level module in training, so that forward was not seen, and its time
    # between steps paged as a stall in `other` (rank 0 of the GPT-style DDP script with
    # --eval-unwrapped, twice in 130 iterations). watch() knows only the model it watches.
    import copy

    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from steptrace.live.autophase import GlobalPhaseHooks
    from steptrace.live.intervals import IntervalWatch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        prof = steptrace.Profiler(tmp_path, detect=False)
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        eval_model = model.module if evaluated == "module" else copy.deepcopy(model.module)
        # model.module also while steptrace run discovers the top-level modules; the copy only
        # after (a module first called then is not among them)
        evaluations = (1, 3, 5) if evaluated == "module" else (3, 5)
        if how == "watch":
            prof.watch(model, opt)
            hooks = None
        else:
            hooks = GlobalPhaseHooks(prof._core, steps=True, intervals=IntervalWatch(prof._core, checkpoints=False))
        for i in range(6):
            if i in evaluations:
                with torch.no_grad():
                    eval_model(torch.randn(4, 8))
            if how == "watch":
                with prof.step():
                    model(torch.randn(4, 8)).sum().backward()
                    opt.step()
            else:
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
            opt.zero_grad()
        if hooks is not None:
            hooks.remove()
        prof.close()
        recs = list(steptrace.read(prof.log_path, validate=True))
        assert [(r["interval"], r["step"]) for r in recs if r["kind"] == "interval"] == [("eval", i) for i in evaluations]
        # the wrapper's training forward runs the inner module: one forward phase, timed once
        assert [list(r["phases_ms"]) for r in steps(recs)] == [["forward", "backward", "optimizer"]] * 6
        assert all("micro_steps" not in r.get("meta", {}) for r in steps(recs))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("before_every_step", ["frozen teacher", "teacher", "trained model"])
def test_a_frozen_teachers_forward_before_every_step_is_no_evaluation(tmp_path, before_every_step):
    # Distillation: the teacher runs under no_grad before the student's forward, which
    # begins the step under steptrace run. Between steps with gradients disabled, it looked
    # like an evaluation: every step's teacher forward was an evaluation interval, outside
    # the iteration the slow-step rules judge (a 300-step run: "eval ... 300 intervals"). A
    # module that opens the gap's interval before three steps in a row and whose parameters
    # no optimizer steps opens none from then on, with requires_grad or without; an
    # evaluation that calls it first is still one (it must not begin a step there); the
    # trained model evaluated before every step stays an evaluation.
    import copy

    from torch import nn

    from steptrace.live.autophase import FROZEN_AFTER_STEPS, GlobalPhaseHooks
    from steptrace.live.intervals import IntervalWatch

    prof = steptrace.Profiler(tmp_path, detect=False)
    torch.manual_seed(0)
    student = nn.Linear(8, 2)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    if before_every_step == "frozen teacher":
        teacher.requires_grad_(False)
    ema = copy.deepcopy(student)  # evaluated now and then: never stepped, yet an evaluation
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    hooks = GlobalPhaseHooks(prof._core, steps=True, intervals=IntervalWatch(prof._core, checkpoints=False))
    evaluations = (6, 9)
    for i in range(12):
        x = torch.randn(4, 8)
        if i in evaluations:
            with torch.no_grad():
                teacher(x)  # the evaluation compares the copy with the teacher, teacher first
                ema(x)
        with torch.no_grad():
            target = (student if before_every_step == "trained model" else teacher)(x)
        loss = nn.functional.mse_loss(student(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
    hooks.remove()
    prof.close()
    recs = list(steptrace.read(prof.log_path, validate=True))
    intervals = [(r["interval"], r["step"]) for r in recs if r["kind"] == "interval"]
    if before_every_step == "trained model":
        assert intervals == [("eval", i) for i in range(12)]
    else:
        learning = tuple(range(FROZEN_AFTER_STEPS))  # before the rule knows the teacher
        assert intervals == [("eval", i) for i in learning + evaluations]
    assert [list(r["phases_ms"]) for r in steps(recs)] == [["forward", "backward", "optimizer"]] * 12


EVAL_MODE_SCRIPT = textwrap.dedent("""
    import argparse, time
    import torch
    from torch import nn

    p = argparse.ArgumentParser()
    p.add_argument("--loop", required=True)
    a = p.parse_args()
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

        def forward(self, x):
            if not self.training:
                time.sleep(0.01)  # the work of a bigger model's forward (the evaluation's, here)
            return self.body(x)

    model, crit = Net(), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    accumulate = 2 if a.loop == "frozen batch norm" else 1

    def evaluate():  # written without no_grad: model.eval() alone
        model.eval()
        for _ in range(4):
            crit(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))

    if a.loop != "eval without no_grad":
        evaluate()  # then training goes on in eval mode: model.train() forgotten, or on purpose
    for step in range(12):
        if a.loop == "eval without no_grad":
            model.train()
        for _ in range(accumulate):
            crit(model(torch.randn(16, 8)), torch.randint(0, 4, (16,))).backward()
        opt.step()
        opt.zero_grad()
        if a.loop == "eval without no_grad" and step in (3, 7):
            evaluate()
            torch.save(model.state_dict(), "/dev/null")
""")


@pytest.mark.parametrize("loop", ["eval without no_grad", "forgot model.train()", "frozen batch norm"])
def test_forwards_in_eval_mode_with_gradients_are_training_only_when_a_backward_follows(tmp_path, loop):
    # A forward of a model in eval mode with gradients enabled, between steps, is an
    # evaluation written without no_grad (model.eval() alone) unless a backward follows it.
    # Under steptrace run such an evaluation's forwards began the next step and became its
    # forward phase: micro_steps 5 and 40 ms of "forward" in a 1 ms step, the goodput
    # counting evaluation as training. A loop that trains in eval mode (model.train()
    # forgotten after an evaluation; frozen batch norm) must still get steps that begin at
    # their forward, with every phase and their micro-steps.
    script = tmp_path / "train_eval_mode.py"
    script.write_text(EVAL_MODE_SCRIPT)
    assert cli(["run", "--log-dir", str(tmp_path / "log"), str(script), "--loop", loop]) == 0
    recs = records(tmp_path / "log")
    found = steps(recs)
    intervals = [(r["interval"], r["step"]) for r in recs if r["kind"] == "interval"]
    assert [r["step"] for r in found] == list(range(12))
    assert all(list(r["phases_ms"]) == list(PHASES[:3]) + ["optimizer"] for r in found)  # no clip here
    if loop == "eval without no_grad":
        assert intervals == [("eval", 4), ("checkpoint", 4), ("eval", 8), ("checkpoint", 8)]
        evals = [r for r in recs if r["kind"] == "interval" and r["interval"] == "eval"]
        assert all(r["duration_ms"] >= 4 * 10 for r in evals)  # every evaluation forward is in it
        assert all("micro_steps" not in r.get("meta", {}) for r in found)
        # none of evaluation's four (the first step's forward aside: its first-call costs took
        # over 40 ms once in a full run; the micro_steps check above covers it)
        assert all(r["phases_ms"]["forward"] < 40 for r in found[1:])
    else:
        # the first evaluation (before the first step): its last forward trained after all?
        # No: the training forward of the same module came next without a backward between
        assert intervals == [("eval", 0)]
        expected = 2 if loop == "frozen batch norm" else None
        assert [r.get("meta", {}).get("micro_steps") for r in found] == [expected] * 12
        for r in found:  # each step begins at its first forward (eval mode: 10 ms each)
            assert r["phases_ms"]["forward"] >= 10 * (expected or 1)
            assert r["step_ms"] >= sum(r["phases_ms"].values()) * 0.9999
