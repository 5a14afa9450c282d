"""A Python training loop on the CUDA clock, against the stand-in libcuda.so.1 of the C++
tests (tests/cpp/fake_cupti/fake_cuda.cpp, compiled here): the extension loads it as it
would the NVIDIA driver (dlopen of libcuda.so.1, found through LD_LIBRARY_PATH in a child
process, since the dynamic loader reads that variable at start-up and the fake must not
leak into this process), and the loop queues each phase's device work on the fake
device. Step records come back on the CUDA clock with the queued times, a step or more
after the step ran, and the schema validates them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


_SRC = Path(__file__).parent.parent / "cpp" / "fake_cupti"

_LOOP = textwrap.dedent(
    """
    import ctypes, json, sys
    import torch
    fake = ctypes.CDLL("libcuda.so.1")  # the stand-in, through LD_LIBRARY_PATH
    fake.fake_cuda_enqueue.argtypes = [ctypes.c_size_t, ctypes.c_double]
    fake.fake_cuda_advance.argtypes = [ctypes.c_double]
    fake.fake_cuda_set_current.argtypes = [ctypes.c_void_p, ctypes.c_int]
    ctx = ctypes.c_int(0)
    fake.fake_cuda_set_current(ctypes.addressof(ctx), 0)  # a current context, as torch makes
    import steptrace

    STREAM = 0x5100  # what torch.cuda.current_stream().cuda_stream would be
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    with steptrace.Profiler(sys.argv[1], clock="cuda", kernel_activity="off", counters="off",
                            nvml="off", detect=False) as prof:
        prof.set_stream(STREAM)
        for i in range(8):
            with prof.step():
                with prof.phase("forward"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    fake.fake_cuda_enqueue(STREAM, 3.0)
                with prof.phase("backward"):
                    loss.backward()
                    fake.fake_cuda_enqueue(STREAM, 5.0)
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
                    fake.fake_cuda_enqueue(STREAM, 1.0)
            if i % 2 == 1:
                fake.fake_cuda_advance(18.0)  # the device catches up every other step
    print(json.dumps({"torch_cuda": torch.cuda.is_available()}))  # False: torch's runtime refuses the fake
    """
)


@pytest.fixture(scope="module")
def fake_cuda_dir(tmp_path_factory):
    """A folder holding the stand-in libcuda.so.1, compiled from the C++ tests' source."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the stand-in libcuda.so.1 (tests/cpp/fake_cupti/fake_cuda.cpp)")
    folder = tmp_path_factory.mktemp("fake_cuda")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-std=c++17", f"-I{_SRC.parent}",
                    "-o", str(folder / "libcuda.so.1"), str(_SRC / "fake_cuda.cpp"), "-ldl"], check=True)
    return folder


