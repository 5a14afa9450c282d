"""Three hazards of timing the program's collectives (issue 49), each on a fake that behaves
as the vendor documents (tests/python/support/fake_nccl.py):

1. CUDA graph capture: no Work is asked whether it completed by a thread that captures, nor
   by any thread while a capture in CUDA's global mode is in progress;
2. the program's synchronous collectives stay synchronous: on NCCL they run on the current
   stream, with no event record or wait added;
3. a completion query that holds the GIL (is_completed() waiting for the CUDA context lock)
   does not slow the training thread.
"""

from __future__ import annotations

from support.fake_nccl import run_case  # noqa: E402 - tests/python is on sys.path (conftest)


def test_collectives_launched_inside_a_cuda_graph_capture_are_left_alone(tmp_path):
    out = run_case(tmp_path, """
        fake = fake_nccl.FakeCuda().install()
        with steptrace.Profiler("run", detect=False) as prof:
            with prof.step():
                t = torch.ones(8)
                try:
                    with fake_nccl.graph(torch.cuda.CUDAGraph()):  # this thread captures (global mode)
                        captured = dist.all_reduce(t, async_op=True)  # nodes of the graph, not work
                        dist.all_reduce(t)
                    ended = "ok"
                except fake_nccl.CaptureViolation as exc:
                    ended = str(exc)
                dist.all_reduce(t, async_op=True)  # after the capture: timed to its completion
                compute(0.15)
            how, count = prof._comm.describe(), getattr(prof._comm, "captured", None)
        print(json.dumps({"violations": fake.violations, "ended": ended, "captured": count,
                          "asked": sorted(captured.queried_by), "comm": comm_of(prof), "how": how}))
    """)
    assert out["violations"] == [] and out["ended"] == "ok", out
    assert out["asked"] == []  # the captured collective's Work: never asked, then or later
    assert out["captured"] == 2 and "2 launched inside a CUDA graph capture: not timed" in out["how"]
    [comm] = out["comm"]
    assert comm["collectives"] == 1 and comm["comm_ms"] >= 49.0, comm  # the one after the capture


def test_no_work_is_asked_while_another_thread_captures_in_global_mode(tmp_path):
    out = run_case(tmp_path, """
        fake = fake_nccl.FakeCuda().install()

        def capture_on_another_thread(mode):
            ended = []
            def run():
                try:
                    with fake_nccl.graph(torch.cuda.CUDAGraph(), capture_error_mode=mode):
                        fake.violated.wait(0.4)  # a 0.4 s capture (over at once if it was invalidated)
                    ended.append("ok")
                except fake_nccl.CaptureViolation as exc:
                    ended.append(str(exc))
            thread = threading.Thread(target=run, name="capturer-" + mode)
            thread.start()
            thread.join()
            return ended[0]

        ended = {}
        with steptrace.Profiler("run", detect=False) as prof:
            for mode in ("global", "thread_local"):
                with prof.step():
                    work = dist.all_reduce(torch.ones(8), async_op=True)  # complete in 50 ms
                    ended[mode] = capture_on_another_thread(mode)
                    compute(0.2)
        print(json.dumps({"violations": fake.violations, "ended": ended, "comm": comm_of(prof),
                          "asked_in_capture": fake.queries_in_capture, "asked_by": sorted(work.queried_by)}))
    """)
    assert out["violations"] == [] and out["asked_in_capture"] == 0, out
    assert out["ended"] == {"global": "ok", "thread_local": "ok"}
    glob, local = out["comm"]
    # each collective timed once, never before its work completed; the one outstanding during
    # the global capture ends after it (0.4 s), the other one at its completion: CUDA lets a
    # thread query while another captures in thread_local mode
    assert glob["collectives"] == 1 and glob["comm_ms"] >= 49.0, glob
    assert local["collectives"] == 1 and 49.0 <= local["comm_ms"] < 300.0, local
    assert out["asked_by"] == ["steptrace-collectives"]  # never the training thread


