"""The evidence behind an alert (issue 54) in ``steptrace summary`` (text, --json) and
``steptrace report``: from a synthetic log with one alert and the ``alert_update`` that
evidence_capture writes after it (its shape copied from docs/alerts.md, "Evidence")."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from support import logfactory as lf
from steptrace.analysis.summary import format_summary, summarize
from steptrace.cli import main

VERDICT = ("forward +3.0 ms/step: new aten::mm 2.89 ms/step; "
           "backward +7.4 ms/step: aten::mm +7.19 ms/step, calls 3→7/step")

EVIDENCE_RECORD: dict[str, Any] = {
    "kind": "alert_update", "rank": 0, "type": "step_regression", "step": 22, "alert_step": 18,
    "phase": "forward", "message": f"evidence: {VERDICT}",
    "details": {"evidence": {
        "verdict": VERDICT,
        "steps": [20, 22], "trace": "evidence/rank0-step20-alert.pt.trace.json.gz", "trace_bytes": 41233,
        "baseline": {"steps": [10, 12], "trace": "evidence/rank0-step10-baseline.pt.trace.json.gz"},
        "syncs": [],
        "diff": {"step_ms": [2.06, 12.4], "between_ms": [0.02, 0.02],
                 "phases_ms": {"forward": [0.41, 3.46], "backward": [0.95, 8.3]},
                 "grew": [{"phase": "backward", "op": "aten::mm", "delta_ms": 7.19, "pct": 1045.6,
                           "calls": [3.0, 7.0]}],
                 "new": [{"phase": "forward", "op": "aten::mm", "ms": 2.89, "calls": 2.0, "sync": False},
                         {"phase": "loss", "op": "aten::item", "ms": 0.05, "calls": 1.0, "sync": True}],
                 "vanished": [{"phase": "forward", "op": "aten::relu", "ms": 0.12, "calls": 1.0, "sync": False}],
                 "ops_changed": True}}},
}


def _records(evidence: bool = True) -> list[dict[str, Any]]:
    recs = lf.run_records(30)
    extra = [lf.alert("step_regression", 18, phase="backward")]
    if evidence:
        extra.append(copy.deepcopy(EVIDENCE_RECORD))
    return recs[:-1] + extra + recs[-1:]


def test_summary_lists_the_evidence_with_its_alert_and_diff() -> None:
    ev = summarize(_records())["evidence"]
    assert ev == [{
        "rank": 0, "type": "step_regression", "alert_step": 18, "alert_phase": "backward", "phase": "forward",
        "steps": [20, 22], "verdict": VERDICT, "trace": "evidence/rank0-step20-alert.pt.trace.json.gz",
        "trace_bytes": 41233, "trace_dropped": None, "baseline_steps": [10, 12],
        "grew": EVIDENCE_RECORD["details"]["evidence"]["diff"]["grew"],
        "new": EVIDENCE_RECORD["details"]["evidence"]["diff"]["new"],
        "vanished": EVIDENCE_RECORD["details"]["evidence"]["diff"]["vanished"],
        "ops": [],
    }]


def test_text_summary_shows_the_verdict_trace_and_diff_table() -> None:
    text = format_summary(summarize(_records()))
    lines = text.splitlines()
    start = lines.index("evidence for step_regression at step 18 in backward (rank 0): "
                        "steps 20-22 against baseline steps 10-12")
    assert lines[start - 1] == ""  # after the alerts, a blank line apart
    block = lines[start:]
    assert block == [
        "evidence for step_regression at step 18 in backward (rank 0): steps 20-22 against baseline steps 10-12",
        f"  verdict: {VERDICT}",
        "  trace: evidence/rank0-step20-alert.pt.trace.json.gz (40.3 KiB)",
        "  change     phase      op                  ms/step   calls/step",
        "  grew       backward   aten::mm     +7.19 (+1046%)          3→7",
        "  new        forward    aten::mm              +2.89            2",
        "  new sync   loss       aten::item            +0.05            1",
        "  vanished   forward    aten::relu            -0.12            1",
    ]


def test_a_log_without_evidence_renders_as_before() -> None:
    plain = summarize(_records(evidence=False))
    assert "evidence" not in plain
    assert "evidence" not in format_summary(plain)
    # an alert_update without evidence (another kind of update) changes nothing either
    other = {**EVIDENCE_RECORD, "details": {"episode": 2}}
    recs = _records(evidence=False)
    with_update = summarize(recs[:-1] + [other] + recs[-1:])
    assert format_summary(with_update) == format_summary(plain)
    assert json.dumps(with_update, sort_keys=True, default=str) == json.dumps(plain, sort_keys=True, default=str)


def test_a_requested_capture_without_baseline_lists_its_own_ops() -> None:
    rec = {"kind": "alert_update", "rank": 1, "type": "capture", "step": 7, "alert_step": 5, "phase": None,
           "message": "evidence: no baseline yet",
           "details": {"evidence": {"verdict": "no baseline yet: the capture's own top ops are in `ops`",
                                    "steps": [5, 7], "trace": None, "trace_bytes": 0, "baseline": None,
                                    "trace_dropped": "over capture_max_bytes", "syncs": [],
                                    "ops": [{"phase": "forward", "op": "aten::addmm", "kind": "cpu",
                                             "calls": 3.0, "self_ms": 1.25, "device_ms": 0.5}]}}}
    recs = lf.run_records(10)
    text = format_summary(summarize(recs[:-1] + [rec] + recs[-1:]))
    lines = text.splitlines()
    start = lines.index("evidence for requested capture (rank 1): steps 5-7")
    assert lines[start:] == [
        "evidence for requested capture (rank 1): steps 5-7",
        "  verdict: no baseline yet: the capture's own top ops are in `ops`",
        "  trace: dropped (over capture_max_bytes)",
        "  change   phase     op            ms/step   calls/step",
        "  top      forward   aten::addmm      1.75            3",
    ]


def test_a_corrupt_evidence_record_gives_dashes_not_an_error() -> None:
    rec = {"kind": "alert_update", "rank": 0, "type": "stall", "alert_step": "x",
           "details": {"evidence": {"verdict": 3, "steps": "no", "diff": {"grew": [{"op": "a", "calls": 1}, 5]}}}}
    recs = lf.run_records(3)
    lines = format_summary(summarize(recs[:-1] + [rec] + recs[-1:])).splitlines()
    start = lines.index("evidence for stall at step - (rank 0): steps -")
    assert lines[start + 1:] == ["  verdict: -", "  change   phase   op   ms/step   calls/step",
                                 "  grew     -       a          -            -"]


def test_cli_summary_json_includes_the_evidence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", _records())
    assert main(["summary", "--json", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(e["type"], e["alert_step"], e["verdict"], e["trace"]) for e in out["evidence"]] == [
        ("step_regression", 18, VERDICT, "evidence/rank0-step20-alert.pt.trace.json.gz")]
    assert main(["summary", "--plain", str(path)]) == 0
    assert f"  verdict: {VERDICT}" in capsys.readouterr().out.splitlines()


def test_report_lists_the_evidence(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("pandas")
    from steptrace.analysis.report import render_report

    text = render_report(lf.write_log(tmp_path / "rank0.jsonl", _records()))
    assert ("<h3>evidence for step_regression at step 18 in backward (rank 0): steps 20-22 against baseline "
            "steps 10-12</h3>") in text
    assert "<p>verdict: forward +3.0 ms/step: new aten::mm 2.89 ms/step; backward +7.4 ms/step" in text
    assert "<p>trace: evidence/rank0-step20-alert.pt.trace.json.gz (40.3 KiB)</p>" in text
    assert ('<tr><td class="l">new sync</td><td class="l">loss</td><td class="l">aten::item</td>'
            '<td class="">+0.05</td><td class="">1</td></tr>') in text
    plain = render_report(lf.write_log(tmp_path / "plain" / "rank0.jsonl", _records(evidence=False)))
    assert "evidence for" not in plain and "Evidence: torch.profiler" not in plain
