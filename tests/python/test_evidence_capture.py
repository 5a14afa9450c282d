"""Evidence behind an alert (issue 54): torch.profiler captures at step boundaries, the
per-step summary and its diff against a baseline (steptrace.analysis.trace_diff), and the
``alert_update`` record carrying ``details.evidence``.

Real PyTorch loops on the CPU; captures are triggered with ``prof.evidence.request_capture()``
(deterministic: the next step boundary starts it) and waited for with ``wait_idle`` (a
thread join). Assertions compare the evidence with what the same run's step records
measured, never with wall-clock constants.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics

import pytest

torch = pytest.importorskip("torch")

import steptrace  # noqa: E402
from steptrace.analysis import trace_diff  # noqa: E402
from steptrace.analysis.reader import validate_record  # noqa: E402

BASELINE_AT = 6
CHANGE_AT = 14
REQUEST_AT = 18
STEPS = 34


@pytest.fixture(autouse=True)
def one_thread():
    # one intra-op thread: on a 2-core box shared with builds, a pool's threads wait on each other
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def records(prof):
    with open(prof.log_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def evidence_of(recs):
    out = [r for r in recs if r["kind"] == "alert_update" and "evidence" in r.get("details", {})]
    for r in out:
        validate_record(r)
    return out


def median_phase(recs, phase, lo, hi):
    """The phase's median over steps [lo, hi) that no capture (nor its worker) touched."""
    vals = [r["phases_ms"].get(phase, 0.0) for r in recs
            if r["kind"] == "step" and lo <= r["step"] < hi and not r.get("profiled")]
    assert len(vals) >= 3
    return statistics.median(vals)


