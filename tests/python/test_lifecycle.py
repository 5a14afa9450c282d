"""Process life: close() from another thread, fork, SIGTERM while the main thread is
blocked in native code, and a log that cannot be written (subprocess tests).

The child reports on stdout when it reached the point under test; the parent waits for
that line (a pipe, not a sleep). Every child runs under a generous timeout: a hang is
the failure these tests look for.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import steptrace

HERE = Path(__file__).parent
TIMEOUT_S = 60

CHILD_PRELUDE = f"""
import sys, os, threading
sys.path.insert(0, {str(HERE)!r})
import steptrace
from support.training import batches, train

def steps(prof, n):  # steps without torch work (libgomp may hang in a forked child)
    for _ in range(n):
        with prof.step():
            with prof.phase("forward"):
                pass
            with prof.phase("backward"):
                pass
"""


def spawn(body: str) -> subprocess.Popen:
    code = CHILD_PRELUDE + textwrap.dedent(body)
    # its own process group: a hung forked grandchild is killed with it
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the child hung (killed after {TIMEOUT_S} s); its output:\n{out}")
    return proc.returncode, out


def wait_for_line(proc: subprocess.Popen, expected: str) -> None:
    for line in proc.stdout:
        if line.strip() == expected:
            return
    raise AssertionError(f"child exited (rc={proc.wait()}) before printing {expected!r}")


def records(path: Path) -> list[dict]:
    return list(steptrace.read(path, validate=True))


def check_one_clean_run(path: Path) -> list[dict]:
    recs = records(path)
    steps = [r for r in recs if r["kind"] == "step"]
    assert [s["step"] for s in steps] == list(range(len(steps)))  # no duplicates, no gaps
    assert sum(r["kind"] == "run_start" for r in recs) == 1
    assert sum(r["kind"] == "run_end" for r in recs) == 1
    assert recs[-1]["kind"] == "run_end" and recs[-1]["steps"] == len(steps)
    return steps


def test_close_from_another_thread_while_the_loop_keeps_stepping(tmp_path):
    proc = spawn(f"""
        prof = steptrace.Profiler({str(tmp_path)!r}, queue_capacity=16, flush_interval_ms=1)
        stepped, stop, errors, count = threading.Event(), threading.Event(), [], [0]
        def loop():
            while not stop.is_set():
                try:
                    with prof.step():
                        with prof.phase("forward"):
                            pass
                except Exception as e:  # nothing may reach the training loop
                    errors.append(repr(e))
                count[0] += 1
                if count[0] == 50:
                    stepped.set()
        t = threading.Thread(target=loop)
        t.start()
        stepped.wait()
        prof.close()  # from the main thread while the loop thread keeps stepping
        at_close = count[0]
        while count[0] < at_close + 500 and t.is_alive():  # far more steps than the ring holds
            pass
        stop.set()
        t.join()
        print("errors", errors, flush=True)
        print("closed", prof.closed, at_close, flush=True)
    """)
    rc, out = finish(proc)
    assert rc == 0, out
    assert "errors []" in out
    assert "closed True" in out
    at_close = int(out.split("closed True")[1].split()[0])
    steps = check_one_clean_run(tmp_path / "rank0.jsonl")
    assert 50 <= len(steps) <= at_close + 1  # steps after the close are not recorded
    assert all(s["status"] == "ok" for s in steps)


CHILD_EXITS = {
    "os._exit": "os._exit(0)",
    "sys.exit": "sys.exit(0)",  # atexit and interpreter finalization run in the child
    "close then os._exit": "prof.close(); assert prof.closed; os._exit(0)",
}


@pytest.mark.parametrize("child_exit", sorted(CHILD_EXITS))
def test_a_forked_child_does_not_write_to_the_parents_log(tmp_path, child_exit):
    proc = spawn(f"""
        prof = steptrace.Profiler({str(tmp_path)!r})
        steps(prof, 5)
        prof.flush()
        pid = os.fork()
        if pid == 0:
            steps(prof, 5000)  # not recorded (more than the ring holds), and nothing raised
            prof.flush()
            {CHILD_EXITS[child_exit]}
        _, status = os.waitpid(pid, 0)
        print("child status", status, flush=True)
        steps(prof, 3)
        prof.close()
    """)
    rc, out = finish(proc)
    assert rc == 0, out
    assert "child status 0" in out
    steps = check_one_clean_run(tmp_path / "rank0.jsonl")
    assert len(steps) == 8  # the parent's 5 + 3, nothing of the child's


def test_a_multiprocessing_fork_worker_does_not_write_to_the_parents_log(tmp_path):
    proc = spawn(f"""
        import multiprocessing
        def work(n):
            steps(prof, n)  # the inherited profiler: not recorded
            return n
        if __name__ == "__main__":
            prof = steptrace.Profiler({str(tmp_path)!r})
            steps(prof, 4)
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(2) as pool:
                print("results", pool.map(work, [3, 3, 3]), flush=True)
            p = ctx.Process(target=work, args=(2,))
            p.start()
            p.join()
            print("exitcode", p.exitcode, flush=True)
            steps(prof, 2)
            prof.close()
    """)
    rc, out = finish(proc)
    assert rc == 0, out
    assert "results [3, 3, 3]" in out and "exitcode 0" in out
    assert len(check_one_clean_run(tmp_path / "rank0.jsonl")) == 6


# Blocks the main thread for good in native code: a second lock of a normal pthread
# mutex (no signal interrupts it; ctypes releases the GIL, as a CUDA wait would). A helper
# thread prints "blocking" once the main thread waits on that very futex (its current
# system call, read from /proc), so the signal cannot come while it still runs Python.
BLOCK_IN_NATIVE_CODE = """
import ctypes, time
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)
libc.pthread_mutex_init(mutex, None)
libc.pthread_mutex_lock(mutex)
def announce():
    path = f"/proc/self/task/{threading.main_thread().native_id}/syscall"
    while True:
        fields = open(path).read().split()
        if fields[0] == "202" and int(fields[1], 16) == ctypes.addressof(mutex):  # futex
            print("blocking", flush=True)
            return
        time.sleep(0.001)
