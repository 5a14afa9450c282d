"""The job's goodput across attempts (issue 51): synthetic job roots with exact timelines
(logfactory.attempt_run), the account per cause, the CLI and the summary."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import pytest

from support import logfactory as lf
from steptrace.analysis.goodput import CAUSES, ideal_step_time, job_attempts, job_goodput, money_text
from steptrace.analysis.summary import format_summary, summarize, summarize_job

MS = 1_000_000
TRUNCATED = '{"kind":"step","rank":0,"step":99,"start_unix_ns":1'  # a write cut off by the crash


def _schema_knows_issue51() -> bool:
    """Whether the schema has the lead's issue 51 fields yet (run_start.job, restore)."""
    from steptrace.analysis.reader import validate_record

    try:
        validate_record(lf.run_start(process_start_unix_ns=lf.T0_NS - 10**9, job=lf.job_of("j", 1, 0)))
        validate_record(lf.interval("restore", 0, 5.0))
    except Exception:  # noqa: BLE001 - jsonschema's ValidationError or LogFormatError
        return False
    return True


def _write(root: Path, attempt: int, logs: dict[int, list[dict[str, Any]]], tails: Optional[dict[int, str]] = None
           ) -> Path:
    folder = root if attempt == 0 else root / f"attempt{attempt}"
    for rank, recs in logs.items():
        lf.write_log(folder / f"rank{rank}.jsonl", recs, tail=(tails or {}).get(rank, ""))
    return folder


def _adds_up(job: dict[str, Any]) -> None:
    """Every cause adds up to the wall clock, and x the ranks to the GPU-hours, per
    attempt and in total, with no negative part."""
    assert all(job["seconds"][c] >= 0 for c in CAUSES), job["seconds"]
    total = math.fsum(job["seconds"].values())
    assert total == pytest.approx(job["wall_s"], rel=1e-6)
    hours = math.fsum(job["gpu_hours"].values())
    assert hours == pytest.approx(job["wall_s"] * job["world_size"] / 3600, rel=1e-6)
    assert job["gpu_hours_total"] == pytest.approx(hours, rel=1e-12)
    for a in job["attempts"]:
        parts = math.fsum(v for c, v in a["seconds"].items() if c != "recovery")
        assert parts == pytest.approx(a["wall_s"], rel=1e-6), a["seconds"]


def _two_attempts(root: Path, progress: bool = True, resume_at: int = 30, gap_s: float = 2.5,
                  torn0: bool = False) -> dict[str, Any]:
    """Attempt 0: 2 ranks, 40 steps of 10 ms, a save before steps 10, 20 and 30; rank 1
    raises after step 39, rank 0 is stopped by a signal 300 ms later (or its log is torn).
    Attempt 1 starts ``gap_s`` after rank 0's last record, restores for 80 ms and runs 30
    steps from progress ``resume_at``."""
    first = 0 if progress else None
    r0, i0 = lf.attempt_run(0, rank=0, world_size=2, save_every=10, first_progress=first,
                            end=None if torn0 else "signal", end_after_ms=300.0)
    r1, _ = lf.attempt_run(0, rank=1, world_size=2, save_every=10, first_progress=first, end="exception",
                           end_after_ms=20.0, error="RuntimeError: injected failure at step 180")
    _write(root, 0, {0: r0, 1: r1}, tails={0: TRUNCATED} if torn0 else None)
    start1 = i0["end_ns"] + int(gap_s * 1e9)
    logs, infos = {}, {}
    for rank in (0, 1):
        logs[rank], infos[rank] = lf.attempt_run(1, rank=rank, world_size=2, start_ns=start1, steps=30,
                                                 first_progress=resume_at if progress else None, restore_ms=80.0,
                                                 save_every=10)
    _write(root, 1, logs)
    return {"a0": i0, "a1": infos[0]}


# --------------------------------------------------------------------------- attempts


