"""The training loop of bench_overhead.py (MLP 64->256->10, batch 64, SGD, torch with one
thread: the 0.5 ms step) under a Profiler with default options, or bare, run long enough
for an outside sampler to see where the time goes (issue 30):

    perf record -F 5000 -e cpu-clock -o /tmp/st.perf -- python benchmarks/loop_for_perf.py --steps 5000
    perf report -i /tmp/st.perf --sort pid --stdio                 # the threads
    perf report -i /tmp/st.perf --tid <TID> --sort dso,sym --stdio  # one thread's symbols

Prints the time per step and how many steps had a C heap reading (`heap_bytes`).

    python benchmarks/loop_for_perf.py --breakdown --steps 20000

runs that under `perf record` itself and splits the training thread's samples from
`--skip-s` seconds after the loop began (the profiler's first steps left out) into steptrace's own code by
entry point (the step's end, the phase boundaries, the loader, the step's begin) and the
clock reads (the vDSO), as shares of the thread's time and as microseconds per step of
an unsampled run (sampling at 20 kHz slows the loop, so these are estimates). The entry
points need an unstripped build: pip's `--config-settings=cmake.build-type=RelWithDebInfo
--config-settings=install.strip=false`; a stripped one counts everything as `_core`."""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import Loop  # noqa: E402 - the same loop as the benchmark's


# steptrace's entry points, by the symbols their samples fall in (first match wins)
ENTRY_POINTS = (
    ("step end", ("end_step", "copy_step_record", "begin_step_record", "step_scope_exit", "take_host",
                  "HeapSampler", "run_queue", "RecordPipeline")),
    ("phase end", ("end_phase", "phase_scope_exit")),
    ("phase begin", ("begin_phase", "phase_lookup", "phase_scope_enter")),
    ("loader (prof.data)", ("data", "add_work", "tensor_attr")),
    ("step begin", ("begin_step", "return_self")),
)


MARK_ENV = "STEPTRACE_PERF_MARK"  # a file the loop writes its start to (CLOCK_MONOTONIC, s)


def breakdown(steps: int, skip_s: float) -> int:
    """This loop under `perf record`, its training thread's samples split (see the docstring)."""
    if shutil.which("perf") is None:
        print("perf is not installed (Debian: linux-perf)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        data, mark = os.path.join(tmp, "perf.data"), os.path.join(tmp, "mark")
        me = [sys.executable, os.path.abspath(__file__), "--steps", str(steps)]
        # the bare step's time moves from run to run (on a VM by up to a third): the median of three
        bare = [float(subprocess.run(me + ["--bare"], capture_output=True, text=True, check=True).stdout.split()[0])
                for _ in range(3)]
        step_us = statistics.median(bare)
        print(f"bare loop, unsampled: {step_us:.1f} us/step (median of {', '.join(f'{b:.0f}' for b in bare)})")
        # sample times on CLOCK_MONOTONIC, the clock the loop's start is written on
        subprocess.run(["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-F", "20000", "-e", "cpu-clock",
                        "-o", data, "--"] + me, check=True, stdout=subprocess.DEVNULL, env={**os.environ, MARK_ENV: mark})
        with open(mark) as f:
            start = float(f.read()) + skip_s
        script = subprocess.run(["perf", "script", "-i", data, "-F", "tid,time,ip,sym,dso"],
                                capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [r.split(None, 3) for r in script if r.strip()]  # tid, time, ip, "symbol (dso)"
    main_tid = collections.Counter(r[0] for r in rows).most_common(1)[0][0]  # the training thread
    rows = [r for r in rows if r[0] == main_tid and len(r) == 4]
    counts: collections.Counter = collections.Counter()
    total = 0
    for _, t, _, rest in rows:
        if float(t.rstrip(":")) < start:
            continue
        total += 1
        if "[vdso]" in rest:
            counts["clock reads (vDSO)"] += 1
        elif "clock_gettime" in rest and "libc" in rest:  # libc's path to the vDSO (nothing else in the loop reads a clock)
            counts["clock reads (libc's wrapper)"] += 1
        elif "_core." in rest:
            counts[next((name for name, keys in ENTRY_POINTS if any(k in rest for k in keys)), "other steptrace code")] += 1
    if total == 0:
        print(f"no samples {skip_s} s after the loop began: run more steps", file=sys.stderr)
        return 1
    print(f"training thread: {total} samples from {skip_s:.0f} s after the loop began")
    print(f"{'':28s} {'share':>8s} {'us/step':>8s}")
    for name, n in counts.most_common():
        print(f"{name:28s} {100 * n / total:7.3f}% {n / total * step_us:8.2f}")
    n = sum(counts.values())
    print(f"{'steptrace in all':28s} {100 * n / total:7.3f}% {n / total * step_us:8.2f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--bare", action="store_true", help="no Profiler")
    parser.add_argument("--breakdown", action="store_true", help="run under perf record and split the "
                        "training thread's samples by steptrace's entry points")
    parser.add_argument("--skip-s", type=float, default=2.0, help="with --breakdown: the seconds of "
                        "the loop's samples left out at its start (the profiler's first steps)")
    args = parser.parse_args()
    if args.breakdown:
        return breakdown(args.steps, args.skip_s)
    torch.set_num_threads(1)
    loop = Loop(steps=args.steps, batch=64, d_in=64, hidden=256, d_out=10)
    with tempfile.TemporaryDirectory() as tmp:
        if os.environ.get(MARK_ENV):
            with open(os.environ[MARK_ENV], "w") as f:
                f.write(repr(time.clock_gettime(time.CLOCK_MONOTONIC)))
        t0 = time.perf_counter()
        r = loop.plain() if args.bare else loop.profiled(Path(tmp))
        elapsed = time.perf_counter() - t0
        print(f"{r['loop'] / args.steps / 1e3:.1f} us/step in the loop ({elapsed:.1f} s with open and close)")
        if not args.bare:
            lines = (Path(tmp) / "rank0.jsonl").read_text().splitlines()
            steps = [json.loads(s) for s in lines if '"kind":"step"' in s]
            heap = [i for i, s in enumerate(steps) if "heap_bytes" in s.get("memory", {})]
            late = sum(i >= 100 for i in heap)
            print(f"steps with a heap reading: {len(heap)} of {len(steps)} ({late} of the "
                  f"{max(0, len(steps) - 100)} after step 100)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
