"""Soak: many empty steps through the real Profiler, watching memory and time per step.

    python benchmarks/soak.py                    # 180 s budget, extrapolated to 10 million steps
    python benchmarks/soak.py --budget-s 30      # a quick look

Runs as many steps as fit in ``--budget-s`` seconds, each with 5 phases whose names are
drawn (seeded) from a pool of distinct names, through ``steptrace.Profiler`` (Python API,
host clock, detectors on), writing the real JSONL log to a temporary folder. A run holds
at most 32 distinct phase names (the core's fixed intern table, docs/configuration.md), so
the pool is 32 names per run; ``--names 1000`` (the default) spreads 1,000 distinct names
over consecutive runs of 32 in the same process (a fresh Profiler per run), so both the
per-run tables and whatever survives a run's close are exercised. It also checks that
the 33rd distinct name of a run is refused (ConfigError): the table cannot grow.

Printed while it runs: steps done, steps/s, RSS. At the end: RSS at start, middle and
end, RSS growth per step between the middle and the end (after warm-up), log bytes per
step, and the median time per step of the first and last decile of the run; the run
fails (exit 1) when memory grows by more than ``--max-growth-bytes-per-step`` after the
middle or the last decile is more than ``--max-slowdown`` times slower than the first.
"""

from __future__ import annotations

import argparse
import gc
from array import array
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import steptrace

PER_RUN = 32  # kMaxPhases (include/steptrace/config.hpp): distinct phase names per run
PHASES_PER_STEP = 5
CHUNK = 2000  # steps between clock reads (the loop itself stays bare)


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=180.0, help="seconds of stepping (default 180)")
    ap.add_argument("--names", type=int, default=1000, help="distinct phase names in all (default 1000)")
    ap.add_argument("--steps-per-run", type=int, default=0,
                    help="steps per Profiler run (default: budget split evenly over the runs)")
    ap.add_argument("--target", type=int, default=10_000_000, help="steps to extrapolate to")
    ap.add_argument("--max-growth-bytes-per-step", type=float, default=1.0)
    ap.add_argument("--max-slowdown", type=float, default=1.25)
    ap.add_argument("--keep", action="store_true", help="keep the log folder")
    args = ap.parse_args(argv)

    names = [f"phase_{i:04d}" for i in range(args.names)]
    pools = [names[i:i + PER_RUN] for i in range(0, len(names), PER_RUN)]
    pools = [p for p in pools if len(p) >= PHASES_PER_STEP] or [names[:PHASES_PER_STEP]]
    rng = random.Random(0)
    root = Path(tempfile.mkdtemp(prefix="steptrace-soak-"))
    print(f"soak: {args.budget_s:g} s, {PHASES_PER_STEP} phases/step from {len(names)} names "
          f"({len(pools)} run(s) of <= {PER_RUN}), log in {root}", flush=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"steptrace {steptrace.__version__}", flush=True)

    # the 33rd distinct name of a run is refused: the intern table is fixed-size
    with steptrace.Profiler(root / "cap", detect=False, phases=[]) as prof:
        refused = None
        with prof.step():
            for i in range(PER_RUN + 1):
                try:
                    with prof.phase(f"cap_{i}"):
                        pass
                except steptrace.ConfigError as exc:
                    refused = (i + 1, str(exc))
                    break
    print(f"distinct name #{refused[0]} refused: {refused[1]}" if refused else "no cap on distinct names!",
          flush=True)

    # The bookkeeping is allocated up front (arrays of a chunk count no run reaches), so
    # that it does not show up as growth: a list of tuples per chunk did (~0.1 byte/step).
    cap = int(args.budget_s * 2_000_000 / CHUNK) + 4096
    done_at, rss_at, chunk_s = array("q", [0]) * cap, array("q", [0]) * cap, array("d", [0.0]) * cap
    n = 0  # chunks so far
    gc.collect()
    rss0 = rss_bytes()
    per_run_s = args.budget_s / len(pools)
    steps = 0
    log_bytes = 0
    t_start = time.perf_counter()
    next_print = t_start + 5
    for run_i, pool in enumerate(pools):
        # each step: 5 names of this run's pool, in a seeded order (precomputed: the loop
        # measures the profiler, not random.sample)
        plans = [tuple(rng.sample(pool, PHASES_PER_STEP)) for _ in range(257)]
        folder = root / f"run{run_i}"
        run_end = time.perf_counter() + per_run_s
        with steptrace.Profiler(folder, phases=[], run_id=f"soak-{run_i}") as prof:
            step, phase = prof.step, prof.phase
            k = 0
            while True:
                t0 = time.perf_counter()
                for _ in range(CHUNK):
                    a, b, c, d, e = plans[k % 257]
                    k += 1
                    with step():
                        with phase(a):
                            pass
                        with phase(b):
                            pass
                        with phase(c):
                            pass
                        with phase(d):
                            pass
                        with phase(e):
                            pass
                now = time.perf_counter()
                steps += CHUNK
                if n < cap:
                    chunk_s[n], done_at[n], rss_at[n] = now - t0, steps, rss_bytes()
                    n += 1
                if now >= next_print:
                    next_print = now + 5
                    print(f"  {steps:>10,} steps  {steps / (now - t_start):>9,.0f} steps/s  "
                          f"RSS {rss_at[n - 1] / 2**20:7.1f} MiB  run {run_i + 1}/{len(pools)}", flush=True)
                if now >= run_end or n >= cap or (args.steps_per_run and k >= args.steps_per_run):
                    break
        log_bytes += sum(f.stat().st_size for f in folder.glob("*.jsonl"))
        shutil.rmtree(folder)  # keep the disk flat; the bytes are counted
    wall = time.perf_counter() - t_start
    gc.collect()
    rss_end = rss_bytes()

    mid, last = n // 2, n - 1
    growth = (rss_at[last] - rss_at[mid]) / max(1, done_at[last] - done_at[mid])
    dec = max(1, n // 10)
    first_us = statistics.median(chunk_s[:dec]) / CHUNK * 1e6
    last_us = statistics.median(chunk_s[n - dec:n]) / CHUNK * 1e6
    per_step_log = log_bytes / max(1, steps)
    rate = steps / wall
    print()
    print(f"steps: {steps:,} in {wall:.1f} s ({rate:,.0f} steps/s, {1e6 / rate:.2f} us/step with 5 phases)")
    print(f"RSS: start {rss0 / 2**20:.1f} MiB, middle {rss_at[mid] / 2**20:.1f} MiB (step {done_at[mid]:,}), "
          f"end {rss_at[last] / 2**20:.1f} MiB (step {done_at[last]:,}), after close {rss_end / 2**20:.1f} MiB")
    print(f"RSS growth middle -> end: {growth:+.4f} bytes/step")
    print(f"log: {log_bytes / 2**20:.1f} MiB, {per_step_log:.1f} bytes/step")
    print(f"time per step: first decile {first_us:.2f} us, last decile {last_us:.2f} us "
          f"(x{last_us / first_us:.3f})")
    t = args.target
    print(f"extrapolated to {t:,} steps: {t / rate / 60:.1f} min, log {t * per_step_log / 2**30:.2f} GiB, "
          f"RSS growth {max(0.0, growth) * t / 2**20:.1f} MiB")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    ok = growth <= args.max_growth_bytes_per_step and last_us <= args.max_slowdown * first_us
    print("flat memory, no slowdown" if ok else "NOT FLAT: see the figures above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
