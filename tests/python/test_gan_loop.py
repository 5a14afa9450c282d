"""Two optimizers per batch (issue 52): a GAN-style loop (tests/python/support/gan_loop.py, as
pytorch/examples' DCGAN writes it) unmodified under ``steptrace run``. Each
``optimizer.step()`` ends a step, as Lightning's ``global_step`` counts: two steps a batch,
alternating D's update (48 samples through the models) and G's (16), of different costs.
The slow-step rules must judge such alternating steps without paging on a clean run, on a
quiet host and beside a CPU hog per core, and still flag a slowdown of G's forward."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

SCRIPT = Path(__file__).resolve().parent / "support" / "gan_loop.py"
SLOW_STEP_ALERTS = {"step_regression", "stall", "hang"}


@contextlib.contextmanager
def cpu_hog(enabled: bool) -> Iterator[None]:
    """One `yes` per core while the block runs; killed and reaped after."""
    procs: list[subprocess.Popen] = []
    try:
        if enabled:
            procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(os.cpu_count() or 1)]
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def gan_run(tmp_path: Path, *args: str, hog: bool = False) -> list[dict]:
    with cpu_hog(hog):
        proc = subprocess.run(
            [sys.executable, "-m", "steptrace.cli", "run", "--log-dir", str(tmp_path / "logs"), str(SCRIPT), *args],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [json.loads(line) for line in (tmp_path / "logs" / "rank0.jsonl").read_text().splitlines()]


def slow_step_alerts(records: list[dict]) -> list[tuple]:
    return [(r["type"], r["step"], r.get("value"), r.get("baseline"), r.get("phase"))
            for r in records if r["kind"] == "alert" and r["type"] in SLOW_STEP_ALERTS]


@pytest.mark.parametrize("hog", [False, True], ids=["quiet", "cpu-hog"])
@pytest.mark.parametrize("seed", [0, 1])
def test_clean_gan_loop_pages_nothing(tmp_path, hog, seed):
    batches = 250 if hog else 300  # beside the hog a step takes ~3x as long
    records = gan_run(tmp_path, "--batches", str(batches), "--seed", str(seed), hog=hog)
    steps = [r for r in records if r["kind"] == "step"]
    # two steps a batch: D's update then G's, each ended by its optimizer.step()
    assert len(steps) == 2 * batches
    samples = [s["work"]["samples"] for s in steps[2:12]]
    assert samples == [48, 16] * 5, samples
    assert slow_step_alerts(records) == []


# Beside a CPU hog per core (and this 2-core host's other load) the same slowdown is called
# host_contention (issue 52 point 0, the lead's): step 300 took 170 ms against a median of
# 19 ms, 161 ms of it runnable; over the slow steps the median went 19 -> 226 ms, forward
# 0.7 -> 215 ms, the run-queue wait 12.8 -> 192 ms a step: the thread's work grew, and its
# wait for a CPU with it. No step_regression or stall came.
@pytest.mark.parametrize("hog", [False, pytest.param(True, marks=pytest.mark.xfail(
    strict=False, reason="before the distribution-shift rule this was host_contention; now flagged in the runs here, "
           "kept non-strict until it holds over many loaded runs"))],
    ids=["quiet", "cpu-hog"])
def test_slower_g_forward_is_flagged_with_its_phase(tmp_path, hog):
    # G runs forward in both updates (a fresh fake batch for G's update): from batch 150 on
    # it does 120 extra matmuls (tens of ms on steps of a few): flagged at once, in forward
    records = gan_run(tmp_path, "--batches", "170", "--regenerate", "--slow-g-from", "150",
                      "--slow-g-matmuls", "120", hog=hog)
    found = [a for a in slow_step_alerts(records) if a[0] in ("step_regression", "stall")]
    assert found, slow_step_alerts(records)
    assert all(a[1] >= 300 for a in found), found  # nothing before the injection (step 300)
    assert found[0][1] < 340 and found[0][4] == "forward", found


# A moderate slowdown (24 matmuls, steps ~3x) in DCGAN's layout: G's forward runs only in D's
# update (G's update reuses the fake batch), so only every other step gets slower. Measured
# (a loaded 2-core host, no hog of ours), one run: D's steps 6.6 -> 22 ms, G's 1.9 ms
# unchanged, the window's median 3.3 -> 11.2 ms, 600 slower steps, no alert: G's steps
# between them are within the noise and end every slow stretch (step_regression tolerates
# one per 10 slow steps), the fastest tenth does not move, and no single step is a stall
# (excess < 50 ms). In another run (G's steps 2.8 ms) it was flagged, step_regression at
# step 388 ("the fastest tenth takes 4.41 ms against 2.82 ms"): it depends on the load.
@pytest.mark.xfail(strict=False, reason="issue 52: a slowdown of one of two alternating steps was missed in "
                   "some runs; the distribution-shift rule flags it in the runs here, kept non-strict until "
                   "it holds over many loaded runs")
def test_slower_g_forward_in_ds_update_only_is_flagged(tmp_path):
    records = gan_run(tmp_path, "--batches", "300", "--slow-g-from", "150", "--slow-g-matmuls", "24")
    found = [a for a in slow_step_alerts(records) if a[0] in ("step_regression", "stall")]
    assert found and all(a[1] >= 300 for a in found), slow_step_alerts(records)