class Mlp(torch.nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        self.extra = torch.nn.Parameter(torch.randn(width, 8 * width) * 0.01)
        self.back = torch.nn.Parameter(torch.randn(8 * width, width) * 0.01)
        self.more = False

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.more:  # the matmul the loop gains at CHANGE_AT (and its way back)
            h = h + torch.mm(torch.mm(h, self.extra), self.back)
        return self.b(h)


def run_loop(tmp_path, change, loader_delay=None, **options):
    """A training loop with explicit phases; ``change(model, step)`` switches the change
    on at CHANGE_AT; the capture is requested at REQUEST_AT. Returns (prof, records)."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(128, 256), torch.randn(128, 256)
    state = {"item": False}

    def batches():
        for i in range(STEPS):
            if loader_delay is not None and i >= CHANGE_AT:
                loader_delay()
            yield x, y

    opts = dict(evidence=True, evidence_steps=3, evidence_baseline_step=BASELINE_AT,
                capture_min_interval_s=0.0, detect=False)
    opts.update(options)
    with steptrace.Profiler(tmp_path, **opts) as prof:
        for i, (xb, yb) in enumerate(prof.data(batches())):
            if i == CHANGE_AT and change is not None:
                change(model, state)
            if i == REQUEST_AT:
                assert prof.evidence.request_capture()
            with prof.step():
                with prof.phase("forward"):
                    out = model(xb)
                with prof.phase("loss"):
                    loss = torch.nn.functional.mse_loss(out, yb)
                    if state["item"]:
                        loss.item()
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
        assert prof.evidence.wait_idle(60)
        ev = prof.evidence
    return prof, ev, records(prof)


def test_extra_matmul_is_named_in_forward_with_the_time_it_added(tmp_path):
    def more(model, state):
        model.more = True

    prof, ev, recs = run_loop(tmp_path, more)
    assert ev.baseline is not None and ev.baseline["steps"] == [BASELINE_AT, BASELINE_AT + 2]
    (rec,) = evidence_of(recs)
    e = rec["details"]["evidence"]
    assert rec["type"] == "capture" and rec["alert_step"] == REQUEST_AT and e["steps"] == [REQUEST_AT, REQUEST_AT + 2]
    assert "forward" in e["verdict"] and "aten::mm" in e["verdict"], e["verdict"]
    grown = [r for r in e["diff"]["grew"] + e["diff"]["new"] if r["phase"] == "forward" and r["op"] in ("aten::mm", "aten::addmm")]
    assert grown, e["diff"]
    added = sum(r.get("delta_ms", r.get("ms", 0.0)) for r in grown)
    # the forward's growth as the captures measured it (its wall time, median step against
    # the baseline's): the named ops account for it
    base_ms, cap_ms = e["diff"]["phases_ms"]["forward"]
    measured = cap_ms - base_ms
    # Within 30%, beyond what the thread waited for a CPU in those steps (host.runq_ms, the
    # host_contention rule's figure): beside a full test run on 2 cores the forward once
    # kept 9 ms per step outside every op in all three captured steps.
    # (the least wait of a captured step: a wait in every step is what moves the typical one)
    b0, b1 = ev.baseline["steps"]
    captured = set(range(b0, b1 + 1)) | set(range(e["steps"][0], e["steps"][1] + 1))
    waits = [r["host"]["runq_ms"] for r in recs
             if r["kind"] == "step" and r["step"] in captured and "runq_ms" in r.get("host", {})]
    waited = min(waits) if waits else 0.0
    assert abs(added - measured) <= 0.3 * measured + waited, (added, measured, waited, e["diff"])
    # and the step records (outside the captures) saw the forward grow too; on a busy
    # 2-core box their wall time also carries the contention, so only its sign is compared
    assert median_phase(recs, "forward", CHANGE_AT + 1, STEPS) > median_phase(recs, "forward", 2, CHANGE_AT)
    # the trace opens as a chrome trace (Perfetto, TensorBoard)
    path = os.path.join(tmp_path, e["trace"])
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    names = {ev.get("name") for ev in trace["traceEvents"]}
    assert {"steptrace/step", "steptrace/forward", "aten::mm"} <= names
    assert e["trace_bytes"] == os.path.getsize(path)
    assert os.path.exists(os.path.join(tmp_path, ev.baseline["trace"]))


def test_new_item_call_is_a_new_host_sync_in_loss(tmp_path):
    def item(model, state):
        state["item"] = True

    prof, ev, recs = run_loop(tmp_path, item)
    (rec,) = evidence_of(recs)
    e = rec["details"]["evidence"]
    syncs = [r for r in e["diff"]["new"] if r["sync"]]
    assert {r["op"] for r in syncs} & {"aten::item", "aten::_local_scalar_dense"}, e["diff"]
    assert all(r["phase"] == "loss" for r in syncs)
    assert "new host sync aten::" in e["verdict"] and "loss" in e["verdict"], e["verdict"]
    assert rec["message"] == "evidence: " + e["verdict"]


def test_slowed_loader_is_ops_unchanged(tmp_path):
    import threading

    # the loader waits 30 ms on an Event nobody sets: its time is outside every op
    never = threading.Event()
    prof, ev, recs = run_loop(tmp_path, None, loader_delay=lambda: never.wait(0.03))
    (rec,) = evidence_of(recs)
    e = rec["details"]["evidence"]
    assert e["verdict"].startswith("ops unchanged: the time is outside them"), e["verdict"]
    assert not e["diff"]["ops_changed"]
    assert e["diff"]["between_ms"][1] > e["diff"]["between_ms"][0]
    assert rec["phase"] is None


def test_bounds_and_off(tmp_path):
    prof, ev, recs = run_loop(tmp_path / "max", None, capture_max=1)
    assert len(evidence_of(recs)) == 1
    assert ev.request_capture() is False  # closed: refused
    assert ev.skipped.get("off") == 1

    # at most one capture per capture_min_interval_s (a fake clock): the second is refused
    with steptrace.Profiler(tmp_path / "interval", evidence=True, evidence_baseline_step=10**6,
                            capture_min_interval_s=60.0, detect=False) as prof:
        now = [100.0]
        prof.evidence._clock = lambda: now[0]
        assert prof.evidence.request_capture()
        for _ in range(4):
            with prof.step():
                torch.ones(4).sum()
        assert prof.evidence.wait_idle(60)
        now[0] += 30.0
        assert not prof.evidence.request_capture()
        assert prof.evidence.skipped == {"capture_min_interval_s": 1}
        now[0] += 31.0
        assert prof.evidence.request_capture()

    # off by default: no hook armed, no folder
    with steptrace.Profiler(tmp_path / "off", detect=False) as prof:
        with prof.step():
            pass
        assert prof.evidence is None
    assert not os.path.exists(tmp_path / "off" / "evidence")

    with pytest.raises(steptrace.ConfigError):
        steptrace.Profiler(tmp_path / "bad", evidence_steps=0)


def test_program_torch_profiler_is_left_alone(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    with steptrace.Profiler(tmp_path, evidence=True, evidence_baseline_step=10**6, capture_min_interval_s=0.0,
                            detect=False) as prof:
        with profile(activities=[ProfilerActivity.CPU]) as user:
            assert prof.evidence.request_capture()
            for _ in range(4):
                with prof.step():
                    torch.ones(4).sum()
        assert prof.evidence.skipped.get("torch_profiler_active") == 1
        assert any(e.name == "aten::sum" for e in user.events())  # the program's trace is intact
    assert evidence_of(records(prof)) == []


def test_summary_and_diff_on_synthetic_events():
    E = trace_diff.Event

    def capture(extra_calls, sync, steps=3):
        events, t = [], 0.0
        for _ in range(steps):
            events.append(E("steptrace/step", "cpu", t, t + 1000, 0))
            events.append(E("steptrace/forward", "cpu", t, t + 600, 0))
            events.append(E("aten::addmm", "cpu", t + 1, t + 101, 100))
            for k in range(extra_calls):
                events.append(E("aten::mm", "cpu", t + 110 + 100 * k, t + 190 + 100 * k, 80))
            events.append(E("steptrace/loss", "cpu", t + 600, t + 1000, 0))
            if sync:
                events.append(E("aten::item", "cpu", t + 700, t + 720, 20))
            events.append(E("aten::copy_", "cpu", t + 1100, t + 1150, 50))  # between steps
            t += 2000
        return trace_diff.summarize_events(events, steps)

    base = capture(0, False)
    assert base["phases_ms"] == {"forward": 0.6, "loss": 0.4} and base["step_ms"] == 1.0
    assert base["between_ms"] == 1.0
    assert {(r["phase"], r["op"]) for r in base["ops"]} == {("forward", "aten::addmm"), ("between", "aten::copy_")}
    d = trace_diff.diff(base, capture(2, True))
    assert [(r["phase"], r["op"], r["calls"], r["sync"]) for r in d["new"]] == [
        ("loss", "aten::item", 1.0, True), ("forward", "aten::mm", 2.0, False)]
    assert d["verdict"].startswith("loss +0.0 ms/step: new host sync aten::item (1/step); forward +0.0 ms/step: new aten::mm")
    d = trace_diff.diff(base, capture(0, False))
    assert d["verdict"].startswith("ops unchanged") and not d["grew"] and not d["new"]
    d = trace_diff.diff(capture(2, True), base)
    assert [r["op"] for r in d["vanished"]] == ["aten::mm", "aten::item"]
    # bounded: 500 distinct ops give 20 rows and 200 names, a few kB of JSON
    many = [E("steptrace/step", "cpu", 0, 1e6, 0)] + [E(f"op{i}", "cpu", i, i + 1, 1) for i in range(500)]
    s = trace_diff.summarize_events(many, 1)
    assert len(s["ops"]) == 20 and len(s["names"]["step"]) == 200
    assert len(json.dumps(s)) < 12000


def test_a_real_step_regression_brings_its_evidence(tmp_path):
    """End to end: the slow-step rule fires on its own (no request), the alert thread arms
    the capture, and the evidence names the matmul the forward gained."""
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(128, 256), torch.randn(128, 256)
    change_at, limit = 60, 3000
    with steptrace.Profiler(tmp_path, evidence=True, evidence_steps=3, evidence_baseline_step=40,
                            capture_min_interval_s=0.0, warmup_steps=5, window=30, min_history=10,
                            regression_min_ms=20.0) as prof:
        for i in range(limit):
            if i == change_at:
                model.more = True
            with prof.step():
                with prof.phase("forward"):
                    out = model(x)
                with prof.phase("loss"):
                    loss = torch.nn.functional.mse_loss(out, y)
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
            if prof.evidence.records:  # written by the worker once the capture ended
                break
        assert prof.evidence.wait_idle(60)
    recs = records(prof)
    steps = {r["step"]: r for r in recs if r["kind"] == "step"}
    assert all(steps[s].get("profiled") for s in (40, 41, 42))  # the baseline's steps
    # the baseline's own steps (its first stop took 265 ms on 1.3 ms steps) raise nothing
    # (before they were marked profiled: a stall at step 42)
    assert not [r for r in recs if r["kind"] == "alert" and r["type"] in ("step_regression", "stall")
                and r["step"] < change_at], recs
    alerts = [r for r in recs if r["kind"] == "alert" and r["type"] in ("step_regression", "stall")]
    assert alerts, recs
    (rec,) = [r for r in evidence_of(recs) if r["type"] == alerts[0]["type"]]
    e = rec["details"]["evidence"]
    assert rec["alert_step"] == alerts[0]["step"] and e["steps"][0] > alerts[0]["step"]
    assert e["baseline"]["steps"] == [40, 42]
    assert "forward" in e["verdict"] and "aten::mm" in e["verdict"], e["verdict"]
