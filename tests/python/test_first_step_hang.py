"""The run's first step and the hang watchdog (issue 52, point 2), on real training loops:
a first step is judged against ``first_step_hang_s`` (nothing of the run is measured
before it), not against ``hang_floor_s``; one that does not end is still named, while it
runs, after that limit. Small limits keep the tests short."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

import steptrace

DEADLINE_S = 60


def hang_alerts(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()
            if '"kind":"alert"' in line and '"type":"hang"' in line]


def wait_for_hang(log: Path) -> Optional[dict]:
    """The first step's body: runs until the watchdog has written its hang alert (bounded)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        found = hang_alerts(log)
        if found:
            return found[0]
        time.sleep(0.02)  # poll interval, not synchronization
    return None


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(64, 16)


def test_a_first_step_that_does_not_end_is_named_after_first_step_hang_s(tmp_path):
    model, opt, x = model_and_optimizer()
    seen = []
    # hang_floor_s 0.1 s: the limit the first step had before (it would be named at 0.1 s)
    with steptrace.Profiler(tmp_path, first_step_hang_s=0.4, hang_floor_s=0.1) as prof:
        prof.watch(model, opt)
        for i in range(3):
            with prof.step():
                loss = model(x).square().mean()
                if i == 0:
                    seen.append(wait_for_hang(Path(prof.log_path)))  # stuck until it is named
                loss.backward()
                opt.step()
                opt.zero_grad()
    hang = seen[0]
    assert hang is not None, "no hang alert while the first step ran"
    assert hang["step"] == 0
    assert hang["threshold"] == 400.0  # first_step_hang_s, not hang_floor_s
    assert hang["value"] > 400.0
    assert hang["details"]["limit_source"] == "first_step_hang_s"
    assert "first_step_hang_s" in hang["message"]
    records = list(steptrace.read(prof.log_path, validate=True))
    assert [r["step"] for r in records if r["kind"] == "step"] == [0, 1, 2]
    assert any(r["kind"] == "resolved" and r["type"] == "hang" for r in records)


def test_a_long_first_step_within_first_step_hang_s_is_no_hang(tmp_path):
    model, opt, x = model_and_optimizer()
    with steptrace.Profiler(tmp_path, hang_floor_s=0.1) as prof:  # first_step_hang_s: 600 s
        prof.watch(model, opt)
        for i in range(3):
            with prof.step():
                if i == 0:
                    time.sleep(0.8)  # the first step's set-up (8 watchdog polls): was a hang at 0.1 s
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    records = list(steptrace.read(prof.log_path, validate=True))
    assert not [r for r in records if r["kind"] == "alert" and r["type"] == "hang" and r["step"] == 0]
    assert len([r for r in records if r["kind"] == "step"]) == 3
