"""NVML telemetry from Python: unavailable on a machine without the driver (the run says
why and nothing else changes), the options as keywords, and the sampler thread against
the stand-in NVML library of the C++ tests (compiled here), with every record checked
against the schema."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import steptrace
from steptrace import ConfigError


def _run(path, steps=5, **options):
    with steptrace.Profiler(path, **options) as prof:
        for _ in range(steps):
            with prof.step():
                with prof.phase("forward"):
                    pass
    return list(steptrace.read(Path(path) / "rank0.jsonl", validate=True))


def test_without_nvml_run_start_says_why_and_steps_have_no_hw(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(tmp_path / "missing" / "libnvidia-ml.so.1"))
    records = _run(tmp_path / "run")
    telemetry = records[0]["backends"]["telemetry"]
    assert telemetry["active"] == []
    assert "could not be loaded" in telemetry["unavailable"]["nvml"]
    assert all("hw" not in r for r in records if r["kind"] == "step")
    assert "hw" not in records[-1]


def test_nvml_off_and_thresholds_as_keywords(tmp_path):
    records = _run(tmp_path / "run", nvml="off", nvml_interval_ms=50, power_low_fraction=0.6,
                   temp_rise_c_per_min=5.0, power_drop_w=250.0, power_drop_fraction=0.3,
                   power_low_min_s=10.0)
    assert records[0]["backends"]["telemetry"]["unavailable"]["nvml"] == 'disabled by nvml="off"'
    config = records[0]["config"]
    assert (config["nvml_interval_ms"], config["power_low_fraction"]) == (50, 0.6)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"nvml": "on"}, '"on" is unknown'),
        ({"nvml_interval_ms": 0}, "nvml_interval_ms=0"),
        ({"power_low_fraction": 1.5}, "power_low_fraction=1.5"),
        ({"power_drop_w": -1.0}, "power_drop_w=-1"),
    ],
)
def test_bad_nvml_options_raise(tmp_path, options, needle):
    with pytest.raises(ConfigError, match=needle):
        steptrace.Profiler(tmp_path / "run", **options)


def test_sampler_thread_fills_hw_and_reports_an_xid_at_once(tmp_path, monkeypatch, fake_nvml):
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "xid")
    xid_seen = threading.Event()

    def on_alert(record):
        if record["type"] == "hardware_error":
            xid_seen.set()

    with steptrace.Profiler(tmp_path / "run", nvml_interval_ms=1, on_alert=on_alert) as prof:
        for _ in range(20):
            with prof.step():
                pass
        # the fake raises XID 79 at its 25th reading (about 25 ms in), with no step running
        assert xid_seen.wait(timeout=30)
        for _ in range(20):
            with prof.step():
                pass
    records = list(steptrace.read(tmp_path / "run" / "rank0.jsonl", validate=True))
    telemetry = records[0]["backends"]["telemetry"]
    assert telemetry["active"] == ["nvml"] and telemetry["power_limit_w"] == 700
    steps = [r for r in records if r["kind"] == "step"]
    with_hw = [r for r in steps if "hw" in r]
    # steps that ran before the sampler's first reading have none (empty steps: on a busy
    # host all of the first 20 may); from the first step with a reading on, every step has one
    first = next(i for i, r in enumerate(steps) if "hw" in r)
    assert first < 21 and len(with_hw) == len(steps) - first, [("hw" in r) for r in steps]
    for r in with_hw:
        assert 640 <= r["hw"]["power_w"] <= 660
        assert r["hw"]["throttle_reasons"] == []
    xid = [r for r in records if r["kind"] == "alert" and r["type"] == "hardware_error"]
    assert xid and xid[0]["details"] == {"kind": "xid", "code": 79}
    assert records[-1]["hw"]["samples"] > 0
