"""steptrace.analysis.plot: the panels drawn for what a log holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support import logfactory as lf

pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

from steptrace.analysis import plot as plot_mod  # noqa: E402
from steptrace.analysis.run import MissingDependencyError, load  # noqa: E402
from steptrace.analysis.plot import plot_run  # noqa: E402


def _run(tmp: Path, n: int = 300, ranks: int = 1, counters: bool = False, alerts: bool = False) -> Path:
    folder = tmp / "run"
    for rank in range(ranks):
        recs = [lf.run_start(rank=rank, world_size=ranks, config={"window": 50, "regression_threshold": 2.0})]
        for i in range(n):
            extra = {}
            if counters:
                extra = {"counters": {"tensor_active_pct": 50.0}, "kernels": {"compute_ms": 8.0, "nccl_ms": 1.0,
                                                                               "idle_ms": 0.5, "count": 40},
                         "telemetry": {"power_w": 300.0, "temp_c": 60.0}}
            slow = 4.0 if i == n // 2 else 1.0
            recs.append(lf.step(i, rank=rank, phases={"forward": 3.0 * slow, "backward": 5.0, "custom": 0.5},
                                memory={"allocated_bytes": 2**30 + i * 2**20, "rss_bytes": 2**31},
                                status="error" if i == n - 1 else "ok", **extra))
            if alerts and i == n // 2:
                recs.append(lf.alert("stall", i, rank=rank))
        lf.write_log(folder / f"rank{rank}.jsonl", recs)
    return folder


def _labels(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_single_rank_panels(tmp_path: Path) -> None:
    out = tmp_path / "p.png"
    fig = plot_run(_run(tmp_path), out)
    assert out.read_bytes()[:4] == b"\x89PNG"
    axes = fig.get_axes()
    assert len(axes) == 2  # timing + memory; no counters in this log
    top = _labels(axes[0])
    assert top[:4] == ["data", "forward", "backward", "custom"]
    assert "trailing median (50 steps)" in top and "2 x median" in top and "error step" in top
    assert _labels(axes[1]) == ["allocated", "rss"]
    assert axes[1].get_ylabel() == "memory GiB"
    assert "rank 0" in axes[0].get_title(loc="left")


def test_counters_alerts_and_ranks(tmp_path: Path) -> None:
    fig = plot_run(_run(tmp_path, ranks=2, counters=True, alerts=True), tmp_path / "p.svg", rank=1)
    assert (tmp_path / "p.svg").read_text().lstrip().startswith("<?xml")
    axes = fig.get_axes()
    assert [a.get_ylabel() for a in axes] == ["iteration ms", "memory GiB", "counters %", "kernels ms", "telemetry"]
    top = _labels(axes[0])
    assert "alert: stall" in top and "other ranks" in top
    assert "rank 1 of 2" in axes[0].get_title(loc="left")
    assert "allocated rank 0" in _labels(axes[1]) and "kernel_nccl_ms" in _labels(axes[3])


def test_long_runs_are_binned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plot_mod, "MAX_POINTS", 50)
    fig = plot_run(_run(tmp_path, n=400))
    top = _labels(fig.get_axes()[0])
    assert "max per 8 steps" in top
    line = next(ln for ln in fig.get_axes()[0].get_lines() if ln.get_label() == "max per 8 steps")
    assert len(line.get_xdata()) == 50
    assert max(line.get_ydata()) == pytest.approx(4 * 3.0 + 5.5 + 1.0)  # the slow step survives binning


def test_step_range_and_unknown_rank(tmp_path: Path) -> None:
    run = load(_run(tmp_path))
    fig = plot_run(run, steps="100:120")
    xs = fig.get_axes()[0].get_lines()[0].get_xdata()
    assert min(xs) == 100 and max(xs) == 119
    from steptrace.errors import UsageError

    with pytest.raises(UsageError, match="rank 5 is not in this log"):
        plot_run(run, rank=5)


def test_missing_matplotlib_gives_a_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"needs matplotlib.*pip install 'steptrace\[plot\]'"):
        plot_run(_run(tmp_path))


def test_the_time_between_steps_is_stacked_above_data(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.timeline_run())
    fig = plot_run(path, tmp_path / "p.png")
    top = _labels(fig.get_axes()[0])
    assert top[:3] == ["data", "other (between steps)", "forward"]
    # step 15's evaluation inside the step is step time no phase covers
    assert "no phase" in top
    # an older log has no between-steps layer
    old = plot_run(lf.write_log(tmp_path / "old" / "rank0.jsonl", lf.run_records(30)), tmp_path / "o.png")
    assert "other (between steps)" not in _labels(old.get_axes()[0])


def test_useful_work_panel_beside_step_time_and_power(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.work_run(40, iteration_ms=lambda i: 10.0 if i < 20 else 12.5,
                                                              energy_j=2.0))
    fig = plot_run(path)
    labels = [a.get_ylabel() for a in fig.get_axes()]
    # the panels: step time, work (MFU), power, memory; then their twin axes: the work
    # panel's tokens/s and power, the power panel's step ms
    assert labels == ["iteration ms", "MFU %", "power W", "memory MiB", "tokens/s", "power W", "step ms"]
    work_ax = fig.get_axes()[1]
    assert _labels(work_ax) == ["MFU %", "tokens/s", "power W"]
    assert "MFU per step and tokens/s" in work_ax.get_title(loc="left")
    mfu = work_ax.get_lines()[0].get_ydata()
    assert list(mfu[:2]) == pytest.approx([20.0, 20.0]) and mfu[-1] == pytest.approx(16.0)


def test_work_panel_without_mfu_or_tokens_shows_what_the_steps_have(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.work_run(20, peak_tflops=None, tokens=None))
    axes = plot_run(path).get_axes()
    assert [a.get_ylabel() for a in axes] == ["iteration ms", "TFLOP/s", "memory MiB", "samples/s"]
    assert len(plot_run(_run(tmp_path, n=30)).get_axes()) == 2  # no work: no work panel
