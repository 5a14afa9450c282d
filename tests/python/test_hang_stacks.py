"""Hang alerts' stacks come from faulthandler, which needs no GIL: a training thread hung
in native code while holding the GIL still gets its stacks, and when faulthandler's
handler has been taken over the alert thread answers as before (subprocess tests).

The child's training thread blocks reading its stdin; the parent polls the child's log
for the hang alert, then writes a byte to let the step finish: the alert must reach the
file while the step is blocked. Every child runs under a generous timeout.
"""

from __future__ import annotations

import json
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

CHILD = """
import ctypes, os, signal, sys, threading
import steptrace
import steptrace.live.profiler as sp

LIBC_PYDLL = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL while it blocks
LIBC_CDLL = ctypes.CDLL(None)    # CDLL: the call releases it

def hold_gil_in_native():
    buf = ctypes.create_string_buffer(1)
    return LIBC_PYDLL.read(0, buf, 1)  # the GIL stays held until the parent writes

def wait_without_gil():
    buf = ctypes.create_string_buffer(1)
    return LIBC_CDLL.read(0, buf, 1)

MODE = sys.argv[2]
with steptrace.Profiler(sys.argv[1], hang_min_s=0.5, handle_signals=False) as prof:
    if MODE == "taken":  # someone else's handler on our signal since: never raise it
        signal.signal(sp._stack_dump[1], lambda *a: None)
    for i in range(40):
        with prof.step():
            with prof.phase("forward"):
                if i == 30:
                    hold_gil_in_native() if MODE == "gil" else wait_without_gil()
print("done", flush=True)
"""


def _run_hang(tmp_path: Path, mode: str) -> dict:
    script = tmp_path / "gil_hang.py"
    script.write_text(textwrap.dedent(CHILD))
    log = tmp_path / "run" / "rank0.jsonl"
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    hang = None
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while hang is None and time.monotonic() < deadline and proc.poll() is None:
            if log.exists():
                for line in log.read_text().splitlines():
                    if '"type":"hang"' in line and '"kind":"alert"' in line:
                        hang = json.loads(line)
            if hang is None:
                time.sleep(0.05)  # poll interval, not synchronization
        blocked = proc.poll() is None  # still in the step when the alert was in the file
        proc.stdin.write("x")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the child hung (killed after {TIMEOUT_S} s):\n{out}\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and out.strip() == "done", err
    assert hang is not None, f"no hang alert reached the log; child stderr:\n{err}"
    assert blocked
    assert (hang["step"], hang["phase"]) == (30, "forward")
    records = list(steptrace.read(log, validate=True))
    assert records[-1]["kind"] == "run_end" and records[-1]["steps"] == 40
    return hang


def test_hang_holding_the_gil_in_native_code_still_gets_stacks(tmp_path):
    hang = _run_hang(tmp_path, "gil")
    stacks = hang["details"]["stacks"]
    assert stacks is not None, "no stacks: the Python thread asked for them cannot run"
    assert hang["details"]["stacks_source"] == "faulthandler"
    assert "hold_gil_in_native" in stacks and "gil_hang.py" in stacks


def test_a_hang_without_the_gil_gets_faulthandler_stacks_too(tmp_path):
    hang = _run_hang(tmp_path, "nogil")
    assert hang["details"]["stacks_source"] == "faulthandler"
    assert "wait_without_gil" in hang["details"]["stacks"]


def test_when_the_signal_is_taken_over_stacks_come_from_the_alert_thread(tmp_path):
    hang = _run_hang(tmp_path, "taken")
    assert hang["details"]["stacks_source"] == "python"
    assert "wait_without_gil" in hang["details"]["stacks"]
