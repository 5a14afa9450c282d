"""Build steptrace/1 records and log files by hand for the reader, summary and CLI tests.

Every builder returns a record that validates against schema/steptrace-1.schema.json
(test_reader.py proves it); keyword overrides replace or add fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

T0_NS = 1_700_000_000_000_000_000
DEFAULT_PHASES_MS = {"forward": 3.0, "loss": 0.5, "backward": 5.0, "clip": 0.25, "optimizer": 1.25}


def run_start(rank: int = 0, world_size: int = 1, run_id: str = "test-run", **over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "kind": "run_start",
        "schema": "steptrace/1",
        "run_id": run_id,
        "rank": rank,
        "world_size": world_size,
        "host": "testhost",
        "pid": 4242,
        "start_unix_ns": T0_NS,
        "versions": {"steptrace": "0.1.0", "python": "3.11.0", "torch": None, "cuda": None, "cupti": None},
        "device": None,
        "config": {"log_dir": "runs/test"},
        "backends": {
            "timer": {"active": ["host"], "unavailable": {"cuda": "no GPU"}},
            "memory": {"active": ["rss"], "unavailable": {"torch": "torch not imported"}},
        },
    }
    rec.update(over)
    return rec


def step(
    index: int,
    rank: int = 0,
    phases: Optional[Mapping[str, float]] = None,
    data_ms: float = 1.0,
    step_ms: Optional[float] = None,
    status: str = "ok",
    memory: Optional[Mapping[str, int]] = None,
    period_ms: float = 20.0,
    **over: Any,
) -> dict[str, Any]:
    """A step record; step_ms defaults to the sum of the phases, start time to
    ``T0_NS + index * period_ms``."""
    ph = dict(DEFAULT_PHASES_MS if phases is None else phases)
    total = sum(ph.values()) if step_ms is None else step_ms
    rec: dict[str, Any] = {
        "kind": "step",
        "rank": rank,
        "step": index,
        "start_unix_ns": T0_NS + int(index * period_ms * 1e6),
        "clock": "host",
        "status": status,
        "step_ms": total,
        "data_ms": data_ms,
        "host_ms": total,
        "phases_ms": ph,
        "memory": dict({"rss_bytes": 100 * 2**20} if memory is None else memory),
    }
    rec.update(over)
    return rec


def alert(type_: str, at_step: int, rank: int = 0, **over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "kind": "alert",
        "rank": rank,
        "type": type_,
        "step": at_step,
        "value": 30.0,
        "baseline": 10.0,
        "threshold": 1.5,
        "phase": "forward",
        "message": f"{type_} at step {at_step}: forward grew from 10 ms to 30 ms",
    }
    rec.update(over)
    return rec


def run_end(steps: int, rank: int = 0, reason: str = "normal", error_steps: int = 0, **over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "kind": "run_end",
        "rank": rank,
        "reason": reason,
        "end_unix_ns": T0_NS + 10**9,
        "steps": steps,
        "error_steps": error_steps,
        "wall_s": 1.0,
        "summary": {
            "step_ms_mean": 10.0,
            "step_ms_max": 10.0,
            "data_ms_total": float(steps),
            "phases_ms_total": {k: v * steps for k, v in DEFAULT_PHASES_MS.items()},
        },
    }
    rec.update(over)
    return rec


def interval(kind: str, at_step: int, duration_ms: float, rank: int = 0, inside_step: bool = False,
             start_unix_ns: int = T0_NS, **over: Any) -> dict[str, Any]:
    """An ``interval`` record (evaluation, checkpoint or other time outside training)."""
    rec: dict[str, Any] = {"kind": "interval", "rank": rank, "interval": kind, "step": at_step,
                           "inside_step": inside_step, "start_unix_ns": start_unix_ns, "duration_ms": duration_ms}
    rec.update(over)
    return rec


def goodput(**over: Any) -> dict[str, Any]:
    """A run_end ``goodput`` object; the parts add up to wall_s."""
    g: dict[str, Any] = {"wall_s": 10.0, "startup_s": 1.0, "steps_s": 7.0, "data_s": 0.5, "eval_s": 1.0,
                         "checkpoint_s": 0.25, "other_s": 0.15, "after_last_step_s": 0.1, "training_pct": 70.0,
                         "from": "process_start"}
    g.update(over)
    return g


#: The checkpoints of :func:`timeline_run` (step -> ms): the third is 5x the others,
#: and a slow_checkpoint alert says so.
TIMELINE_CHECKPOINTS = {8: 300.0, 16: 300.0, 24: 1500.0}


def timeline_run(n: int = 30, rank: int = 0, world_size: int = 1, end: bool = True, step_ms: float = 10.0,
                 data_ms: float = 1.0, other_ms: float = 0.5, run_id: str = "test-run",
                 process_start_s: float = 2.0) -> list[dict[str, Any]]:
    """A run in the current format, with every second between its steps accounted for:
    start-up 1 s after the profiler started (``process_start_s`` more since the process
    did), then ``n`` steps of ``step_ms`` with the loader's wait (``data_ms``) and other
    host work (``other_ms``) before each one after the first; an evaluation of 200 ms
    between steps 9 and 10, one of 5 ms inside step 15 (a step of step_ms + 5), the
    checkpoints of :data:`TIMELINE_CHECKPOINTS` before those steps, a checkpoint of 400 ms
    after the last step, run_end 100 ms later (unless ``end`` is False: a crashed run). The
    run-queue wait is read at every other step. Alerts: host_contention at step 12,
    slow_checkpoint at step 24. run_end's goodput is the exact account of this timeline."""
    ms = 1_000_000
    recs: list[dict[str, Any]] = [run_start(rank=rank, world_size=world_size, run_id=run_id)]
    t = T0_NS + 1000 * ms  # the first step starts 1 s after the profiler
    totals = {"steps": 0.0, "data": 0.0, "eval": 0.0, "checkpoint": 0.0, "other": 0.0}
    first_data = data_ms
    prev_end = None
    for i in range(n):
        gap_intervals: list[dict[str, Any]] = []
        fields: dict[str, Any] = {}
        data = data_ms
        other = 0.0 if i == 0 else other_ms
        if prev_end is not None:
            t = prev_end + int((data + other) * ms)
        if i == 10:
            gap_intervals.append(interval("eval", i, 200.0, rank=rank, start_unix_ns=t))
            fields["eval_ms"] = 200.0
            t += 200 * ms
        if i in TIMELINE_CHECKPOINTS:
            d = TIMELINE_CHECKPOINTS[i]
            gap_intervals.append(interval("checkpoint", i, d, rank=rank, start_unix_ns=t))
            fields["checkpoint_ms"] = d
            t += int(d * ms)
        host = step_ms
        if i == 15:  # an evaluation inside the step
            gap_intervals.append(interval("eval", i, 5.0, rank=rank, inside_step=True, start_unix_ns=t + 2 * ms))
            fields["eval_ms"] = 5.0
            fields["interval_in_step_ms"] = 5.0
            host = step_ms + 5.0
        if i % 2 == 1:
            fields["host"] = {"runq_ms": 0.25, "runq_span_ms": 2 * (step_ms + data_ms + other_ms)}
        recs += gap_intervals
        recs.append(step(i, rank=rank, data_ms=data, other_ms=other, step_ms=host, host_ms=host,
                         start_unix_ns=t, **fields))
        if i == 12:
            recs.append(alert("host_contention", i, rank=rank, phase=None, value=8.0, baseline=10.0, threshold=4.0,
                              message=f"step {i} took 18.00 ms vs the trailing median 10.00 ms, and the training "
                                      "thread waited 8.00 ms of it for a CPU (runnable, not running): the host is "
                                      "oversubscribed, not the model",
                              details={"runq_ms": 8.0, "runq_span_ms": 20.0, "excess_ms": 8.0}))
        if i == 24:
            recs.append(alert("slow_checkpoint", i, rank=rank, phase=None, value=1.5, baseline=0.3, threshold=1.3,
                              message=f"the checkpoint before step {i} took 1.50 s, 5.0x the run's earlier ones "
                                      "(median 0.30 s over 2): the filesystem is slower than it was",
                              details={"checkpoint_s": 1.5, "median_s": 0.3, "earlier": 2}))
        totals["steps"] += host - fields.get("interval_in_step_ms", 0.0)
        totals["data"] += data
        totals["other"] += other
        totals["eval"] += fields.get("eval_ms", 0.0)
        totals["checkpoint"] += fields.get("checkpoint_ms", 0.0)
        prev_end = t + int(host * ms)
    last_end = prev_end
    recs.append(interval("checkpoint", n, 400.0, rank=rank, start_unix_ns=last_end))
    totals["checkpoint"] += 400.0
    if not end:
        return recs
    end_ns = last_end + 500 * ms
    origin = T0_NS - int(process_start_s * 1e9)
    wall_s = (end_ns - origin) / 1e9
    g = goodput(wall_s=wall_s, startup_s=(T0_NS + 1000 * ms - origin) / 1e9 - first_data / 1e3,
                steps_s=totals["steps"] / 1e3, data_s=totals["data"] / 1e3, eval_s=totals["eval"] / 1e3,
                checkpoint_s=totals["checkpoint"] / 1e3, other_s=totals["other"] / 1e3, after_last_step_s=0.1,
                training_pct=100.0 * totals["steps"] / 1e3 / wall_s)
    end_rec = run_end(n, rank=rank, end_unix_ns=end_ns, wall_s=(end_ns - T0_NS) / 1e9, goodput=g)
    end_rec["summary"]["runq_ms_total"] = 0.25 * (n // 2)
    end_rec["alerts"] = {"host_contention": 1, "slow_checkpoint": 1}
    recs.append(end_rec)
    return recs


def job_of(job_id: Optional[str], attempt: int, previous: Optional[int] = None, root: str = "runs/job",
           source: Optional[str] = "STEPTRACE_JOB") -> dict[str, Any]:
    """run_start's ``job`` object (issue 51): the job id and where it came from, the attempt,
    the previous attempt found, the job root."""
    return {"id": job_id, "source": source if job_id is not None else None, "attempt": attempt,
            "previous_attempt": previous, "root": root}


def attempt_run(attempt: int = 0, rank: int = 0, world_size: int = 1, start_ns: int = T0_NS, steps: int = 40,
                step_ms: Any = 10.0, data_ms: float = 1.0, other_ms: float = 0.5, save_every: Optional[int] = None,
                save_ms: float = 50.0, first_progress: Optional[int] = 0, restore_ms: Optional[float] = None,
                end: Optional[str] = "normal", job_id: Optional[str] = "job-1", startup_ms: float = 500.0,
                profiler_after_ms: float = 1000.0, end_after_ms: float = 50.0, error: Optional[str] = None,
                config: Optional[dict[str, Any]] = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One rank's log of one attempt of a job, with an exact timeline: the process starts
    at ``start_ns``, the profiler ``profiler_after_ms`` later; a checkpoint restore of
    ``restore_ms`` (an interval of kind ``restore``, listed by the first step), then the
    first step ``startup_ms`` after the profiler's start (plus the restore); ``steps``
    steps of ``step_ms`` (a number or a function of the step index), each after the first
    following ``data_ms`` of loader wait and ``other_ms`` of other host work; a checkpoint
    save of ``save_ms`` before every ``save_every``-th step; ``progress`` counting from
    ``first_progress`` (None: no progress field). ``end``: the run_end reason (its goodput
    the exact account), or None for a torn log (no run_end). Returns the records and the
    facts the tests check: ``process_start_ns``, ``first_start_ns``, ``end_ns`` (the last
    record's end), ``steps`` [(start_ns, ms, progress)], ``save_ends`` (unix ns)."""
    ms = 1_000_000
    prof = start_ns + int(profiler_after_ms * ms)
    rs = run_start(rank=rank, world_size=world_size, run_id=f"{job_id}-attempt{attempt}", start_unix_ns=prof,
                   process_start_unix_ns=start_ns, job=job_of(job_id, attempt, attempt - 1 if attempt else None),
                   config=dict({"log_dir": "runs/job"}, **(config or {})))
    recs: list[dict[str, Any]] = [rs]
    t = prof + int(startup_ms * ms)
    before_first = data_ms
    if restore_ms:
        recs.append(interval("restore", 0, restore_ms, rank=rank, start_unix_ns=t))
        t += int(restore_ms * ms)
        before_first += restore_ms
    info: dict[str, Any] = {"process_start_ns": start_ns, "steps": [], "save_ends": []}
    totals = {"steps": 0.0, "data": 0.0, "other": 0.0, "checkpoint": 0.0}
    prev_end: Optional[int] = None
    for i in range(steps):
        fields: dict[str, Any] = {}
        other = 0.0 if i == 0 else other_ms
        if prev_end is not None:
            t = prev_end + int((data_ms + other) * ms)
        if i == 0 and restore_ms:
            fields["restore_ms"] = restore_ms
        if save_every and i and i % save_every == 0:
            recs.append(interval("checkpoint", i, save_ms, rank=rank, start_unix_ns=t))
            t += int(save_ms * ms)
            info["save_ends"].append(t)
            fields["checkpoint_ms"] = save_ms
            totals["checkpoint"] += save_ms
        if first_progress is not None:
            fields["progress"] = first_progress + i
        d = float(step_ms(i) if callable(step_ms) else step_ms)
        recs.append(step(i, rank=rank, data_ms=data_ms, other_ms=other, step_ms=d, host_ms=d, start_unix_ns=t,
                         phases={"forward": d / 2, "backward": d / 2}, **fields))
        info["steps"].append((t, d, fields.get("progress")))
        if i == 0:
            info["first_start_ns"] = t
        totals["steps"] += d
        totals["data"] += data_ms
        totals["other"] += other
        prev_end = t + int(d * ms)
    last_end = prev_end if prev_end is not None else t
    if end is None:
        info["end_ns"] = last_end
        return recs, info
    end_ns = last_end + int(end_after_ms * ms)
    info["end_ns"] = end_ns
    wall_s = (end_ns - start_ns) / 1e9
    first_start = info.get("first_start_ns", last_end)
    g = goodput(wall_s=wall_s, startup_s=(first_start - start_ns) / 1e9 - before_first / 1e3,
                steps_s=totals["steps"] / 1e3, data_s=totals["data"] / 1e3, eval_s=0.0,
                checkpoint_s=totals["checkpoint"] / 1e3, other_s=totals["other"] / 1e3,
                after_last_step_s=end_after_ms / 1e3, training_pct=100.0 * totals["steps"] / 1e3 / wall_s)
    if restore_ms:
        g["restore_s"] = restore_ms / 1e3
    extra: dict[str, Any] = {"error": error} if error else {}
    recs.append(run_end(steps, rank=rank, reason=end, end_unix_ns=end_ns, wall_s=(end_ns - prof) / 1e9, goodput=g,
                        **extra))
    return recs, info


def run_records(n_steps: int = 5, rank: int = 0, world_size: int = 1, end: bool = True) -> list[dict[str, Any]]:
    """A whole valid run: run_start, n_steps default steps, run_end (unless end=False)."""
    recs = [run_start(rank=rank, world_size=world_size)]
    recs += [step(i, rank=rank) for i in range(n_steps)]
    if end:
        recs.append(run_end(n_steps, rank=rank))
    return recs


def work(iteration_ms: float, samples: Optional[float] = 8, tokens: Optional[float] = 1024,
         flops: Optional[float] = 2e10, peak_tflops: Optional[float] = 10.0,
         energy_j: Optional[float] = None) -> dict[str, Any]:
    """A step's ``work`` object as the profiler writes it: the figures given (None: not
    known) and their rates over ``iteration_ms``; MFU against ``peak_tflops``."""
    s = iteration_ms / 1e3
    w: dict[str, Any] = {}
    if samples is not None:
        w["samples"] = samples
    if tokens is not None:
        w["tokens"] = tokens
    if flops is not None:
        w["flops"] = flops
    if samples is not None:
        w["samples_per_s"] = samples / s
    if tokens is not None:
        w["tokens_per_s"] = tokens / s
    if flops is not None:
        w["tflops_per_s"] = flops / s / 1e12
        if peak_tflops:
            w["mfu_pct"] = 100.0 * flops / s / (peak_tflops * 1e12)
    if energy_j is not None:
        if samples:
            w["j_per_sample"] = energy_j / samples
        if tokens:
            w["j_per_token"] = energy_j / tokens
    return w


def work_run(n: int = 40, rank: int = 0, world_size: int = 1, run_id: str = "test-run",
             iteration_ms: Any = 10.0, peak_tflops: Optional[float] = 10.0, energy_j: Optional[float] = None,
             end: bool = True, **work_over: Any) -> list[dict[str, Any]]:
    """A run whose steps did useful work: 8 samples, 1024 tokens, 2e10 FLOPs a step (keyword
    overrides to :func:`work`), an iteration of ``iteration_ms`` (a number, or a function
    of the step index): 1 ms of data wait and the rest the step. run_start says the peak
    (the peak_tflops option) or why there is none; run_end has the run's totals."""
    def it(i: int) -> float:
        return float(iteration_ms(i) if callable(iteration_ms) else iteration_ms)

    start_work: dict[str, Any] = ({"peak_tflops": peak_tflops, "chip": "peak_tflops option",
                                   "source": "the peak_tflops option"} if peak_tflops else
                                  {"peak_tflops": None, "mfu_unavailable": "no GPU timed the steps: MFU on a CPU "
                                   "needs the peak_tflops option"})
    recs = [run_start(rank=rank, world_size=world_size, run_id=run_id, work=start_work)]
    total_ms = 0.0
    for i in range(n):
        ms = it(i)
        total_ms += ms
        phases = {"forward": (ms - 1.0) / 2, "backward": (ms - 1.0) / 2}
        rec = step(i, rank=rank, phases=phases, data_ms=1.0, period_ms=ms,
                   work=work(ms, peak_tflops=peak_tflops, energy_j=energy_j, **work_over))
        if energy_j is not None:
            power = energy_j / (ms / 1e3)
            rec["hw"] = {"power_w": power, "min_power_w": power, "energy_j": energy_j, "throttle_reasons": [],
                         "samples": 2}
        recs.append(rec)
    if end:
        last = dict(work(total_ms, peak_tflops=peak_tflops, **work_over))
        totals = {k: v * n for k, v in work(1.0, peak_tflops=None, **work_over).items()
                  if k in ("samples", "tokens", "flops")}
        end_work = {**{k: v for k, v in last.items() if k.endswith("_per_s") or k == "mfu_pct"}, **totals}
        for k in ("samples_per_s", "tokens_per_s", "tflops_per_s", "mfu_pct"):
            if k in end_work:
                end_work[k] *= n
        if peak_tflops:
            end_work["peak_tflops"] = peak_tflops
        if energy_j is not None and "tokens" in totals:
            end_work["energy_j"] = energy_j * n
            end_work["j_per_token"] = energy_j * n / totals["tokens"]
            end_work["tokens_per_kwh"] = 3.6e6 * totals["tokens"] / (energy_j * n)
        recs.append(run_end(n, rank=rank, work=end_work))
    return recs


def lines(records: Iterable[Any]) -> list[str]:
    """The JSON text of each record (one line each, no newline)."""
    return [json.dumps(r) for r in records]


def write_log(path: Path, records: Iterable[Any], tail: str = "") -> Path:
    """Write records as JSON Lines (each ending in a newline), then ``tail`` verbatim
    (e.g. a truncated last line without its newline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(line + "\n" for line in lines(records)) + tail
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- the CLI

REPO = Path(__file__).resolve().parents[3]
TESTS = Path(__file__).resolve().parents[1]  # tests/python


def steptrace_script() -> str:
    """The installed ``steptrace`` console script (the venv's, next to this Python)."""
    import shutil
    import sys

    beside = Path(sys.executable).parent / "steptrace"
    if beside.exists():
        return str(beside)
    found = shutil.which("steptrace")
    if found is None:
        raise RuntimeError("the steptrace console script is not installed (pip install .)")
    return found


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for the CLI: the source tree's python/ first on PYTHONPATH, so the
    console script runs the code under test; no progress-bar delay override."""
    import os

    env = dict(os.environ)
    env.pop("STEPTRACE_PROGRESS_DELAY_S", None)
    parts = [str(REPO / "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra)
    return env


def installed_env(**extra: str) -> dict[str, str]:
    """The environment for a training subprocess: the source tree's python/ off PYTHONPATH,
    so it imports the installed steptrace (the compiled core lives there, not in the tree)."""
    import os

    env = dict(os.environ)
    src = str(REPO / "python")
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and os.path.abspath(p) != src)
    env.update(extra)
    return env


def run_cli(*args: Any, timeout: float = 180, **env: str) -> Any:
    """Run the real ``steptrace`` console script; returns the CompletedProcess."""
    import subprocess

    return subprocess.run([steptrace_script(), *map(str, args)], capture_output=True, text=True,
                          env=cli_env(**env), timeout=timeout, stdin=subprocess.DEVNULL)


def run_cli_tty(*args: Any, stdout_tty: bool = True, stderr_tty: bool = False, timeout: float = 120,
                **env: str) -> tuple[int, str, str]:
    """Run the CLI with stdout and/or stderr on a pseudo-terminal; returns (rc, out, err)
    with what a terminal would have received."""
    import os
    import pty
    import subprocess

    full_env = cli_env(COLUMNS="120", LINES="40", TERM="xterm-256color", **env)
    for var in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # as a plain terminal
        if var not in env:
            full_env.pop(var, None)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [steptrace_script(), *map(str, args)],
            stdout=slave if stdout_tty else subprocess.PIPE,
            stderr=slave if stderr_tty else subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=full_env,
        )
    finally:
        os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out, err = proc.communicate(timeout=timeout)
    tty_text = b"".join(chunks).decode("utf-8", "replace")
    pipe_out = out.decode() if out else ""
    pipe_err = err.decode() if err else ""
    return (proc.returncode, tty_text if stdout_tty else pipe_out, tty_text if stderr_tty else pipe_err)


# --------------------------------------------------------------------------- real runs

_REAL_RUNS: dict[str, Path] = {}

_TRAIN_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import steptrace
from support.training import batches, model, train
torch.set_num_threads(1)  # steady steps beside other load (see conftest.py)

class SlowForward(torch.nn.Module):
    # the model of a 'new version' that spends `delay_s` more in every forward
    def __init__(self, net, delay_s):
        super().__init__()
        self.net, self.delay_s = net, delay_s
    def forward(self, x):
        time.sleep(self.delay_s)
        return self.net(x)

root = sys.argv[2]
for name, spec in json.loads(sys.argv[3]).items():
    net = model()
    if spec.get("slow_forward_s"):
        net = SlowForward(net, spec["slow_forward_s"])
    with steptrace.Profiler(f"{root}/{name}") as prof:
        train(prof, batches(spec["steps"]), net=net)
"""

#: The real runs every CLI test shares: a base run and a "new version" whose forward is
#: 3 ms slower (more than ten times its base median on a CPU).
REAL_RUN_SPECS = {
    "base": {"steps": 160},
    "slow": {"steps": 160, "slow_forward_s": 0.003},
}


def real_runs(tmp_path_factory: Any) -> dict[str, Path]:
    """Run folders written by real (tiny) CPU training loops under steptrace.Profiler,
    made once per test session in a subprocess that imports the installed steptrace (the
    compiled core lives there, not in the source tree)."""
    import subprocess
    import sys

    if _REAL_RUNS:
        return dict(_REAL_RUNS)
    root = tmp_path_factory.mktemp("real_runs")
    env = installed_env()
    proc = subprocess.run([sys.executable, "-c", _TRAIN_SCRIPT, str(TESTS), str(root), json.dumps(REAL_RUN_SPECS)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=str(root))
    if proc.returncode != 0:
        raise RuntimeError(f"training the real runs failed:\n{proc.stdout}\n{proc.stderr}")
    for name in REAL_RUN_SPECS:
        _REAL_RUNS[name] = root / name
    return dict(_REAL_RUNS)


# --------------------------------------------------------------------------- checks


def check_chrome_trace(trace: Any) -> list[dict[str, Any]]:
    """Assert that ``trace`` (parsed JSON) is a valid trace-event file as Perfetto and
    chrome://tracing load it: the JSON Object Format, every event with its required
    fields, X events with non-negative durations, properly nested per (pid, tid), and a
    process_name for every pid. Returns the events."""
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list)
    assert trace.get("displayTimeUnit") in (None, "ms", "ns")
    events = trace["traceEvents"]
    named_pids = set()
    lanes: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for ev in events:
        assert isinstance(ev, dict), ev
        ph = ev.get("ph")
        assert ph in ("X", "B", "E", "i", "I", "C", "M"), ev
        assert isinstance(ev.get("name"), str) and ev["name"], ev
        assert isinstance(ev.get("pid"), int), ev
        if ph == "M":
            assert ev["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), ev
            assert isinstance(ev.get("args"), dict), ev
            if ev["name"] == "process_name":
                assert isinstance(ev["args"].get("name"), str)
                named_pids.add(ev["pid"])
            if ev["name"].startswith("thread_"):
                assert isinstance(ev.get("tid"), int), ev
            continue
        assert isinstance(ev.get("ts"), (int, float)) and not isinstance(ev["ts"], bool), ev
        if ph == "X":
            assert isinstance(ev.get("tid"), int), ev
            assert isinstance(ev.get("dur"), (int, float)) and ev["dur"] >= 0, ev
            lanes.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"], ev["name"]))
        elif ph in ("i", "I"):
            assert ev.get("s", "t") in ("g", "p", "t"), ev
        elif ph == "C":
            assert isinstance(ev.get("args"), dict) and ev["args"], ev
            assert all(isinstance(v, (int, float)) for v in ev["args"].values()), ev
        if "args" in ev:
            assert isinstance(ev["args"], dict), ev
    for pid in {ev["pid"] for ev in events}:
        assert pid in named_pids, f"pid {pid} has no process_name"
    eps = 1e-3  # the export writes microseconds with 3 decimals
    for lane, slices in lanes.items():
        # slices on one thread must nest: each starts after the previous one ended, or
        # lies inside one of the still-open ones
        slices.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        for start, end, name in slices:
            while stack and start >= stack[-1][1] - eps:
                stack.pop()
            if stack:
                assert end <= stack[-1][1] + eps, f"{lane}: {name} [{start}, {end}] overlaps {stack[-1]}"
            stack.append((start, end, name))
    return events
