"""Closure optimizers (issue 52, point 3): LBFGS runs forward and backward inside
``optimizer.step(closure)``, up to ``max_iter`` times a step. Under ``steptrace run`` and
``prof.watch()`` the closure's forward, loss and backward are timed as such, inside the
optimizer call, the optimizer phase keeps LBFGS's own work, phases still add up to at
most the step, and one ``step()`` is one step. A loop without closures (a GAN's two
optimizers a batch) is counted as before."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import steptrace
from steptrace.cli import main as cli

LBFGS_SCRIPT = """
import contextlib, json, sys
import torch
from torch import nn


def lbfgs_steps(steps, by_keyword=False, step_scope=contextlib.nullcontext, watch=None):
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = torch.sin(x @ torch.randn(16, 1))
    model = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 1))
    loss_fn = nn.MSELoss()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    if watch is not None:
        watch(model, opt, loss_fn)
    calls = []
    for step in range(steps):
        n = [0]

        def closure():
            n[0] += 1
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        with step_scope():
            returned = opt.step(closure=closure) if by_keyword else opt.step(closure)
        assert isinstance(returned, torch.Tensor)  # the closure's loss comes back through any wrapper
        calls.append(n[0])
        with torch.no_grad():  # a prediction after each step, as time_sequence_prediction does
            model(x[:8])
    return calls


if __name__ == "__main__":
    print(json.dumps(lbfgs_steps(int(sys.argv[1]), by_keyword=sys.argv[2:] == ["keyword"])))
"""

GAN_SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
gen = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 16))
disc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
for batch in range(12):
    real = torch.randn(32, 16)
    fake = gen(torch.randn(32, 8))
    opt_d.zero_grad()
    loss_d = bce(disc(real), torch.ones(32, 1)) + bce(disc(fake.detach()), torch.zeros(32, 1))
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    loss_g = bce(disc(fake), torch.ones(32, 1))
    loss_g.backward()
    opt_g.step()
"""


def run_script(tmp_path: Path, text: str, *args: str) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(text))
    assert cli(["run", "--log-dir", str(tmp_path / "logs"), str(script), *args]) == 0
    return list(steptrace.read(tmp_path / "logs" / "rank0.jsonl", validate=True))


def check_closure_steps(recs: list[dict], calls: list[int]) -> None:
    found = [r for r in recs if r["kind"] == "step"]
    assert len(found) == len(calls)  # one step per optimizer.step(closure), not per closure call
    assert all(r["status"] == "ok" for r in found)
    assert max(calls) > 1  # LBFGS did evaluate the closure several times a step
    for r, n in zip(found, calls):
        phases = r["phases_ms"]
        assert {"forward", "backward", "optimizer"} <= set(phases), phases
        assert all(v > 0 for v in phases.values()), phases
        # forward and backward are not counted twice (inside and as part of the optimizer)
        assert sum(phases.values()) <= r["step_ms"] * 1.0001, (phases, r["step_ms"])
        assert r.get("meta", {}).get("micro_steps", 1) == n  # the closure's forwards, counted
    # the closure's work is most of an LBFGS step here (a 256-wide MLP on 512 samples, up to
    # five evaluations): its phases hold it, not `optimizer`
    share = sorted((r["phases_ms"]["forward"] + r["phases_ms"]["backward"]) / r["step_ms"] for r in found)
    assert share[len(share) // 2] > 0.3, share
    alerts = [r for r in recs if r["kind"] == "alert" and r["type"] in ("hang", "stall", "step_regression")]
    assert not alerts, alerts


def test_lbfgs_under_steptrace_run_times_the_closures_phases(tmp_path, capsys):
    recs = run_script(tmp_path, LBFGS_SCRIPT, "40")
    calls = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    check_closure_steps(recs, calls)


def test_a_closure_given_by_keyword_is_timed_too(tmp_path, capsys):
    recs = run_script(tmp_path, LBFGS_SCRIPT, "15", "keyword")
    calls = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    check_closure_steps(recs, calls)


def test_lbfgs_under_watch_times_the_closures_phases(tmp_path):
    script: dict = {}
    exec(LBFGS_SCRIPT, script)  # the same loop as the scripts above, in this process
    with steptrace.Profiler(tmp_path) as prof:
        calls = script["lbfgs_steps"](30, step_scope=prof.step, watch=prof.watch)
    recs = list(steptrace.read(prof.log_path, validate=True))
    check_closure_steps(recs, calls)
    assert all("loss" in r["phases_ms"] for r in recs if r["kind"] == "step")


def test_a_gan_loops_two_optimizers_are_counted_as_before(tmp_path):
    recs = run_script(tmp_path, GAN_SCRIPT)
    found = [r for r in recs if r["kind"] == "step"]
    assert len(found) == 24  # one step per optimizer.step(): D then G, 12 batches
    for r in found:
        assert "optimizer" in r["phases_ms"] and "backward" in r["phases_ms"]
        assert sum(r["phases_ms"].values()) <= r["step_ms"] * 1.0001
    alerts = [r for r in recs if r["kind"] == "alert" and r["type"] in ("hang", "stall", "step_regression")]
    assert not alerts, alerts