def test_job_attempts_of_a_root_a_run_folder_and_bad_paths(tmp_path: Path) -> None:
    from steptrace.errors import LogFormatError

    recs, _ = lf.attempt_run(0)
    _write(tmp_path / "job", 0, {0: recs})
    for k in (10, 2, 1):
        _write(tmp_path / "job", k, {0: lf.attempt_run(k)[0]})
    (tmp_path / "job" / "attempt3").mkdir()  # no logs in it: not an attempt
    (tmp_path / "job" / "notes").mkdir()
    got = job_attempts(tmp_path / "job")
    assert [a.number for a in got] == [0, 1, 2, 10]
    assert got[0].path == tmp_path / "job" and got[3].path == tmp_path / "job" / "attempt10"
    # a root whose attempt 0 is missing still has its later attempts
    _write(tmp_path / "late", 1, {0: recs})
    assert [a.number for a in job_attempts(tmp_path / "late")] == [1]
    # a plain run folder and a single file are jobs of one attempt
    assert [a.number for a in job_attempts(tmp_path / "job" / "attempt2")] == [0]
    assert job_attempts(tmp_path / "job" / "rank0.jsonl")[0].path.name == "rank0.jsonl"
    with pytest.raises(LogFormatError, match="no such file"):
        job_attempts(tmp_path / "missing")
    with pytest.raises(LogFormatError, match="holds no .jsonl log files"):
        job_attempts(tmp_path / "job" / "notes")


# --------------------------------------------------------------------------- the ideal step time


def test_ideal_step_time_is_the_mean_at_or_below_median_plus_3_mad() -> None:
    # median 3, deviations 2 1 0 1 97 -> MAD 1, cut-off 6: the mean of 1, 2, 3, 4
    got = ideal_step_time([1.0, 2.0, 3.0, 4.0, 100.0])
    assert got["ms"] == 2.5 and got["median_ms"] == 3.0 and got["mad_ms"] == 1.0 and got["cutoff_ms"] == 6.0
    assert got["steps"] == 4 and got["of_steps"] == 5
    # an even count: the medians are the means of the two middle values; MAD 0 keeps only
    # the steps at the median
    got = ideal_step_time([10.0, 10.0, 10.0, 10.0, 12.0, 50.0])
    assert got["median_ms"] == 10.0 and got["mad_ms"] == 0.0 and got["ms"] == 10.0 and got["steps"] == 4
    assert ideal_step_time([]) is None and ideal_step_time([float("nan"), 0.0]) is None


# --------------------------------------------------------------------------- restarts


@pytest.mark.parametrize("progress", [True, False], ids=["progress", "last-save"])
def test_failure_after_the_last_checkpoint_wastes_exactly_those_steps(tmp_path: Path, progress: bool) -> None:
    t = _two_attempts(tmp_path, progress=progress)
    job = job_goodput(tmp_path)
    _adds_up(job)
    a0, a1 = job["attempts"]
    assert a0["failed"] and not a1["failed"]
    assert a0["end_reasons"] == {"0": "signal", "1": "exception"}
    # steps 30..39 ran after the save before step 30: 10 steps of 10 ms
    assert a0["wasted_steps"] == 10
    assert job["seconds"]["wasted_progress"] == pytest.approx(0.100, abs=1e-9)
    assert ("progress >= 30" in a0["wasted_how"]) if progress else ("after the last checkpoint" in a0["wasted_how"])
    # recovery: from attempt 0's last record (rank 0's run_end) to attempt 1's process start
    assert job["seconds"]["recovery"] == pytest.approx(2.5, abs=1e-9)
    assert a0["seconds"]["recovery"] == pytest.approx(2.5, abs=1e-9) and a1["seconds"]["recovery"] == 0
    assert job["seconds"]["restore"] == pytest.approx(0.080, abs=1e-9)
    assert job["seconds"]["checkpoint"] == pytest.approx(0.050 * (3 + 2), abs=1e-9)  # saves: 3, then 2
    # the job's wall clock: attempt 0's process start to attempt 1's last record
    assert job["wall_s"] == pytest.approx((t["a1"]["end_ns"] - t["a0"]["process_start_ns"]) / 1e9, abs=1e-9)
    # every step took the ideal 10 ms: all of the other 60 steps' time is productive
    assert job["ideal_step"]["ms"] == 10.0 and job["seconds"]["slow_steps"] == 0
    assert job["seconds"]["productive"] == pytest.approx(0.6, abs=1e-9)
    assert job["goodput_ratio"] == pytest.approx(0.6 / job["wall_s"])
    # startup: each process's start to its first step, less the restore and the loader's wait
    startup = sum((a["first_start_ns"] - a["process_start_ns"]) / 1e9 - 0.001 for a in (t["a0"], t["a1"])) - 0.080
    assert job["seconds"]["startup"] == pytest.approx(startup, abs=1e-9)
    # GPU-hours are x 2 ranks
    assert job["gpu_hours"]["recovery"] == pytest.approx(2.5 * 2 / 3600)
    assert a0["origin"]["rank"] == 1 and "exception" in a0["origin"]["why"]
    assert "injected failure" in a0["origin"]["why"]


