"""GPU hardware telemetry (NVML ``hw`` in the step records) in ``steptrace summary``
(text, rich, JSON), ``steptrace plot`` (the power-and-step-time panel) and ``steptrace
report`` (the GPU hardware section); and a log without ``hw`` rendering as before."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from support import logfactory as lf
import steptrace
from steptrace.analysis.summary import HwSeries, format_summary, hw_summary, render_rich, summarize

N = 100
LIMIT = 700.0
TELEMETRY = {"active": ["nvml"], "unavailable": {}, "device": "GPU-fake-0", "power_limit_w": LIMIT}


def _hw(i: int, rank: int = 0) -> dict[str, Any]:
    """Step i's readings: 600 W (rank 1: 500 W) falling to 400 W over steps 60..69 with a
    power cap, 0.01 J per W (a 10 ms step), temperature climbing 60 -> 60 + 0.2 x i."""
    power = (600.0 if rank == 0 else 500.0) if not 60 <= i < 70 else 400.0
    return {"power_w": power, "min_power_w": power - 20.0, "energy_j": power * 0.01,
            "max_temp_c": 60.0 + 0.2 * i, "sm_clock_mhz": 1980.0 if not 60 <= i < 70 else 1400.0,
            "power_limit_w": LIMIT, "throttle_reasons": ["sw_power_cap"] if 60 <= i < 70 else [],
            "samples": 1}


def _records(rank: int = 0, world: int = 1, hw: bool = True) -> list[dict[str, Any]]:
    backends = dict(lf.run_start()["backends"])
    if hw:
        backends["telemetry"] = TELEMETRY
    recs = [lf.run_start(rank=rank, world_size=world, backends=backends)]
    recs += [lf.step(i, rank=rank, **({"hw": _hw(i, rank)} if hw else {})) for i in range(N)]
    end: dict[str, Any] = {}
    if hw:
        steps_energy = sum(_hw(i, rank)["energy_j"] for i in range(N))
        end["hw"] = {"source": "nvml", "samples": N, "steps_with_hw": N, "steps_energy_j": steps_energy,
                     "energy_j_per_1000_steps": 1000 * steps_energy / N, "energy_j": steps_energy + 50.0,
                     "power_limit_w": LIMIT}
    recs.append(lf.run_end(N, rank=rank, **end))
    return recs


def _log(tmp: Path, ranks: int = 1, hw: bool = True) -> Path:
    folder = tmp / "run"
    for r in range(ranks):
        lf.write_log(folder / f"rank{r}.jsonl", _records(r, ranks, hw))
    return folder


def test_synthetic_records_are_valid(tmp_path: Path) -> None:
    assert len(list(steptrace.read(_log(tmp_path), validate=True))) == N + 2


def test_summary_hw_figures() -> None:
    hw = summarize(_records())["hw"]
    # 90 steps at 600 W and 10 at 400 W
    assert hw["mean_power_w"] == pytest.approx(580.0)
    assert hw["min_power_w"] == 380.0 and hw["max_power_w"] == 600.0
    assert hw["power_limit_w"] == LIMIT and hw["power_pct_of_limit"] == pytest.approx(100 * 580 / 700)
    assert hw["energy_per_step_j"] == pytest.approx(5.8)
    assert hw["steps_energy_j"] == pytest.approx(580.0)
    assert hw["energy_j"] == pytest.approx(630.0)  # run_end's counter rise: waits included
    assert hw["energy_j_per_1000_steps"] == pytest.approx(5800.0)
    assert hw["max_temp_c"] == pytest.approx(60 + 0.2 * 99)
    assert hw["mean_sm_clock_mhz"] == pytest.approx((90 * 1980 + 10 * 1400) / 100)
    assert hw["throttle_reasons"] == {"sw_power_cap": 10} and hw["throttled_steps"] == 10
    assert hw["steps_with_hw"] == N and hw["source"] == "nvml"


def test_summary_hw_two_ranks_adds_energy() -> None:
    hw = summarize(_records(0, 2) + _records(1, 2))["hw"]
    assert hw["mean_power_w"] == pytest.approx((580.0 + 490.0) / 2)
    assert hw["energy_j"] == pytest.approx(630.0 + 540.0)
    assert hw["energy_j_per_1000_steps"] == pytest.approx(5800.0 + 4900.0)
    assert hw["steps_with_hw"] == 2 * N


def test_summary_from_run_end_only() -> None:
    recs = _records()
    for r in recs:
        if r["kind"] == "step":
            del r["hw"]
    hw = summarize(recs)["hw"]
    assert hw["energy_j"] == pytest.approx(630.0) and hw["energy_j_per_1000_steps"] == pytest.approx(5800.0)
    assert hw["mean_power_w"] is None and hw["steps_with_hw"] == N
    assert hw_summary(None, [], []) is None and hw_summary(HwSeries(), [], []) is None


def test_summary_text_rich_and_json(tmp_path: Path) -> None:
    summary = summarize(_records())
    text = format_summary(summary)
    for needle in ("gpu (nvml)", "power mean", "580 W (83% of 700 W)", "power min", "380 W",
                   "energy per step", "5.8 J", "energy per 1000 steps", "5800.0 J", "energy total", "630.0 J",
                   "temperature max", "80 C", "sw_power_cap (10 steps)"):
        assert needle in text, needle
    from rich.console import Console

    buf = io.StringIO()
    render_rich(summary, Console(file=buf, width=160, color_system=None))
    assert "580 W (83% of 700 W)" in buf.getvalue() and "sw_power_cap" in buf.getvalue()
    proc = lf.run_cli("summary", _log(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["hw"]["mean_power_w"] == pytest.approx(580.0)
    assert data["hw"]["throttle_reasons"] == {"sw_power_cap": 10}
    proc = lf.run_cli("summary", _log(tmp_path), "--plain")
    assert proc.returncode == 0 and "energy per step" in proc.stdout


def test_without_hw_summary_is_unchanged(tmp_path: Path) -> None:
    plain = summarize(_records(hw=False))
    assert "hw" not in plain
    text = format_summary(plain)
    assert "power" not in text and "energy" not in text and "gpu" not in text
    # the same log with hw only adds the hw part and its table
    with_hw = summarize(_records())
    assert {k: v for k, v in with_hw.items() if k != "hw"} == plain
    assert format_summary(with_hw).startswith(text.split("\nalerts")[0])
    proc = lf.run_cli("summary", _log(tmp_path, hw=False), "--json")
    assert proc.returncode == 0 and "hw" not in json.loads(proc.stdout)


def test_plot_power_and_step_time_panel(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    from steptrace.analysis.plot import plot_run

    fig = plot_run(_log(tmp_path), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    axes = fig.get_axes()
    power = next(ax for ax in axes if ax.get_ylabel() == "power W")
    twin = next(ax for ax in axes if ax.get_ylabel() == "step ms")
    labels = [t.get_text() for t in power.get_legend().get_texts()]
    assert labels == ["power W (step mean)", "power W (step min)", "power limit 700 W", "step ms"]
    y = power.get_lines()[0].get_ydata()
    assert len(y) == N and y[0] == 600.0 and y[65] == 400.0
    assert list(twin.get_lines()[0].get_ydata()[:3]) == [10.0, 10.0, 10.0]
    assert "max 80 C" in power.get_title(loc="left")
    # the panel sits under the timing panel and shares its step axis
    assert axes.index(power) == 1


def test_plot_without_hw_is_unchanged(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    from steptrace.analysis.plot import plot_run

    axes = plot_run(_log(tmp_path, hw=False)).get_axes()
    assert len(axes) == 2 and [ax.get_ylabel() for ax in axes] == ["iteration ms", "memory MiB"]


def test_report_hardware_section(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    from steptrace.analysis.report import render_report

    text = render_report(_log(tmp_path, ranks=2))
    assert "<h2>GPU hardware</h2>" in text
    for needle in ("535 W", "mean power (76% of limit)", "energy per step", "1170.0 J", "energy in all",
                   "80 C", "sw_power_cap", "sw_power_cap (20 steps)", "energy per 1000 steps"):
        assert needle in text, needle
    plain = render_report(_log(tmp_path / "plain", ranks=2, hw=False))
    assert "GPU hardware" not in plain and "energy" not in plain


def test_real_run_on_the_fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_nvml: Path) -> None:
    """A profiler run on the stand-in library (steady: 640..660 W) summarized and plotted."""
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady")
    import time

    with steptrace.Profiler(tmp_path / "run", nvml_interval_ms=1) as prof:
        for _ in range(30):
            with prof.step():
                time.sleep(0.002)
    hw = summarize(steptrace.read(tmp_path / "run"))["hw"]
    assert 640 <= hw["mean_power_w"] <= 660 and hw["power_limit_w"] == 700
    assert hw["energy_per_step_j"] > 0 and hw["energy_j"] >= hw["steps_energy_j"] > 0
    assert hw["throttle_reasons"] == {} and hw["steps_with_hw"] >= 29
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    from steptrace.analysis.plot import plot_run

    assert any(ax.get_ylabel() == "power W" for ax in plot_run(tmp_path / "run").get_axes())
