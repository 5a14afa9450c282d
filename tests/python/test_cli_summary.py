"""Tests of steptrace.analysis.summary (numbers on known data) and the `steptrace summary` CLI."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from support import logfactory as lf
from steptrace.cli import main
from steptrace.analysis.summary import MISSING_END, format_summary, percentile, summarize

PYTHON_DIR = Path(__file__).resolve().parents[2] / "python"


def _known_run() -> list[dict]:
    """Four ok steps with hand-picked timings, one error step, memory and alerts.

    iterations (data + step): 3, 5, 7, 16 -> total 31 ms
    """
    spec = [  # (phases, data_ms)
        ({"zeta": 0.0, "backward": 2.0, "forward": 1.0}, 0.0),
        ({"forward": 2.0, "backward": 2.0}, 1.0),
        ({"forward": 3.0, "comm": 1.0, "backward": 2.0}, 1.0),
        ({"forward": 4.0, "backward": 10.0}, 2.0),
    ]
    rss = [100, 300, 250, 200]
    recs = [lf.run_start()]
    for i, (phases, data) in enumerate(spec):
        recs.append(lf.step(i, phases=phases, data_ms=data, memory={"rss_bytes": rss[i]}))
    # an error step: counted, but its partial timings stay out of the statistics
    recs.append(lf.step(4, phases={"forward": 500.0}, data_ms=100.0, status="error", memory={"rss_bytes": 200}))
    recs += [lf.alert("stall", 3), lf.alert("step_regression", 2), lf.alert("stall", 1)]
    recs.append(lf.run_end(5, error_steps=1))
    return recs


# --------------------------------------------------------------------------- summary


def test_known_run_records_are_valid() -> None:
    from steptrace.analysis.reader import validate_record

    for rec in _known_run():
        validate_record(rec)


def test_summary_numbers_on_known_data() -> None:
    s = summarize(_known_run())
    assert s["steps"] == 5
    assert s["error_steps"] == 1
    assert s["clock"] == "host"
    assert s["end_reason"] == "normal"
    # defaults first in their fixed order, then others in first-seen order
    assert list(s["phases"]) == ["forward", "backward", "zeta", "comm"]

    fwd = s["phases"]["forward"]
    assert fwd["count"] == 4
    assert fwd["p50_ms"] == pytest.approx(2.5)
    assert fwd["p95_ms"] == pytest.approx(3.85)  # 3 + 0.85 * (4 - 3)
    assert fwd["max_ms"] == 4.0
    assert fwd["share_pct"] == pytest.approx(100 * 10 / 31)

    bwd = s["phases"]["backward"]
    assert (bwd["p50_ms"], bwd["max_ms"]) == (2.0, 10.0)
    assert bwd["share_pct"] == pytest.approx(100 * 16 / 31)
    # a phase seen in one step: its share counts the other steps as zero
    assert s["phases"]["comm"]["count"] == 1
    assert s["phases"]["comm"]["share_pct"] == pytest.approx(100 * 1 / 31)

    assert s["data"]["p50_ms"] == 1.0 and s["data"]["max_ms"] == 2.0
    assert s["data"]["share_pct"] == pytest.approx(100 * 4 / 31)
    assert s["step"]["p50_ms"] == pytest.approx(5.0)  # steps 3, 4, 6, 14
    assert s["step"]["max_ms"] == 14.0
    assert s["iteration"]["p50_ms"] == pytest.approx(6.0)  # iterations 3, 5, 7, 16
    assert s["data"]["share_pct"] + s["step"]["share_pct"] == pytest.approx(100.0)

    # 5 step starts 20 ms apart: 4 iterations in 80 ms
    assert s["steps_per_s"] == pytest.approx(50.0)
    assert s["memory"] == {"rss_bytes": {"start": 100, "peak": 300, "end": 200}}
    assert s["alerts"] == {"stall": {"count": 2, "first_step": 1}, "step_regression": {"count": 1, "first_step": 2}}
    json.dumps(s)  # JSON-ready


def test_steps_per_s_falls_back_to_iteration_sum() -> None:
    # a single step has no span: 1 step / (3 + 1) ms = 250 steps/s
    recs = [lf.run_start(), lf.step(0, phases={"forward": 3.0}, data_ms=1.0)]
    assert summarize(recs)["steps_per_s"] == pytest.approx(250.0)


def test_missing_run_end() -> None:
    s = summarize(lf.run_records(3, end=False))
    assert s["end_reason"] == MISSING_END
    assert "missing (no run_end" in format_summary(s)


def test_two_ranks_pool_steps_and_report_each_end() -> None:
    recs = lf.run_records(4, rank=0, world_size=2) + lf.run_records(4, rank=1, world_size=2, end=False)
    s = summarize(recs)
    assert s["ranks"] == [0, 1]
    assert s["steps"] == 4
    assert s["steps_by_rank"] == {"0": 4, "1": 4}
    assert s["phases"]["forward"]["count"] == 8
    assert s["end_reasons"] == {"0": "normal", "1": MISSING_END}
    assert s["end_reason"].startswith("rank 0 normal, rank 1 missing")


def test_no_steps() -> None:
    s = summarize([lf.run_start()])
    assert s["steps"] == 0 and s["iteration"] is None and s["phases"] == {}
    assert "no completed steps" in format_summary(s)


def test_percentile_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        vals = sorted(rng.uniform(0, 100) for _ in range(n))
        for q in (0, 5, 50, 95, 99, 100):
            assert percentile(vals, q) == pytest.approx(float(np.percentile(vals, q)))


def test_format_summary_table() -> None:
    text = format_summary(summarize(_known_run(), source="rank0.jsonl"))
    lines = text.splitlines()
    assert lines[0] == "run rank0.jsonl: 5 steps (1 error), 50.0 steps/s, clock host, ended normal"
    assert lines[1].split() == ["phase", "p50", "ms", "p95", "ms", "p99", "ms", "max", "ms", "share"]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[2:9]}
    assert list(rows) == ["data", "forward", "backward", "zeta", "comm", "step", "iteration"]
    assert rows["forward"] == ["2.500", "3.850", "3.970", "4.000", "32.3%"]  # p99: 3 + 0.97 * (4 - 3)
    assert rows["data"][-1] == "12.9%"
    # the numeric columns line up: every row of the phase table has the same width
    assert len({len(ln) for ln in lines[1:9]}) == 1
    assert any(ln.startswith("rss") and "300 B" in ln for ln in lines)
    assert any(ln.split()[:3] == ["stall", "2", "1"] for ln in lines)


# --------------------------------------------------------------------------- CLI


def _env() -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(PYTHON_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steptrace.cli", *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )


def test_cli_summary_prints_phases_and_end_reason(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", _known_run())
    proc = _cli("summary", str(path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "ended normal" in out
    for phase in ("data", "forward", "backward", "zeta", "comm", "step"):
        assert any(ln.split()[:1] == [phase] for ln in out.splitlines()), phase
    assert "32.3%" in out
    assert proc.stderr == ""


def test_cli_summary_json_parses(tmp_path: Path) -> None:
    lf.write_log(tmp_path / "run" / "rank0.jsonl", lf.run_records(3, world_size=2))
    lf.write_log(tmp_path / "run" / "rank1.jsonl", lf.run_records(3, rank=1, world_size=2))
    proc = _cli("summary", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["ranks"] == [0, 1]
    assert data["steps"] == 3
    assert data["phases"]["forward"]["p50_ms"] == 3.0
    assert data["end_reason"] == "normal"


@pytest.mark.parametrize(
    "content, needle",
    [
        ("", "empty log"),
        ('{"hello": 1}\n', "not a steptrace log"),
        (None, "no such file"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, content, needle: str) -> None:
    path = tmp_path / "rank0.jsonl"
    if content is not None:
        path.write_text(content)
    proc = _cli("summary", str(path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    err_lines = proc.stderr.strip().splitlines()
    assert len(err_lines) == 1
    assert err_lines[0].startswith("steptrace: error: ") and needle in err_lines[0]
    assert proc.stdout == ""


def test_cli_corrupt_line_and_skip_bad(tmp_path: Path) -> None:
    text = lf.lines(lf.run_records(3))
    text.insert(2, '{"no_kind": 1}')
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(text) + "\n")
    proc = _cli("summary", str(path))
    assert proc.returncode == 2
    assert f"{path}:3:" in proc.stderr and "Traceback" not in proc.stderr

    proc = _cli("summary", str(path), "--skip-bad")
    assert proc.returncode == 0, proc.stderr
    assert "3 steps" in proc.stdout
    assert proc.stderr.startswith("steptrace: warning: ") and ":3:" in proc.stderr


def test_cli_torn_line_warns_once_and_succeeds(tmp_path: Path) -> None:
    text = lf.lines(lf.run_records(3))
    text.insert(2, "{broken")
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(text) + "\n")
    proc = _cli("summary", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "3 steps" in proc.stdout
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("steptrace: warning: ") and f"{path}:3: torn line skipped" in proc.stderr


def test_cli_truncated_last_line_warns_once_and_succeeds(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(2, end=False), tail='{"kind": "st')
    proc = _cli("summary", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "ended missing" in proc.stdout
    assert proc.stderr.count("\n") == 1 and "truncated" in proc.stderr


def test_main_in_process_returns_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(2))
    assert main(["summary", str(path)]) == 0
    assert "ended normal" in capsys.readouterr().out
    assert main(["summary", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("steptrace: error: ")
    assert main([]) == 2  # no command
    assert main(["bogus"]) == 2  # argparse usage error, returned rather than raised


# --------------------------------------------------------------------------- the time between steps


def _timeline_goodput(recs: list[dict]) -> dict:
    return next(r for r in recs if r["kind"] == "run_end")["goodput"]


def test_timeline_run_records_are_valid_and_its_goodput_adds_up() -> None:
    from steptrace.analysis.reader import validate_record

    recs = lf.timeline_run()
    for rec in recs:
        validate_record(rec)
    g = _timeline_goodput(recs)
    assert sum(g[k] for k in ("startup_s", "steps_s", "data_s", "eval_s", "checkpoint_s", "other_s",
                              "after_last_step_s")) == pytest.approx(g["wall_s"])


def test_summary_shows_where_the_wall_clock_went_from_run_end() -> None:
    recs = lf.timeline_run()
    g = _timeline_goodput(recs)
    s = summarize(recs)
    good = s["goodput"]
    assert good["source"] == "run_end" and good["from"] == "process_start" and good["ranks"] == 1
    for key in ("wall_s", "startup_s", "steps_s", "data_s", "eval_s", "checkpoint_s", "other_s", "after_last_step_s"):
        assert good[key] == pytest.approx(g[key]), key
    assert good["training_pct"] == pytest.approx(g["training_pct"])
    assert good["parts_pct"]["checkpoint"] == pytest.approx(100 * g["checkpoint_s"] / g["wall_s"])
    assert sum(good["parts_pct"].values()) == pytest.approx(100.0)
    # the interval records: 3 checkpoints before steps and one after the last, 2 evaluations
    assert s["intervals"]["checkpoint"] == {"count": 4, "total_s": pytest.approx(2.5), "max_s": 1.5, "inside_step": 0}
    assert s["intervals"]["eval"] == {"count": 2, "total_s": pytest.approx(0.205), "max_s": 0.2, "inside_step": 1}
    assert "other" not in s["intervals"]
    assert s["runq"]["total_ms"] == pytest.approx(0.25 * 15) and s["runq"]["readings"] == 15

    text = format_summary(s)
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("wall clock"))
    assert lines[head].split() == ["wall", "clock", "seconds", "share", "intervals"]
    rows = {ln.rsplit("  ", 1)[0].split("  ")[0].strip(): ln for ln in lines[head + 1:head + 9]}
    assert list(rows) == ["startup", "steps (training)", "data", "eval", "checkpoint", "other", "after last step",
                          "total (from process start)"]
    assert rows["checkpoint"].split()[1:] == ["2.500", f"{100 * 2.5 / g['wall_s']:.1f}%", "4,", "longest", "1.50", "s"]
    assert rows["eval"].split()[-4:] == ["2,", "longest", "200.00", "ms"]
    assert rows["total (from process start)"].split()[-2:] == [f"{g['wall_s']:.3f}", "100.0%"]
    assert f"training share (goodput): {g['training_pct']:.1f}% of the wall clock" in lines
    runq = next(ln for ln in lines if ln.startswith("run-queue wait"))
    assert "3.75 ms" in runq and "1 host_contention alert" in runq


def test_summary_lists_other_beside_data_and_the_iteration_leaves_out_intervals() -> None:
    s = summarize(lf.timeline_run())
    # every step waited 1 ms for its batch; after the first, 0.5 ms of other host work
    assert s["data"]["p50_ms"] == 1.0
    assert s["other"]["p50_ms"] == 0.5 and s["other"]["max_ms"] == 0.5 and s["other"]["count"] == 30
    # step 15 ran a 5 ms evaluation inside it: its step is 15 ms, its iteration is not
    assert s["step"]["max_ms"] == 15.0
    assert s["iteration"]["max_ms"] == pytest.approx(11.5) and s["iteration"]["p50_ms"] == pytest.approx(11.5)
    lines = format_summary(s).splitlines()
    assert [ln.split()[0] for ln in lines[2:11]] == ["data", "other", "forward", "loss", "backward", "clip",
                                                     "optimizer", "step", "iteration"]
    assert lines[11] == "" and lines[12].startswith("wall clock")
    # an older log (no other_ms) keeps its table and gets no wall-clock section
    old = summarize(_known_run())
    assert old["other"] is None and old["goodput"] is None and old["intervals"] == {} and old["runq"] is None
    assert "wall clock" not in format_summary(old) and "run-queue" not in format_summary(old)


def test_summary_of_a_crashed_run_computes_the_wall_clock_from_its_records() -> None:
    full = _timeline_goodput(lf.timeline_run())
    s = summarize(lf.timeline_run(end=False))
    good = s["goodput"]
    assert good["source"] == "steps" and good["from"] == "profiler_start"
    # the same account, but from the profiler's start (2 s later than the process's) to
    # the end of the checkpoint after the last step (no run_end: nothing after it)
    assert good["startup_s"] == pytest.approx(full["startup_s"] - 2.0)
    for key in ("steps_s", "data_s", "eval_s", "checkpoint_s", "other_s"):
        assert good[key] == pytest.approx(full[key]), key
    assert good["after_last_step_s"] == 0.0
    assert good["wall_s"] == pytest.approx(full["wall_s"] - 2.0 - full["after_last_step_s"])
    parts = sum(good[k] for k in ("startup_s", "steps_s", "data_s", "eval_s", "checkpoint_s", "other_s",
                                  "after_last_step_s"))
    assert parts == pytest.approx(good["wall_s"])
    assert good["training_pct"] == pytest.approx(100 * good["steps_s"] / good["wall_s"])
    text = format_summary(s)
    assert "total (from profiler start)" in text
    assert "(computed from the step records: no run_end)" in text


def test_goodput_of_two_ranks_is_summed_and_a_rank_without_run_end_is_computed() -> None:
    recs = lf.timeline_run(world_size=2) + lf.timeline_run(rank=1, world_size=2, end=False)
    s = summarize(recs)
    good = s["goodput"]
    assert good["ranks"] == 2 and good["source"] == "mixed" and good["from"] == "mixed"
    by = good["by_rank"]
    assert by["0"]["source"] == "run_end" and by["1"]["source"] == "steps"
    assert good["wall_s"] == pytest.approx(by["0"]["wall_s"] + by["1"]["wall_s"])
    assert good["training_pct"] == pytest.approx(100 * (by["0"]["steps_s"] + by["1"]["steps_s"]) / good["wall_s"])
    assert format_summary(s).splitlines()[12].startswith("wall clock (2 ranks, summed)")


def test_alert_list_shows_host_contention_and_slow_checkpoint() -> None:
    s = summarize(lf.timeline_run())
    assert s["alerts"] == {"host_contention": {"count": 1, "first_step": 12},
                           "slow_checkpoint": {"count": 1, "first_step": 24}}
    assert s["alert_first"]["host_contention"]["phase"] is None
    lines = format_summary(s).splitlines()
    contention = next(ln for ln in lines if ln.startswith("host_contention"))
    assert contention.split()[1:3] == ["1", "12"] and "waited 8.00 ms of it for a CPU" in contention
    checkpoint = next(ln for ln in lines if ln.startswith("slow_checkpoint"))
    assert checkpoint.split()[1:3] == ["1", "24"] and "took 1.50 s" in checkpoint


def test_cli_summary_json_and_rich_show_the_wall_clock(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "run" / "rank0.jsonl", lf.timeline_run())
    proc = _cli("summary", str(path.parent), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["goodput"]["training_pct"] == pytest.approx(_timeline_goodput(lf.timeline_run())["training_pct"])
    assert data["other"]["p50_ms"] == 0.5 and data["intervals"]["checkpoint"]["count"] == 4

    from io import StringIO

    from rich.console import Console

    from steptrace.analysis.summary import render_rich

    buf = StringIO()
    render_rich(data, Console(file=buf, width=160, color_system=None))
    out = buf.getvalue()
    assert "steps (training)" in out and "training share (goodput)" in out and "slow_checkpoint" in out


# --------------------------------------------------------------------------- useful work


def _slowing(i: int) -> float:
    """10 ms iterations, 12.5 ms from step 20 on: the same work, 20% fewer per second."""
    return 10.0 if i < 20 else 12.5


def test_work_run_records_are_valid() -> None:
    from steptrace.analysis.reader import validate_record

    for rec in lf.work_run(5, energy_j=2.0) + lf.work_run(3, peak_tflops=None, tokens=None):
        validate_record(rec)


def test_summary_reports_work_medians_trend_peak_and_energy() -> None:
    s = summarize(lf.work_run(40, energy_j=2.0))
    w = s["work"]
    # 8 samples, 1024 tokens, 2e10 FLOPs per 10 ms iteration; peak 10 TFLOP/s
    assert w["samples_per_s"]["p50"] == pytest.approx(800.0)
    assert w["tokens_per_s"]["p50"] == pytest.approx(102400.0)
    assert w["tflops_per_s"]["p50"] == pytest.approx(2.0)
    assert w["mfu_pct"]["p50"] == pytest.approx(20.0)
    assert w["mfu_pct"]["steps"] == 40
    assert w["mfu_pct"]["trend"]["trend"] == "flat"
    assert "job_p50" not in w["tokens_per_s"]
    assert w["peak"]["peak_tflops"] == 10.0
    # run_end: 2 J a step, 1024 tokens a step
    assert w["run"]["j_per_token"] == pytest.approx(2.0 / 1024)
    assert w["run"]["tokens_per_kwh"] == pytest.approx(3.6e6 * 1024 / 2.0)
    assert w["run"]["energy_j"] == pytest.approx(80.0)
    text = format_summary(s)
    rows: dict = {}
    for ln in text.splitlines():
        if ln.split():
            rows.setdefault(ln.split()[0], ln)  # the table's row, not the lines under it
    assert rows["tokens/s"].split()[1] == "102,400" and rows["tokens/s"].split()[2] == "flat"
    assert rows["MFU"].split()[1] == "20.0%"
    assert "MFU against a peak of 10 TFLOP/s" in text
    assert "energy per token: 0.00195 J, 1,843.2 M tokens/kWh (80.0 J in all)" in text


def test_summary_work_trend_falls_when_the_same_work_takes_longer() -> None:
    w = summarize(lf.work_run(40, iteration_ms=_slowing))["work"]
    for field in ("tokens_per_s", "samples_per_s", "tflops_per_s", "mfu_pct"):
        trend = w[field]["trend"]
        assert trend["trend"] == "falling", field
        assert trend["change_pct"] < -10
    assert w["mfu_pct"]["p50"] == pytest.approx((20.0 + 16.0) / 2)  # 20 steps at each
    line = next(ln for ln in format_summary(summarize(lf.work_run(40, iteration_ms=_slowing))).splitlines()
                if ln.startswith("MFU "))
    assert "falling -" in line and "% over" in line


def test_summary_work_of_two_ranks_sums_the_job_and_the_energy() -> None:
    recs = lf.work_run(20, energy_j=1.0) + lf.work_run(20, rank=1, world_size=2, iteration_ms=20.0, energy_j=3.0)
    w = summarize(recs)["work"]
    assert w["tokens_per_s"]["by_rank"] == {"0": pytest.approx(102400.0), "1": pytest.approx(51200.0)}
    assert w["tokens_per_s"]["job_p50"] == pytest.approx(153600.0)
    assert "job_p50" not in w["mfu_pct"]
    assert w["run"]["tokens"] == 2 * 20 * 1024
    assert w["run"]["j_per_token"] == pytest.approx((20 * 1.0 + 20 * 3.0) / (2 * 20 * 1024))
    text = format_summary(summarize(recs))
    assert "work (per rank)" in text
    assert any(ln.split()[:3] == ["tokens/s", "76,800", "153,600"] for ln in text.splitlines()), text


def test_summary_without_a_peak_says_why_and_without_work_says_nothing() -> None:
    s = summarize(lf.work_run(10, peak_tflops=None, tokens=None))
    assert set(s["work"]) == {"samples_per_s", "tflops_per_s", "run", "peak"}
    text = format_summary(s)
    assert "no MFU: no GPU timed the steps" in text
    assert not any(ln.startswith(("MFU ", "tokens/s")) for ln in text.splitlines())
    plain = summarize(lf.run_records(5))
    assert "work" not in plain
    assert "work" not in format_summary(plain).split()


def test_cli_summary_json_and_rich_carry_the_work(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.work_run(30, energy_j=2.0))
    proc = _cli("summary", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["work"]["mfu_pct"]["p50"] == pytest.approx(20.0)
    assert data["work"]["run"]["tokens_per_kwh"] == pytest.approx(3.6e6 * 1024 / 2.0)
    from rich.console import Console

    from steptrace.analysis.summary import render_rich

    console = Console(record=True, width=160)
    render_rich(data, console)
    out = console.export_text()
    assert "tokens/s" in out and "20.0%" in out and "energy per token" in out
