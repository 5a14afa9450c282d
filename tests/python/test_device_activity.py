"""Kernel activity, hardware counters and their diagnoses through the public API: the
fake device backends (the CPU twin of CUPTI, from the test build's steptrace._testing) in a
real CPU training loop, living beside torch.profiler, and what a CPU-only run says about the
real backends."""

from __future__ import annotations

import pytest
import torch

import steptrace
from steptrace import _core
from steptrace.cli import main as cli_main
from steptrace.errors import ConfigError
from steptrace.analysis.summary import summarize
from support.training import batches, model

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1"
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"


def fake_profiler(log_dir, **options):
    """A Profiler on the fake device backends, and the FakeDevice that feeds them."""
    from steptrace import _testing  # the test build's module (STEPTRACE_TEST_HOOKS=ON)

    dev = _testing.FakeDevice()
    return steptrace.Profiler(log_dir, _backends=dev.backends(), **options), dev


def fake_train(prof, dev, steps: int, kernels, counters) -> None:
    """A real CPU loop whose steps also report fake device work."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for x, y in prof.data(batches(steps)):
        with prof.step():
            with prof.phase("forward"):
                loss = torch.nn.functional.cross_entropy(net(x), y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
            dev.work(kernels, counters)


def test_step_records_carry_kernels_and_counters_on_the_sampled_steps(tmp_path, records_of):
    prof, dev = fake_profiler(tmp_path / "run", counter_every=3, top_kernels=5)
    with prof:
        fake_train(prof, dev, 9, [(GEMM, "matmul", 2.0), (ALLREDUCE, "nccl", 1.0), ("relu", "compute", 0.5)],
                   [80, 30, 70, 55])
    records = records_of(tmp_path / "run")  # validated against the schema
    start = records[0]
    assert start["backends"]["kernel_activity"]["active"] == ["fake"]
    assert start["backends"]["counters"]["metrics"]["dram_throughput_pct"] == "fake__metric_dram_throughput_pct"
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 9
    for s in steps:
        k = s["kernels"]
        assert k["count"] == 3
        assert k["matmul_ms"] == pytest.approx(2.0)
        assert k["compute_ms"] == pytest.approx(2.5)
        assert k["nccl_ms"] == pytest.approx(1.0)
        assert k["exposed_nccl_ms"] == pytest.approx(1.0)  # back to back: nothing overlaps it
    assert [s["step"] for s in steps if "counters" in s] == [0, 3, 6]
    assert steps[3]["counters"]["tensor_active_pct"] == pytest.approx(80)
    assert steps[3]["counters"]["sm_throughput_pct"] == pytest.approx(55)
    end = records[-1]
    top = end["device_activity"]["kernels"]["top"]
    assert [k["name"] for k in top] == [GEMM, ALLREDUCE, "relu"]
    assert top[0]["count"] == 9 and top[0]["work"] == "matmul"
    assert end["device_activity"]["counters"]["steps_with_counters"] == 3


def test_summary_lists_the_top_kernels_and_the_device_backends(tmp_path, capsys):
    prof, dev = fake_profiler(tmp_path / "run")
    with prof:
        fake_train(prof, dev, 4, [(GEMM, "matmul", 3.0), (ALLREDUCE, "nccl", 1.0)], [])
    summary = summarize(steptrace.read(tmp_path / "run"))
    assert [k["name"] for k in summary["top_kernels"]] == [GEMM, ALLREDUCE]
    assert summary["top_kernels"][0]["share_pct"] == pytest.approx(75)
    assert summary["device_backends"]["kernel_activity"] == "fake"
    assert cli_main(["summary", str(tmp_path / "run"), "--plain"]) == 0
    out = capsys.readouterr().out
    assert GEMM[:40] in out and "75.0%" in out
    assert "kernel activity: fake" in out


def test_diagnoses_fire_once_with_advice(tmp_path, records_of):
    alerts = []
    prof, dev = fake_profiler(tmp_path / "run", counter_every=1, warmup_steps=2, on_alert=alerts.append)
    with prof:
        # matmul-dominated, tensor cores at 20%, DRAM 90% at 40% occupancy, NCCL ~40% of the
        # (fake) device step: all three diagnoses
        # 30 steps: comm_bound's share is over the step's host-timed window, which a
        # preempted step (a loaded host) stretches; three steps in a row still come
        fake_train(prof, dev, 30, [(GEMM, "matmul", 3.0), (ALLREDUCE, "nccl", 2.0)], [20, 90, 40])
    records = records_of(tmp_path / "run")
    fired = [r for r in records if r["kind"] == "alert" and r["type"] in ("low_tensor_core", "memory_bound")]
    assert sorted(r["type"] for r in fired) == ["low_tensor_core", "memory_bound"]
    low = next(r for r in fired if r["type"] == "low_tensor_core")
    assert low["step"] == 4  # three steps in a row after the two warmup steps
    assert low["value"] == pytest.approx(20) and low["threshold"] == 60
    assert "bf16" in low["message"]
    assert {a["type"] for a in alerts} >= {"low_tensor_core", "memory_bound"}
    assert records[-1]["alerts"]["low_tensor_core"] == 1
    comm = [r for r in records if r["kind"] == "alert" and r["type"] == "comm_bound"]
    # 2 of 5 ms, or less where a preempted step stretched its window (a new episode then)
    assert comm and 25 < comm[0]["value"] <= 40.5


def test_kernel_activity_yields_while_torch_profiler_runs_and_both_keep_working(tmp_path, records_of):
    net = model()
    x, y = batches(1)[0]
    prof, dev = fake_profiler(tmp_path / "run")
    with prof:
        for i in range(6):
            if i == 2:
                tp = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                tp.__enter__()
            with prof.step():
                torch.nn.functional.cross_entropy(net(x), y).backward()
                dev.work([(GEMM, "matmul", 1.0)], [])
            if i == 3:
                tp.__exit__(None, None, None)
    steps = [r for r in records_of(tmp_path / "run") if r["kind"] == "step"]
    assert ["kernels" in s for s in steps] == [True, True, False, False, True, True]
    assert any("addmm" in e.key for e in tp.key_averages())  # torch.profiler's trace is intact


def test_started_inside_a_running_torch_profiler_it_waits_for_it_to_end(tmp_path, records_of):
    net = model()
    x, y = batches(1)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        prof, dev = fake_profiler(tmp_path / "run")
        with prof.step():
            net(x).sum().backward()
            dev.work([(GEMM, "matmul", 1.0)], [])
    with prof.step():
        dev.work([(GEMM, "matmul", 1.0)], [])
    prof.close()
    steps = [r for r in records_of(tmp_path / "run") if r["kind"] == "step"]
    assert ["kernels" in s for s in steps] == [False, True]
    assert len(tp.key_averages()) > 0


def test_cpu_only_run_says_why_kernel_activity_and_counters_are_off(tmp_path, records_of):
    with steptrace.Profiler(tmp_path / "run") as prof:
        assert not [name for name in dir(prof._core) if "fake" in name]  # the fakes are in _testing
    start = records_of(tmp_path / "run")[0]
    for key in ("kernel_activity", "counters"):
        entry = start["backends"][key]
        assert entry["active"] == []
        assert "CUDA event timing" in entry["unavailable"]["cupti"]


@pytest.mark.parametrize("options, needle", [
    ({"counters": "on"}, "counters=\"on\" is unknown"),
    ({"kernel_activity": True}, "kernel_activity=True must be a str"),
    ({"counter_every": 5, "counter_burst": 6}, "counter_burst=6 is out of range"),
    ({"comm_bound_pct": 150.0}, "comm_bound_pct=150"),
])
def test_bad_device_options_raise_before_any_file(tmp_path, options, needle):
    with pytest.raises(ConfigError, match=needle):
        steptrace.Profiler(tmp_path / "run", **options)
    assert not (tmp_path / "run").exists()


def test_the_fakes_are_in_the_test_module_only():
    """steptrace._core carries no fake backend; the test build (STEPTRACE_TEST_HOOKS=ON,
    scripts/setup.sh) adds steptrace._testing, whose fakes reach a Profiler as a capsule."""
    assert not hasattr(_core.Profiler, "fake_device_work")
    assert not [name for name in dir(_core) + dir(_core.Profiler) if "fake" in name.lower()]
    from steptrace import _testing  # the test build has it

    assert _testing.BACKENDS_CAPSULE == "steptrace.Backends/" + _core.version()  # the same build's


def test_a_backends_capsule_is_taken_once_and_checked(tmp_path):
    from steptrace import _testing

    dev = _testing.FakeDevice()
    backends = dev.backends()
    with pytest.raises(ValueError, match="called already"):
        dev.backends()
    with steptrace.Profiler(tmp_path / "a", _backends=backends) as prof:
        with prof.step():
            dev.work([("k", "compute", 1.0)], [])
    with pytest.raises(ValueError, match="already given to a Profiler"):
        steptrace.Profiler(tmp_path / "b", _backends=backends)
    with pytest.raises(TypeError, match="capsule named"):
        steptrace.Profiler(tmp_path / "c", _backends=object())
    with pytest.raises(ValueError, match="is unknown"):
        dev.work([("k", "gemm", 1.0)], [])
    dev.work([("k", "compute", 1.0)], [])  # its profiler is closed: nothing to reach, nothing breaks


def test_fake_device_work_is_safe_when_the_profiler_dropped_the_fakes(tmp_path, records_of):
    from steptrace import _testing

    dev = _testing.FakeDevice()
    with steptrace.Profiler(tmp_path / "run", _backends=dev.backends(), kernel_activity="off") as prof:
        with prof.step():
            dev.work([("k", "compute", 1.0)], [1.0])  # the activity fake was dropped at start
    steps = [r for r in records_of(tmp_path / "run") if r["kind"] == "step"]
    assert len(steps) == 1 and "kernels" not in steps[0]