def test_a_global_capture_begun_during_a_query_waits_for_it(tmp_path):
    # A query that holds the GIL 12 ms lets another thread run after the interpreter's 5 ms
    # switch interval: a capture begun then, in the middle of the query, would contain it.
    out = run_case(tmp_path, """
        fake = fake_nccl.FakeCuda().install()
        ended = []
        def run():
            if fake.query_started.wait(10):
                try:
                    with fake_nccl.graph(torch.cuda.CUDAGraph()):
                        pass
                    ended.append("ok")
                except fake_nccl.CaptureViolation as exc:
                    ended.append(str(exc))
        with steptrace.Profiler("run", detect=False) as prof:
            fake_nccl.set_query_s(0.012)
            thread = threading.Thread(target=run, name="capturer")
            thread.start()
            with prof.step():
                dist.all_reduce(torch.ones(8), async_op=True)
                thread.join()
        print(json.dumps({"violations": fake.violations, "ended": ended}))
    """)
    assert out == {"violations": [], "ended": ["ok"]}


def test_synchronous_collectives_stay_synchronous_on_the_current_stream(tmp_path):
    out = run_case(tmp_path, """
        with steptrace.Profiler("run", detect=False) as prof:
            with prof.step():
                t = torch.ones(8)
                returned = [dist.all_reduce(t)]  # the program's own async_op=False
                work = dist.all_reduce(t, async_op=True)
                work.wait()
                returned.append(dist.barrier())
                compute(0.15)
            how = prof._comm.describe()
        print(json.dumps({"launches": fake_nccl.launches, "returned": returned, "comm": comm_of(prof),
                          "how": how, "t": t.tolist()}))
    """)
    # what ProcessGroupNCCL saw: each call as the program made it (async_op=False: the current
    # stream, no event added; async_op=True: NCCL's stream)
    assert out["launches"] == [["allreduce", "current"], ["allreduce", "internal"], ["barrier", "current"]]
    assert out["returned"] == [None, None] and out["t"] == [1.0] * 8
    [comm] = out["comm"]
    # all three timed: the synchronous ones from launch to return (on NCCL, the launch: the host
    # does not wait for the device), the asynchronous one to its completion (50 ms)
    assert comm["collectives"] == 3 and comm["comm_ms"] >= 49.0, comm
    assert comm["exposed_ms"] < 40.0, comm  # the host was never blocked for the device's 50 ms
    assert "synchronous calls (async_op=False) from launch to return" in out["how"]


def test_a_completion_query_that_holds_the_gil_does_not_slow_the_training_thread(tmp_path):
    # A CPU training loop, one asynchronous all-reduce per step (its work outstanding 50 ms),
    # in blocks alternating between works whose is_completed() is quick and works whose
    # is_completed() holds the GIL 2 ms (as it does waiting for the CUDA context lock). Both
    # kinds run in the same process, interleaved: load on the machine affects both alike.
    out = run_case(tmp_path, """
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.001)
        x = torch.randn(32, 64)
        times = {0.0: [], 0.002: []}
        with steptrace.Profiler("run", detect=False) as prof:
            for block in range(8):
                for query_s in (0.0, 0.002):
                    fake_nccl.set_query_s(query_s)
                    for i in range(12):
                        with prof.step():
                            start = time.perf_counter()
                            dist.all_reduce(torch.ones(8), async_op=True)
                            for _ in range(6):
                                model(x).sum().backward()
                                opt.step()
                                opt.zero_grad()
                            times[query_s].append(time.perf_counter() - start)
        print(json.dumps({"quick_ms": statistics.median(times[0.0]) * 1e3,
                          "slow_ms": statistics.median(times[0.002]) * 1e3, "queries": fake_nccl.queries[0]}))
    """)
    # The poller's rounds take at most 2% of the time (steptrace.live.comm.POLL_SHARE), and the
    # training thread asks no work: the step's median stays within 15% (asking every work
    # every 0.5 ms, and at each launch, made it 1.5-3x slower).
    assert out["slow_ms"] <= 1.15 * out["quick_ms"], out
    assert out["queries"] > 0, out  # completion is still polled


def test_torch_cuda_graph_gets_its_own_methods_back_when_the_profiler_closes(tmp_path):
    out = run_case(tmp_path, """
        names = ("capture_begin", "capture_end_pre", "capture_end")
        graph_class = torch.cuda.CUDAGraph
        before = {n: graph_class.__dict__.get(n) for n in names}
        with steptrace.Profiler("run", detect=False) as prof:
            wrapped = [n for n in names if hasattr(graph_class.__dict__.get(n), "__wrapped__")]
        after = {n: graph_class.__dict__.get(n) for n in names}
        print(json.dumps({"wrapped": wrapped, "restored": before == after}))
    """)
    assert out == {"wrapped": ["capture_begin", "capture_end_pre", "capture_end"], "restored": True}
