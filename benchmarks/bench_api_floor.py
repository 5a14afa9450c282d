"""What the shape of the phase API costs on a real 0.5 ms step, apart from steptrace
(issue 30): paired rounds of adjacent steps of the benchmark's MLP (bench_overhead.py),
one per arm in a random order, steptrace's last; thread CPU against the round's bare step,
rounds with a preempted step left out (bench_overhead.unpreempted).

Arms: the loop's shape without any call (``for name, call in named``); six ``with``
blocks on C scopes that only read the clock (steptrace._testing.clock_scopes, the
"floor" of bench_overhead.py); the same twelve calls without ``with`` (bound methods
called straight); twelve calls of a C builtin that does nothing; one ``with`` around the
step only; a second bare step (A/A); steptrace with its five phases (default options).
Needs the test build (steptrace._testing: scripts/setup.sh).

    python benchmarks/bench_api_floor.py --rounds 20000   # about 1 minute per 2,000 rounds
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_overhead as B  # noqa: E402
from bench_host_clock import profiled_arm  # noqa: E402

from steptrace.live.profiler import Profiler  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.rounds < 100:
        parser.error(f"--rounds {args.rounds}: at least 100")
    try:
        from steptrace._testing import clock_scopes
    except ImportError:
        print("steptrace._testing is missing: build the test build (scripts/setup.sh)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    work = B._mlp_step(64, 256, 10, 64)
    calls = [work] + [B._nothing] * 4
    named = list(zip(B.PHASES, calls))
    clock_step, clock_phase = clock_scopes()
    scopes = [(clock_phase(n), c) for n, c in named]
    step_scope = clock_step()
    bound = [(s.__enter__, c, s.__exit__) for s, c in scopes]
    step_enter, step_exit = step_scope.__enter__, step_scope.__exit__
    nop = sys.getrecursionlimit
    nops = [(nop, c, nop) for _, c in scopes]
    thread_ns = time.thread_time_ns
    prof = Profiler(Path(tempfile.mkdtemp(prefix="api-floor-")) / "run", overwrite=True)

    def bare() -> int:
        c0 = thread_ns()
        for call in calls:
            call()
        return thread_ns() - c0

    def shape() -> int:
        c0 = thread_ns()
        for _name, call in named:
            call()
        return thread_ns() - c0

    floor = profiled_arm(SimpleNamespace(step=clock_step, phase=clock_phase), named)  # steptrace's shape

    def calls_without_with() -> int:
        c0 = thread_ns()
        step_enter()
        for enter, call, exit_ in bound:
            enter()
            call()
            exit_(None, None, None)
        step_exit(None, None, None)
        return thread_ns() - c0

    def nop_calls() -> int:
        c0 = thread_ns()
        nop()
        for before, call, after in nops:
            before()
            call()
            after()
        nop()
        return thread_ns() - c0

    def step_only() -> int:
        c0 = thread_ns()
        with step_scope:
            for call in calls:
                call()
        return thread_ns() - c0

    arms = [("bare", bare), ("the loop's shape, no call", shape), ("six `with` on clock-only C scopes (floor)", floor),
            ("the same 12 calls without `with`", calls_without_with), ("12 calls of a C builtin doing nothing", nop_calls),
            ("one `with` around the step", step_only), ("bare again (A/A)", bare),
            ("steptrace, 5 phases, default options", profiled_arm(prof, named))]
    last = len(arms) - 1
    for _ in range(300):
        for _, run in arms:
            run()
    times: list[list[int]] = [[] for _ in arms]
    others = list(range(last))
    rng = random.Random(args.seed)
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.rounds):
            rng.shuffle(others)
            for i in others + [last]:
                times[i].append(arms[i][1]())
    finally:
        gc.enable()
    prof.close()
    print(f"bare step {statistics.median(times[0]) / 1e3:.1f} us thread CPU (median), {args.rounds} rounds")
    print(f"{'overhead against bare, us (thread CPU)':44s} {'mean':>7s} {'95% CI':>16s} {'median':>7s} dropped")
    for i in range(1, len(arms)):
        kept = B.unpreempted(times[0], times[i])
        m, lo, hi = (x / 1e3 for x in B.mean_ci(kept))
        print(f"{arms[i][0]:44s} {m:+7.2f} {lo:+7.2f}..{hi:+6.2f} {statistics.median(kept) / 1e3:+7.2f} "
              f"{len(times[0]) - len(kept):7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
