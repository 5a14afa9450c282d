"""The step table keeps the steps' NVML readings (``hw``): the summary, the plot and the
HTML report of a run with NVML figures read its log once, not again for ``hw``."""

from __future__ import annotations

import steptrace
from steptrace._table import collect
from steptrace.analysis.run import load_table
from steptrace.analysis.plot import hw_of
from steptrace.analysis.report import render_report
from steptrace.analysis.summary import summarize_table

# The stand-in NVML library of the C++ tests, compiled by test_nvml.py's fixture.


def test_the_table_keeps_hw_and_nothing_reads_the_log_again(tmp_path, monkeypatch, fake_nvml):
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady")
    with steptrace.Profiler(tmp_path / "run", nvml_interval_ms=1) as prof:
        for _ in range(30):
            with prof.step():
                with prof.phase("forward"):
                    sum(range(20000))
    log = tmp_path / "run" / "rank0.jsonl"
    records = list(steptrace.read(log))
    with_hw = [r for r in records if r["kind"] == "step" and "hw" in r]
    assert len(with_hw) >= 29

    table = collect(records)
    assert len(table.hw) == len(with_hw)
    assert table.hw.step == [r["step"] for r in with_hw]
    assert table.hw.values["power_w"] == [r["hw"]["power_w"] for r in with_hw]

    run = load_table(log)
    rereads = []
    run._reread = lambda: rereads.append(1) or steptrace.read(log)  # counts any second read
    log.unlink()  # nothing below may need the file
    hw = summarize_table(run.table)["hw"]
    assert 640 <= hw["mean_power_w"] <= 660  # the fake's steady 650 W
    assert hw_of(run) is run.table.hw
    html = render_report(run)
    assert "energy per step" in html and "mean power" in html
    assert rereads == []


def test_a_log_without_hw_has_an_empty_series_and_no_hw_view(tmp_path):
    with steptrace.Profiler(tmp_path / "run", nvml="off") as prof:
        for _ in range(5):
            with prof.step():
                pass
    run = load_table(tmp_path / "run" / "rank0.jsonl")
    assert len(run.table.hw) == 0 and hw_of(run) is None
    assert "hw" not in summarize_table(run.table)
