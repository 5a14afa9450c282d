"""The waste report of real jobs that restart (issue 51). Under torchrun: 2 ranks on gloo,
a checkpoint every 50 steps, rank 1 raises (or is killed with SIGKILL) at step 180 of
attempt 0, attempt 1 resumes from step 150; each process writes its own start and exit
times to a side file, the view of the restart the report's recovery is checked against.
And a Slurm-style requeue: a new process of the same job id resuming from its checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from support import logfactory as lf

torch = pytest.importorskip("torch")

STEPS = 300
SAVE_EVERY = 50
FAIL_AT = 180

# Runs under torchrun. time.time_ns() first: the process's own view of its start, before
# any import; its exit time last, after the profiler closed (atexit runs after a raise).
_TRAIN = r"""
import time
_t0 = time.time_ns()
import atexit, json, os, signal, sys
root, side, how = sys.argv[1], sys.argv[2], sys.argv[6]
steps, save_every, fail_at = map(int, sys.argv[3:6])
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

_closed = []

def _process_start_ns():  # /proc/self/stat's starttime (clock ticks after boot), as steptrace reads it
    with open("/proc/self/stat", "rb") as f:
        ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
    return time.time_ns() - int((time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")) * 1e9)

_process_start = _process_start_ns()

def _exit(*_):
    with open(os.path.join(side, f"a{attempt}r{rank}.json"), "w") as fh:
        json.dump({"start_ns": _t0, "process_start_ns": _process_start, "exit_ns": time.time_ns(),
                   "closed_ns": _closed[0] if _closed else None}, fh)

def _term(*_):  # torchrun stops the surviving ranks with SIGTERM: note the time, then go
    _exit()
    os._exit(143)

atexit.register(_exit)
signal.signal(signal.SIGTERM, _term)  # before the profiler: its watcher then only flushes
import datetime
import torch
import torch.distributed as dist
import steptrace
torch.set_num_threads(1)
torch.manual_seed(0)
# the agent's store, under a prefix per attempt: a restarted gloo group must not find the
# addresses the previous attempt's ranks published (connection refused)
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                      is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                        world_size=int(os.environ["WORLD_SIZE"]))
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 32), torch.randn(16, 8)
ckpt = os.path.join(side, "ckpt.pt")
try:
    with steptrace.Profiler(root) as prof:
        start = 0
        if os.path.exists(ckpt):
            with prof.interval("restore"):
                state = torch.load(ckpt)
                net.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
            start = state["progress"]
            prof.set_step(start)
        for i in range(start, steps):
            if attempt == 0 and rank == 1 and i == fail_at:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)  # no run_end, no atexit: a lost node
                raise RuntimeError(f"injected failure at step {i}")
            with prof.step():
                with prof.phase("forward"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
            if (i + 1) % save_every == 0 and rank == 0:
                with prof.interval("checkpoint"):
                    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "progress": i + 1}, ckpt + ".tmp")
                    os.replace(ckpt + ".tmp", ckpt)
            if (i + 1) % save_every == 0:
                dist.barrier()  # every rank knows the save is done before it goes on
finally:  # the profiler has closed: its last record is written
    _closed.append(time.time_ns())
