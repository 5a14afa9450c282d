"""NVML telemetry from Python: unavailable on a machine without the driver (the run says
why and nothing else changes), the options as keywords, and the sampler thread against
the stand-in NVML library of the C++ tests (compiled here), with every record checked
against the schema."""

from __future__ import annotations

import ctypes
import threading
import time
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


def test_power_drop_read_every_100ms_by_the_sampler_thread_is_a_power_drop(tmp_path, monkeypatch, fake_nvml):
    """Issue 49: on Ampere and newer (but GA100) nvmlDeviceGetPowerUsage is a trailing 1 s
    mean, so at 100 ms a reading the stand-in's 700 -> 200 W drop falls 50 W a reading and
    never crosses the 280 W threshold; the instantaneous field (NVML_FI_DEV_POWER_INSTANT)
    shows it in one reading. The real path: the sampler thread, each step's readings, the
    detector. The stand-in's scripted time moves 100 ms a reading (the sampler reads every
    1 ms of real time), and the steps go on until it has read 45 scripted seconds."""
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "drop")
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_READING_MS", "100")
    fake = ctypes.CDLL(str(fake_nvml))  # the same copy the profiler loads
    fake.fake_nvml_power_read_ns.restype = ctypes.c_longlong
    fake.fake_nvml_power_read_ns.argtypes = [ctypes.c_long]
    deadline = time.monotonic() + 120
    with steptrace.Profiler(tmp_path / "run", nvml_interval_ms=1) as prof:
        while fake.fake_nvml_power_read_ns(450) < 0 and time.monotonic() < deadline:
            with prof.step():
                time.sleep(0.002)  # the step's work
    assert fake.fake_nvml_power_read_ns(450) >= 0, "the sampler did not get to 45 s"
    records = list(steptrace.read(tmp_path / "run" / "rank0.jsonl", validate=True))
    drops = [r for r in records if r["kind"] == "alert" and r["type"] == "power_drop"]
    assert [(d["value"], d["threshold"]) for d in drops] == [(500, 280)], drops
    assert "NVML_FI_DEV_POWER_INSTANT" in records[0]["backends"]["telemetry"]["device"]


def test_local_rank_beyond_the_one_visible_gpu_has_telemetry_for_that_gpu(tmp_path, monkeypatch, fake_nvml):
    """Issue 49: one GPU per rank (CUDA_VISIBLE_DEVICES names the rank's own): LOCAL_RANK=1
    is no device this process sees, and its one visible device is the rank's (the counters'
    rule), not 'NVML unavailable'. Without the CUDA driver the visible devices are the
    entries of CUDA_VISIBLE_DEVICES; the stand-in's GPU 1 plays "hot" (75-76 C)."""
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady,hot")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with steptrace.Profiler(tmp_path / "run", nvml_interval_ms=1) as prof:
        for _ in range(20):
            with prof.step():
                time.sleep(0.002)  # the step's work
    records = list(steptrace.read(tmp_path / "run" / "rank0.jsonl", validate=True))
    telemetry = records[0]["backends"]["telemetry"]
    assert telemetry["active"] == ["nvml"], telemetry
    assert "LOCAL_RANK=1 is not among the 1 visible devices" in telemetry["device"]
    assert "GPU-1932f937" in telemetry["device"]
    temps = [r["hw"]["max_temp_c"] for r in records if r["kind"] == "step" and "hw" in r]
    assert temps and all(75 <= t <= 76 for t in temps), temps