def test_progress_finds_the_steps_recomputed_after_a_resume_from_an_older_checkpoint(tmp_path: Path) -> None:
    # attempt 1 resumed at progress 20, not at the last save (30): 20 steps were recomputed
    _two_attempts(tmp_path, resume_at=20)
    job = job_goodput(tmp_path)
    _adds_up(job)
    assert job["attempts"][0]["wasted_steps"] == 20
    assert job["seconds"]["wasted_progress"] == pytest.approx(0.200, abs=1e-9)


def test_a_torn_failed_log_still_counts(tmp_path: Path) -> None:
    t = _two_attempts(tmp_path, torn0=True)
    with pytest.warns(Warning, match="truncated last line"):
        job = job_goodput(tmp_path)
    _adds_up(job)
    a0 = job["attempts"][0]
    assert a0["failed"] and a0["end_reasons"]["0"] == "missing"
    # rank 0's view ends with its last step: the recovery runs from there
    assert a0["end_unix_ns"] == t["a0"]["end_ns"]
    assert job["seconds"]["recovery"] == pytest.approx(2.5, abs=1e-9)
    assert job["seconds"]["wasted_progress"] == pytest.approx(0.100, abs=1e-9)
    # rank 1 raised: the exception names the origin before the torn log does
    assert a0["origin"]["rank"] == 1


def test_the_origin_is_the_rank_killed_first_while_the_others_went_on(tmp_path: Path) -> None:
    r0, _ = lf.attempt_run(0, rank=0, world_size=2, save_every=10, end="signal", end_after_ms=2000.0)
    r1, _ = lf.attempt_run(0, rank=1, world_size=2, save_every=10, steps=35, end=None)  # kill -9 at step 35
    _write(tmp_path, 0, {0: r0, 1: r1})
    job = job_goodput(tmp_path)
    _adds_up(job)
    origin = job["attempts"][0]["origin"]
    assert origin["rank"] == 1 and "without run_end" in origin["why"] and "rank 0 went on" in origin["why"]
    # the last attempt failed: its steps after the last save are lost all the same
    assert job["attempts"][0]["wasted_steps"] == 10


def test_a_killed_rank_is_the_origin_not_the_rank_that_saw_it_go(tmp_path: Path) -> None:
    # kill -9 of rank 1: its log ends without run_end; rank 0's all-reduce fails on the
    # closed connection and ends on that exception
    seen = ("RuntimeError: [gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:1434. This is "
            "typically caused by a remote worker crashing.")
    r0, _ = lf.attempt_run(0, rank=0, world_size=2, save_every=10, end="exception", end_after_ms=1500.0, error=seen)
    r1, _ = lf.attempt_run(0, rank=1, world_size=2, save_every=10, end=None)
    _write(tmp_path, 0, {0: r0, 1: r1})
    origin = job_goodput(tmp_path)["attempts"][0]["origin"]
    assert origin["rank"] == 1 and "without run_end" in origin["why"]
    # with no torn rank, the peer's exception is all there is: its first rank, said so
    _write(tmp_path, 0, {0: r0, 1: lf.attempt_run(0, rank=1, world_size=2, end="signal", end_after_ms=2000.0)[0]})
    origin = job_goodput(tmp_path)["attempts"][0]["origin"]
    assert origin["rank"] == 0 and "a peer's failure" in origin["why"]


