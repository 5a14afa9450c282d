"""The live waste metrics (steptrace_badput_seconds_total{cause}, steptrace_job_goodput_ratio)
continue across the attempts of a job and agree with the offline report (steptrace.analysis.goodput).

Each attempt is its own process (a restart is a new process: its start is where the
recovery ends), writing the metrics to a node-exporter textfile at close.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from steptrace.analysis import goodput

LOOP = textwrap.dedent("""
    import os, sys, torch, steptrace
    fail_at = int(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start, ckpt = 0, "ckpt.pt"
    with steptrace.Profiler("runs/job", job="live-job", metrics_textfile=sys.argv[2]) as prof:
        if os.path.exists(ckpt):
            with prof.interval("restore"):
                state = torch.load(ckpt)
            model.load_state_dict(state["model"])
            start = state["step"]
        prof.set_step(start)
        for step in range(start, 90):
            with prof.step():
                if step % 30 == 15:
                    import gc; gc.collect()  # a full collection inside the step: the gc cause
                loss = model(torch.randn(16, 32)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            if step % 20 == 19:
                with prof.interval("checkpoint"):
                    torch.save({"model": model.state_dict(), "step": step + 1}, ckpt)
            if step == fail_at:
                raise SystemExit(3)
""")

_SAMPLE = re.compile(r'^(steptrace_badput_seconds_total|steptrace_job_goodput_ratio)\{[^}]*?(?:cause="(\w+)")?\} (\S+)$')


def _metrics(path: Path) -> tuple[dict[str, float], float]:
    badput: dict[str, float] = {}
    ratio = float("nan")
    for line in path.read_text().splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == "steptrace_badput_seconds_total":
            badput[m.group(2)] = float(m.group(3))
        elif m:
            ratio = float(m.group(3))
    return badput, ratio


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("live")
    (cwd / "loop.py").write_text(LOOP)
    first = subprocess.run([sys.executable, "loop.py", "50", "first.prom"], cwd=cwd, timeout=240)
    assert first.returncode == 3  # failed in step 50, after the save that follows step 39
    second = subprocess.run([sys.executable, "loop.py", "-1", "second.prom"], cwd=cwd, timeout=240)
    assert second.returncode == 0
    return cwd


def test_the_restart_continues_the_jobs_waste_account(job: Path) -> None:
    first, _ = _metrics(job / "first.prom")
    second, ratio = _metrics(job / "second.prom")
    assert set(second) == set(goodput.BADPUT)
    assert first["recovery"] == 0 and first["wasted_progress"] == 0  # nothing before it
    assert second["recovery"] > 0 and second["wasted_progress"] > 0
    assert second["restore"] > 0 and second["checkpoint"] > first["checkpoint"] > 0
    for cause in ("startup", "checkpoint", "host_contention", "other"):
        assert second[cause] >= first[cause], cause  # counters continue: never below the first attempt's
    assert 0 < ratio < 1


def test_the_live_account_agrees_with_the_offline_report(job: Path) -> None:
    live, ratio = _metrics(job / "second.prom")
    offline = goodput.job_goodput(job / "runs" / "job")
    sec = offline["seconds"]
    assert [a["attempt"] for a in offline["attempts"]] == [0, 1]
    assert offline["attempts"][0]["failed"] and offline["attempts"][0]["wasted_steps"] == 11  # steps 40..50
    # the same records, the same rules: the parts that do not depend on the ideal step time
    assert live["wasted_progress"] == pytest.approx(sec["wasted_progress"], rel=1e-6)
    # (run_end's goodput, which the report reads for an attempt that ended, has whole ms)
    for cause in ("checkpoint", "restore", "data", "eval", "compile", "host_contention", "gc"):
        assert live[cause] == pytest.approx(sec[cause], abs=2.5e-3), cause
    assert sec["gc"] > 0  # the loop's collections inside steps, on both sides
    # the process start is read in clock ticks (10 ms) by each side
    assert live["recovery"] == pytest.approx(sec["recovery"], abs=0.03)
    assert live["startup"] == pytest.approx(sec["startup"], abs=0.05 + 0.02 * sec["startup"])
    # all of it: the live total (badput / (1 - goodput ratio)) is the job's wall clock
    total = sum(live.values()) / (1 - ratio)
    assert total == pytest.approx(offline["wall_s"], rel=0.03)
    # the ideal step time is the trailing window's live, the job's offline: close, not equal
    assert ratio == pytest.approx(offline["goodput_ratio"], abs=0.05)


def test_an_unknown_cause_from_earlier_attempts_is_refused(tmp_path: Path) -> None:
    import steptrace

    with steptrace.Profiler(tmp_path / "run", metrics_textfile=str(tmp_path / "m.prom")) as prof:
        with pytest.raises(steptrace.UsageError, match="cause \"swap\" is unknown; allowed: productive"):
            prof._core.add_earlier_attempts("swap", 1.0)
        prof._core.add_earlier_attempts("gc", 1.0)  # a cause of its own (issue 52)
        with pytest.raises(steptrace.UsageError, match="seconds=-1"):
            prof._core.add_earlier_attempts("recovery", -1.0)