dist.destroy_process_group()
"""


def _torchrun(tmp_path: Path, how: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    root, side = tmp_path / "job", tmp_path / "side"
    side.mkdir()
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = lf.installed_env(OMP_NUM_THREADS="1")
    for var in ("STEPTRACE_JOB", "SLURM_JOB_ID", "SLURM_RESTART_COUNT"):  # the job is torchrun's run id
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "--rdzv-id", f"goodput-{uuid.uuid4().hex}",
           "--monitor-interval", "1", str(script), str(root), str(side), str(STEPS), str(SAVE_EVERY),
           str(FAIL_AT), how]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=str(tmp_path))
    return proc, root, side


def _side(side: Path, attempt: int, rank: int) -> dict[str, Any]:
    return json.loads((side / f"a{attempt}r{rank}.json").read_text())


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_restarted_torchrun_job_accounts_its_restart(tmp_path: Path, how: str) -> None:
    """Rank 1 raises (``raise``) or is killed with SIGKILL (``kill``) at step 180."""
    from steptrace.analysis.goodput import CAUSES, job_goodput

    proc, root, side = _torchrun(tmp_path, how)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (root / "rank0.jsonl").exists() and (root / "attempt1" / "rank0.jsonl").exists(), sorted(
        str(p.relative_to(root)) for p in root.rglob("*"))
    job = job_goodput(root)
    a0, a1 = job["attempts"]
    assert [a0["attempt"], a1["attempt"]] == [0, 1] and a0["failed"] and not a1["failed"]
    assert a0["origin"]["rank"] == 1, a0["origin"]
    if how == "raise":
        assert "injected failure" in a0["origin"]["why"] and a0["end_reasons"]["1"] == "exception"
    else:  # rank 0 saw the connection close: the killed rank is the origin all the same
        assert "without run_end" in a0["origin"]["why"] and a0["end_reasons"]["1"] == "missing"

    # wasted progress: the steps from 150 on that rank 0 ran in attempt 0 (the save after
    # step 149 was its last), at their own measured time: steps 150..179, and the step 180
    # it was in when rank 1 raised, if it had begun it (failed: it waited in the all-reduce
    # for the dead peer until gloo saw the connection close)
    from steptrace.analysis.reader import read

    steps0 = [r for r in read(root / "rank0.jsonl") if r["kind"] == "step" and r["rank"] == 0]
    lost = [r for r in steps0 if r["step"] >= 150]
    done = [r for r in lost if r["status"] == "ok"]
    assert [r["step"] for r in done] == list(range(150, 180))
    assert [r["step"] for r in lost if r["status"] != "ok"] in ([], [180])
    assert a0["wasted_steps"] == len(lost)
    wasted_s = math.fsum(r["host_ms"] - r.get("interval_in_step_ms", 0.0) for r in lost) / 1e3
    assert job["seconds"]["wasted_progress"] == pytest.approx(wasted_s, rel=1e-6)
    # one restore, attempt 1 starting at progress 150
    assert job["seconds"]["restore"] > 0 and a1["first_progress"] == 150
    restores = [r for r in read(root / "attempt1" / "rank0.jsonl")
                if r["kind"] == "interval" and r["interval"] == "restore"]
    assert len(restores) == 1

    # recovery: the gap the processes saw, from the last of attempt 0's profilers closing
    # (rank 0's, when gloo saw rank 1 go; its exit may come much later on a busy host, but
    # that is recovery too) to attempt 1's rank 0 process starting (/proc, as steptrace)
    ended = [c for c in (_side(side, 0, r)["closed_ns"] for r in (0, 1) if (side / f"a0r{r}.json").exists())
             if c is not None]
    outside_s = (_side(side, 1, 0)["process_start_ns"] - max(ended)) / 1e9
    assert outside_s > 0
    assert job["seconds"]["recovery"] == pytest.approx(outside_s, rel=0.10)

    # the parts add up to the wall clock (x 2 ranks for the GPU-hours)
    assert math.fsum(job["seconds"][c] for c in CAUSES) == pytest.approx(job["wall_s"], rel=1e-6)
    assert math.fsum(job["gpu_hours"].values()) == pytest.approx(job["wall_s"] * 2 / 3600, rel=1e-6)
    assert all(job["seconds"][c] >= 0 for c in CAUSES)
    # the wall clock: attempt 0's process start (a little before its first line ran) to
    # attempt 1's rank 0 exit (a little after its last record)
    outside_wall = (_side(side, 1, 0)["exit_ns"] - _side(side, 0, 0)["start_ns"]) / 1e9
    assert job["wall_s"] == pytest.approx(outside_wall, rel=0.10)


# A Slurm-style requeue: a new process of the same job (SLURM_JOB_ID), its restart count
# one up, resuming from the job's last checkpoint. The side file holds the process's first
# line and the moment before it raised; the test notes when it started the second process.
_REQUEUE = r"""
import time
_t0 = time.time_ns()
import json, os, sys
root, side = sys.argv[1], sys.argv[2]
attempt = int(os.environ["SLURM_RESTART_COUNT"])
marks = {"start_ns": _t0}
import torch
import steptrace
torch.set_num_threads(1)
net = torch.nn.Linear(32, 8)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x, y = torch.randn(16, 32), torch.randn(16, 8)
ckpt = os.path.join(side, "ckpt.pt")
try:
    with steptrace.Profiler(root, gpu_hour_cost=3.0) as prof:
        start = 0
        if os.path.exists(ckpt):
            with prof.interval("restore"):
                state = torch.load(ckpt)
                net.load_state_dict(state["model"])
            start = state["progress"]
            prof.set_step(start)
        for i in range(start, 120):
            if attempt == 0 and i == 80:
                marks["raise_ns"] = time.time_ns()
                raise RuntimeError("the node went away at step 80")
            with prof.step():
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            if (i + 1) % 25 == 0:
                with prof.interval("checkpoint"):
                    torch.save({"model": net.state_dict(), "progress": i + 1}, ckpt)