def test_a_rank_silent_alert_names_the_origin_when_no_rank_raised(tmp_path: Path) -> None:
    r0, _ = lf.attempt_run(0, rank=0, world_size=2, end="signal")
    r0.insert(-1, lf.alert("rank_silent", 39, rank=0, phase=None, subject_rank=1,
                           message="rank 1 has sent nothing for 60 s"))
    r1, _ = lf.attempt_run(0, rank=1, world_size=2, end="signal")
    _write(tmp_path, 0, {0: r0, 1: r1})
    origin = job_goodput(tmp_path)["attempts"][0]["origin"]
    assert origin["rank"] == 1 and "rank_silent" in origin["why"]


# --------------------------------------------------------------------------- slow steps


def test_slow_steps_are_the_excess_over_the_ideal_step_time(tmp_path: Path) -> None:
    slow = {5: 30.0, 15: 45.0, 25: 12.5}  # a straggler held rank 0 up at three steps
    recs, _ = lf.attempt_run(0, world_size=4, steps=40, step_ms=lambda i: slow.get(i, 10.0))
    _write(tmp_path, 0, {0: recs})
    job = job_goodput(tmp_path)
    _adds_up(job)
    excess = sum(v - 10.0 for v in slow.values()) / 1e3
    assert job["ideal_step"]["ms"] == 10.0
    assert job["seconds"]["slow_steps"] == pytest.approx(excess, abs=1e-9)
    assert job["gpu_hours"]["slow_steps"] == pytest.approx(excess * 4 / 3600, rel=1e-9)
    assert job["seconds"]["productive"] == pytest.approx(0.400, abs=1e-9)
    assert not job["attempts"][0]["failed"] and job["seconds"]["wasted_progress"] == 0


def test_host_contention_and_compile_are_not_slow_steps(tmp_path: Path) -> None:
    fields = {7: {"host": {"runq_ms": 4.0, "runq_span_ms": 14.0}}, 9: {"compile_ms": 20.0}}
    durations = {7: 14.0, 9: 30.0, 0: 25.0}  # the first step warms up: startup, not a slow step
    recs, _ = lf.attempt_run(0, steps=20, step_ms=lambda i: durations.get(i, 10.0))
    for r in recs:
        if r["kind"] == "step" and r["step"] in fields:
            r.update(fields[r["step"]])
    _write(tmp_path, 0, {0: recs})
    job = job_goodput(tmp_path)
    _adds_up(job)
    s = job["seconds"]
    assert s["host_contention"] == pytest.approx(0.004, abs=1e-9)
    assert s["compile"] == pytest.approx(0.020, abs=1e-9)
    assert s["slow_steps"] == 0
    assert s["productive"] == pytest.approx(0.200, abs=1e-9)  # 20 steps at the ideal 10 ms


# --------------------------------------------------------------------------- the CLI


