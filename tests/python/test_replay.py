"""The detectors on synthetic timelines through steptrace.detect (the public offline
replay; the same C++ detectors as a live run): exact, deterministic steps, no wall clock."""

from __future__ import annotations

import random

import pytest

import steptrace

PHASES = ("forward", "backward")


def steps(times, start=0, data=None, memory=None):
    """Step records for iteration times in ms (split 40/60 into forward/backward), with
    optional per-step data wait and memory figures."""
    out = []
    for i, ms in enumerate(times):
        d = data(start + i) if data else 0.0
        rec = {"kind": "step", "step": start + i, "step_ms": ms, "data_ms": d,
               "phases_ms": {"forward": 0.4 * ms, "backward": 0.6 * ms}}
        if memory:
            rec["memory"] = memory(start + i)
        out.append(rec)
    return out


def alerts(records, kind="alert"):
    return [r for r in records if r["kind"] == kind]


def test_a_busy_host_preempting_a_sub_millisecond_loop_raises_nothing():
    rng = random.Random(1)
    # 0.34 ms steps; one in ten preempted for 4-5 ms, as beside a compile job
    times = [0.34 * rng.uniform(0.9, 1.1) + (rng.uniform(4, 5) if rng.random() < 0.1 else 0) for _ in range(3000)]
    assert steptrace.detect(steps(times)) == []


def test_a_one_second_step_in_a_180_ms_loop_is_a_stall_with_its_thresholds():
    rng = random.Random(2)
    times = [180 * rng.uniform(0.97, 1.03) for _ in range(150)] + [1000] + [180] * 10
    out = steptrace.detect(steps(times))
    stall, resolved = alerts(out), alerts(out, "resolved")
    assert [(a["type"], a["step"], a["phase"]) for a in stall] == [("stall", 150, "backward")]
    a = stall[0]
    assert a["value"] == pytest.approx(1000) and a["baseline"] == pytest.approx(180, rel=0.05)
    assert a["threshold"] == pytest.approx(5 * a["baseline"])  # the ratio is the binding part here
    d = a["details"]
    assert d["ratio_threshold"] == 5.0 and d["min_excess_ms"] == 50.0 and d["noise_sigmas"] == 6.0
    assert 0 < d["noise_ms"] < 10 and d["window_p95_ms"] > a["baseline"]
    assert [(r["type"], r["step"], r["first_step"], r["repeats"]) for r in resolved] == [("stall", 151, 150, 0)]


def test_steps_an_evidence_capture_slowed_are_not_judged_on_replay():
    # the profiler's start and stop slow the captured steps (docs/alerts.md, Evidence); live
    # they carry "profiled": true and no detector judges them, and the replay must agree
    rng = random.Random(2)
    times = [180 * rng.uniform(0.97, 1.03) for _ in range(150)] + [1000, 900, 1000] + [180] * 10
    recs = steps(times)
    assert [(a["type"], a["step"]) for a in alerts(steptrace.detect(recs))] == [("stall", 150)]
    for r in recs[150:153]:
        r["profiled"] = True
    assert steptrace.detect(recs) == []


def test_a_slow_loader_is_one_regression_naming_data_with_its_repeats():
    data = lambda i: 10.0 if 200 <= i < 280 else 0.0  # +10 ms on a 5 ms loop: 3x for 80 steps
    out = steptrace.detect(steps([5.0] * 400, data=data))
    (a,) = alerts(out)
    assert a["type"] == "step_regression" and a["phase"] == "data"
    assert a["step"] == 266  # slow steps of 15 ms in a row for regression_min_ms (1 s): 67
    assert a["details"]["slow_steps_needed"] == 67 and a["details"]["slow_since_step"] == 200
    assert a["details"]["slow_ms"] == pytest.approx(1005.0) and a["details"]["slow_ms_needed"] == 1000.0
    (r,) = alerts(out, "resolved")
    assert (r["step"], r["first_step"], r["repeats"]) == (280, 200, 79)