finally:
    marks["exit_ns"] = time.time_ns()
    with open(os.path.join(side, f"a{attempt}.json"), "w") as fh:
        json.dump(marks, fh)
"""


def test_a_slurm_style_requeue_is_the_next_attempt_of_the_job(tmp_path: Path) -> None:
    import time

    from steptrace.analysis.goodput import CAUSES, job_goodput
    from steptrace.analysis.reader import read

    root, side = tmp_path / "job", tmp_path / "side"
    side.mkdir()
    script = tmp_path / "train.py"
    script.write_text(_REQUEUE)
    spawned = []
    for attempt in (0, 1):
        env = lf.installed_env(OMP_NUM_THREADS="1", SLURM_JOB_ID="4242", SLURM_RESTART_COUNT=str(attempt))
        for var in ("STEPTRACE_JOB", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
            env.pop(var, None)
        spawned.append(time.time_ns())
        proc = subprocess.run([sys.executable, str(script), str(root), str(side)], capture_output=True, text=True,
                              env=env, timeout=120)
        assert proc.returncode == (1 if attempt == 0 else 0), proc.stderr[-3000:]
    start = next(r for r in read(root / "attempt1" / "rank0.jsonl") if r["kind"] == "run_start")
    assert start["job"]["id"] == "4242" and start["job"]["source"] == "SLURM_JOB_ID"
    assert start["job"]["attempt"] == 1 and start["job"]["previous_attempt"] == 0

    job = job_goodput(root)
    a0, a1 = job["attempts"]
    assert a0["failed"] and a0["end_reasons"] == {"0": "exception"} and not a1["failed"]
    assert a0["origin"] == {"rank": 0, "why": "its run_end says it ended on an exception: RuntimeError: the node "
                                              "went away at step 80"}
    # the save after step 74 was the last: steps 75..79 were lost, at their measured time
    steps0 = [r for r in read(root / "rank0.jsonl") if r["kind"] == "step"]
    lost = [r for r in steps0 if r["step"] >= 75]
    assert [r["step"] for r in lost] == [75, 76, 77, 78, 79] and a0["wasted_steps"] == 5
    assert job["seconds"]["wasted_progress"] == pytest.approx(
        math.fsum(r["host_ms"] - r.get("interval_in_step_ms", 0.0) for r in lost) / 1e3, rel=1e-6)
    assert a1["first_progress"] == 75 and job["seconds"]["restore"] > 0
    # recovery, bounded from outside: attempt 0's last record came after it raised, and
    # attempt 1's process started after the test spawned it and before its first line
    # (the kernel's start time has 10 ms ticks)
    m0, m1 = (json.loads((side / f"a{k}.json").read_text()) for k in (0, 1))
    tick = 0.02
    assert (spawned[1] - m0["exit_ns"]) / 1e9 - tick <= job["seconds"]["recovery"]
    assert job["seconds"]["recovery"] <= (m1["start_ns"] - m0["raise_ns"]) / 1e9 + tick
    assert math.fsum(job["seconds"][c] for c in CAUSES) == pytest.approx(job["wall_s"], rel=1e-6)
    # the price of a GPU-hour, from the gpu_hour_cost option in run_start's config
    assert job["cost"]["per_gpu_hour"] == 3.0 and job["cost"]["from"] == "run_start config gpu_hour_cost"
    assert job["cost"]["lost"] == pytest.approx(3.0 * job["lost_gpu_hours"])
