"""steptrace.analysis.export: the Chrome trace-event timeline and the CSV, on hand-made logs."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from support import logfactory as lf
from steptrace.analysis.export import StepRange, export, export_chrome, export_csv


def _two_rank_run(tmp: Path, n: int = 20) -> Path:
    run = tmp / "run"
    for rank in (0, 1):
        recs = [lf.run_start(rank=rank, world_size=2, host=f"node{rank}", start_unix_ns=lf.T0_NS - 10**9 * rank)]
        for i in range(n):
            recs.append(lf.step(i, rank=rank, clock="cuda", counters={"tensor_active_pct": 50.0 + i},
                                host_phases_ms={"forward": 0.5, "backward": 0.7},
                                memory={"allocated_bytes": 2**30 + i, "rss_bytes": 2**29}))
            if i == 7:
                recs.append(lf.alert("step_regression", 7, rank=rank, phase="backward"))
        recs.append(lf.run_end(n, rank=rank))
        lf.write_log(run / f"rank{rank}.jsonl", recs)
    return run


def _chrome(path, **kw) -> dict:
    buf = io.StringIO()
    export_chrome(path, buf, **kw)
    return json.loads(buf.getvalue())


def test_chrome_trace_is_valid_with_a_process_per_rank(tmp_path: Path) -> None:
    trace = _chrome(_two_rank_run(tmp_path))
    events = lf.check_chrome_trace(trace)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (node0)", 1: "rank 1 (node1)"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {(r, t): n for r in (0, 1) for t, n in ((1, "steps"), (2, "data wait"), (3, "host"))}
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    assert len(steps) == 40 and all(e["tid"] == 1 for e in steps)
    # µs from the earliest run_start (rank 1 started a second before rank 0)
    assert trace["otherData"]["origin_unix_ns"] == lf.T0_NS - 10**9
    first = min(e["ts"] for e in steps if e["pid"] == 0)
    assert first == pytest.approx(1e6)
    assert steps[0]["dur"] == pytest.approx(10.0 * 1000)  # the factory's 10 ms step


def test_phases_are_laid_end_to_end_inside_their_step(tmp_path: Path) -> None:
    trace = _chrome(_two_rank_run(tmp_path))
    events = trace["traceEvents"]
    step0 = next(e for e in events if e["ph"] == "X" and e["name"] == "step" and e["pid"] == 0)
    phases = [e for e in events if e.get("cat") == "phase" and e["pid"] == 0 and e["args"]["step"] == 0]
    assert [e["name"] for e in phases] == list(lf.DEFAULT_PHASES_MS)
    assert phases[0]["ts"] == step0["ts"]
    for a, b in zip(phases, phases[1:]):
        assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=1e-3)
    assert [e["dur"] for e in phases] == pytest.approx([v * 1000 for v in lf.DEFAULT_PHASES_MS.values()])
    data = next(e for e in events if e["ph"] == "X" and e["name"] == "data" and e["pid"] == 0)
    assert data["tid"] == 2 and data["ts"] + data["dur"] == pytest.approx(step0["ts"], abs=1e-3)
    host = [e for e in events if e.get("cat") == "host" and e["pid"] == 0 and e["args"]["step"] == 0]
    assert [(e["name"], e["dur"]) for e in host] == [("forward", 500.0), ("backward", 700.0)]


def test_nested_phases_are_cut_at_the_step_end(tmp_path: Path) -> None:
    # "block" contains "attn": together longer than the step; the trace must still nest
    recs = [lf.run_start(), lf.step(0, phases={"block": 8.0, "attn": 5.0}, step_ms=9.0)]
    path = lf.write_log(tmp_path / "rank0.jsonl", recs)
    events = lf.check_chrome_trace(_chrome(path))
    attn = next(e for e in events if e["name"] == "attn")
    assert attn["dur"] == pytest.approx(1000.0)


def test_alerts_and_counters(tmp_path: Path) -> None:
    events = _chrome(_two_rank_run(tmp_path))["traceEvents"]
    alerts = [e for e in events if e["ph"] == "i"]
    assert len(alerts) == 2 and {e["pid"] for e in alerts} == {0, 1}
    a = alerts[0]
    assert a["name"] == "alert: step_regression" and a["args"]["step"] == 7 and a["args"]["phase"] == "backward"
    step7 = next(e for e in events if e.get("name") == "step" and e["pid"] == a["pid"] and e["args"]["step"] == 7)
    assert a["ts"] == step7["ts"]  # no unix_ns in the alert: placed at its step
    mem = [e for e in events if e["ph"] == "C" and e["name"] == "memory"]
    assert len(mem) == 40 and mem[0]["args"] == {"allocated_MiB": pytest.approx(1024.0), "rss_MiB": 512.0}
    counters = [e for e in events if e["ph"] == "C" and e["name"] == "counters"]
    assert counters[0]["args"] == {"tensor_active_pct": 50.0}


def test_step_range(tmp_path: Path) -> None:
    events = _chrome(_two_rank_run(tmp_path), steps=StepRange.parse("5:10"))["traceEvents"]
    steps = sorted({e["args"]["step"] for e in events if e["ph"] == "X"})
    assert steps == [5, 6, 7, 8, 9]
    assert StepRange.parse("7").start == 7 and StepRange.parse(":3").stop == 3 and StepRange.parse("").everything
    with pytest.raises(ValueError, match="bad step range"):
        StepRange.parse("x:y")


def test_csv_matches_the_dataframe(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    from steptrace.analysis.run import load

    run = _two_rank_run(tmp_path)
    buf = io.StringIO()
    assert export_csv(run, buf) == 40
    df = pd.read_csv(io.StringIO(buf.getvalue()))
    ref = load(run).steps
    assert list(df.columns) == list(ref.columns)
    assert (df["rank"].to_numpy() == ref["rank"].to_numpy()).all()
    for col in ("step_ms", "forward_ms", "host_forward_ms", "iteration_ms", "tensor_active_pct"):
        assert df[col].to_numpy() == pytest.approx(ref[col].to_numpy())
    assert df["allocated_bytes"].dtype.kind == "i" and df["allocated_bytes"].iloc[3] == 2**30 + 3
    assert set(df["clock"]) == {"cuda"} and set(df["status"]) == {"ok"}


def test_csv_missing_values_are_empty_cells(tmp_path: Path) -> None:
    recs = [lf.run_start(), lf.step(0, phases={"forward": 1.0}), lf.step(1, phases={"forward": 1.0, "extra": 2.0},
                                                                         status="error")]
    path = lf.write_log(tmp_path / "rank0.jsonl", recs)
    buf = io.StringIO()
    export_csv(path, buf)
    rows = list(csv.DictReader(io.StringIO(buf.getvalue())))
    assert rows[0]["extra_ms"] == "" and rows[1]["extra_ms"] == "2.0"
    assert rows[1]["status"] == "error"


def test_export_to_a_file_is_atomic(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    text = lf.lines(lf.run_records(5))
    text.insert(3, "[1, 2]")  # JSON, not a record (a torn line would just be skipped)
    bad.write_text("\n".join(text) + "\n")
    out = tmp_path / "t.json"
    from steptrace.errors import LogFormatError

    with pytest.raises(LogFormatError, match=":4: record is not a JSON object"):
        export(bad, "chrome", out)
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]
    from steptrace.analysis.reader import CorruptLineWarning

    with pytest.warns(CorruptLineWarning, match=":4: skipped"):
        assert export(bad, "chrome", out, skip_bad=True) > 0
    lf.check_chrome_trace(json.loads(out.read_text()))
    with pytest.raises(ValueError, match="unknown export format"):
        export(bad, "xml", out)


def test_cli_export_to_stdout(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(4))
    proc = lf.run_cli("export", path, "--format", "csv", "-o", "-", "--steps", "1:3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith("run_id,rank,step,")
    proc = lf.run_cli("export", path, "--format", "chrome", "-o", "-")
    lf.check_chrome_trace(json.loads(proc.stdout))
