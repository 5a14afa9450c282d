"""Alert quality of steptrace's detectors: false alerts on clean loops, and detection of
injected faults, on real CPU training loops (torch, one thread).

    ~/.cache/steptrace/venv/bin/python benchmarks/alert_quality.py            # full run (about 8 minutes on 2 cores)
    ~/.cache/steptrace/venv/bin/python benchmarks/alert_quality.py --quick    # a smoke run (about 100 s)
    ~/.cache/steptrace/venv/bin/python benchmarks/alert_quality.py --only real --real-loops gpt,hf
    ~/.cache/steptrace/venv/bin/python benchmarks/alert_quality.py --only faults --faults-under-hog --json out.json

It is a benchmark, not a test: it never asserts and exits 0; whatever the detectors say
is reported as it is.

**Clean loops.** Every ``alert`` record of a clean loop is a false alert; the table gives
their count and rate per 10,000 steps by type (stall, step_regression, hang,
host_contention, slow_checkpoint, and any other type), with the run's step and iteration
medians, the share of the measured time the training thread spent runnable but not
running (``runq``: the steps' ``host.runq_ms`` over ``runq_span_ms``), the evaluation and
checkpoint intervals recorded, the training steps' share of the wall clock from the
first step on (``run_end.goodput``) and the load average at the end of the run. Each
loop runs without and with a CPU hog beside it (one ``yes > /dev/null`` per core);
beside the hog, slow steps are expected to be ``host_contention`` (the excess was
run-queue wait), never stall or step_regression, and a line per loop counts which they
were. The text of every false alert other than host_contention is printed under the
table. Two families:

* *MLP loops* (``--only mlp``): an MLP (64 -> H -> H -> 10, batch 64, SGD with momentum)
  at three step sizes: sub-millisecond, about 5 ms and about 50 ms. H is calibrated at
  start by compute (matmuls, no sleeps) so that the median step of a plain loop lands
  near the target. Step counts: 10,000 / 3,000 / 600 (``--scale``; ``--quick`` is 0.1).
  The step medians drift by 10-20% between runs on a small VM; the table prints the
  median each run measured under steptrace.
* *Real-shaped loops* (``--only real``; ``--real-loops`` picks some of them), where time
  between steps is evaluation, checkpoints, logging and callbacks, not only data:
  ``gpt``: the nanoGPT-style loop of tests/python/support/gpt_loop.py (explicit phases,
  gradient accumulation, evaluation every 50 iterations under ``prof.interval("eval")``,
  ``torch.save`` checkpoints under ``prof.interval("checkpoint")``); ``gpt-run``: the same
  script unmodified under ``steptrace run`` (intervals found automatically); ``gpt-ddp``:
  the same script under DDP with two gloo ranks (``steptrace run --nproc-per-node 2``),
  where rank 0 alone evaluates (60 batches) and saves while rank 1 waits for it in the
  next all-reduce, as nanoGPT does (both ranks' steps and alerts counted); ``hf``: the
  Hugging Face Trainer on a tiny GPT-2 (evaluation every 50 steps, a save every 100,
  ``SteptraceCallback``); ``distill-run``: benchmarks/distill_epochs.py under ``steptrace
  run`` (a frozen teacher under ``no_grad`` before each student forward, a ``DataLoader``
  with two workers started again every 32-step epoch, ``torch.compile`` recompiling for
  each epoch's short last batch, an evaluation and a ``torch.save`` per epoch);
  ``lightning``: Lightning with a validation loop every 50
  steps and ``ModelCheckpoint(every_n_train_steps=100)`` (its ``SteptraceCallback``);
  ``gan-run``: tests/python/support/gan_loop.py under ``steptrace run``, two optimizers per batch
  (DCGAN's D and G updates, two steps a batch of different costs, alternating).
  Steps: 1,500 / 1,500 / 1,500 / 1,600 / 2,000 / 5,000 / 2,000 at ``--scale`` 1, never fewer than
  150 / 150 / 150 / 192 / 150 / 300 / 400 (so a quick run still evaluates and saves a few times). All run in
  this process except ``gpt-run``, ``gpt-ddp``, ``distill-run`` and ``gan-run`` (child processes, which
  include interpreter start-up).

``--only clean`` runs both families. The MLP loops take about 3 minutes of the full run,
the real-shaped loops about 4.5 (2 cores, load average about 3).

**Injected faults**, on the 5 ms loop (no hog; also under the hog with
``--faults-under-hog``), each in its own 400-step run, starting at step 200. Sleeps are
multiples of the median iteration (and backward) time the run itself measured over the
steps before the fault, so they stay in proportion under the hog:

* slow loader: the loader sleeps 2x the median iteration for 100 steps (a 3x iteration,
  about 1.5 s of slow steps) -> ``step_regression`` naming ``data``;
* slow backward: a full backward hook sleeps the median backward time for 150 steps (a 2x
  backward, about 1.2 s of slow steps) -> ``step_regression`` naming ``backward``. A
  regression's slow steps must last ``regression_min_ms`` (1 s) in all, so the slowdowns
  last longer than that;
* a 20x step: forward sleeps 19x the median iteration at one step -> ``stall`` naming
  ``forward``;
* a leak: from step 200 on, forward keeps a 0.5 MB float32 activation per step ->
  ``memory_growth`` naming ``forward`` (in the alert or in the ``alert_update`` after it).
  All runs share one process, as in a notebook: the heap still holds what the earlier
  runs freed, which RSS would not show growing (the detector watches the C heap's in-use
  bytes on the CPU);
* a hang: forward blocks 3 s at one step -> ``hang`` naming ``forward``, written while the
  step is blocked (the blocked wait polls the log to see when it appears).

Per fault: detected, delay in steps after the fault started, the phase named, and the
other alerts of that run (shown, not counted as false alerts of the clean table).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import io
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

import steptrace

logging.getLogger("steptrace").setLevel(logging.ERROR)  # the alerts are counted from the log

BATCH, D_IN, D_OUT = 64, 64, 10
N_BATCHES = 16  # distinct batches the loader cycles through
FAULT_START = 200
FAULT_RUN_STEPS = 400
LEAK_BYTES_PER_STEP = 512 * 1024  # one float32 BATCH x LEAK_COLS tensor kept per step
LEAK_COLS = LEAK_BYTES_PER_STEP // 4 // BATCH
HANG_POLL_S = 0.05
REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests" / "python"
GPT_SCRIPT = TESTS / "support" / "gpt_loop.py"
SLOW_STEP_TYPES = ("stall", "step_regression", "hang")
KINDS = SLOW_STEP_TYPES + ("host_contention", "slow_checkpoint")  # the table's columns; the rest: "other"

pc = time.perf_counter


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# the workload: an MLP sized by its hidden width
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoopSize:
    name: str
    target_ms: float
    steps: int  # clean steps at --scale 1


SIZES = (
    LoopSize("sub-ms", 0.4, 10_000),
    LoopSize("5 ms", 5.0, 3_000),
    LoopSize("50 ms", 50.0, 600),
)
FAULT_SIZE = SIZES[1]


@dataclass
class Workload:
    size: LoopSize
    hidden: int
    calibrated_ms: float  # median step of the plain loop (no steptrace, no hog)


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, D_OUT))


def make_batches() -> List[tuple]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, D_IN, generator=g), torch.randint(0, D_OUT, (BATCH,), generator=g))
            for _ in range(N_BATCHES)]


def plain_step_ms(hidden: int, steps: int) -> float:
    """Median step (forward, loss, backward, optimizer) of a plain loop, in ms."""
    net = make_model(hidden)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batches = make_batches()
    times = []
    for i in range(steps):
        x, y = batches[i % N_BATCHES]
        t0 = pc()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(pc() - t0)
    return statistics.median(times[steps // 5:]) * 1e3


def calibrate(size: LoopSize, rounds: int = 5) -> Workload:
    """The hidden width whose plain step is nearest the target: step time grows about as
    the square of the width, so each round rescales it by sqrt(target / measured)."""
    hidden, best = 256, None
    for _ in range(rounds):
        guess_ms = best[1] if best else 1.0
        ms = plain_step_ms(hidden, steps=int(min(300, max(20, 600 / guess_ms))))
        if best is None or abs(math.log(ms / size.target_ms)) < abs(math.log(best[1] / size.target_ms)):
            best = (hidden, ms)
        if abs(ms / size.target_ms - 1) < 0.1:
            break
        factor = min(4.0, max(0.25, math.sqrt(size.target_ms / ms)))
        new = max(8, int(round(hidden * factor / 8)) * 8)
        if new == hidden:  # at the floor (Python overhead) or the rounding step
            break
        hidden = new
    return Workload(size, best[0], best[1])


# --------------------------------------------------------------------------------------
# faults
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """Medians the run measured over its steps before the fault started."""

    iteration_s: float
    backward_s: float


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    site: str  # where it is injected: "loader", "backward" (hook), "forward" (a wait), "keep"
    length: Optional[int]  # steps affected from FAULT_START; None: to the end of the run
    seconds: Callable[[Baseline], float]  # delay per affected step (unused by "keep")
    expect_type: str
    expect_phase: str


FAULTS = (
    Fault("slow loader", "loader sleeps 2x median iteration, steps 200-299", "loader", 100,
          lambda b: 2 * b.iteration_s, "step_regression", "data"),
    Fault("slow backward", "backward hook sleeps median backward, steps 200-349", "backward", 150,
          lambda b: b.backward_s, "step_regression", "backward"),
    Fault("20x step", "forward sleeps 19x median iteration at step 200", "forward", 1,
          lambda b: 19 * b.iteration_s, "stall", "forward"),
    Fault("leak 0.5 MB/step", "forward keeps 0.5 MB per step from step 200 on", "keep", None,
          lambda b: 0.0, "memory_growth", "forward"),
    Fault("hang 3 s", "forward blocks 3 s at step 200", "forward", 1,
          lambda b: 3.0, "hang", "forward"),
)


class Injector:
    """Measures the run's medians before FAULT_START, then applies the fault at its site.
    Without a fault every method is a no-op (apart from the bookkeeping)."""

    def __init__(self, fault: Optional[Fault], log_path: str) -> None:
        self.fault = fault
        self.log_path = log_path
        self.iterations: List[float] = []
        self.backwards: List[float] = []
        self.baseline: Optional[Baseline] = None
        self.kept: List[torch.Tensor] = []
        self.proj = torch.randn(D_IN, LEAK_COLS)
        self.hang_seen_after_s: Optional[float] = None  # when a hang alert reached the log, while blocked
        self.step = -1

    def _active(self, site: str, i: int) -> bool:
        f = self.fault
        if f is None or f.site != site or i < FAULT_START:
            return False
        return f.length is None or i < FAULT_START + f.length

    def _delay(self, site: str, i: int) -> float:
        if not self._active(site, i):
            return 0.0
        return self.fault.seconds(self.baseline)

    def observe(self, iteration_s: Optional[float], backward_s: float) -> None:
        """Called after each step; the baseline is frozen after the last step before the fault."""
        if self.step >= FAULT_START:
            return
        if iteration_s is not None:
            self.iterations.append(iteration_s)
        self.backwards.append(backward_s)
        if self.step == FAULT_START - 1:
            warm = slice(10, None)  # past the first steps (allocator, caches)
            self.baseline = Baseline(statistics.median(self.iterations[warm]),
                                     statistics.median(self.backwards[warm]))

    # the sites
    def loader(self, batches: List[tuple], steps: int) -> Iterator[tuple]:
        for i in range(steps):
            self.step = i
            d = self._delay("loader", i)
            if d > 0:
                time.sleep(d)
            yield batches[i % len(batches)]

    def backward_hook(self, module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        d = self._delay("backward", self.step)
        if d > 0:
            time.sleep(d)

    def forward(self, x: torch.Tensor) -> None:
        d = self._delay("forward", self.step)
        if d > 0:
            self._blocked_wait(d)
        if self._active("keep", self.step):
            self.kept.append((x @ self.proj).relu())  # a forward activation kept across steps

    def _blocked_wait(self, seconds: float) -> None:
        """Blocks for `seconds` (an Event wait, like a collective that does not return),
        polling the log for a hang alert written meanwhile."""
        t0 = pc()
        blocker = threading.Event()
        while (left := seconds - (pc() - t0)) > 0:
            blocker.wait(min(HANG_POLL_S, left))
            if self.hang_seen_after_s is None and _log_has_hang(self.log_path):
                self.hang_seen_after_s = pc() - t0


def _log_has_hang(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return False
    for line in text.splitlines():
        if b"hang" in line:
            try:
                r = json.loads(line)
            except ValueError:  # the line being written
                continue
            if r.get("kind") == "alert" and r.get("type") == "hang":
                return True
    return False


# --------------------------------------------------------------------------------------
# one run
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def cpu_hog(enabled: bool) -> Iterator[int]:
    """One `yes > /dev/null` per core while the block runs; killed and reaped after."""
    procs: List[subprocess.Popen] = []
    try:
        if enabled:
            for _ in range(os.cpu_count() or 1):
                procs.append(subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield len(procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@dataclass
class Alert:
    type: str
    step: int
    phase: Optional[str]  # from the alert, else from a later record of the same type
    value: object = None
    baseline: object = None
    message: str = ""


@dataclass
class RunResult:
    steps: int
    median_step_ms: float
    median_iteration_ms: float
    wall_s: float
    alerts: List[Alert]
    baseline: Optional[Baseline] = None
    hang_seen_after_s: Optional[float] = None
    error: Optional[str] = None
    runq_pct: Optional[float] = None  # run-queue wait over the time it was measured over, %
    intervals: Dict[str, int] = field(default_factory=dict)  # interval records by kind
    training_pct: Optional[float] = None  # steps' share of the wall clock after start-up (run_end.goodput)


def alerts_of(records: List[dict]) -> List[Alert]:
    out = []
    for n, r in enumerate(records):
        if r.get("kind") != "alert":
            continue
        phase = r.get("phase")
        if phase is None:  # named by a later record of the same type (e.g. an alert_update)
            phase = next((later["phase"] for later in records[n + 1:]
                          if later.get("type") == r.get("type") and later.get("phase") is not None), None)
        out.append(Alert(r.get("type"), r.get("step"), phase, r.get("value"), r.get("baseline"),
                         r.get("message", "")))
    return out


def run_loop(work: Workload, steps: int, hog: bool, fault: Optional[Fault] = None) -> RunResult:
    """Trains `steps` steps of the workload under steptrace (default options), with the
    fault injected if one is given and the CPU hog beside it if asked; reads the log back."""
    net = make_model(work.hidden)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    batches = make_batches()
    with tempfile.TemporaryDirectory(prefix="steptrace-alerts-") as log_dir:
        prof = steptrace.Profiler(log_dir, overwrite=True)
        inj = Injector(fault, prof.log_path)
        if fault is not None and fault.site == "backward":
            net[2].register_full_backward_hook(inj.backward_hook)
        t_start = pc()
        with cpu_hog(hog), prof:
            last = None
            for x, y in prof.data(inj.loader(batches, steps)):
                now = pc()
                with prof.step():
                    with prof.phase("forward"):
                        out = net(x)
                        inj.forward(x)
                    with prof.phase("loss"):
                        loss = loss_fn(out, y)
                    with prof.phase("backward"):
                        t0 = pc()
                        loss.backward()
                        backward_s = pc() - t0
                    with prof.phase("optimizer"):
                        opt.step()
                        opt.zero_grad()
                inj.observe(now - last if last is not None else None, backward_s)
                last = now
        wall = pc() - t_start
        records = list(steptrace.read(log_dir))
    r = summarize(records, wall)
    r.baseline = inj.baseline
    r.hang_seen_after_s = inj.hang_seen_after_s
    return r


def summarize(records: List[dict], wall_s: float) -> RunResult:
    """A run's figures from its log: step and iteration medians (iteration: data + other +
    step, what the slow-step rules judge), alerts, run-queue share, intervals, goodput."""
    steps = [r for r in records if r.get("kind") == "step"]
    nan = float("nan")
    hosts = [r["host"] for r in steps if isinstance(r.get("host"), dict)]
    span = sum(h.get("runq_span_ms", 0.0) for h in hosts)
    goodput = next((r.get("goodput") for r in reversed(records) if r.get("kind") == "run_end"), None) or {}
    return RunResult(
        steps=len(steps),
        median_step_ms=statistics.median(r["step_ms"] for r in steps) if steps else nan,
        median_iteration_ms=statistics.median(r["step_ms"] + r.get("data_ms", 0.0) + r.get("other_ms", 0.0)
                                              for r in steps) if steps else nan,
        wall_s=wall_s,
        alerts=alerts_of(records),
        runq_pct=sum(h.get("runq_ms", 0.0) for h in hosts) / span * 100 if span > 0 else None,
        intervals=dict(Counter(r.get("interval") for r in records if r.get("kind") == "interval")),
        training_pct=training_share(goodput),
    )


def training_share(goodput: dict) -> Optional[float]:
    """The share of the wall clock from the first step to the run's end spent in training
    steps, in % (run_end's training_pct also counts the start-up, which for a run inside
    this long-lived process is the benchmark's own earlier runs)."""
    try:
        span = goodput["wall_s"] - goodput["startup_s"]
        return goodput["steps_s"] / span * 100 if span > 0 else None
    except (KeyError, TypeError):
        return None


def guarded(label: str, what: str, run: Callable[[], RunResult]) -> RunResult:
    """Runs one run with progress lines; an error is reported in the result, not raised."""
    progress(f"start {label}: {what}")
    try:
        r = run()
    except Exception as e:  # a broken run must not lose the others' results
        traceback.print_exc()
        r = RunResult(0, float("nan"), float("nan"), 0.0, [], error=f"{type(e).__name__}: {e}")
    progress(f"end   {label}: {r.steps} steps in {r.wall_s:.1f} s, median step {r.median_step_ms:.3f} ms, "
             f"{len(r.alerts)} alerts" + (f" ({fmt_types(dict(Counter(a.type for a in r.alerts)))})" if r.alerts else "")
             + (f", ERROR {r.error}" if r.error else ""))
    return r


def guarded_run(label: str, work: Workload, steps: int, hog: bool, fault: Optional[Fault] = None) -> RunResult:
    return guarded(label, f"hidden {work.hidden}, {steps} steps{', CPU hog' if hog else ''}",
                   lambda: run_loop(work, steps, hog, fault))


# --------------------------------------------------------------------------------------
# real-shaped loops: time between steps is evaluation, checkpoints and callbacks
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RealLoop:
    name: str
    description: str
    steps: int  # at --scale 1
    min_steps: int  # at any scale: enough for a few evaluations and checkpoints
    train: Callable[[int, Path], Path]  # (steps, scratch folder) -> the run's log folder


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The loops' own printing (losses, framework banners, warnings) kept off the report."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _test_module(name: str):
    """A module of tests/python (the real-shaped loops the tests run too)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module(name)


def train_gpt(steps: int, tmp: Path) -> Path:
    gpt_loop = _test_module("support.gpt_loop")
    with quiet(), steptrace.Profiler(tmp / "run") as prof:
        gpt_loop.train(prof, iters=steps, out_dir=str(tmp), intervals=True)
    return tmp / "run"


def _steptrace_run(cmd: List[str], tmp: Path) -> Path:
    """Runs a `steptrace run` command line (one thread per process); its log folder."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"steptrace run exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return tmp / "logs"


def train_gpt_run(steps: int, tmp: Path) -> Path:
    """The script unmodified, in a child process under `steptrace run`."""
    cmd = [sys.executable, "-m", "steptrace.cli", "run", "--log-dir", str(tmp / "logs"), str(GPT_SCRIPT),
           "--iters", str(steps), "--out", str(tmp)]
    return _steptrace_run(cmd, tmp)


def train_gpt_ddp(steps: int, tmp: Path) -> Path:
    """The same script under DDP, unmodified, `steptrace run --nproc-per-node 2` (gloo on the
    CPU): rank 0 alone evaluates (60 batches) and saves while rank 1 waits for it in the next
    step's all-reduce, as nanoGPT does. Both ranks' logs are read."""
    cmd = [sys.executable, "-m", "steptrace.cli", "run", "--nproc-per-node", "2", "--torchrun=--standalone",
           "--log-dir", str(tmp / "logs"), str(GPT_SCRIPT), "--iters", str(steps), "--eval-iters", "60",
           "--out", str(tmp)]
    return _steptrace_run(cmd, tmp)


def train_distill_run(steps: int, tmp: Path) -> Path:
    """benchmarks/distill_epochs.py unmodified under `steptrace run`: a frozen teacher under
    no_grad before each student forward, a DataLoader with two workers restarted every
    epoch (32 steps), torch.compile recompiling for each epoch's short last batch, an
    evaluation and a torch.save after every epoch."""
    cmd = [sys.executable, "-m", "steptrace.cli", "run", "--log-dir", str(tmp / "logs"),
           str(REPO / "benchmarks" / "distill_epochs.py"), "--epochs", str(max(1, steps // 32)), "--out", str(tmp)]
    return _steptrace_run(cmd, tmp)


def train_hf(steps: int, tmp: Path) -> Path:
    """The Hugging Face Trainer on a tiny GPT-2: evaluation every 50 steps, a save every 100
    (the last two kept), the train loader's fetches as data (tests/python/support/framework_loops.py)."""
    with quiet():
        return _test_module("support.framework_loops").hf_trainer_run(tmp, max_steps=steps, eval_steps=50, save_steps=100,
                                                              save_total_limit=2)


def train_lightning(steps: int, tmp: Path) -> Path:
    """Lightning: a small classifier, validation every 50 steps (and the sanity check),
    ModelCheckpoint every 100 training steps (tests/python/support/framework_loops.py)."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with quiet():
        return _test_module("support.framework_loops").lightning_run(tmp, max_steps=steps, val_every=50,
                                                             checkpoint_every=100)[0]


def train_gan_run(steps: int, tmp: Path) -> Path:
    """tests/python/support/gan_loop.py unmodified under `steptrace run`: two optimizers per batch
    (a discriminator and a generator update, each ending a step: steps // 2 batches)."""
    cmd = [sys.executable, "-m", "steptrace.cli", "run", "--log-dir", str(tmp / "logs"),
           str(GPT_SCRIPT.parent / "gan_loop.py"), "--batches", str(max(1, steps // 2))]
    return _steptrace_run(cmd, tmp)


def train_busy_mlp(steps: int, tmp: Path) -> Path:
    """tests/python/test_busy_host_regression.py's ~1 ms loop (explicit phases), clean: the
    loop whose lasting regression beside a CPU hog per core went unreported (issue 52)."""
    mod = _test_module("test_busy_host_regression")
    mod.STEPS = steps
    with quiet():
        mod.run_loop(tmp / "run", regress=False)
    return tmp / "run"


def train_lbfgs_run(steps: int, tmp: Path) -> Path:
    """tests/python/test_closure_optimizers.py's LBFGS loop under `steptrace run`: forward and
    backward inside optimizer.step(closure), up to 5 closure calls a step (issue 52)."""
    script = tmp / "lbfgs.py"
    script.write_text(_test_module("test_closure_optimizers").LBFGS_SCRIPT.replace("{call}", "opt.step(closure)"))
    cmd = [sys.executable, "-m", "steptrace.cli", "run", "--log-dir", str(tmp / "logs"), str(script), str(steps)]
    return _steptrace_run(cmd, tmp)


def train_gc_gan(steps: int, tmp: Path) -> Path:
    """tests/python/test_gc_pause.py's GAN-style loop: two optimizers a batch, 600k live
    containers, a generation-2 collection inside the generator's forward every 60 batches
    (its own length: `steps` is not used). Collections are gc_pause tickets, never pages."""
    del steps
    with quiet(), steptrace.Profiler(tmp / "run") as prof:
        _test_module("test_gc_pause")._gan_loop(prof)
    return tmp / "run"


REAL_LOOPS = (
    RealLoop("gpt", "GPT-style loop, explicit phases, prof.interval eval every 50 + torch.save",
             1500, 150, train_gpt),
    RealLoop("gpt-run", "the same script unmodified under `steptrace run`", 1500, 150, train_gpt_run),
    RealLoop("gpt-ddp", "the same script under DDP, 2 ranks, rank 0 alone evaluates (60 batches) and saves; "
             "steps of both ranks", 1500, 150, train_gpt_ddp),
    RealLoop("distill-run", "distillation under `steptrace run`: frozen teacher, DataLoader workers restarted "
             "every 32-step epoch, torch.compile recompiling, eval + torch.save per epoch", 1600, 192,
             train_distill_run),
    RealLoop("hf", "HF Trainer, tiny GPT-2, eval every 50, save every 100, SteptraceCallback", 2000, 150, train_hf),
    RealLoop("lightning", "Lightning, validation every 50, ModelCheckpoint every 100, SteptraceCallback",
             5000, 300, train_lightning),
    RealLoop("gan-run", "GAN-style loop under `steptrace run`: two optimizers per batch (D and G updates), "
             "alternating steps of different costs", 2000, 400, train_gan_run),
    RealLoop("busy-mlp", "the ~1 ms loop of the busy-host regression test, explicit phases, clean", 2000, 1200,
             train_busy_mlp),
    RealLoop("lbfgs-run", "LBFGS under `steptrace run`: forward and backward inside optimizer.step(closure)",
             200, 60, train_lbfgs_run),
    RealLoop("gc-gan", "GAN-style loop with 600k live objects and a generation-2 collection every 60 batches "
             "(gc_pause tickets)", 0, 0, train_gc_gan),
)


def run_real(loop: RealLoop, steps: int, hog: bool) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="steptrace-alerts-real-") as tmp:
        t0 = pc()
        with cpu_hog(hog):
            log_dir = loop.train(steps, Path(tmp))
        wall = pc() - t0
        return summarize(list(steptrace.read(log_dir)), wall)


# --------------------------------------------------------------------------------------
# the two sections
# --------------------------------------------------------------------------------------


@dataclass
class CleanResult:
    loop: str  # "MLP 5 ms", "gpt", "hf", ...
    hog: bool
    hidden: Optional[int]  # the MLP's width; None for the real-shaped loops
    steps: int
    median_step_ms: float
    median_iteration_ms: float
    alerts: int
    by_type: Dict[str, int]
    per_10k_steps: float
    wall_s: float
    alert_list: List[Alert] = field(default_factory=list)
    error: Optional[str] = None
    runq_pct: Optional[float] = None
    intervals: Dict[str, int] = field(default_factory=dict)
    training_pct: Optional[float] = None
    load_1min: Optional[float] = None  # the load average at the end of the run


@dataclass
class FaultResult:
    fault: str
    description: str
    hog: bool
    expect_type: str
    expect_phase: str
    detected: bool
    alert_step: Optional[int]
    delay_steps: Optional[int]
    phase: Optional[str]
    right_phase: bool
    other_alerts: int
    other_types: Dict[str, int]
    other_at: List[str]  # "type@step" of each other alert
    baseline_iteration_ms: Optional[float]
    baseline_backward_ms: Optional[float]
    hang_seen_while_blocked_s: Optional[float]
    median_step_ms: float
    alert_list: List[Alert] = field(default_factory=list)
    error: Optional[str] = None


def clean_result(loop: str, hog: bool, hidden: Optional[int], r: RunResult) -> CleanResult:
    n = len(r.alerts)
    return CleanResult(loop, hog, hidden, r.steps, r.median_step_ms, r.median_iteration_ms, n,
                       dict(Counter(a.type for a in r.alerts)), n / r.steps * 10_000 if r.steps else float("nan"),
                       r.wall_s, r.alerts, r.error, r.runq_pct, r.intervals, r.training_pct,
                       round(os.getloadavg()[0], 2))


def clean_section(works: Dict[str, Workload], scale: float) -> List[CleanResult]:
    results = []
    for size in SIZES:
        work = works[size.name]
        steps = max(50, int(round(size.steps * scale)))
        for hog in (False, True):
            r = guarded_run(f"clean {size.name}{' + hog' if hog else ''}", work, steps, hog)
            results.append(clean_result(f"MLP {size.name}", hog, work.hidden, r))
    return results


def real_section(loops: List[RealLoop], scale: float) -> List[CleanResult]:
    results = []
    for loop in loops:
        steps = max(loop.min_steps, int(round(loop.steps * scale)))
        for hog in (False, True):
            r = guarded(f"clean {loop.name}{' + hog' if hog else ''}",
                        f"{loop.description}, {steps} steps{', CPU hog' if hog else ''}",
                        lambda: run_real(loop, steps, hog))
            results.append(clean_result(loop.name, hog, None, r))
    return results


def judge(fault: Fault, hog: bool, r: RunResult) -> FaultResult:
    """The detection is the first alert of the expected type at or after the fault start;
    every other alert of the run is listed as 'other'."""
    hit = next((a for a in r.alerts if a.type == fault.expect_type and a.step >= FAULT_START), None)
    others = [a for a in r.alerts if a is not hit]
    b = r.baseline
    return FaultResult(
        fault.name, fault.description, hog, fault.expect_type, fault.expect_phase,
        detected=hit is not None,
        alert_step=hit.step if hit else None,
        delay_steps=hit.step - FAULT_START if hit else None,
        phase=hit.phase if hit else None,
        right_phase=hit is not None and hit.phase == fault.expect_phase,
        other_alerts=len(others),
        other_types=dict(Counter(a.type for a in others)),
        other_at=[f"{a.type}@{a.step}" for a in others],
        baseline_iteration_ms=b.iteration_s * 1e3 if b else None,
        baseline_backward_ms=b.backward_s * 1e3 if b else None,
        hang_seen_while_blocked_s=r.hang_seen_after_s,
        median_step_ms=r.median_step_ms,
        alert_list=r.alerts,
        error=r.error,
    )


def fault_section(work: Workload, under_hog: bool) -> List[FaultResult]:
    results = []
    for hog in (False, True) if under_hog else (False,):
        for fault in FAULTS:
            r = guarded_run(f"fault {fault.name}{' + hog' if hog else ''}", work, FAULT_RUN_STEPS, hog, fault)
            results.append(judge(fault, hog, r))
    return results


# --------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------


def machine() -> Dict[str, object]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for dist in ("transformers", "lightning"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "steptrace": steptrace.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "commit": commit,
        **versions,
    }


def fmt_types(d: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def fmt_others(f: "FaultResult") -> str:
    return ", ".join(f.other_at) if 0 < len(f.other_at) <= 4 else fmt_types(f.other_types)


def dash(v: Optional[object], spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def fmt_kind(n: int, steps: int) -> str:
    """A count and its rate per 10,000 steps: "0", or "3 (12.5)"."""
    return "0" if n == 0 else f"{n} ({n / steps * 10_000:.1f})" if steps else str(n)


def print_clean(rows: List[CleanResult]) -> None:
    print("\n== clean loops: false alerts by type, count (per 10,000 steps); every alert is a false alert ==")
    print(f"{'loop':12s} {'hog':>3s} {'steps':>6s} {'step p50':>8s} {'iter p50':>8s} {'runq':>5s} {'ev/ckpt':>7s} "
          f"{'train':>5s} {'load':>4s} {'alerts':>6s} {'per 10k':>7s} "
          + " ".join(f"{k:>12.12s}" for k in KINDS) + f" {'other':>10s}")
    for c in rows:
        other = {k: v for k, v in c.by_type.items() if k not in KINDS}
        print(f"{c.loop:12s} {'yes' if c.hog else 'no':>3s} {c.steps:6d} {c.median_step_ms:8.2f} "
              f"{c.median_iteration_ms:8.2f} {dash(c.runq_pct, '4.0f') + '%' if c.runq_pct is not None else '-':>5s} "
              f"{str(c.intervals.get('eval', 0)) + '/' + str(c.intervals.get('checkpoint', 0)):>7s} "
              f"{dash(c.training_pct, '4.0f') + '%' if c.training_pct is not None else '-':>5s} "
              f"{dash(c.load_1min, '4.1f'):>4s} {c.alerts:6d} {c.per_10k_steps:7.1f} "
              + " ".join(f"{fmt_kind(c.by_type.get(k, 0), c.steps):>12s}" for k in KINDS)
              + f" {fmt_kind(sum(other.values()), c.steps):>10s}"
              + (f"  {fmt_types(other)}" if other else "")
              + (f"  ERROR {c.error}" if c.error else ""))
    print("(step/iter p50 in ms; iter = data + other + step, what the slow-step rules judge; runq: the share of "
          "the measured time the training thread waited for a CPU; ev/ckpt: eval and checkpoint intervals "
          "recorded; train: the steps' share of the wall clock from the first step on (run_end goodput); "
          "load: 1-minute load average at the run's end)")
    total_steps = sum(c.steps for c in rows)
    total = sum(c.alerts for c in rows)
    if total_steps:
        for label, part in (("without the hog", [c for c in rows if not c.hog]),
                            ("beside the hog", [c for c in rows if c.hog])):
            n, st = sum(c.alerts for c in part), sum(c.steps for c in part)
            slow = sum(c.by_type.get(k, 0) for c in part for k in SLOW_STEP_TYPES)
            print(f"all clean runs {label}: {n} alerts in {st} steps = "
                  f"{n / st * 10_000 if st else float('nan'):.1f} per 10k steps "
                  f"(stall/step_regression/hang {slow})")
        print(f"all clean runs: {total} alerts in {total_steps} steps = {total / total_steps * 10_000:.1f} per 10k steps")
    hogged = [c for c in rows if c.hog]
    if hogged:
        print("beside the hog, slow-step alerts: host_contention vs stall/step_regression (hang):")
        for c in hogged:
            hc = c.by_type.get("host_contention", 0)
            sr = c.by_type.get("stall", 0) + c.by_type.get("step_regression", 0)
            print(f"  {c.loop:12s} host_contention {hc:3d}, stall/step_regression {sr:3d}, hang "
                  f"{c.by_type.get('hang', 0)}"
                  + (f"  ({hc / (hc + sr) * 100:.0f}% host_contention)" if hc + sr else ""))
    shown = [(c, a) for c in rows for a in c.alert_list if a.type != "host_contention"]
    if shown:
        print("false alerts other than host_contention (the log's text):")
        for c, a in shown:
            print(f"  [{c.loop}{' + hog' if c.hog else ''}] {a.type} at step {a.step}"
                  + (f" ({a.phase})" if a.phase else "") + f": {a.message}")


def print_faults(rows: List[FaultResult]) -> None:
    print(f"\n== injected faults (5 ms loop, {FAULT_RUN_STEPS} steps per run, fault from step {FAULT_START}; "
          "leak: kept from step 200 on) ==")
    print(f"{'fault':17s} {'hog':>3s} {'expect':>24s} {'detected':>8s} {'step':>5s} {'delay':>5s} "
          f"{'phase':>9s} {'right':>5s} {'base ms':>7s}  other alerts")
    for f in rows:
        print(f"{f.fault:17s} {'yes' if f.hog else 'no':>3s} {f.expect_type + '/' + f.expect_phase:>24s} "
              f"{'yes' if f.detected else 'NO':>8s} {dash(f.alert_step):>5s} {dash(f.delay_steps):>5s} "
              f"{dash(f.phase):>9s} {('yes' if f.right_phase else 'no') if f.detected else '-':>5s} "
              f"{dash(f.baseline_iteration_ms, '.2f'):>7s}  {f.other_alerts}: {fmt_others(f)}"
              + (f"  ERROR {f.error}" if f.error else ""))
    for f in rows:
        if f.expect_type == "hang":
            seen = f.hang_seen_while_blocked_s
            print(f"hang{' (hog)' if f.hog else ''}: alert in the log while the step was blocked: "
                  + (f"yes, {seen:.2f} s into the 3 s block" if seen is not None else "no"))
    print("(base ms: the median iteration before the fault, which the injected sleeps are multiples of; "
          "delay: alert step - 200)")
    for f in rows:
        print(f"  {f.fault}{' (hog)' if f.hog else ''}: {f.description}")


def to_json(obj: object) -> object:
    return json.loads(json.dumps(obj, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))


def main() -> int:
    parser = argparse.ArgumentParser(description="false alerts and fault detection of steptrace's detectors")
    parser.add_argument("--quick", action="store_true", help="a smoke run: clean step counts x 0.1")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the clean loops' step counts")
    parser.add_argument("--only", choices=("clean", "mlp", "real", "faults"),
                        help="run one section: clean (the MLP and the real-shaped loops), mlp (the MLP clean "
                             "loops), real (the real-shaped loops), faults")
    parser.add_argument("--real-loops", default=",".join(loop.name for loop in REAL_LOOPS),
                        help="the real-shaped loops to run, comma-separated (default: %(default)s)")
    parser.add_argument("--faults-under-hog", action="store_true", help="also run the faults beside the CPU hog")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    scale = 0.1 if args.quick else args.scale
    wanted = [name.strip() for name in args.real_loops.split(",") if name.strip()]
    unknown = sorted(set(wanted) - {loop.name for loop in REAL_LOOPS})
    if unknown:
        parser.error(f"unknown real loops {', '.join(unknown)}; choose from "
                     f"{', '.join(loop.name for loop in REAL_LOOPS)}")
    real_loops = [loop for loop in REAL_LOOPS if loop.name in wanted]
    run_mlp = args.only in (None, "clean", "mlp")
    run_real_loops = args.only in (None, "clean", "real") and real_loops
    run_faults = args.only in (None, "faults")
    torch.set_num_threads(1)
    t0 = pc()

    head = machine()
    print("== steptrace alert quality ==")
    print(f"{head['date']}  cpus {head['cpus']} ({head['cpu_model']})  python {head['python']}  "
          f"torch {head['torch']}  steptrace {head['steptrace']} (repo at {head['commit']})  "
          f"torch threads {head['torch_threads']}")
    if run_real_loops:
        print(f"transformers {head['transformers']}  lightning {head['lightning']}")
    print(f"load average {' '.join(str(v) for v in head['load_average'])}; clean step scale {scale:g}; "
          f"steptrace default options")

    sizes = SIZES if run_mlp else (FAULT_SIZE,) if run_faults else ()
    works: Dict[str, Workload] = {}
    for size in sizes:
        progress(f"calibrating {size.name} (target {size.target_ms} ms)")
        works[size.name] = w = calibrate(size)
        print(f"calibrated {size.name:7s}: MLP {D_IN}->{w.hidden}->{w.hidden}->{D_OUT}, batch {BATCH}: "
              f"plain median step {w.calibrated_ms:.3f} ms (target {size.target_ms} ms)")

    out: Dict[str, object] = {"machine": head, "scale": scale,
                              "workloads": {k: asdict(v) for k, v in works.items()}}
    clean: List[CleanResult] = []
    if run_mlp:
        clean += clean_section(works, scale)
    if run_real_loops:
        clean += real_section(real_loops, scale)
    if clean:
        out["clean"] = clean
        print_clean(clean)
    if run_faults:
        out["faults"] = faults = fault_section(works[FAULT_SIZE.name], args.faults_under_hog)
        print_faults(faults)
    out["wall_s"] = pc() - t0
    print(f"\ntotal wall time {out['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(out), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
