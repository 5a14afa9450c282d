"""Alert quality of steptrace's detectors: false alerts on clean loops, and detection of
injected faults, on real CPU training loops (torch, one thread).

    ~/.cache/steptrace/venv/bin/python benchmarks/alert_quality.py            # full run (about 3.5 minutes on 2 cores)
    ~/.cache/steptrace/venv/bin/python benchmarks/alert_quality.py --quick    # a smoke run (about 40 s)
    ~/.cache/steptrace/venv/bin/python benchmarks/alert_quality.py --only faults --faults-under-hog --json out.json

It is a benchmark, not a test: it never asserts and exits 0; whatever the detectors say
is reported as it is.

**Clean loops.** An MLP (64 -> H -> H -> 10, batch 64, SGD with momentum) at three step
sizes: sub-millisecond, about 5 ms and about 50 ms. H is calibrated at start by compute
(matmuls, no sleeps) so that the median step of a plain loop lands near the target.
Each size runs with and without a CPU hog beside it (one ``yes > /dev/null`` per core).
Every ``alert`` record there is a false alert; the table gives them by type and per
10,000 steps. Step counts: 10,000 / 3,000 / 600 (``--scale``; ``--quick`` is 0.1), about
2.5 minutes of the full run. The step medians drift by 10-20% between runs on a small
VM; the table prints the median each run measured under steptrace.

**Injected faults**, on the 5 ms loop (no hog; also under the hog with
``--faults-under-hog``), each in its own 400-step run, starting at step 200. Sleeps are
multiples of the median iteration (and backward) time the run itself measured over the
steps before the fault, so they stay in proportion under the hog:

* slow loader: the loader sleeps 2x the median iteration for 15 steps (a 3x iteration)
  -> ``step_regression`` naming ``data``;
* slow backward: a full backward hook sleeps the median backward time for 12 steps (a 2x
  backward) -> ``step_regression`` naming ``backward``;
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
    Fault("slow loader", "loader sleeps 2x median iteration, steps 200-214", "loader", 15,
          lambda b: 2 * b.iteration_s, "step_regression", "data"),
    Fault("slow backward", "backward hook sleeps median backward, steps 200-211", "backward", 12,
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
    step_recs = [r for r in records if r.get("kind") == "step"]
    return RunResult(
        steps=len(step_recs),
        median_step_ms=statistics.median(r["step_ms"] for r in step_recs) if step_recs else float("nan"),
        median_iteration_ms=statistics.median(r["step_ms"] + r.get("data_ms", 0.0) for r in step_recs)
        if step_recs else float("nan"),
        wall_s=wall,
        alerts=alerts_of(records),
        baseline=inj.baseline,
        hang_seen_after_s=inj.hang_seen_after_s,
    )


def guarded_run(label: str, work: Workload, steps: int, hog: bool, fault: Optional[Fault] = None) -> RunResult:
    """run_loop with progress lines; an error is reported in the result, not raised."""
    progress(f"start {label}: hidden {work.hidden}, {steps} steps{', CPU hog' if hog else ''}")
    try:
        r = run_loop(work, steps, hog, fault)
    except Exception as e:  # a broken run must not lose the others' results
        traceback.print_exc()
        r = RunResult(0, float("nan"), float("nan"), 0.0, [], error=f"{type(e).__name__}: {e}")
    progress(f"end   {label}: {r.steps} steps in {r.wall_s:.1f} s, median step {r.median_step_ms:.3f} ms, "
             f"{len(r.alerts)} alerts" + (f", ERROR {r.error}" if r.error else ""))
    return r


# --------------------------------------------------------------------------------------
# the two sections
# --------------------------------------------------------------------------------------


@dataclass
class CleanResult:
    size: str
    hog: bool
    hidden: int
    steps: int
    median_step_ms: float
    median_iteration_ms: float
    alerts: int
    by_type: Dict[str, int]
    per_10k_steps: float
    wall_s: float
    alert_list: List[Alert] = field(default_factory=list)
    error: Optional[str] = None


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


def clean_section(works: Dict[str, Workload], scale: float) -> List[CleanResult]:
    results = []
    for size in SIZES:
        work = works[size.name]
        steps = max(50, int(round(size.steps * scale)))
        for hog in (False, True):
            r = guarded_run(f"clean {size.name}{' + hog' if hog else ''}", work, steps, hog)
            n = len(r.alerts)
            results.append(CleanResult(
                size.name, hog, work.hidden, r.steps, r.median_step_ms, r.median_iteration_ms, n,
                dict(Counter(a.type for a in r.alerts)), n / r.steps * 10_000 if r.steps else float("nan"),
                r.wall_s, r.alerts, r.error))
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
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "steptrace": steptrace.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }


def fmt_types(d: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def fmt_others(f: "FaultResult") -> str:
    return ", ".join(f.other_at) if 0 < len(f.other_at) <= 4 else fmt_types(f.other_types)


def dash(v: Optional[object], spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def print_clean(rows: List[CleanResult]) -> None:
    print("\n== clean loops (every alert is a false alert) ==")
    print(f"{'loop':8s} {'hog':>3s} {'hidden':>6s} {'steps':>6s} {'step p50 ms':>11s} {'iter p50 ms':>11s} "
          f"{'alerts':>6s} {'per 10k':>8s}  by type")
    for c in rows:
        print(f"{c.size:8s} {'yes' if c.hog else 'no':>3s} {c.hidden:6d} {c.steps:6d} {c.median_step_ms:11.3f} "
              f"{c.median_iteration_ms:11.3f} {c.alerts:6d} {c.per_10k_steps:8.1f}  {fmt_types(c.by_type)}"
              + (f"  ERROR {c.error}" if c.error else ""))
    total_steps = sum(c.steps for c in rows)
    total = sum(c.alerts for c in rows)
    if total_steps:
        print(f"all clean runs: {total} alerts in {total_steps} steps = {total / total_steps * 10_000:.1f} per 10k steps")


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
    parser.add_argument("--only", choices=("clean", "faults"), help="run one section")
    parser.add_argument("--faults-under-hog", action="store_true", help="also run the faults beside the CPU hog")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    scale = 0.1 if args.quick else args.scale
    torch.set_num_threads(1)
    t0 = pc()

    head = machine()
    print("== steptrace alert quality ==")
    print(f"{head['date']}  cpus {head['cpus']} ({head['cpu_model']})  python {head['python']}  "
          f"torch {head['torch']}  steptrace {head['steptrace']}  torch threads {head['torch_threads']}")
    print(f"load average {' '.join(str(v) for v in head['load_average'])}; clean step scale {scale:g}; "
          f"steptrace default options")

    sizes = SIZES if args.only != "faults" else (FAULT_SIZE,)
    works: Dict[str, Workload] = {}
    for size in sizes:
        progress(f"calibrating {size.name} (target {size.target_ms} ms)")
        works[size.name] = w = calibrate(size)
        print(f"calibrated {size.name:7s}: MLP {D_IN}->{w.hidden}->{w.hidden}->{D_OUT}, batch {BATCH}: "
              f"plain median step {w.calibrated_ms:.3f} ms (target {size.target_ms} ms)")

    out: Dict[str, object] = {"machine": head, "scale": scale,
                              "workloads": {k: asdict(v) for k, v in works.items()}}
    if args.only != "faults":
        out["clean"] = clean = clean_section(works, scale)
        print_clean(clean)
    if args.only != "clean":
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
