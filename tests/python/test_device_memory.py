"""Device-wide memory (a step's memory.device_used_bytes / device_total_bytes) without a
driver call per step (issue 25 point 4): torch.cuda.mem_get_info syncs the host on some
stacks, so the step hook calls it at most once a second, and with NVML the core takes the
figure from the telemetry sampler's latest reading instead (nvmlDeviceGetMemoryInfo on
the sampler thread)."""

from __future__ import annotations

import time
import types
from pathlib import Path

import steptrace
from steptrace.live import _cuda_hooks as cuda_hooks


class _FakeCuda:
    """The torch.cuda calls the step hooks make, counting mem_get_info."""

    def __init__(self) -> None:
        self.mem_get_info_calls = 0
        self.capturing = False

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def current_stream(self, device=None):
        return types.SimpleNamespace(cuda_stream=0x5100)

    def is_current_stream_capturing(self) -> bool:
        return self.capturing

    def mem_get_info(self, device=None):
        self.mem_get_info_calls += 1
        return 60 << 30, 141 << 30  # free, total


def _fake_torch(cuda: _FakeCuda):
    stats = {"allocated_bytes": {"all": {"current": 1 << 30, "peak": 2 << 30}},
             "reserved_bytes": {"all": {"current": 3 << 30}}}
    c = types.SimpleNamespace(_cuda_memoryStats=lambda device: stats,
                              _cuda_resetPeakMemoryStats=lambda device: None)
    return types.SimpleNamespace(cuda=cuda, _C=c)


def _clock(monkeypatch, start: float = 1000.0) -> list:
    """The hooks' time.monotonic, moved by the test: [now]."""
    now = [start]
    fake_time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    fake_time.monotonic = lambda: now[0]
    monkeypatch.setattr(cuda_hooks, "time", fake_time)
    return now


def test_mem_get_info_is_not_called_every_step(monkeypatch):
    cuda = _FakeCuda()
    now = _clock(monkeypatch)
    _, end = cuda_hooks._cuda_step_hooks(_fake_torch(cuda), True)
    results = []
    for _ in range(500):  # 500 steps of 10 ms: 5 s
        results.append(end())
        now[0] += 0.010
    # once a second at most, not once a step
    assert 1 <= cuda.mem_get_info_calls <= 6, cuda.mem_get_info_calls
    # every step still has the figure (the last reading held)
    assert all(r[3] == 81 << 30 and r[4] == 141 << 30 for r in results), results[:3]
    assert all(r[:3] == (1 << 30, 3 << 30, 2 << 30) for r in results)


def test_a_fast_loop_calls_it_once(monkeypatch):
    cuda = _FakeCuda()
    _clock(monkeypatch)  # time stands still
    _, end = cuda_hooks._cuda_step_hooks(_fake_torch(cuda), True)
    for _ in range(1000):
        end()
    assert cuda.mem_get_info_calls == 1


def test_no_mem_get_info_while_the_stream_captures(monkeypatch):
    cuda = _FakeCuda()
    cuda.capturing = True
    now = _clock(monkeypatch)
    _, end = cuda_hooks._cuda_step_hooks(_fake_torch(cuda), True)
    for _ in range(20):
        assert end()[3:] == (-1, -1)
        now[0] += 2.0
    assert cuda.mem_get_info_calls == 0


def test_with_nvml_steps_take_device_memory_from_the_sampler(tmp_path, monkeypatch, fake_nvml):
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady")
    with steptrace.Profiler(tmp_path / "run", nvml_interval_ms=1) as prof:
        assert prof._core.device_memory_sampled
        for _ in range(5):
            with prof.step():
                time.sleep(0.005)
    records = list(steptrace.read(Path(tmp_path / "run") / "rank0.jsonl", validate=True))
    assert records[0]["backends"]["telemetry"]["device_memory"] is True
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and all(s["memory"]["device_used_bytes"] == 80 << 30 for s in steps), steps[0]
    assert all(s["memory"]["device_total_bytes"] == 141 << 30 for s in steps)


def test_with_nvml_sampling_the_hook_never_calls_mem_get_info(monkeypatch):
    cuda = _FakeCuda()
    now = _clock(monkeypatch)
    _, end = cuda_hooks._cuda_step_hooks(_fake_torch(cuda), True, -1, True)
    for _ in range(20):
        assert end()[3:] == (-1, -1)  # the core fills in the sampler's reading
        now[0] += 2.0
    assert cuda.mem_get_info_calls == 0


class _TwoGpus(_FakeCuda):
    """Two devices, each with its own current stream; device 0 is current."""

    def device_count(self) -> int:
        return 2

    def current_stream(self, device=None):
        return types.SimpleNamespace(cuda_stream=0x5100 + (device or 0))


def test_the_stream_timed_is_the_rank_devices(monkeypatch):
    # A model on cuda:LOCAL_RANK without torch.cuda.set_device: device 0 stays current, yet
    # the rank's work (and its hardware figures) is on device 1.
    monkeypatch.setenv("LOCAL_RANK", "1")
    begin, _ = cuda_hooks._cuda_step_hooks(_fake_torch(_TwoGpus()), False)
    assert begin() == (0x5101, 1)
    # An explicit device_index wins; without either, the current device at each step.
    begin, _ = cuda_hooks._cuda_step_hooks(_fake_torch(_TwoGpus()), False, 0)
    assert begin() == (0x5100, 0)
    monkeypatch.delenv("LOCAL_RANK")
    begin, _ = cuda_hooks._cuda_step_hooks(_fake_torch(_TwoGpus()), False)
    assert begin() == (0x5100, 0)
    # LOCAL_RANK past the devices this process sees (one GPU per process): the current one.
    monkeypatch.setenv("LOCAL_RANK", "5")
    begin, _ = cuda_hooks._cuda_step_hooks(_fake_torch(_TwoGpus()), False)
    assert begin() == (0x5100, 0)