def _run_on_the_fake(script: str, run: Path, fake_cuda_dir: Path, records_of) -> list:
    """Runs `script` (argv[1]: the log folder) in a child that loads the stand-in driver;
    its records."""
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(
        p for p in (str(fake_cuda_dir), os.environ.get("LD_LIBRARY_PATH", "")) if p))
    proc = subprocess.run([sys.executable, "-c", script, str(run)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return records_of(run / "rank0.jsonl")


def test_a_training_loop_on_the_fake_driver_is_timed_on_the_cuda_clock(tmp_path, fake_cuda_dir, records_of):
    records = _run_on_the_fake(_LOOP, tmp_path / "run", fake_cuda_dir, records_of)
    start = records[0]
    assert start["backends"]["timer"]["active"][0] == "cuda", start["backends"]["timer"]
    assert start["device"]["name"] == "Fake H200"
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["step"] for s in steps] == list(range(8))
    for s in steps:
        assert s["clock"] == "cuda", s
        assert s["phases_ms"] == pytest.approx({"forward": 3.0, "backward": 5.0, "optimizer": 1.0})
        assert s["step_ms"] == pytest.approx(9.0)
        assert "waited" not in s
    assert not [r for r in records if r["kind"] == "alert" and r["type"] == "timer_fallback"]


_FRESH_THREAD_LOOP = textwrap.dedent(
    """
    import ctypes, sys, threading
    import torch
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_cuda_enqueue.argtypes = [ctypes.c_size_t, ctypes.c_double]
    fake.fake_cuda_advance.argtypes = [ctypes.c_double]
    fake.fake_cuda_primary_context.restype = ctypes.c_void_p
    fake.cuCtxPushCurrent.argtypes = [ctypes.c_void_p]
    fake.cuCtxPopCurrent.argtypes = [ctypes.c_void_p]
    fake.fake_cuda_primary_retains.restype = ctypes.c_int
    import steptrace

    primary = fake.fake_cuda_primary_context(0)

    def device_work(ms):  # a kernel launched on device 0's default stream
        fake.cuCtxPushCurrent(primary)
        fake.fake_cuda_enqueue(0, ms)
        fake.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p()))

    model = torch.nn.Linear(16, 4)
    x = torch.randn(32, 16)

    def train():  # a thread with no CUDA context current (none is, on any thread)
        with steptrace.Profiler(sys.argv[1], clock="cuda", kernel_activity="off", counters="off",
                                nvml="off", detect=False) as prof:
            prof.set_stream(0, 0)  # torch.cuda.current_stream(0): the default stream, device 0
            for i in range(6):
                with prof.step():
                    with prof.phase("forward"):
                        model(x).sum().backward()
                        device_work(4.0)
                fake.fake_cuda_advance(10.0)
            assert fake.fake_cuda_primary_retains(0) == 1
        assert fake.fake_cuda_primary_retains(0) == 0

    t = threading.Thread(target=train)
    t.start()
    t.join()
    """
)


def test_a_loop_on_a_thread_without_a_context_is_timed_on_the_named_device(tmp_path, fake_cuda_dir, records_of):
    records = _run_on_the_fake(_FRESH_THREAD_LOOP, tmp_path / "run", fake_cuda_dir, records_of)
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 6
    for s in steps:
        assert s["clock"] == "cuda", s
        assert s["phases_ms"]["forward"] == pytest.approx(4.0)
        assert s["stream"] == {"id": 0, "device": 0}
    assert records[-1]["device_timing"] == {"steps": 6, "captured_steps": 0, "clamped_intervals": 0}
    assert not [r for r in records if r["kind"] == "alert" and r["type"] == "timer_fallback"]


# The stand-in driver with a current context and the capture calls typed, for the capture cases.
_CAPTURE_PRELUDE = textwrap.dedent(
    """
    import ctypes, sys
    fake = ctypes.CDLL("libcuda.so.1")
    fake.fake_cuda_enqueue.argtypes = [ctypes.c_size_t, ctypes.c_double]
    fake.fake_cuda_advance.argtypes = [ctypes.c_double]
    fake.fake_cuda_set_current.argtypes = [ctypes.c_void_p, ctypes.c_int]
    fake.cuStreamBeginCapture_v2.argtypes = [ctypes.c_void_p, ctypes.c_int]
    fake.cuStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    ctx = ctypes.c_int(0)
    fake.fake_cuda_set_current(ctypes.addressof(ctx), 0)
    import steptrace
    """
)

_CAPTURE_ON_A_POOL_STREAM = _CAPTURE_PRELUDE + textwrap.dedent(
    """

    # torch.cuda.graph's capture stream: a pool stream, created non-blocking
    pool = ctypes.c_void_p()
    assert fake.cuStreamCreate(ctypes.byref(pool), 1) == 0  # CU_STREAM_NON_BLOCKING
    with steptrace.Profiler(sys.argv[1], clock="cuda", kernel_activity="off", counters="off",
                            nvml="off", detect=False) as prof:
        prof.set_stream(0)  # the default stream, where the eager steps run
        for i in range(4):
            with prof.step():
                with prof.phase("forward"):
                    fake.fake_cuda_enqueue(0, 3.0)
                if i == 1:  # the step that wraps `with torch.cuda.graph(g):`
                    prof.set_stream(pool.value)  # the capture stream is current in the block
                    assert fake.cuStreamBeginCapture_v2(pool, 0) == 0  # global mode, torch's default
                    with prof.phase("backward"):
                        fake.fake_cuda_enqueue(pool.value, 5.0)  # captured, not run
                    graph = ctypes.c_void_p()
                    assert fake.cuStreamEndCapture(pool, ctypes.byref(graph)) == 0, "capture broken"
                    prof.set_stream(0)
            fake.fake_cuda_advance(10.0)
    assert fake.fake_cuda_invalidated_captures() == 0
    """
)


def test_a_step_on_the_default_stream_around_a_capture_on_a_pool_stream_is_captured(
        tmp_path, fake_cuda_dir, records_of):
    # The legacy stream never shows a capture on a non-blocking stream (fake_cuda.cpp,
    # legacy_blocked): the current stream, given during the step, does.
    records = _run_on_the_fake(_CAPTURE_ON_A_POOL_STREAM, tmp_path / "run", fake_cuda_dir, records_of)
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["clock"] for s in steps] == ["cuda", "host", "cuda", "cuda"], steps
    assert steps[1].get("captured") is True, steps[1]
    assert all("captured" not in s for s in steps[::2])
    assert records[-1]["device_timing"]["captured_steps"] == 1
    assert not [r for r in records if r["kind"] == "alert" and r["type"] == "timer_fallback"]


