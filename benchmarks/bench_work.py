"""Cost of counting useful work (samples, tokens, FLOPs; docs/useful-work.md), side by side
with Lightning's ``Throughput`` (the class behind its ``ThroughputMonitor``) on the same loop.

    python benchmarks/bench_work.py            # about 3 minutes on 2 cores
    python benchmarks/bench_work.py --quick    # fewer blocks, noisier

Two measurements, one run:

* Per call, on the training thread (median of interleaved trials): what a step costs with
  ``count_work`` on once the FLOPs are known: the watched model's forward hooks (reading
  the input shapes, looking the FLOPs up, ``add_work``) and the loader's batch count;
  against Lightning's ``Throughput.update`` + ``compute`` with the figures handed to it.
  Also the one-time FLOP count of the first forward of a shape.
* A GPT-style CPU training loop (tests/python/support/gpt_loop.py's model, batch 8 x 32 tokens,
  ``torch.set_num_threads(1)``) in interleaved, shuffled blocks: bare; steptrace with
  ``count_work=False``; steptrace with ``count_work`` (watch + data); bare with Lightning's
  Throughput. The medians per variant, and the difference steptrace's counting makes with
  a 95% bootstrap interval over the blocks.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))

import steptrace  # noqa: E402
from support.gpt_loop import GPT, get_batch  # noqa: E402
from steptrace.live.work import ModelWork, batch_counter  # noqa: E402


def per_call_ns(fn, reps: int, trials: int = 7) -> float:
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter_ns() - t0) / reps)
    return statistics.median(samples)


def micro(reps: int) -> dict:
    model = GPT()
    x = torch.randint(0, 65, (8, 32))
    out = {}
    with tempfile.TemporaryDirectory() as tmp, steptrace.Profiler(tmp, overwrite=True) as prof:
        core = prof._core
        work = ModelWork(core, model)
        with prof.step():
            t0 = time.perf_counter_ns()
            work.pre(model, (x, x), {})
            model(x, x)
            work.post(model, (x, x), {}, None)
            out["first_forward_count_ms"] = (time.perf_counter_ns() - t0) / 1e6
            t0 = time.perf_counter_ns()
            model(x, x)
            out["forward_uncounted_ms"] = (time.perf_counter_ns() - t0) / 1e6

            def hooks() -> None:
                work.pre(model, (x, x), {})
                work.post(model, (x, x), {}, None)

            count = batch_counter(core)
            batch = (x, x)
            out["model_hooks_ns"] = per_call_ns(hooks, reps)
            out["batch_count_ns"] = per_call_ns(lambda: count(batch), reps)
    from lightning.fabric.utilities.throughput import Throughput

    tp = Throughput(available_flops=1e12, window_size=100)
    i = [0]

    def lightning() -> None:
        i[0] += 1
        tp.update(time=i[0] * 0.01, batches=i[0], samples=8 * i[0], lengths=256 * i[0], flops=5e7)
        tp.compute()

    out["lightning_update_compute_ns"] = per_call_ns(lightning, reps)
    return out


def loop_block(variant: str, steps: int, state: dict) -> float:
    """Seconds per step of one block of `variant`."""
    model, opt, data, gen = state["model"], state["opt"], state["data"], state["gen"]
    batches = [get_batch(data, 8, 32, gen) for _ in range(steps)]

    def train_step(x, y) -> None:
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if variant in ("bare", "lightning"):
        tp = state["throughput"] if variant == "lightning" else None
        origin = state["origin"]  # Throughput wants its clock to rise across blocks
        t0 = time.perf_counter()
        for x, y in batches:
            train_step(x, y)
            if tp is not None:
                n = state["seen"] = state.get("seen", 0) + 1
                tp.update(time=time.perf_counter() - origin, batches=n, samples=8 * n, lengths=256 * n,
                          flops=state["flops"])
                tp.compute()
        return (time.perf_counter() - t0) / steps
    count = variant == "count"
    with tempfile.TemporaryDirectory() as tmp, steptrace.Profiler(tmp, count_work=count, detect=False,
                                                                  peak_tflops=1.0) as prof:
        if count:
            prof.watch(model, phases=False)
        it = prof.data(batches)
        next_batch = next(it)
        model(*next_batch)  # the FLOP count of this shape happens here, outside the timing
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            with prof.step():
                train_step(*next_batch)
            next_batch = next(it, None)
            if next_batch is None:
                break
        return (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    blocks, steps, reps = (8, 20, 2000) if a.quick else (40, 30, 20000)
    print(f"torch {torch.__version__}, steptrace {steptrace.__version__}, python {sys.version.split()[0]}")
    m = micro(reps)
    print("\nper call, training thread (median of 7 trials):")
    print(f"  watched model's hooks, FLOPs known (pre + post) {m['model_hooks_ns'] / 1e3:8.2f} us")
    print(f"  batch count (prof.data item)                     {m['batch_count_ns'] / 1e3:8.2f} us")
    print(f"  Lightning Throughput.update + compute            {m['lightning_update_compute_ns'] / 1e3:8.2f} us")
    print(f"  first forward of a shape, counted                {m['first_forward_count_ms']:8.2f} ms "
          f"(uncounted {m['forward_uncounted_ms']:.2f} ms)")

    torch.manual_seed(0)
    from lightning.fabric.utilities.throughput import Throughput

    state = {"model": GPT(), "gen": torch.Generator().manual_seed(0),
             "data": torch.randint(65, (20_000,), generator=torch.Generator().manual_seed(1)),
             "throughput": Throughput(available_flops=1e12, window_size=100), "flops": 47_235_072,
             "origin": time.perf_counter()}
    state["opt"] = torch.optim.AdamW(state["model"].parameters(), lr=1e-3)
    variants = ["bare", "plain", "count", "lightning"]
    per_step = {v: [] for v in variants}
    rng = random.Random(0)
    for _ in range(blocks):
        order = variants[:]
        rng.shuffle(order)
        for v in order:
            per_step[v].append(loop_block(v, steps, state))
    print(f"\nGPT-style CPU loop ({blocks} interleaved blocks of {steps} steps; median per step):")
    base = statistics.median(per_step["bare"])
    for v in variants:
        med = statistics.median(per_step[v])
        print(f"  {v:10s} {med * 1e3:8.3f} ms  ({(med / base - 1) * 100:+.2f}% vs bare)")

    def diff_ci(x: list, y: list) -> tuple:
        d = [b - c for b, c in zip(x, y)]
        boots = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(2000))
        return statistics.median(d), boots[49], boots[1949]

    mid, lo, hi = diff_ci(per_step["count"], per_step["plain"])
    print(f"  counting work (count - plain): {mid * 1e6:+.1f} us per step (95% CI {lo * 1e6:+.1f} .. {hi * 1e6:+.1f})")
    mid, lo, hi = diff_ci(per_step["lightning"], per_step["bare"])
    print(f"  Lightning Throughput (lightning - bare): {mid * 1e6:+.1f} us per step "
          f"(95% CI {lo * 1e6:+.1f} .. {hi * 1e6:+.1f})")


if __name__ == "__main__":
    main()