def test_the_loaders_start_at_each_epoch_is_data_but_no_stall():
    # Epochs of 100 steps of 5 ms whose first step waits 300 ms for the loader's workers to
    # start: a stall at every epoch where that wait is plain data, none where it is the
    # loader's start (data_start_ms, left out of the iteration), however large.
    start = lambda i: 300.0 if i % 100 == 0 and i > 0 else 0.0
    plain = steps([5.0] * 600, data=start)
    assert [(a["type"], a["step"], a["phase"]) for a in alerts(steptrace.detect(plain))] == [
        ("stall", i, "data") for i in (100, 200, 300, 400, 500)]
    marked = [dict(r, data_start_ms=r["data_ms"]) for r in plain]
    assert steptrace.detect(marked) == []
    # a slow loader inside the epoch is still the input pipeline's regression
    slow = [dict(r, data_ms=r["data_ms"] + (10.0 if 250 <= r["step"] < 350 else 0.0)) for r in marked]
    assert [(a["type"], a["phase"]) for a in alerts(steptrace.detect(slow))] == [("step_regression", "data")]


def test_compiling_inside_a_step_is_no_stall():
    # a 2 s recompile (torch.compile meeting a new shape) in a 5 ms loop: a stall as plain
    # step time, nothing as the step's compile_ms
    recs = steps([5.0] * 300)
    recs[200] = dict(recs[200], step_ms=2005.0, phases_ms={"forward": 2002.0, "backward": 3.0})
    assert [(a["type"], a["step"]) for a in alerts(steptrace.detect(recs))] == [("stall", 200)]
    recs[200]["compile_ms"] = 2000.0
    assert steptrace.detect(recs) == []


def test_a_long_batch_is_judged_per_token_and_a_slow_one_still_pages():
    # Dynamic padding: most batches 256 tokens (10 ms), one in 50 has 2,048 and takes 8x as
    # long. As plain time each is a stall; per token against the usual amount, none. A step
    # 8x as long with the usual tokens is still a stall, and a short batch gets no slack.
    long = lambda i: i % 50 == 25
    recs = [dict(r, work={"tokens": 2048 if long(r["step"]) else 256}) for r in
            steps([80.0 if long(i) else 10.0 for i in range(400)])]
    plain = [{k: v for k, v in r.items() if k != "work"} for r in recs]
    assert [a["step"] for a in alerts(steptrace.detect(plain))] == [i for i in range(400) if long(i) and i > 50]
    assert steptrace.detect(recs) == []
    recs[310] = dict(recs[310], step_ms=80.0, phases_ms={"forward": 32.0, "backward": 48.0})
    recs[330] = dict(recs[330], step_ms=80.0, work={"tokens": 64})
    (a, b) = alerts(steptrace.detect(recs))
    assert (a["type"], a["step"], a["details"]["work_ratio"]) == ("stall", 310, 1.0)
    assert (b["type"], b["step"], b["details"]["work_ratio"]) == ("stall", 330, 1.0)


def test_tuning_the_floor_on_a_recorded_run():
    data = lambda i: 3.0 if 200 <= i < 340 else 0.0  # +3 ms on 5 ms: 1.6x, above the 2 ms floor
    recs = steps([5.0] * 450, data=data)  # 140 slow steps of 8 ms: 1.12 s
    assert [a["type"] for a in alerts(steptrace.detect(recs))] == ["step_regression"]
    assert steptrace.detect(recs, min_excess_ms=5.0) == []  # a floor above the excess
    assert steptrace.detect(recs, regression_min_ms=2000.0) == []  # 2 s of slow steps in a row
    # the old rule (200 ms, at most 10 steps) would have called 25 such steps a regression
    short = steps([5.0] * 300, data=lambda i: 3.0 if 200 <= i < 225 else 0.0)
    assert steptrace.detect(short) == []
    assert [a["type"] for a in alerts(steptrace.detect(short, regression_min_ms=150.0))] == ["step_regression"]


def test_an_episode_still_open_at_the_end_is_resolved_with_its_count():
    out = steptrace.detect(steps([5.0] * 100 + [15.0] * 80))
    assert [a["step"] for a in alerts(out)] == [166]
    (r,) = alerts(out, "resolved")
    assert (r["step"], r["first_step"], r["repeats"]) == (179, 100, 79)
    assert "run ended" in r["message"]