_CAPTURE_THROUGH_TORCH_CUDA_GRAPH = _CAPTURE_PRELUDE + textwrap.dedent(
    """
    import threading
    from steptrace.live.graph_capture import CaptureWatch

    pool = ctypes.c_void_p()
    assert fake.cuStreamCreate(ctypes.byref(pool), 1) == 0  # CU_STREAM_NON_BLOCKING

    class Stream:
        def __init__(self, handle):
            self.cuda_stream, self.device_index = handle, 0

    class Cuda:  # torch.cuda as torch.cuda.graph uses it: the capture stream is current inside
        current = Stream(0)

        @staticmethod
        def current_stream():
            return Cuda.current

        class CUDAGraph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                Cuda.current = Stream(POOL)
                assert fake.cuStreamBeginCapture_v2(ctypes.c_void_p(POOL), 0) == 0

            def capture_end(self):
                graph = ctypes.c_void_p()
                assert fake.cuStreamEndCapture(ctypes.c_void_p(POOL), ctypes.byref(graph)) == 0, "capture broken"
                Cuda.current = Stream(0)

    POOL = pool.value
    with steptrace.Profiler(sys.argv[1], clock="cuda", kernel_activity="off", counters="off",
                            nvml="off", detect=False) as prof:
        watch = CaptureWatch(prof._core, Cuda).install()

        def begin():  # as the Profiler's CUDA step hook: this thread's step, on the current stream
            watch.step_began()
            return Cuda.current.cuda_stream, 0

        prof._core.set_step_hooks(begin, None)
        outside = []
        for i in range(4):
            with prof.step():
                with prof.phase("forward"):
                    fake.fake_cuda_enqueue(0, 3.0)
                if i == 1:
                    g = Cuda.CUDAGraph()
                    g.capture_begin()  # `with torch.cuda.graph(g):`
                    with prof.phase("backward"):
                        fake.fake_cuda_enqueue(POOL, 5.0)  # captured, not run
                    g.capture_end()
                if i == 2:  # a capture begun by another thread is not this step's
                    t = threading.Thread(target=lambda: (outside.append(1), Cuda.CUDAGraph().capture_begin(),
                                                         Cuda.CUDAGraph().capture_end()))
                    t.start()
                    t.join()
            fake.fake_cuda_advance(10.0)
        watch.remove()
    assert "capture_begin" in Cuda.CUDAGraph.__dict__ and Cuda.CUDAGraph.capture_begin.__name__ == "capture_begin"
    assert not hasattr(Cuda.CUDAGraph.capture_begin, "__wrapped__"), "the wrapper was not removed"
    assert fake.fake_cuda_invalidated_captures() == 0
    """
)


def test_a_step_around_torch_cuda_graph_on_a_pool_stream_is_captured_without_set_stream(
        tmp_path, fake_cuda_dir, records_of):
    """The Profiler's capture watch (steptrace.live.graph_capture) gives the step the capture
    stream when CUDAGraph.capture_begin runs on its thread: no set_stream by the program."""
    records = _run_on_the_fake(_CAPTURE_THROUGH_TORCH_CUDA_GRAPH, tmp_path / "run", fake_cuda_dir, records_of)
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["clock"] for s in steps] == ["cuda", "host", "cuda", "cuda"], steps
    assert steps[1].get("captured") is True, steps[1]
    assert records[-1]["device_timing"]["captured_steps"] == 1
