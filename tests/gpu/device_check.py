"""What the device check scripts share: the PASS/FAIL/SKIP/INFO table, reading steps back,
the run's time budget, and checks that run in a child process (with a time limit).

Statuses: PASS and FAIL decide the exit code; SKIP is a check that cannot run here (the
reason is its detail: one GPU only, no NVLink, ...); INFO is a figure recorded for the
reader, with no verdict. A script exits 1 when any check failed or none ran.

run.sh sets STEPTRACE_GPU_DEADLINE (Unix time) so that the whole run stays under its
budget: time_left() is what is left of it, and child checks are given at most that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import steptrace

RESULT = "RESULT "  # a child check's result line: RESULT {"name", "detail", "status"}


def cuda_device():
    """The CUDA device to check, after printing what it is; None (said) without one."""
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (this script needs an NVIDIA GPU and a CUDA build of torch)")
        return None
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.device_count()} visible GPU(s)")
    return torch.device("cuda")


def no_gpu() -> int:
    """A script's whole result on a machine without a CUDA device: one SKIP row, exit 0
    (a dry run of run.sh here, or in CI, is not a failure)."""
    print(f"\nSKIP  {Path(sys.argv[0]).name}  no GPU (torch.cuda.is_available() is False)")
    return 0


class log_dir(str):  # noqa: N801 - used like a function, and as `with log_dir(...) as d:`
    """A new folder for one profiled run's JSONL logs, kept after the script: under
    $STEPTRACE_GPU_LOGS (run.sh points it into its output folder, which is copied back from
    the GPU machine), else under the system's temporary folder."""

    def __new__(cls, prefix: str = "steptrace-gpu-") -> "log_dir":
        parent = os.environ.get("STEPTRACE_GPU_LOGS") or None
        if parent:
            os.makedirs(parent, exist_ok=True)
        return super().__new__(cls, tempfile.mkdtemp(prefix=prefix, dir=parent))

    def __enter__(self) -> str:
        return str(self)

    def __exit__(self, *exc: object) -> None:
        pass  # kept: the logs are part of the results


class Checks:
    """Collects named checks; table() prints them and gives the exit code.

    Each result is also printed as it comes (a script stopped by its time limit still
    shows what it had); a child process (emit=True) prints them as RESULT lines that the
    parent's run_child() adds to its own table."""

    def __init__(self, emit: bool = False) -> None:
        self.results: list[tuple[str, str, str]] = []
        self.emit = emit

    def add(self, status: str, name: str, detail: str) -> None:
        self.results.append((name, detail, status))
        if self.emit:
            print(RESULT + json.dumps({"name": name, "detail": detail, "status": status}), flush=True)
        else:
            print(f"  .. {status} {name}: {detail}", flush=True)

    def __call__(self, name: str, detail: str, ok: bool) -> None:
        self.add("PASS" if ok else "FAIL", name, detail)

    def skip(self, name: str, reason: str) -> None:
        self.add("SKIP", name, reason)

    def info(self, name: str, detail: str) -> None:
        self.add("INFO", name, detail)

    def failed(self) -> bool:
        return any(s == "FAIL" for _, _, s in self.results)

    def table(self) -> int:
        width = max((len(n) for n, _, _ in self.results), default=0)
        print()
        for name, detail, status in self.results:
            print(f"{status:<4}  {name:<{width}}  {detail}")
        return 0 if self.results and not self.failed() else 1


def steps(path) -> list[dict]:
    return [r for r in steptrace.read(path) if r["kind"] == "step"]


def records(path) -> list[dict]:
    return list(steptrace.read(path))


def alerts(recs: list[dict], kind: str) -> list[dict]:
    return [r for r in recs if r.get("kind") == "alert" and r.get("type") == kind]


def time_left() -> float:
    """Seconds left of the run's budget (run.sh's STEPTRACE_GPU_DEADLINE); inf without one."""
    deadline = os.environ.get("STEPTRACE_GPU_DEADLINE")
    if not deadline:
        return float("inf")
    try:
        return float(deadline) - time.time()
    except ValueError:
        return float("inf")


def limit(want_s: float, margin_s: float = 3.0) -> float:
    """A child's time limit: want_s, or less when the run's budget has less left."""
    return max(0.0, min(want_s, time_left() - margin_s))


class Child:
    """A check run in a child process: `python SCRIPT --child NAME ARGS...`, started now,
    judged by finish(). Its RESULT lines become checks; a crash, a non-zero exit or the
    time limit is a FAIL with the last lines of its output."""

    def __init__(self, label: str, script: str, name: str, *args: str, timeout_s: float = 60.0,
                 env: "dict | None" = None) -> None:
        self.label, self.timeout_s = label, limit(timeout_s)
        self.t0 = time.monotonic()
        self.proc = None
        if self.timeout_s < 5:
            return  # not started: finish() says so
        self.proc = subprocess.Popen([sys.executable, script, "--child", name, *args],
                                     env=dict(os.environ, **(env or {})), cwd=str(Path(script).parent),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def finish(self, check: Checks) -> list[dict]:
        """Waits (within the time limit), adds the child's checks; returns its results."""
        if self.proc is None:
            check(self.label, "not run: the run's time budget is spent (STEPTRACE_GPU_DEADLINE)", False)
            return []
        timed_out = False
        try:
            out, err = self.proc.communicate(timeout=max(0.1, self.timeout_s - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(self.proc.pid, 9)  # the child's own session: it and what it started
            except OSError:
                self.proc.kill()
            out, err = self.proc.communicate()
        results = []
        for line in out.splitlines():
            if line.startswith(RESULT):
                try:
                    results.append(json.loads(line[len(RESULT):]))
                except ValueError:
                    pass
        for r in results:
            check.add(r["status"], r["name"], r["detail"])
        lines = [x for x in (out + "\n" + err).strip().splitlines() if not x.startswith(RESULT)]
        tail = " | ".join(lines[-4:])[-600:]
        took = time.monotonic() - self.t0
        if timed_out:
            check(self.label, f"child stopped at its time limit ({self.timeout_s:.0f} s) after "
                              f"{len(results)} result(s); last output: {tail}", False)
        elif self.proc.returncode != 0:
            check(self.label, f"child exited {self.proc.returncode} after {took:.1f} s with {len(results)} "
                              f"result(s): {tail}", False)
        elif not results:
            check(self.label, f"child gave no result ({took:.1f} s): {tail}", False)
        else:
            print(f"  ({self.label}: child took {took:.1f} s)", flush=True)
        return results


def child_main(children: dict) -> "int | None":
    """In a script's __main__: runs `--child NAME ARGS` (NAME from `children`, which get a
    Checks(emit=True) and the ARGS) and returns its exit code; None when not a child."""
    if len(sys.argv) >= 3 and sys.argv[1] == "--child":
        check = Checks(emit=True)
        children[sys.argv[2]](check, *sys.argv[3:])
        sys.stdout.flush()
        return 0
    return None
