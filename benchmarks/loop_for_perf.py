"""The training loop of bench_overhead.py (MLP 64->256->10, batch 64, SGD, torch with one
thread: the 0.5 ms step) under a Profiler with default options, or bare, run long enough
for an outside sampler to see where the time goes (issue 30):

    perf record -F 5000 -e cpu-clock -o /tmp/st.perf -- python benchmarks/loop_for_perf.py --steps 5000
    perf report -i /tmp/st.perf --sort pid --stdio                 # the threads
    perf report -i /tmp/st.perf --tid <TID> --sort dso,sym --stdio  # one thread's symbols

Prints the time per step and how many steps had a C heap reading (`heap_bytes`)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import Loop  # noqa: E402 - the same loop as the benchmark's


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--bare", action="store_true", help="no Profiler")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loop = Loop(steps=args.steps, batch=64, d_in=64, hidden=256, d_out=10)
    with tempfile.TemporaryDirectory() as tmp:
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
