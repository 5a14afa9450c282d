"""Detectors on real CPU training loops: each alert fires where it should, and a clean
run raises none. Slowdowns are injected as latency (sleeps inside the loader, a backward
hook, a phase); nothing here sleeps to wait for another thread."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

import pytest
import torch
from torch import nn

import steptrace

# A small model: iterations are dominated by the injected latencies (sleeps need no CPU),
# so a loaded machine does not turn compute jitter into alerts.
FEATURES, HIDDEN, BATCH = 64, 128, 32
LEAK_FEATURES = 4096  # the leaking loop keeps a BATCH x 4096 float32 activation per step
LEAK_PROJ = torch.randn(FEATURES, LEAK_FEATURES)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def make_batches(n: int = 16):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(n)]


class Loader:
    """Yields `steps` batches; waits `delay_s(i)` before batch i (the latency of a slow
    input pipeline)."""

    def __init__(self, steps: int, delay_s=lambda i: 0.0):
        self.steps, self.delay_s, self.data = steps, delay_s, make_batches()

    def __iter__(self):
        for i in range(self.steps):
            d = self.delay_s(i)
            if d > 0:
                time.sleep(d)
            yield self.data[i % len(self.data)]


def run(prof, loader, net=None, forward_extra=None, keep=None):
    net = net if net is not None else make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for i, (x, y) in enumerate(prof.data(loader)):
        with prof.step():
            with prof.phase("forward"):
                out = net(x)
                if forward_extra is not None:
                    forward_extra(i)
                if keep is not None:
                    keep.append((x @ LEAK_PROJ).relu())  # a forward activation kept across steps
            with prof.phase("loss"):
                loss = nn.functional.cross_entropy(out, y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()


def alerts_in(path, kind="alert"):
    return [r for r in steptrace.read(path, validate=True) if r["kind"] == kind]


@pytest.fixture(autouse=True)
def one_thread():
    # Steadier step times on a small shared machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_clean_run_raises_no_alert(tmp_path):
    with steptrace.Profiler(tmp_path) as prof:
        run(prof, Loader(500, lambda i: 0.005))
    records = list(steptrace.read(tmp_path, validate=True))
    assert sum(r["kind"] == "step" for r in records) == 500
    # a busy host (a CPU hog beside the tests) may say so; nothing else is ever raised
    alerts = [r for r in records if r["kind"] == "alert"]
    assert [a for a in alerts if a["type"] != "host_contention"] == []
    assert all(a["details"]["runq_ms"] + (a["details"]["steal_ms"] or 0.0) >= 0.5 * a["details"]["excess_ms"]
               for a in alerts)
    assert set(records[-1]["alerts"]) <= {"host_contention"}


def test_slow_loader_is_a_regression_naming_data_that_resolves(tmp_path):
    slow = range(200, 240)
    with steptrace.Profiler(tmp_path) as prof:
        # 8x slower data for 40 steps: 35 ms more per step, well above the noise of a
        # sleep-paced loop on a loaded host, and below the stall floor (50 ms more)
        run(prof, Loader(300, lambda i: 0.040 if i in slow else 0.005))
    regressions = [a for a in alerts_in(tmp_path) if a["type"] == "step_regression"]
    assert len(regressions) == 1, regressions
    alert = regressions[0]
    # slow steps of 40+ ms in a row for regression_min_ms (1 s): 25 at most, and a step
    # within the noise now and then (on a loaded host) adds one each
    assert 200 <= alert["step"] <= 232 and alert["details"]["slow_ms"] >= 1000
    assert alert["phase"] == "data"
    assert alert["value"] > 1.5 * alert["baseline"]
    assert "DataLoader workers" in alert["message"]
    resolved = [r for r in alerts_in(tmp_path, "resolved") if r["type"] == "step_regression"]
    assert len(resolved) == 1 and 239 <= resolved[0]["step"] <= 245


def test_slower_backward_is_named(tmp_path):
    net = make_model()
    state = {"delay": 0.004}
    net[2].register_full_backward_hook(lambda *args: time.sleep(state["delay"]))

    def loader_delay(i):
        state["delay"] = 0.034 if 100 <= i < 135 else 0.004  # backward 8x slower: +30 ms
        return 0.001

    with steptrace.Profiler(tmp_path) as prof:
        run(prof, Loader(170, loader_delay), net=net)
    regressions = [a for a in alerts_in(tmp_path) if a["type"] == "step_regression"]
    assert len(regressions) == 1, regressions
    assert regressions[0]["phase"] == "backward"
    assert 100 <= regressions[0]["step"] <= 133  # a second of ~40 ms steps: 26 (+ noisy ones)


def test_six_times_slower_step_is_a_stall(tmp_path):
    def forward_extra(i):
        if i == 60:
            time.sleep(0.15)  # ~5 ms iterations: this one is about 30x, 145 ms over the 50 ms floor

    with steptrace.Profiler(tmp_path) as prof:
        run(prof, Loader(80, lambda i: 0.005), forward_extra=forward_extra)
    stalls = [a for a in alerts_in(tmp_path) if a["type"] == "stall"]
    assert [(a["step"], a["phase"]) for a in stalls] == [(60, "forward")]
    assert stalls[0]["value"] > 5 * stalls[0]["baseline"]


def _restore_signals_as_lightning_does() -> None:
    # Lightning's Trainer, at the end of fit, sets every signal back to what
    # signal.getsignal said at its start: SIG_DFL for a handler faulthandler installed.
    # The real-time ones only here (the dump's is one), so that pytest's own faulthandler
    # keeps its fatal-signal handlers.
    for signum in range(signal.SIGRTMIN, signal.SIGRTMAX + 1):
        if signal.getsignal(signum) in (None, signal.SIG_DFL):
            signal.signal(signum, signal.SIG_DFL)


@pytest.mark.parametrize("signals_restored", [False, True], ids=["plain", "after-lightning-restored-signals"])
def test_hang_is_written_while_the_step_is_still_blocked(tmp_path, caplog, signals_restored):
    if signals_restored:
        steptrace.Profiler(tmp_path / "earlier").close()  # the dump's signal is armed by now
        _restore_signals_as_lightning_does()
    release = threading.Event()
    seen = {}
    log = tmp_path / "rank0.jsonl"

    def watch():
        # Polls the log (bounded) for the hang alert, then lets the step finish.
        deadline = time.monotonic() + 60
        while not release.is_set() and time.monotonic() < deadline:
            for line in log.read_text().splitlines():
                if '"type":"hang"' in line and '"kind":"alert"' in line:
                    seen["alert"] = json.loads(line)
                    seen["blocked"] = not release.is_set()
                    release.set()
                    return
            release.wait(0.05)  # poll interval, not synchronization
        release.set()

    def forward_extra(i):
        if i == 30:
            watcher.start()
            release.wait(60)  # a collective that never returns, until the test lets go

    watcher = threading.Thread(target=watch)
    caplog.set_level(logging.WARNING, logger="steptrace")
    with steptrace.Profiler(tmp_path, hang_min_s=1.0) as prof:
        run(prof, Loader(40, lambda i: 0.002), forward_extra=forward_extra)
    watcher.join()
    assert seen.get("blocked") is True, "no hang alert reached the file while the step was blocked"
    hang = seen["alert"]
    assert hang["step"] == 30 and hang["phase"] == "forward"
    assert hang["value"] >= 1000.0
    assert "forward_extra" in hang["details"]["stacks"]  # the Python stack of the hung thread
    assert hang["details"]["stacks_source"] == "faulthandler"
    records = list(steptrace.read(tmp_path, validate=True))
    kinds = [(r["kind"], r.get("type"), r.get("step")) for r in records if r["kind"] in ("alert", "resolved")]
    assert ("alert", "hang", 30) in kinds
    assert ("resolved", "hang", 30) in kinds
    assert ("alert", "stall", 30) in kinds  # the step record and a stall follow
    assert any(r["kind"] == "step" and r["step"] == 30 for r in records)
    assert any("hang alert at step 30" in m for m in caplog.messages)


def test_a_slow_stretch_over_the_hang_limit_is_one_hang_episode(tmp_path, caplog):
    # Steps 30..32 each block 0.7 s, over the 0.3 s hang limit (hang_min_s): one alert,
    # the later steps folded in, resolved once step 33 finishes in time.
    def forward_extra(i):
        if 30 <= i <= 32:
            time.sleep(0.7)

    caplog.set_level(logging.WARNING, logger="steptrace")
    with steptrace.Profiler(tmp_path, hang_min_s=0.3) as prof:
        run(prof, Loader(40, lambda i: 0.002), forward_extra=forward_extra)
    records = list(steptrace.read(tmp_path, validate=True))
    hangs = [r for r in records if r["kind"] == "alert" and r["type"] == "hang"]
    assert [(h["step"], h["phase"]) for h in hangs] == [(30, "forward")]
    (resolved,) = [r for r in records if r["kind"] == "resolved" and r["type"] == "hang"]
    assert (resolved["first_step"], resolved["step"], resolved["repeats"]) == (30, 32, 2)
    assert records[-1]["alerts"]["hang"] == 1 and records[-1]["alert_repeats"]["hang"] == 2
    assert sum("hang alert" in m for m in caplog.messages) == 1
    # no record is stamped after the run's end
    end = records[-1]["end_unix_ns"]
    assert all(r["unix_ns"] <= end for r in records if r["kind"] == "alert")


def leak_run(path, steps, seed=0):
    """A loop that keeps one 0.5 MiB forward activation per step; returns its alert and the
    follow-up that names the phase (None when missing)."""
    torch.manual_seed(seed)
    kept: list = []
    with steptrace.Profiler(path, warmup_steps=10) as prof:
        run(prof, Loader(steps), keep=kept)
    records = list(steptrace.read(path, validate=True))
    kept.clear()
    alert = [r for r in records if r["kind"] == "alert" and r["type"] == "memory_growth"]
    update = [r for r in records if r["kind"] == "alert_update" and r["type"] == "memory_growth"]
    return alert, update


def test_kept_activations_are_a_memory_leak_named_in_forward(tmp_path):
    alerts, updates = leak_run(tmp_path, 200)
    assert len(alerts) == 1, alerts
    leak = alerts[0]
    assert leak["step"] <= 150
    assert leak["details"]["metric"] == "heap_bytes"  # the C heap's in-use bytes on the CPU
    per_step = BATCH * LEAK_FEATURES * 4  # what the loop keeps
    assert 0.9 * per_step <= leak["details"]["bytes_per_step"] <= 1.2 * per_step
    assert leak["details"]["steps_until_full"] > 0
    assert leak["threshold"] > leak["baseline"] and leak["value"] > leak["threshold"]
    # the alert comes first; a follow-up names the phase once it was measured
    assert len(updates) == 1, updates
    assert updates[0]["phase"] == "forward" and updates[0]["alert_step"] == leak["step"]
    assert updates[0]["step"] > leak["step"]


def test_a_leak_is_flagged_within_150_steps_in_20_runs_in_one_process(tmp_path):
    # Back to back in one process, as in a notebook: the heap keeps the memory the earlier
    # runs freed, which hid the leak from RSS.
    for seed in range(20):
        alerts, _ = leak_run(tmp_path / str(seed), 150, seed)
        assert len(alerts) == 1, (seed, alerts)
        assert alerts[0]["step"] < 150


def test_a_clean_loop_of_2000_steps_has_no_memory_alert(tmp_path):
    with steptrace.Profiler(tmp_path, warmup_steps=10) as prof:
        run(prof, Loader(2000))
    records = list(steptrace.read(tmp_path))
    assert sum(r["kind"] == "step" for r in records) == 2000
    assert [r for r in records if r["kind"] in ("alert", "alert_update") and r["type"] == "memory_growth"] == []


def test_log_lines_are_rate_limited_while_the_file_keeps_every_alert(tmp_path, caplog):
    stalls = set(range(40, 400, 30))  # twelve separate stall episodes of 120 ms in ~5 ms steps

    def forward_extra(i):
        if i in stalls:
            time.sleep(0.12)

    caplog.set_level(logging.INFO, logger="steptrace")
    with steptrace.Profiler(tmp_path) as prof:
        run(prof, Loader(400, lambda i: 0.004), forward_extra=forward_extra)
    records = list(steptrace.read(tmp_path, validate=True))
    filed = [r["step"] for r in records if r["kind"] == "alert" and r["type"] == "stall"]
    assert filed == sorted(stalls)
    assert records[-1]["alerts"] == {"stall": len(stalls)}
    lines = [m for m in caplog.messages if m.startswith("stall alert")]
    assert len(lines) == 3  # the rest were held back within the minute
    assert any("9 more stall alert lines held back" in m for m in caplog.messages), caplog.messages


def test_on_alert_is_called_off_the_training_thread(tmp_path):
    got = []

    def on_alert(alert):
        got.append((alert["kind"], alert["type"], threading.current_thread().name))

    with steptrace.Profiler(tmp_path, on_alert=on_alert) as prof:
        run(prof, Loader(40, lambda i: 0.15 if i == 30 else 0.005))
    assert got == [("alert", "stall", "steptrace-alerts"), ("resolved", "stall", "steptrace-alerts")]


def test_bad_detector_options(tmp_path):
    with pytest.raises(steptrace.ConfigError, match="min_history"):
        steptrace.Profiler(tmp_path / "a", min_history=1)
    with pytest.raises(steptrace.ConfigError, match="on_alert"):
        steptrace.Profiler(tmp_path / "b", on_alert=3)
    with pytest.raises(steptrace.ConfigError, match="memory_growth_pct"):
        steptrace.Profiler(tmp_path / "c", memory_growth_pct=0)


def test_on_the_cuda_path_the_phase_follows_the_allocator_not_the_heap(tmp_path):
    # What the CUDA path does, with a stand-in allocator: the step's allocated_bytes come
    # from the step hook and the level at phase boundaries from the live-bytes hook
    # (torch.cuda.memory_allocated there). The allocator leaks 1 MiB per step in backward;
    # the C heap does what it likes.
    from steptrace import _core
    from steptrace.live.profiler import build_config

    allocated = {"bytes": 100 << 20}
    config, _ = build_config(tmp_path, {})
    core = _core.Profiler(config, {}, live_bytes=lambda: allocated["bytes"])
    for i in range(200):
        core.begin_step()
        core.begin_phase("forward")
        allocated["bytes"] += 4096  # a temporary, freed in backward
        core.end_phase("forward")
        core.begin_phase("backward")
        allocated["bytes"] += (1 << 20) - 4096  # kept: the leak
        core.end_phase("backward")
        core.set_step_memory(allocated_bytes=allocated["bytes"], device_total_bytes=8 << 30)
        core.end_step()
        if i % 20 == 0:
            core.flush()  # let the writer see the alert and ask for phase levels in time
    core.close("normal")
    records = list(steptrace.read(tmp_path, validate=True))
    (alert,) = [r for r in records if r["kind"] == "alert" and r["type"] == "memory_growth"]
    assert alert["details"]["metric"] == "allocated_bytes"
    assert alert["details"]["bytes_per_step"] == pytest.approx(1 << 20, rel=0.01)
    (update,) = [r for r in records if r["kind"] == "alert_update"]
    assert update["phase"] == "backward"
    assert update["details"]["phase_bytes_per_step"] == pytest.approx(1 << 20, rel=0.01)


def test_with_constant_flops_per_step_an_mfu_drop_is_a_step_regression():
    # docs/useful-work.md: MFU = flops / iteration / peak, so with the FLOPs of a step fixed,
    # MFU falls exactly where the iteration grows, and step_regression judges that growth.
    from support import logfactory as lf

    recs = lf.work_run(220, iteration_ms=lambda i: 10.0 if i < 150 else 20.0)
    mfu = {r["step"]: r["work"]["mfu_pct"] for r in recs if r["kind"] == "step"}
    assert mfu[149] == pytest.approx(20.0) and mfu[150] == pytest.approx(10.0)
    alerts = [a for a in steptrace.detect(recs) if a["kind"] == "alert"]
    assert [a["type"] for a in alerts] == ["step_regression"]
    # 20 ms steps in a row for regression_min_ms (1 s): the 50th
    assert alerts[0]["step"] == 199 and alerts[0]["phase"] in ("forward", "backward")
