"""steptrace.analysis.run: load() and its DataFrames; the column collector behind them and
behind the summary (numpy and pure Python give the same numbers)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support import logfactory as lf
from steptrace import _table
from steptrace.analysis.run import ALERT_COLUMNS, MissingDependencyError, Run, load, load_table
from steptrace.analysis.summary import summarize

pd = pytest.importorskip("pandas")
np = pytest.importorskip("numpy")


def _mixed_run(tmp: Path) -> Path:
    recs = [lf.run_start(run_id="r1")]
    recs.append(lf.step(0, phases={"forward": 1.0, "backward": 2.0}, memory={"rss_bytes": 100}))
    recs.append(lf.step(1, phases={"forward": 1.5, "step": 0.5}, memory={"rss_bytes": 120, "allocated_bytes": 7},
                        counters={"tensor_active_pct": 40.0}, kernels={"compute_ms": 1.0, "nccl_ms": 0.5,
                                                                        "idle_ms": 0.1, "count": 12}))
    recs.append(lf.alert("stall", 1, phase="forward"))
    recs.append({"kind": "resolved", "rank": 0, "type": "stall", "step": 2, "first_step": 1, "message": "back"})
    recs.append(lf.step(2, phases={"backward": 2.5}, status="error", memory={"rss_bytes": 130},
                        phase_retained_bytes={"backward": 4096}))
    recs.append(lf.run_end(3, error_steps=1))
    for r in recs:
        from steptrace.analysis.reader import validate_record

        validate_record(r)
    return lf.write_log(tmp / "rank0.jsonl", recs)


def test_steps_dataframe_columns_and_dtypes(tmp_path: Path) -> None:
    run = load(_mixed_run(tmp_path))
    df = run.steps
    assert list(df.columns) == [
        "run_id", "rank", "step", "start_unix_ns", "clock", "status", "step_ms", "data_ms", "host_ms",
        "iteration_ms", "other_ms", "eval_ms", "checkpoint_ms", "interval_in_step_ms", "runq_ms", "runq_span_ms", "on_cpu_ms", "steal_ms",
        "forward_ms", "backward_ms", "phase_step_ms", "backward_retained_bytes",
        "rss_bytes", "allocated_bytes", "tensor_active_pct",
        "kernel_compute_ms", "kernel_nccl_ms", "kernel_idle_ms", "kernel_count",
    ]
    # a phase called "step" cannot be "step_ms": that is the step time
    assert run.phase_columns == {"forward": "forward_ms", "backward": "backward_ms", "step": "phase_step_ms"}
    assert run.phases == ["forward", "backward", "step"]
    assert df["rank"].dtype == np.int64 and df["step"].tolist() == [0, 1, 2]
    assert df["start_unix_ns"].dtype == np.int64 and df["start_unix_ns"].iloc[0] == lf.T0_NS
    assert df["rss_bytes"].dtype == np.int64 and df["rss_bytes"].tolist() == [100, 120, 130]
    assert df["allocated_bytes"].dtype == np.float64 and math.isnan(df["allocated_bytes"].iloc[0])
    assert df["status"].tolist() == ["ok", "ok", "error"] and str(df["status"].dtype) == "category"
    assert str(df["clock"].dtype) == "category" and set(df["clock"]) == {"host"}
    assert df["run_id"].tolist() == ["r1"] * 3
    assert df["forward_ms"].tolist()[:2] == [1.0, 1.5] and math.isnan(df["forward_ms"].iloc[2])
    assert df["iteration_ms"].tolist() == [4.0, 3.0, 3.5]  # data 1.0 + step
    assert df["kernel_count"].iloc[1] == 12 and math.isnan(df["kernel_count"].iloc[0])
    assert df["backward_retained_bytes"].iloc[2] == 4096


def test_work_columns_of_the_steps(tmp_path: Path) -> None:
    recs = lf.work_run(4, peak_tflops=None, tokens=None)
    recs[2]["work"] = lf.work(10.0)  # a step that also knew its tokens and its MFU
    df = load(lf.write_log(tmp_path / "rank0.jsonl", recs)).steps
    assert df["samples_per_s"].tolist() == pytest.approx([800.0] * 4)
    assert df["samples"].dtype == np.float64 and df["samples"].tolist() == [8.0] * 4
    assert df["tokens_per_s"].iloc[1] == pytest.approx(102400.0) and math.isnan(df["tokens_per_s"].iloc[0])
    assert df["mfu_pct"].iloc[1] == pytest.approx(20.0) and df["mfu_pct"].isna().sum() == 3
    assert list(df.columns)[-1] in ("mfu_pct", "tokens_per_s")  # work columns come last


def test_alerts_dataframe(tmp_path: Path) -> None:
    run = load(_mixed_run(tmp_path))
    al = run.alerts
    assert list(al.columns) == list(ALERT_COLUMNS)
    assert len(al) == 1
    row = al.iloc[0]
    assert (row["type"], row["step"], row["phase"], row["resolved_step"]) == ("stall", 1, "forward", 2)
    assert row["value"] == 30.0 and row["baseline"] == 10.0 and row["run_id"] == "r1"
    empty = load(lf.write_log(tmp_path / "e" / "rank0.jsonl", lf.run_records(2))).alerts
    assert list(empty.columns) == list(ALERT_COLUMNS) and len(empty) == 0


def test_run_object(tmp_path: Path) -> None:
    path = _mixed_run(tmp_path)
    run = load(path)
    assert isinstance(run, Run) and len(run) == 3 and run.ranks == [0] and run.run_ids == ["r1"]
    assert "3 steps" in repr(run) and "1 alerts" in repr(run)
    assert run.config == {"log_dir": "runs/test"}
    assert run.summary()["error_steps"] == 1
    assert load(run) is run
    assert run.run_ends[0]["reason"] == "normal" and run.run_starts[0]["run_id"] == "r1"


def test_load_several_runs_and_ranks(tmp_path: Path) -> None:
    for name in ("a", "b"):
        for rank in (0, 1):
            recs = [lf.run_start(rank=rank, world_size=2, run_id=f"run-{name}")]
            recs += [lf.step(i, rank=rank) for i in range(4)]
            lf.write_log(tmp_path / name / f"rank{rank}.jsonl", recs)
    run = load([tmp_path / "a", tmp_path / "b"])
    df = run.steps
    assert len(df) == 16 and run.run_ids == ["run-a", "run-b"]
    assert df.groupby(["run_id", "rank"], observed=True).size().tolist() == [4, 4, 4, 4]
    assert df[df["run_id"] == "run-b"]["rank"].tolist() == [0] * 4 + [1] * 4


def test_phases_appearing_late_and_custom_names(tmp_path: Path) -> None:
    recs = [lf.run_start()] + [lf.step(i, phases={"forward": 1.0}) for i in range(3000)]
    recs += [lf.step(3000 + i, phases={"zeta": 2.0, "forward": 1.0, 'attention "block"': 0.5}) for i in range(5)]
    run = load(lf.write_log(tmp_path / "rank0.jsonl", recs))
    df = run.steps
    assert run.phases == ["forward", "zeta", 'attention "block"']
    assert df["zeta_ms"].isna().sum() == 3000 and df["zeta_ms"].iloc[-1] == 2.0
    assert df['attention "block"_ms'].notna().sum() == 5


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to 12 significant digits."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-12, nan_ok=True)
    return a == b


def test_pure_python_summary_equals_numpy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _mixed_run(tmp_path)
    recs = lf.run_records(50) + [lf.alert("memory_growth", 30)]
    for i, r in enumerate(recs):
        if r["kind"] == "step":
            r["memory"]["rss_bytes"] += i * 2**21
            r["phases_ms"]["forward"] += (i % 7) * 0.1
    # the time between steps, the wall clock (from run_end, and from the steps of a crashed run)
    timeline = lf.timeline_run() + lf.timeline_run(rank=1, world_size=2, end=False)
    # useful work on two ranks, slowing down (the work rates' medians and trends)
    work = lf.work_run(30, iteration_ms=lambda i: 10.0 + 0.1 * i, energy_j=1.0) + lf.work_run(30, rank=1, world_size=2)
    with_np = [summarize(recs), summarize(list(__import__("steptrace").read(path))), summarize(timeline),
               summarize(work)]
    monkeypatch.setattr(_table, "_NUMPY", None)
    without = [summarize(recs), summarize(list(__import__("steptrace").read(path))), summarize(timeline),
               summarize(work)]
    for a, b in zip(with_np[:3], without[:3]):
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    # a fitted slope of non-integer rates may differ in its last bit (numpy's dot product)
    assert _same(with_np[3], without[3])
    assert with_np[2]["goodput"]["source"] == "mixed" and with_np[2]["other"]["count"] == 60
    assert with_np[0]["memory_trend"]["rss_bytes"]["trend"] == "rising"
    assert with_np[0]["memory_trend"]["rss_bytes"]["bytes_per_step"] == pytest.approx(2**21)
    assert with_np[3]["work"]["mfu_pct"]["trend"]["trend"] == "falling"


def test_malformed_values_are_tolerated_as_missing(tmp_path: Path) -> None:
    recs = [lf.run_start(), lf.step(0), lf.step(1, step_ms="fast", data_ms=None), lf.step(2), lf.step(3, rank="zero")]
    recs[2]["memory"] = "lots"
    recs[3]["phases_ms"] = None
    recs[4]["phases_ms"] = [1, 2]
    table = _table.collect(recs)
    assert table.n == 4
    assert math.isnan(table.step_ms[1]) and math.isnan(table.data_ms[1])
    assert math.isnan(table.phases.cols["forward"][2])
    s = summarize(recs)
    assert s["steps"] == 4 and s["phases"]["forward"]["count"] == 1  # step 1 has no step_ms: not timed


def test_missing_pandas_gives_a_clear_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(2))
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas -> ImportError
    with pytest.raises(MissingDependencyError, match=r"needs pandas.*pip install 'steptrace\[analysis\]'"):
        load(path)
    run = load_table(path)  # the columns load without pandas; the DataFrame needs it
    with pytest.raises(ImportError, match=r"steps needs pandas"):
        run.steps
    from steptrace.cli import main

    assert main(["summary", str(path)]) == 0  # the summary never needs pandas


def test_a_hundred_thousand_steps_load_quickly(tmp_path: Path) -> None:
    # A million steps take a few seconds; a tenth of that must stay far below the limit
    # (catches an accidentally quadratic or per-value Python path).
    import orjson

    n = 100_000
    path = tmp_path / "rank0.jsonl"
    step = lf.step(0)
    with open(path, "wb") as fh:
        fh.write(orjson.dumps(lf.run_start()) + b"\n")
        for i in range(n):
            step["step"] = i
            step["start_unix_ns"] = lf.T0_NS + i * 20_000_000
            step["phases_ms"]["forward"] = 3.0 + (i % 100) / 100
            fh.write(orjson.dumps(step) + b"\n")
    t0 = time.perf_counter()
    run = load(path)
    df = run.steps
    s = run.summary()
    elapsed = time.perf_counter() - t0
    assert len(df) == n and s["steps"] == n
    assert s["phases"]["forward"]["p50_ms"] == pytest.approx(3.495, abs=0.01)
    assert elapsed < 15, f"{n} steps took {elapsed:.1f} s"


def test_resolved_step_covers_the_whole_episode(tmp_path: Path) -> None:
    # the detector flags step 190 of an episode that began at 188 and ended at 193; a
    # later alert of the same type is a new, unresolved episode
    recs = [lf.run_start()] + [lf.step(i) for i in range(200)]
    recs += [lf.alert("step_regression", 190),
             {"kind": "resolved", "rank": 0, "type": "step_regression", "step": 193, "first_step": 188,
              "message": "back"},
             lf.alert("step_regression", 197), lf.alert("stall", 191)]
    al = load(lf.write_log(tmp_path / "rank0.jsonl", recs)).alerts
    assert al["resolved_step"].tolist()[0] == 193
    assert al["resolved_step"].isna().tolist() == [False, True, True]


def test_between_step_and_run_queue_columns(tmp_path: Path) -> None:
    recs = lf.timeline_run(n=20)
    run = load(lf.write_log(tmp_path / "rank0.jsonl", recs))
    df = run.steps
    cols = ["other_ms", "eval_ms", "checkpoint_ms", "interval_in_step_ms", "runq_ms", "runq_span_ms"]
    assert list(df.columns[10:16]) == cols and all(df[c].dtype == np.float64 for c in cols)
    assert df["other_ms"].tolist() == [0.0] + [0.5] * 19  # nothing before the first step
    # written only where they happened: NaN elsewhere
    assert df["eval_ms"].dropna().to_dict() == {10: 200.0, 15: 5.0}
    assert df["checkpoint_ms"].dropna().to_dict() == {8: 300.0, 16: 300.0}
    assert df["interval_in_step_ms"].dropna().to_dict() == {15: 5.0}
    assert df["runq_ms"].isna().tolist() == [i % 2 == 0 for i in range(20)]
    assert df["runq_ms"].sum() == pytest.approx(0.25 * 10) and (df["runq_span_ms"].dropna() == 23.0).all()
    # the training iteration: data + other + step - the intervals inside the step
    assert df["iteration_ms"].tolist() == pytest.approx([11.0] + [11.5] * 19)
    assert df.loc[15, "step_ms"] == 15.0 and df.loc[15, "iteration_ms"] == pytest.approx(11.5)
    # the steps' between-step time adds up to run_end's goodput (the last checkpoint
    # came after the last step: in no step record)
    g = recs[-1]["goodput"]
    assert df["other_ms"].sum() / 1e3 == pytest.approx(g["other_s"])
    assert df["eval_ms"].sum() / 1e3 == pytest.approx(g["eval_s"])
    assert df["checkpoint_ms"].sum() / 1e3 + 0.4 == pytest.approx(g["checkpoint_s"])


def test_between_step_columns_are_nan_in_older_logs_and_junk_is_nan(tmp_path: Path) -> None:
    df = load(lf.write_log(tmp_path / "old" / "rank0.jsonl", lf.run_records(3))).steps
    for c in ("other_ms", "eval_ms", "checkpoint_ms", "interval_in_step_ms", "runq_ms", "runq_span_ms"):
        assert df[c].isna().all(), c
    assert df["iteration_ms"].tolist() == [11.0] * 3  # data 1.0 + step, as before
    recs = [lf.run_start(), lf.step(0, other_ms="slow", eval_ms=[1], host={"runq_ms": None}),
            lf.step(1, other_ms=2.0, host="busy", checkpoint_ms={"a": 1}), lf.step(2, other_ms=1.0)]
    df = load(lf.write_log(tmp_path / "junk" / "rank0.jsonl", recs)).steps
    assert math.isnan(df["other_ms"][0]) and df["other_ms"].tolist()[1:] == [2.0, 1.0]
    assert df["eval_ms"].isna().all() and df["runq_ms"].isna().all() and df["checkpoint_ms"].isna().all()


def test_a_phase_named_like_a_between_step_field_gets_the_phase_prefix(tmp_path: Path) -> None:
    recs = [lf.run_start(), lf.step(0, phases={"eval": 2.0, "other": 1.0}, other_ms=0.5)]
    run = load(lf.write_log(tmp_path / "rank0.jsonl", recs))
    assert run.phase_columns == {"eval": "phase_eval_ms", "other": "phase_other_ms"}
    assert run.steps.loc[0, "other_ms"] == 0.5 and run.steps.loc[0, "phase_other_ms"] == 1.0
