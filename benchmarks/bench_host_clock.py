"""The host clock's two ways side by side in one process (issue 30): a profiler whose
boundaries read the CPU's time-stamp counter (the default where the kernel keeps time
with it) and one that reads CLOCK_MONOTONIC through the vDSO (STEPTRACE_HOST_CLOCK=monotonic),
each around the same real training step (MLP 64->256->10, batch 64, SGD, torch with one
thread: the 0.5 ms step), against the bare step, in rounds of one step per arm in a random
order. Prints each arm's thread-CPU cost per step against the round's bare step, and the
counter's against the vDSO's, with 95% intervals (rounds where a step was preempted,
over 3x the bare median, left out for every arm alike).

    python benchmarks/bench_host_clock.py [--rounds 80000] [--phases split|one]

`split`: the step's work in four phases (forward, loss, backward, optimizer), so most
boundaries come after torch's work, with cold caches; `one`: all of it in the first of
five phases, the others empty, as bench_overhead.py's paired arms do. One build, so the
only difference between the two profilers is the clock.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Tuple

import torch

import steptrace

PREEMPTED = 3.0  # as bench_overhead.unpreempted


def training_step(split: bool) -> List[Tuple[str, Callable[[], None]]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    loss_fn = torch.nn.CrossEntropyLoss()
    held = {}

    def forward() -> None:
        held["out"] = model(x)

    def loss() -> None:
        held["loss"] = loss_fn(held["out"], y)

    def backward() -> None:
        opt.zero_grad()
        held["loss"].backward()

    def optimizer() -> None:
        opt.step()

    if split:
        return [("forward", forward), ("loss", loss), ("backward", backward), ("optimizer", optimizer)]

    def whole() -> None:
        forward()
        loss()
        backward()
        optimizer()

    def nothing() -> None:
        pass

    return [("forward", whole)] + [(name, nothing) for name in ("loss", "backward", "clip", "optimizer")]


def profiled_arm(prof: steptrace.Profiler, named) -> Callable[[], int]:
    step, phase, thread_ns = prof.step, prof.phase, time.thread_time_ns

    def arm() -> int:
        c0 = thread_ns()
        with step():
            for name, call in named:
                with phase(name):
                    call()
        return thread_ns() - c0

    return arm


def mean_ci(d: List[float]) -> str:
    m = statistics.fmean(d)
    h = 1.96 * statistics.stdev(d) / len(d) ** 0.5
    return f"{m / 1e3:+6.2f} us ({(m - h) / 1e3:+.2f}..{(m + h) / 1e3:+.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=80000, help="rounds of one step per arm (default 80000)")
    ap.add_argument("--phases", choices=("split", "one"), default="split",
                    help="the work in four phases (split) or in the first of five (one)")
    args = ap.parse_args()
    if args.rounds < 100:
        ap.error(f"--rounds {args.rounds}: at least 100 rounds")
    named = training_step(args.phases == "split")
    thread_ns = time.thread_time_ns

    def bare() -> int:
        c0 = thread_ns()
        for _, call in named:
            call()
        return thread_ns() - c0

    folder = Path(tempfile.mkdtemp(prefix="bench_host_clock_"))
    saved = os.environ.pop("STEPTRACE_HOST_CLOCK", None)
    try:
        counter = steptrace.Profiler(folder / "counter")
        os.environ["STEPTRACE_HOST_CLOCK"] = "monotonic"
        kernel = steptrace.Profiler(folder / "monotonic")
    finally:
        os.environ.pop("STEPTRACE_HOST_CLOCK", None)
        if saved is not None:
            os.environ["STEPTRACE_HOST_CLOCK"] = saved
    arms = [("bare", bare), ("counter", profiled_arm(counter, named)), ("CLOCK_MONOTONIC", profiled_arm(kernel, named))]
    cpu: List[List[int]] = [[] for _ in arms]
    order = list(range(len(arms)))
    rng = random.Random(1)
    print(f"{args.rounds} rounds, work {'in four phases' if args.phases == 'split' else 'in one of five phases'} ...",
          file=sys.stderr)
    gc.collect()  # before the first step: a collection between steps would be a stall
    gc.disable()
    try:
        for _ in range(300):  # past the detectors' warmup and the counter's calibration
            for _, run in arms:
                run()
        for r in range(args.rounds):
            rng.shuffle(order)
            for i in order:
                cpu[i].append(arms[i][1]())
            if (r + 1) % 20000 == 0:
                print(f"  {r + 1} rounds", file=sys.stderr)
    finally:
        gc.enable()
    counter.close()
    kernel.close()
    methods = [json.loads((folder / name / "rank0.jsonl").open().readline())["backends"]["timer"]["method"]
               for name in ("counter", "monotonic")]
    cap = PREEMPTED * statistics.median(cpu[0])
    kept = [i for i in range(args.rounds) if all(series[i] < cap for series in cpu)]
    print(f"bare step {statistics.median(cpu[0]) / 1e3:.1f} us thread CPU (median); "
          f"{args.rounds - len(kept)} preempted rounds left out")
    print(f"  counter arm's clock: {methods[0]}")
    print(f"  other arm's clock:   {methods[1]}")
    for name, arm, base in (("counter - bare", 1, 0), ("CLOCK_MONOTONIC - bare", 2, 0),
                            ("counter - CLOCK_MONOTONIC", 1, 2)):
        print(f"{name:28s} {mean_ci([cpu[arm][i] - cpu[base][i] for i in kept])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
