"""A lasting regression beside a busy host is reported; the clean loop beside it is not
(issue 52, point 0).

A ~1 ms CPU loop whose forward gains three or more 320x320 matmuls (~3.5 ms) from step 400: on a quiet host
the per-step rules flag it; beside a CPU hog per core single steps vary by the
scheduler's slices, no single step clears the per-step noise floor, and before the
distribution-shift rule (csrc/core/detect/shift_detector.hpp) no alert of any kind came in 1,000
slow steps. Each case runs several times; the hogs are `yes` processes, one per core,
started and killed here.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

import steptrace

torch = pytest.importorskip("torch")

STEPS = 1200
REGRESS_AT = 400


@contextlib.contextmanager
def hogs(on: bool) -> Iterator[None]:
    procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(os.cpu_count() or 1)] if on else []
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def extra_matmuls() -> int:
    """How many 320x320 matmuls make ~3.5 ms of added work on this machine (at least the
    issue's three): a regression is a lasting slowdown of at least regression_min_ms (1 s)
    of slow steps, so 400 steps need ~2.5 ms more each; on a fast CPU three came to 2.2 ms
    and the quiet run was flagged 409 steps in (the clean-clone CI)."""
    torch.set_num_threads(1)
    m = torch.randn(320, 320)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(3):
            m = m @ m
            m = m / m.norm()
        times.append((time.perf_counter() - start) / 3)
    return max(3, math.ceil(3.5e-3 / min(times)))


def run_loop(log_dir: Path, regress: bool) -> list[dict]:
    n_extra = extra_matmuls() if regress else 0
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    extra = torch.randn(320, 320)
    with steptrace.Profiler(log_dir, metrics_port=-1) as prof:
        for i in range(STEPS):
            with prof.step():
                with prof.phase("forward"):
                    out = model(x)
                    if regress and i >= REGRESS_AT:
                        for _ in range(n_extra):
                            extra = extra @ extra
                            extra = extra / extra.norm()
                with prof.phase("loss"):
                    loss = torch.nn.functional.mse_loss(out, y)
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
    return [r for r in steptrace.read(log_dir) if r["kind"] == "alert"]


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "beside-a-hog-per-core"])
def test_a_lasting_regression_is_flagged_in_forward_within_400_steps(tmp_path: Path, busy: bool) -> None:
    with hogs(busy):
        for run in range(2):
            alerts = run_loop(tmp_path / f"run{run}", regress=True)
            slow = [a for a in alerts if a["type"] in ("step_regression", "stall")]
            assert slow, f"run {run}: no alert; alerts: {[a['type'] for a in alerts]}"
            first = slow[0]
            assert REGRESS_AT <= first["step"] < REGRESS_AT + 400, first["message"]
            assert first["phase"] == "forward", first["message"]
            assert len([a for a in slow if a["step"] >= REGRESS_AT]) == 1, [a["message"] for a in slow]


@pytest.mark.parametrize("busy", [False, True], ids=["quiet", "beside-a-hog-per-core"])
def test_the_clean_loop_stays_silent(tmp_path: Path, busy: bool) -> None:
    with hogs(busy):
        for run in range(2):
            alerts = run_loop(tmp_path / f"run{run}", regress=False)
            slow = [a for a in alerts if a["type"] in ("step_regression", "stall", "hang")]
            assert not slow, [a["message"] for a in slow]