def test_cli_json_and_table_with_a_price(tmp_path: Path) -> None:
    _two_attempts(tmp_path / "job")
    proc = lf.run_cli("goodput", tmp_path / "job", "--json", "--gpu-hour-cost", "2.5")
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)
    _adds_up(job)
    assert job["cost"]["per_gpu_hour"] == 2.5
    assert job["cost"]["lost"] == pytest.approx(2.5 * job["lost_gpu_hours"])
    assert [a["attempt"] for a in job["attempts"]] == [0, 1]

    proc = lf.run_cli("goodput", tmp_path / "job", "--gpu-hour-cost", "2.5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    lost = job["lost_gpu_hours"]
    assert lines[0].startswith(f"this job lost {lost:.3g} GPU-hours (= {money_text(2.5 * lost)} at 2.50 per "
                               "GPU-hour): ")
    restarts = 100 * (job["gpu_hours"]["wasted_progress"] + job["gpu_hours"]["recovery"]) / lost
    assert f"{restarts:.0f}% restarts (wasted progress + recovery)" in lines[0]
    head = next(i for i, ln in enumerate(lines) if ln.startswith("cause"))
    assert lines[head].split() == ["cause", "seconds", "GPU-hours", "share", "cost"]
    rows = {ln[:20].strip(): ln.split() for ln in lines[head + 1:head + 2 + len(CAUSES)]}
    assert rows["recovery"][1] == "2.500"
    assert rows["total"][-2:] == ["100.0%", money_text(job["cost"]["total"])]
    attempts = next(i for i, ln in enumerate(lines) if ln.startswith("attempt"))
    assert lines[attempts + 1].split()[:3] == ["0", "2", "failed"]
    assert "rank 1: its run_end says it ended on an exception" in lines[attempts + 1]


def test_cli_takes_the_price_from_the_config(tmp_path: Path) -> None:
    recs, _ = lf.attempt_run(0, config={"gpu_hour_cost": 4.0})
    _write(tmp_path, 0, {0: recs})
    proc = lf.run_cli("goodput", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)
    assert job["gpu_hour_cost"] == 4.0 and job["cost"]["from"] == "run_start config gpu_hour_cost"


@pytest.mark.parametrize("case", ["missing", "empty", "negative", "nan"])
def test_cli_bad_input_is_one_error_line_naming_the_value(tmp_path: Path, case: str) -> None:
    recs, _ = lf.attempt_run(0)
    _write(tmp_path / "job", 0, {0: recs})
    (tmp_path / "empty").mkdir()
    args = {"missing": [tmp_path / "nope"], "empty": [tmp_path / "empty"],
            "negative": [tmp_path / "job", "--gpu-hour-cost", "-3"],
            "nan": [tmp_path / "job", "--gpu-hour-cost", "nan"]}[case]
    needle = {"missing": f"{tmp_path / 'nope'}: no such file", "empty": f"{tmp_path / 'empty'}: holds no",
              "negative": "'-3' must be a number >= 0", "nan": "'nan' must be a number >= 0"}[case]
    proc = lf.run_cli("goodput", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert needle in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- the summary


def test_summary_of_a_plain_run_shows_the_waste_table() -> None:
    s = summarize(lf.timeline_run())
    job = s["waste"]
    _adds_up(job)
    # the run's own wall-clock account is the same time, split the same way outside the steps
    g = s["goodput"]
    assert job["wall_s"] == pytest.approx(g["wall_s"])
    assert job["seconds"]["checkpoint"] == pytest.approx(g["checkpoint_s"])
    assert job["seconds"]["data"] == pytest.approx(g["data_s"])
    steps = sum(job["seconds"][c] for c in ("productive", "slow_steps", "compile", "host_contention"))
    assert steps + job["seconds"]["startup"] - g["startup_s"] == pytest.approx(g["steps_s"])
    lines = format_summary(s).splitlines()
    assert any(ln.startswith("this job lost ") for ln in lines)
    head = next(i for i, ln in enumerate(lines) if ln.startswith("cause"))
    assert [ln[:20].strip() for ln in lines[head + 1:head + 1 + len(CAUSES)]][:4] == [
        "productive", "slow steps", "wasted progress", "recovery"]
    # an older log without the time between steps has no report, and says nothing of it
    old = summarize(lf.run_records(5))
    assert old["waste"] is None and "this job lost" not in format_summary(old)


def test_summary_of_a_job_root_pools_the_attempts_and_shows_both_tables(tmp_path: Path) -> None:
    _two_attempts(tmp_path)
    s = summarize_job(tmp_path)
    assert s["attempts"] == 2 and s["goodput"] is None
    assert s["steps"] == 70  # each rank: 40 + 30 steps
    assert s["waste"]["seconds"]["recovery"] == pytest.approx(2.5, abs=1e-9)
    text = format_summary(s)
    assert text.splitlines()[0].startswith(f"job {tmp_path}, 2 attempts: ")
    assert "steps (training)" not in text  # one run's wall-clock table: the waste report covers both
    assert any(ln.startswith("attempt") for ln in text.splitlines())
    proc = lf.run_cli("summary", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["waste"]["failed_attempts"] == 1


@pytest.mark.xfail(not _schema_knows_issue51(), reason="the lead's issue 51 schema (run_start.job, "
                   "process_start_unix_ns, progress, restore) has not landed yet", strict=False)
def test_the_synthetic_attempts_validate_against_the_schema(tmp_path: Path) -> None:
    from steptrace.analysis.reader import read

    _two_attempts(tmp_path)
    for folder in (tmp_path, tmp_path / "attempt1"):
        assert len(list(read(folder, validate=True))) > 2 * 30


def test_the_report_of_a_job_root_has_the_waste_section(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    from steptrace.analysis.report import render_report

    _two_attempts(tmp_path / "job")
    page = render_report(str(tmp_path / "job"))
    job = job_goodput(tmp_path / "job")
    assert "<h2>Waste report</h2>" in page and "this job lost" in page
    assert "restarts (wasted progress + recovery)" in page
    assert ">wasted progress</td><td class=\"\">0.100</td>" in page
    assert "rank 1: its run_end says it ended on an exception" in page  # the per-attempt table
    assert f"{100 * job['goodput_ratio']:.1f}%" in page


def test_the_summary_of_the_example_shows_the_waste_table(tmp_path: Path) -> None:
    import subprocess
    import sys

    run = tmp_path / "train_mlp"
    proc = subprocess.run([sys.executable, str(lf.REPO / "examples" / "train_mlp.py"), str(run), "--synthetic",
                           "--epochs", "2"], capture_output=True, text=True, env=lf.installed_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = lf.run_cli("summary", run)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    sentence = next(ln for ln in lines if ln.startswith("this job lost "))
    head = next(i for i, ln in enumerate(lines) if ln.startswith("cause"))
    assert lines[head - 1].startswith("ideal step time ") and lines[head - 2].startswith("goodput ")
    table = {ln[:20].strip(): ln.split() for ln in lines[head + 1:head + 2 + len(CAUSES)]}
    assert list(table)[-1] == "total" and len(table) == len(CAUSES) + 1
    # one normal attempt: nothing restarted; the evaluations and checkpoints are in
    assert table["wasted progress"][2] == "0.000" and table["recovery"][1] == "0.000"
    assert float(table["evaluation"][1]) > 0 and float(table["checkpoint save"][2]) > 0
    assert "restarts" not in sentence
    job = json.loads(lf.run_cli("goodput", run, "--json").stdout)
    _adds_up(job)
    assert job["attempts"][0]["steps"] == 2 * 64 and not job["attempts"][0]["failed"]


@pytest.mark.parametrize("end", ["normal", None], ids=["run_end", "torn"])
def test_the_wall_clock_table_of_a_run_that_restored_has_a_restore_row(end: Optional[str]) -> None:
    # from run_end's goodput, or computed from the records of a torn log: the restore
    # before the first step is its own part, not startup, and the parts still add up
    recs, info = lf.attempt_run(1, restore_ms=80.0, end=end)
    g = summarize(recs)["goodput"]
    assert g["restore_s"] == pytest.approx(0.080, abs=1e-9)
    origin = info["process_start_ns"] if end else recs[0]["start_unix_ns"]
    assert g["startup_s"] == pytest.approx((info["first_start_ns"] - origin) / 1e9 - 0.080 - 0.001, abs=1e-9)
    parts = ("startup_s", "steps_s", "data_s", "eval_s", "checkpoint_s", "restore_s", "other_s", "after_last_step_s")
    assert math.fsum(g[k] for k in parts) == pytest.approx(g["wall_s"], rel=1e-9)
    lines = format_summary(summarize(recs)).splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("wall clock"))
    labels = [ln[:28].strip() for ln in lines[head + 1:head + 10]]
    assert labels[:6] == ["startup", "steps (training)", "data", "eval", "checkpoint", "restore"]


def test_the_last_save_of_any_rank_bounds_the_wasted_progress(tmp_path: Path) -> None:
    # rank 1 saved; rank 0 waited for it (a barrier): to rank 0 the saves were other time
    r0, _ = lf.attempt_run(0, rank=0, world_size=2, save_every=10, first_progress=None, end="signal")
    r0 = [r for r in r0 if r["kind"] != "interval"]
    for r in r0:
        if r["kind"] == "step" and "checkpoint_ms" in r:
            r["other_ms"] += r.pop("checkpoint_ms")
    g = r0[-1]["goodput"]
    g["other_s"], g["checkpoint_s"] = g["other_s"] + g["checkpoint_s"], 0.0
    r1, _ = lf.attempt_run(0, rank=1, world_size=2, save_every=10, first_progress=None, end="exception")
    _write(tmp_path, 0, {0: r0, 1: r1})
    job = job_goodput(tmp_path)
    _adds_up(job)
    assert job["seconds"]["checkpoint"] == 0  # rank 0's view: it did not save
    # rank 1's last save ended as step 30 began: rank 0's steps 30..39 were lost, not all 40
    assert job["attempts"][0]["wasted_steps"] == 10
    assert job["seconds"]["wasted_progress"] == pytest.approx(0.100, abs=1e-9)


def test_without_rank_0s_log_the_lowest_rank_present_is_the_view(tmp_path: Path) -> None:
    slow = {5: 30.0}  # rank 2's own view: its step 5 was slow
    r2, _ = lf.attempt_run(0, rank=2, world_size=4, step_ms=lambda i: slow.get(i, 10.0))
    r3, _ = lf.attempt_run(0, rank=3, world_size=4)
    _write(tmp_path, 0, {2: r2, 3: r3})
    job = job_goodput(tmp_path)
    _adds_up(job)
    a = job["attempts"][0]
    assert a["view_rank"] == 2 and a["ranks"] == [2, 3] and a["world_size"] == 4
    assert job["seconds"]["slow_steps"] == pytest.approx(0.020, abs=1e-9)
    assert job["gpu_hours"]["slow_steps"] == pytest.approx(0.020 * 4 / 3600)


def test_cluster_of_a_job_root_compares_the_ranks_of_each_attempt(tmp_path: Path) -> None:
    # attempt 0: rank 1 twice as slow as rank 0; attempt 1: the ranks even. Read as one run,
    # the folder would mix them (two rank 0s); each attempt is its own cluster view.
    _write(tmp_path, 0, {r: lf.attempt_run(0, rank=r, world_size=2, steps=60, step_ms=10.0 * (1 + r))[0]
                         for r in (0, 1)})
    _write(tmp_path, 1, {r: lf.attempt_run(1, rank=r, world_size=2, steps=60, start_ns=lf.T0_NS + 10**10)[0]
                         for r in (0, 1)})
    out = lf.run_cli("cluster", tmp_path, "--json", "--interval", "20")
    assert out.returncode == 0, out.stderr
    attempts = json.loads(out.stdout)["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1]

    def excess(attempt: dict[str, Any]) -> dict[int, float]:
        return {row["rank"]: row["straggler_pct"] for row in attempt["table"]["ranks"]}

    assert excess(attempts[0])[1] > 50 and abs(excess(attempts[1])[1]) < 1
    text = lf.run_cli("cluster", tmp_path, "--interval", "20")
    assert text.returncode == 0, text.stderr
    assert "attempt 0 (" in text.stdout and "attempt 1 (" in text.stdout
