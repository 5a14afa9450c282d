"""Collectives timed by their completion, with no call from the program: on a process
group that behaves as NCCL's does on the host (futures complete at enqueue, the work 50 ms
later: tests/python/support/fake_nccl.py), and for DDP models made before or after the Profiler,
with no ``watch()``. (gloo, whose futures complete with the work, runs in test_cluster.py's
torchrun tests.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.fake_nccl import run_case  # noqa: E402 - tests/python is on sys.path (conftest)


def test_a_collective_whose_future_completes_at_launch_is_timed_to_its_completion(tmp_path):
    out = run_case(tmp_path, """
        with steptrace.Profiler("run") as prof:
            for i in range(4):
                with prof.step():
                    with prof.phase("backward"):
                        t = torch.ones(8)
                        work = dist.all_reduce(t, async_op=True)  # returns at once, as on NCCL; done 50 ms later
                        work.wait()  # the current stream would wait; the host goes on
                    with prof.phase("optimizer"):
                        compute(0.15)
            how = prof._comm.describe()
        print(json.dumps({"comm": comm_of(prof), "how": how}))
    """)
    for comm in out["comm"]:
        assert comm is not None and comm["collectives"] == 1
        assert 49.0 <= comm["comm_ms"] <= 120.0, out  # the work's 50 ms, not the launch's µs
        assert comm["exposed_ms"] == 0.0  # the host never waited for it
        assert comm["bytes"] == 32  # 8 float32: nccl-tests' S; one rank: bus bandwidth 0
        assert comm["algbw_gbps"] == pytest.approx(32 / (comm["comm_ms"] * 1e6), rel=0.01)
        assert comm["busbw_gbps"] == 0.0
    assert "host not blocked" in out["how"]


@pytest.mark.parametrize("made", ["before", "after"])
def test_ddp_gradient_all_reduces_are_timed_without_watch(tmp_path, made):
    out = run_case(tmp_path, f"""
        def make():
            return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)))
        model = make() if {made!r} == "before" else None
        with steptrace.Profiler("run") as prof:
            model = model or make()
            for i in range(4):
                with prof.step():
                    with prof.phase("forward"):
                        loss = model(torch.randn(8, 16)).sum()
                    with prof.phase("backward"):
                        loss.backward()
                    with prof.phase("optimizer"):
                        compute(0.15)
        print(json.dumps({{"comm": comm_of(prof)}}))
    """)
    assert all(c is not None and c["collectives"] >= 1 and c["comm_ms"] >= 49.0 for c in out["comm"]), out


def test_a_hook_the_program_registers_later_replaces_ddps_own_and_is_timed(tmp_path):
    out = run_case(tmp_path, """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        calls = []
        def my_hook(state, bucket):
            calls.append(bucket.index())
            return fp16_compress_hook(state, bucket)
        with steptrace.Profiler("run") as prof:
            model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))  # gets steptrace's dispatcher
            model.register_comm_hook(None, my_hook)  # DDP takes one hook: this one goes behind it
            for i in range(3):
                with prof.step():
                    with prof.phase("backward"):
                        model(torch.randn(8, 16)).sum().backward()
                    with prof.phase("optimizer"):
                        compute(0.15)
        try:
            model.register_comm_hook(None, my_hook)  # a second hook: DDP's own error, as without steptrace
            second = "accepted"
        except RuntimeError as exc:
            second = str(exc)
        print(json.dumps({"calls": len(calls), "comm": comm_of(prof), "second": second}))
    """)
    assert out["calls"] >= 3
    assert all(c is not None and c["comm_ms"] >= 49.0 for c in out["comm"]), out
    assert "only be called once" in out["second"]


def test_comm_timing_off_leaves_torch_distributed_as_it_was(tmp_path):
    out = run_case(tmp_path, """
        original = dist.all_reduce
        with steptrace.Profiler("run", comm_timing="off") as prof:
            same = dist.all_reduce is original
            with prof.step():
                dist.all_reduce(torch.ones(2))
        with steptrace.Profiler("run2") as prof2:
            patched = dist.all_reduce is not original
        starts = [next(steptrace.read(p.log_path, validate=True)) for p in (prof, prof2)]
        print(json.dumps({"same": same, "patched": patched, "restored": dist.all_reduce is original,
                          "comm": comm_of(prof), "run_start": [s["config"]["comm_timing"] for s in starts],
                          "how": [s["backends"]["comm"] for s in starts]}))
    """)
    how = out.pop("how")
    assert out == {"same": True, "patched": True, "restored": True, "comm": [None], "run_start": ["off", "auto"]}
    # run_start says how the collectives are timed, or why they are not
    assert how[0] == {"active": [], "unavailable": {"completion": 'comm_timing="off": torch.distributed is left as it is'}}
    assert how[1]["active"] == ["completion"] and how[1]["method"].startswith(
        "completion polling of Work.is_completed() at most every 0.5 ms and 2% of the time (steptrace_fake_nccl: "
    ), how[1]
    assert how[1]["method"].endswith("synchronous calls (async_op=False) from their launch to their return "
                                     "(on steptrace_fake_nccl: the launch)"), how[1]


def test_run_start_says_when_there_is_nothing_to_time(tmp_path):
    code = ("import sys, json, steptrace\n"
            "prof = steptrace.Profiler(sys.argv[1]); prof.close()\n"
            "print(json.dumps(next(steptrace.read(prof.log_path))['backends']['comm']))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {"active": [], "unavailable": {
        "completion": "untimed: torch.distributed is not imported (no process group)"}}


def test_bad_comm_timing_is_refused_before_any_file(tmp_path):
    import steptrace

    with pytest.raises(steptrace.ConfigError, match=r'comm_timing="sometimes" is unknown; allowed: "auto", "off"'):
        steptrace.Profiler(tmp_path / "run", comm_timing="sometimes")
    assert not (tmp_path / "run").exists()


def test_payload_and_bus_factor_follow_nccl_tests(monkeypatch):
    # nccl-tests doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for all-reduce, (n-1)/n for
    # all-gather and reduce-scatter (S the full output / input), 1 for broadcast
    import inspect

    import torch
    import torch.distributed as dist

    from steptrace.live.comm import payload

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    t = torch.ones(1000)  # 4000 bytes
    out = torch.ones(4000)

    def of(name, *args):
        fn = getattr(dist, name)
        return payload(name, inspect.signature(getattr(fn, "__wrapped__", fn)), args, {})

    assert of("all_reduce", t) == (4000, 6000)
    assert of("all_gather_into_tensor", out, t) == (16000, 12000)
    assert of("reduce_scatter_tensor", t, out) == (16000, 12000)
    assert of("all_gather", [torch.ones(1000)] * 4, t) == (16000, 12000)
    assert of("broadcast", t, 0) == (4000, 4000)
    assert of("barrier") == (0, 0)


def test_a_synchronous_gloo_collective_is_timed_in_the_calling_thread(tmp_path):
    out = run_case(tmp_path, """
        gloo = dist.new_group(backend="gloo")  # wait() returns once its work is done
        with steptrace.Profiler("run") as prof:
            with prof.step():
                dist.all_reduce(torch.ones(8), group=gloo)  # timed to wait()'s return, no poller
            poller_after_sync = prof._comm._poller._thread is not None
        print(json.dumps({"comm": comm_of(prof), "poller_after_sync": poller_after_sync}))
    """)
    [first] = out["comm"]
    assert not out["poller_after_sync"]  # no thread started, no 0.5 ms polls
    assert first["collectives"] == 1 and first["bytes"] == 32 and first["exposed_ms"] == first["comm_ms"]


def test_a_dead_weakref_proxy_in_the_process_does_not_stop_the_profiler(tmp_path):
    # At its start in a process group the Profiler looks for DDP models among every object;
    # isinstance on a weakref.proxy whose referent is gone raises ReferenceError (dynamo
    # leaves such proxies: a DDP test after a torch.compile one failed in the Profiler's
    # constructor).
    import weakref

    import torch.distributed as dist

    import steptrace

    class Gone:
        pass

    gone = Gone()
    held = [weakref.proxy(gone)]
    del gone
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        prof = steptrace.Profiler(tmp_path, detect=False)
        prof.close()
    finally:
        dist.destroy_process_group()
    assert len(held) == 1
