"""Nothing is lost on SIGTERM, interpreter exit or kill -9 (subprocess tests).

The child reports on stdout when it reached the point under test; the parent waits for
that line (a pipe, not a sleep) before it signals.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import steptrace
from steptrace.analysis.reader import TruncatedLogWarning

HERE = Path(__file__).parent

CHILD_PRELUDE = f"""
import sys, itertools
sys.path.insert(0, {str(HERE)!r})
import steptrace
from support.training import batches, train
"""


def spawn(body: str) -> subprocess.Popen:
    code = CHILD_PRELUDE + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, expected: str) -> None:
    for line in proc.stdout:
        if line.strip() == expected:
            return
    raise AssertionError(f"child exited (rc={proc.wait()}) before printing {expected!r}")


def records(path: Path) -> list[dict]:
    return list(steptrace.read(path, validate=True))


def test_sigterm_flushes_everything_and_writes_run_end(tmp_path):
    proc = spawn(f"""
        prof = steptrace.Profiler({str(tmp_path)!r})
        train(prof, batches(25))
        print("trained", flush=True)
        while True:  # a job still training when the scheduler stops it
            train(prof, batches(1))
    """)
    wait_for_line(proc, "trained")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # still dies of SIGTERM
    recs = records(tmp_path / "rank0.jsonl")
    steps = [r for r in recs if r["kind"] == "step"]
    assert len(steps) >= 25
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert recs[-1]["kind"] == "run_end" and recs[-1]["reason"] == "signal"
    assert recs[-1]["steps"] == len(steps)


def test_sigterm_with_the_programs_own_handler(tmp_path):
    proc = spawn(f"""
        import signal
        def graceful(signum, frame):
            print("handler ran", flush=True)
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, graceful)
        with steptrace.Profiler({str(tmp_path)!r}) as prof:
            train(prof, batches(5))
            print("trained", flush=True)
            while True:
                train(prof, batches(1))
    """)
    wait_for_line(proc, "trained")
    proc.send_signal(signal.SIGTERM)
    wait_for_line(proc, "handler ran")
    assert proc.wait(timeout=60) == 3
    recs = records(tmp_path / "rank0.jsonl")
    assert recs[-1]["reason"] == "signal"
    assert sum(r["kind"] == "step" for r in recs) >= 5


def test_interpreter_exit_without_close_writes_run_end(tmp_path):
    proc = spawn(f"""
        prof = steptrace.Profiler({str(tmp_path)!r})
        train(prof, batches(7))
        # no close(): atexit must flush and end the run
    """)
    assert proc.wait(timeout=60) == 0
    recs = records(tmp_path / "rank0.jsonl")
    assert sum(r["kind"] == "step" for r in recs) == 7
    assert recs[-1]["kind"] == "run_end" and recs[-1]["reason"] == "exit"


def test_an_uncaught_exception_without_close_ends_the_run_as_exception(tmp_path):
    proc = spawn(f"""
        prof = steptrace.Profiler({str(tmp_path)!r})
        train(prof, batches(4))
        raise ValueError("loss went to nan")  # no close(), no with: what a framework without an exception hook leaves
    """)
    assert proc.wait(timeout=60) == 1
    recs = records(tmp_path / "rank0.jsonl")
    assert sum(r["kind"] == "step" for r in recs) == 4
    assert recs[-1]["kind"] == "run_end" and recs[-1]["reason"] == "exception"
    assert recs[-1]["error"] == "ValueError: loss went to nan"


def test_kill_9_loses_at_most_the_unflushed_batch(tmp_path):
    proc = spawn(f"""
        prof = steptrace.Profiler({str(tmp_path)!r}, flush_interval_ms=10)
        train(prof, batches(30))
        prof.flush()
        print("flushed", flush=True)
        for i in itertools.count():
            train(prof, batches(1))
    """)
    wait_for_line(proc, "flushed")
    proc.kill()
    proc.wait(timeout=60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recs = list(steptrace.read(tmp_path))  # reads, at worst with a warning
    assert all(issubclass(w.category, TruncatedLogWarning) for w in caught)
    steps = [r for r in recs if r["kind"] == "step"]
    assert len(steps) >= 30  # everything flushed before the kill is there
    assert [s["step"] for s in steps] == list(range(len(steps)))
    assert recs[-1]["kind"] != "run_end"


def test_keyboard_interrupt_ends_with_reason_signal(tmp_path):
    proc = spawn(f"""
        try:
            with steptrace.Profiler({str(tmp_path)!r}) as prof:
                train(prof, batches(3))
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
    """)
    assert proc.wait(timeout=60) == 0
    assert records(tmp_path / "rank0.jsonl")[-1]["reason"] == "signal"