def test_a_heap_leak_fires_then_a_jump_does_not():
    mib = 1 << 20
    leak = steptrace.detect(steps([5.0] * 200, memory=lambda i: {"heap_bytes": 300 * mib + i * mib // 2}))
    (a,) = alerts(leak)
    assert a["type"] == "memory_growth" and a["details"]["metric"] == "heap_bytes"
    assert a["details"]["bytes_per_step"] == pytest.approx(mib / 2)
    assert a["step"] < 60
    jump = steptrace.detect(steps([5.0] * 600, memory=lambda i: {"heap_bytes": (300 if i < 250 else 330) * mib}))
    assert jump == []


def test_replaying_a_live_run_gives_its_alerts(tmp_path):
    import time

    import torch

    net = torch.nn.Linear(8, 2)
    with steptrace.Profiler(tmp_path) as prof:
        for i in range(80):
            with prof.step():
                with prof.phase("forward"):
                    net(torch.randn(4, 8)).sum().backward()
                    time.sleep(0.002 if i != 60 else 0.15)  # a 60x step
    live = [(r["kind"], r["type"], r["step"]) for r in steptrace.read(tmp_path) if r["kind"] in ("alert", "resolved")]
    replayed = [(r["kind"], r["type"], r["step"]) for r in steptrace.detect(tmp_path)]
    assert ("alert", "stall", 60) in live
    assert replayed == live


def test_bad_options_and_records_say_what_is_wrong():
    with pytest.raises(steptrace.ConfigError, match="min_excess_ms=-1"):
        steptrace.detect(steps([5.0] * 20), min_excess_ms=-1.0)
    with pytest.raises(steptrace.UnknownOptionError, match="nosuch"):
        steptrace.detect(steps([5.0] * 20), nosuch=1)
    with pytest.raises(steptrace.LogFormatError, match="step_ms=None must be a number"):
        steptrace.detect([{"kind": "step", "step": 0}])
    with pytest.raises(steptrace.LogFormatError, match="step 3 comes after step 5"):
        steptrace.detect([{"step": 5, "step_ms": 1.0}, {"step": 3, "step_ms": 1.0}])
    with pytest.raises(steptrace.LogFormatError, match="memory.heap_bytes='x' must be an integer"):
        steptrace.detect([{"step": 0, "step_ms": 1.0, "memory": {"heap_bytes": "x"}}])


def test_a_compute_loop_sharing_its_core_with_a_hog_raises_nothing():
    # Under a CPU hog a 4.5 ms step gets a core to itself about half the time and shares it
    # otherwise (8-13 ms): a bimodal loop whose slow mode is no regression.
    rng = random.Random(3)
    times = [4.5 * rng.uniform(0.95, 1.05) if rng.random() < 0.5 else rng.uniform(8, 13) for _ in range(3000)]
    assert steptrace.detect(steps(times)) == []


def test_steps_slowed_by_hypervisor_steal_replay_as_host_contention():
    # a 12 ms loop whose steps take 20 ms for 60 steps, 5 ms of each stolen by the VM's host:
    # the live verdict (host_contention) comes back from the records' host figures alone
    recs = steps([12.0] * 60 + [20.0] * 60 + [12.0] * 20)
    for r in recs:
        stolen = 5.0 if 60 <= r["step"] < 120 else 0.0
        r["host"] = {"runq_ms": 0.0, "runq_span_ms": r["step_ms"], "on_cpu_ms": r["step_ms"] - stolen,
                     "steal_ms": stolen}
    out = alerts(steptrace.detect(recs))
    assert [(a["type"], a["details"]["steal_ms"]) for a in out] == [("host_contention", 5.0)]
    for r in recs:  # the same records without steal: the model's regression
        r["host"] = {"runq_ms": 0.0, "runq_span_ms": r["step_ms"]}
    assert [a["type"] for a in alerts(steptrace.detect(recs))] == ["step_regression"]
