"""What the NVML sampler costs, against the stand-in NVML library (no GPU needed).

    python benchmarks/bench_nvml.py            # full run (about 2 minutes on 2 cores)
    python benchmarks/bench_nvml.py --quick    # a fast, noisier run (about 25 s)

A small CPU training loop (MLP 64->256->10, batch 64, SGD, ``torch.set_num_threads(1)``,
the phases forward / loss / backward / optimizer) runs under steptrace three ways, in
interleaved trials with the order rotating every trial, the same weights each time:

* ``nvml="off"`` (the baseline), and ``nvml="off"`` again (an A/A comparison: how much of
  a difference is noise);
* NVML on, sampling every 100 ms (the default) and every 10 ms, against the fake
  ``libnvidia-ml.so.1`` of the C++ tests (``tests/cpp/fake_nvml/fake_nvml.cpp``, compiled
  here with the system C++ compiler unless ``--fake-lib`` names one), scenario ``steady``,
  loaded through ``STEPTRACE_NVML_LIBRARY``.

It prints, medians over the trials:

* the training thread's time per step, wall and CPU (``time.thread_time``), and the
  ratio of each to ``nvml="off"``;
* the sampler thread's CPU time per second of training, from ``/proc/self/task/<tid>/
  schedstat`` (time on CPU). The sampler thread has no name of its own (it is a
  ``std::thread`` that keeps the process's name), so it is found as the thread that
  exists only when NVML is on: of the threads started with the profiler, the one whose
  voluntary context switches per second (``/proc/self/task/<tid>/status``) come nearest
  1000 / interval. "all steptrace threads" is the CPU time of every thread started with
  the profiler (writer, watchdog, sampler), whose rise over ``nvml="off"`` is the whole
  cost of the telemetry off the training thread (the writer also folds the readings into
  the step records).

These are figures for the fake library, whose calls return at once: a real driver's
``nvmlDeviceGet*`` calls take microseconds to tens of microseconds each (the real-device
check under tests/gpu measures them); the training thread's figure does not depend on it.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

import steptrace
from steptrace.live.profiler import Profiler

REPO = Path(__file__).resolve().parent.parent
FAKE_NVML = REPO / "tests" / "cpp" / "fake_nvml" / "fake_nvml.cpp"
pc = time.perf_counter_ns


# --------------------------------------------------------------------------------------
# per-thread CPU time from /proc


def thread_stats() -> Dict[int, Tuple[int, int]]:
    """tid -> (ns on CPU, voluntary context switches) for every thread of this process."""
    out: Dict[int, Tuple[int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                on_cpu = int(fh.read().split()[0])
            vol = 0
            with open(f"/proc/self/task/{tid}/status") as fh:
                for line in fh:
                    if line.startswith("voluntary_ctxt_switches:"):
                        vol = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        out[int(tid)] = (on_cpu, vol)
    return out


# --------------------------------------------------------------------------------------
# the loop


class Loop:
    def __init__(self, steps: int, hidden: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.batches = [(torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g))
                        for _ in range(steps)]
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.init = copy.deepcopy(self.model.state_dict())
        self.loss_fn = nn.CrossEntropyLoss()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def run(self, log_dir: Path, interval_ms: Optional[int], lib: Path, extra: Optional[dict] = None,
            on_start: Optional[Callable[[Profiler], Callable[[], None]]] = None) -> Dict[str, float]:
        """One run under steptrace: NVML off (interval_ms None) or on at that interval;
        ``extra`` options for the profiler; ``on_start(prof)`` runs before the first step
        and returns what to call after the last one (bench_metrics.py starts a scraper)."""
        with torch.no_grad():
            self.model.load_state_dict(self.init)
        self.opt.state.clear()
        self.opt.zero_grad(set_to_none=True)
        model, loss_fn, opt = self.model, self.loss_fn, self.opt
        os.environ["STEPTRACE_NVML_LIBRARY"] = str(lib)
        os.environ["STEPTRACE_FAKE_NVML_SCENARIO"] = "steady"
        opts = {"nvml": "off"} if interval_ms is None else {"nvml_interval_ms": interval_ms}
        before = set(thread_stats())
        with Profiler(log_dir, overwrite=True, **opts, **(extra or {})) as prof:
            after = on_start(prof) if on_start else None
            s0 = thread_stats()
            c0, t0 = time.thread_time_ns(), pc()
            for x, y in prof.data(self.batches):
                with prof.step():
                    with prof.phase("forward"):
                        out = model(x)
                    with prof.phase("loss"):
                        loss = loss_fn(out, y)
                    with prof.phase("backward"):
                        loss.backward()
                    with prof.phase("optimizer"):
                        opt.step()
                        opt.zero_grad()
            t1, c1 = pc(), time.thread_time_ns()
            s1 = thread_stats()
            if after:
                after()
        wall_s = (t1 - t0) / 1e9
        mine = {tid: (cpu - s0.get(tid, (0, 0))[0], vol - s0.get(tid, (0, 0))[1])
                for tid, (cpu, vol) in s1.items() if tid not in before}
        steps = len(self.batches)
        res = {"step_us": (t1 - t0) / steps / 1e3, "cpu_us": (c1 - c0) / steps / 1e3, "wall_s": wall_s,
               "threads": len(mine), "all_ms_per_s": sum(c for c, _ in mine.values()) / 1e6 / wall_s,
               "sampler_ms_per_s": float("nan"), "sampler_wakeups_per_s": float("nan")}
        if interval_ms is not None and mine:
            want = 1000.0 / interval_ms
            tid = min(mine, key=lambda t: abs(mine[t][1] / wall_s - want))
            res["sampler_ms_per_s"] = mine[tid][0] / 1e6 / wall_s
            res["sampler_wakeups_per_s"] = mine[tid][1] / wall_s
        # the records: hw in (nearly) every step when NVML is on
        recs = list(steptrace.read(log_dir / "rank0.jsonl"))
        step_recs = [r for r in recs if r.get("kind") == "step"]
        res["hw_steps"] = sum(1 for r in step_recs if "hw" in r) / max(1, len(step_recs))
        end = recs[-1] if recs and recs[-1].get("kind") == "run_end" else {}
        res["samples"] = float((end.get("hw") or {}).get("samples", 0))
        return res


def fake_library(explicit: Optional[str], where: Path) -> Path:
    if explicit:
        return Path(explicit)
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        sys.exit("no C++ compiler to build the fake NVML library: pass --fake-lib")
    lib = where / "libnvidia-ml.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-fvisibility=hidden", "-o", str(lib), str(FAKE_NVML)],
                   check=True)
    return lib


def med(rows: List[Dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] == r[key]]
    return statistics.median(vals) if vals else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description="NVML sampler cost against the fake NVML library")
    parser.add_argument("--quick", action="store_true", help="fewer steps and trials")
    parser.add_argument("--steps", type=int, help="steps per run (default 5000; --quick 1500)")
    parser.add_argument("--trials", type=int, help="trials, each running every arm once (default 7; --quick 3)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the MLP (64->H->10)")
    parser.add_argument("--intervals", default="100,10", help="NVML sampling intervals to measure, ms")
    parser.add_argument("--fake-lib", help="a built fake libnvidia-ml.so.1 (default: compile it here)")
    args = parser.parse_args()
    steps = args.steps or (1500 if args.quick else 5000)
    trials = args.trials or (3 if args.quick else 7)
    intervals = [int(v) for v in args.intervals.split(",") if v.strip()]
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="bench_nvml-") as tmp:
        tmp_path = Path(tmp)
        lib = fake_library(args.fake_lib, tmp_path)
        loop = Loop(steps, args.hidden)
        arms: List[Tuple[str, Optional[int]]] = [('nvml="off"', None), ('nvml="off" (A/A)', None)] + [(f"nvml {i} ms", i) for i in intervals]
        results: Dict[str, List[Dict[str, float]]] = {label: [] for label, _ in arms}
        for label, interval in arms:  # warm-up: torch's and the profiler's first-use costs
            loop.run(tmp_path / "warm", interval, lib)
        for t in range(trials):
            order = arms[t % len(arms):] + arms[: t % len(arms)]
            for label, interval in order:
                results[label].append(loop.run(tmp_path / f"run-{t}-{interval}", interval, lib))

    load = os.getloadavg()
    print(f"steptrace {steptrace.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"fake NVML (steady scenario), {steps} steps per run, {trials} interleaved trials, medians; "
          f"MLP 64->{args.hidden}->10, batch 64, 1 torch thread")
    base = results[arms[0][0]]
    b_wall, b_cpu, b_all = med(base, "step_us"), med(base, "cpu_us"), med(base, "all_ms_per_s")
    head = ("arm", "step us", "ratio", "train CPU us", "ratio", "sampler CPU ms/s", "wakeups/s",
            "steptrace thr CPU ms/s", "minus off", "hw steps", "samples")
    rows = [head]
    for label, _ in arms:
        r = results[label]
        wall, cpu, allc = med(r, "step_us"), med(r, "cpu_us"), med(r, "all_ms_per_s")
        # ratio: median over trials of the per-trial ratio to that trial's nvml="off" run
        ratio_w = statistics.median(a["step_us"] / b["step_us"] for a, b in zip(r, base))
        ratio_c = statistics.median(a["cpu_us"] / b["cpu_us"] for a, b in zip(r, base))
        samp, wake = med(r, "sampler_ms_per_s"), med(r, "sampler_wakeups_per_s")
        rows.append((label, f"{wall:.1f}", f"{ratio_w:.3f}", f"{cpu:.1f}", f"{ratio_c:.3f}",
                     "-" if samp != samp else f"{samp:.3f}", "-" if wake != wake else f"{wake:.0f}",
                     f"{allc:.3f}", "-" if label == arms[0][0] else f"{allc - b_all:+.3f}",
                     f"{100 * med(r, 'hw_steps'):.0f}%", f"{med(r, 'samples'):.0f}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print(f"(nvml=\"off\": {b_wall:.1f} us per step wall, {b_cpu:.1f} us CPU; ratio = with / without, the median "
          "of the per-trial ratios; sampler CPU ms/s = the sampler thread's CPU time per second of training)")
    print("These are fake-library figures, not GPU figures.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