threading.Thread(target=announce, daemon=True).start()
libc.pthread_mutex_lock(mutex)
"""


def test_sigterm_while_the_main_thread_is_blocked_in_native_code(tmp_path):
    proc = spawn(textwrap.dedent(f"""
        # only the signal path can get these steps out: no flush, no flush interval
        prof = steptrace.Profiler({str(tmp_path)!r}, flush_interval_ms=60000, sigterm_grace_s=0.5)
        train(prof, batches(12))
    """) + BLOCK_IN_NATIVE_CODE)
    wait_for_line(proc, "blocking")
    proc.send_signal(signal.SIGTERM)
    rc, _ = finish(proc)
    assert rc == -signal.SIGTERM  # re-raised with the default action
    steps = check_one_clean_run(tmp_path / "rank0.jsonl")
    assert len(steps) == 12
    end = records(tmp_path / "rank0.jsonl")[-1]
    assert end["reason"] == "signal"
    assert "grace period" in end["error"]


def test_sigterm_with_the_programs_own_handler_is_left_to_it_while_blocked(tmp_path):
    # The program handles SIGTERM itself: steptrace flushes at once (the main thread is
    # blocked in native code, so only the watcher can) and never ends the process, even
    # with no grace at all; the program's handler runs once the main thread is back.
    proc = spawn(f"""
        import ctypes, signal, time
        def graceful(signum, frame):
            print("handler ran", flush=True)
            raise SystemExit(3)
        signal.signal(signal.SIGTERM, graceful)
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)
        libc.pthread_mutex_init(mutex, None)
        libc.pthread_mutex_lock(mutex)
        def unblock():  # releases the main thread when the parent says so
            sys.stdin.read(1)
            libc.pthread_mutex_unlock(mutex)
        threading.Thread(target=unblock, daemon=True).start()
        with steptrace.Profiler({str(tmp_path)!r}, flush_interval_ms=60000, sigterm_grace_s=0.0) as prof:
            train(prof, batches(6))
            def announce():  # once the main thread waits on the mutex (see BLOCK_IN_NATIVE_CODE)
                path = f"/proc/self/task/{{threading.main_thread().native_id}}/syscall"
                while True:
                    fields = open(path).read().split()
                    if fields[0] == "202" and int(fields[1], 16) == ctypes.addressof(mutex):
                        print("blocking", flush=True)
                        return
                    time.sleep(0.001)
            threading.Thread(target=announce, daemon=True).start()
            libc.pthread_mutex_lock(mutex)  # signals do not interrupt this
            while True:
                train(prof, batches(1))
    """)
    wait_for_line(proc, "blocking")
    proc.send_signal(signal.SIGTERM)
    log = tmp_path / "rank0.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while log.read_text().count('"kind":"step"') < 6:  # poll the observable result
        assert time.monotonic() < deadline and proc.poll() is None, "the steps were never flushed"
        time.sleep(0.005)
    assert proc.poll() is None  # blocked, alive: the program's handler decides
    proc.stdin.write("x")
    proc.stdin.flush()
    rc, out = finish(proc)
    assert rc == 3, out
    assert "handler ran" in out
    recs = records(log)
    assert recs[-1]["kind"] == "run_end" and recs[-1]["reason"] == "signal"
    assert sum(r["kind"] == "step" for r in recs) >= 6


def test_a_log_that_cannot_be_written_is_reported(tmp_path):
    # A file size limit makes writes past it fail (EFBIG), like a full disk.
    proc = spawn(f"""
        import logging, resource, signal
        logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        prof = steptrace.Profiler({str(tmp_path)!r}, detect=False)
        size = os.path.getsize(prof.log_path)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 2000, resource.RLIM_INFINITY))
        for _ in range(5):
            train(prof, batches(20))
            prof.flush()
        print("write_errors", prof._core.write_errors, prof._core.write_error, flush=True)
        prof.close()
    """)
    rc, out = finish(proc)
    assert rc == 0, out
    warnings = [line for line in out.splitlines() if line.startswith("steptrace WARNING")]
    assert len(warnings) == 1, out  # once, not per failed write
    assert "cannot write its log" in warnings[0] and "File too large" in warnings[0]
    count = int(out.split("write_errors ")[1].split()[0])
    assert count >= 1
