"""Per-step host cost of automatic phases, against explicit phases and no profiler, in one run.

    python benchmarks/bench_autophase.py            # about 1 minute on 2 cores
    python benchmarks/bench_autophase.py --quick    # a fast, noisier run

The same tiny CPU training step (MLP 32->64->4, batch 16, cross-entropy, backward,
clip_grad_norm_, SGD step, zero_grad; ``torch.set_num_threads(1)``), so small that the
hooks' cost is visible, is run in interleaved rounds (the order rotating each round) as:

* ``none``: no profiler (twice: ``none`` and ``none-again``, an A/A pair for the noise);
* ``explicit``: ``with prof.step():`` and the five ``with prof.phase(...)`` blocks;
* ``watch``: ``prof.watch(model, opt, loss_fn)`` and ``with prof.step():`` only;
* ``global``: what ``steptrace run`` installs (``GlobalPhaseHooks(steps=True)``: global
  module and optimizer hooks, steps from optimizer steps, with its ``IntervalWatch``) with
  nothing in the loop.

Each round times ``--steps`` steps per variant with time.perf_counter_ns; the figures are
the median and the minimum over rounds of the per-step time (the minimum is the round
least disturbed by other load on a shared machine). The costs are the differences from
``none`` (the profiler's whole per-step cost: step, phases, hooks), and the ratio
watch / explicit of those costs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import shutil
import statistics
import tempfile
import time
from typing import Callable, Dict

import torch
from torch import nn

import steptrace
from steptrace.live.autophase import GlobalPhaseHooks
from steptrace.live.intervals import IntervalWatch

pc = time.perf_counter_ns


def make_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: nn.Module, x: torch.Tensor,
              y: torch.Tensor, phase: Callable[[str], object] | None) -> Callable[[], None]:
    if phase is None:
        def step() -> None:
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return step

    def step_phases() -> None:
        with phase("forward"):
            out = model(x)
        with phase("loss"):
            loss = loss_fn(out, y)
        with phase("backward"):
            loss.backward()
        with phase("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with phase("optimizer"):
            opt.step()
            opt.zero_grad()
    return step_phases


def micro(repeat: int) -> Dict[str, float]:
    """Added cost of each mechanism per phase, inside a step (ns): the minimum over
    ``repeat`` rounds, interleaving the bare call and the instrumented one (the minimum of
    each, their least disturbed runs, subtracted): a forward of a 4x4 Linear in ``with
    prof.phase()``, with empty torch hooks (torch's own dispatch), with watch's hooks;
    the wrapper of ``torch.autograd.backward`` and the clip functions."""
    import timeit

    from steptrace.live.autophase import PhaseHooks

    m, x = nn.Linear(4, 4), torch.randn(2, 4)
    params = list(m.parameters())
    folder = tempfile.mkdtemp(prefix="bench_autophase_micro_")
    prof = steptrace.Profiler(folder, detect=False)
    env = {"m": m, "x": x, "prof": prof, "torch": torch, "params": params, "y": None}

    def t(stmt: str, number: int) -> float:
        return timeit.timeit(stmt, globals=env, number=number) / number * 1e9

    def empty_hooks() -> Callable[[], None]:
        a = m.register_forward_pre_hook(lambda mod, args: None)
        b = m.register_forward_hook(lambda mod, args, o: None, always_call=True)
        return lambda: (a.remove(), b.remove())

    def watch_hooks() -> Callable[[], None]:
        return PhaseHooks(prof._core, m).remove

    def nothing() -> Callable[[], None]:
        return lambda: None

    import sys
    import types

    from steptrace.live.autophase import PhaseGate, _GlobalWrap

    dummy = types.ModuleType("bench_autophase_dummy")
    dummy.f = lambda: None  # type: ignore[attr-defined]
    sys.modules[dummy.__name__] = dummy
    env["dummy"] = dummy

    def wrap_dummy() -> Callable[[], None]:
        wrap, gate = _GlobalWrap((dummy.__name__,), "f", "backward"), PhaseGate(prof._core)
        wrap.add(gate)
        return lambda: wrap.discard(gate)

    cases = {  # name: (bare statement, instrumented statement, what instruments it)
        "forward in prof.phase": ("m(x)", "with prof.phase('forward'): m(x)", nothing),
        "forward, empty torch hooks": ("m(x)", "m(x)", empty_hooks),
        "forward, watch hooks": ("m(x)", "m(x)", watch_hooks),
        # backward and clip are tens of us with a large spread: the wrapper is measured
        # around an empty function instead (the same _GlobalWrap that wraps both)
        "backward / clip wrapper": ("dummy.f()", "dummy.f()", wrap_dummy),
    }
    out: Dict[str, float] = {}
    with prof.step():
        env["y"] = m(x).sum()
        for name, (bare, timed, install) in cases.items():
            best_bare = best_timed = float("inf")
            for _ in range(repeat):  # interleaved; the minimum of each is its least disturbed run
                best_bare = min(best_bare, t(bare, 2000))
                undo = install()
                try:
                    best_timed = min(best_timed, t(timed, 2000))
                finally:
                    undo()
            out[name] = best_timed - best_bare
    prof.close()
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per variant per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="--steps 200 --rounds 5")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 200, 5
    torch.set_num_threads(1)
    print("added cost per phase (ns; min of instrumented minus min of bare, interleaved rounds):")
    for k, v in micro(3 if args.quick else 7).items():
        print(f"  {k:28s} {v:8.0f}")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    tmp = tempfile.mkdtemp(prefix="bench_autophase_")

    def loop_none(name: str) -> Callable[[int], int]:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = make_step(model, opt, nn.CrossEntropyLoss(), x, y, None)

        def run(n: int) -> int:
            t0 = pc()
            for _ in range(n):
                step()
            return pc() - t0
        return run

    def loop_profiled(name: str) -> Callable[[int], int]:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = nn.CrossEntropyLoss()
        prof = steptrace.Profiler(f"{tmp}/{name}", overwrite=True, detect=False)  # no alert thread: costs only
        profilers[name] = prof
        if name == "explicit":
            step = make_step(model, opt, loss_fn, x, y, prof.phase)
        else:
            step = make_step(model, opt, loss_fn, x, y, None)
        if name == "watch":
            prof.watch(model, opt, loss_fn)
        s = prof.step

        def run(n: int) -> int:
            t0 = pc()
            for _ in range(n):
                with s():
                    step()
            elapsed = pc() - t0
            prof.flush()  # outside the timed region: the training thread's cost only
            return elapsed

        def run_global(n: int) -> int:
            # what steptrace run installs: the interval watch (checkpoints, loader fetches,
            # evaluation forwards between steps) and the global hooks; only one variant's at a time
            intervals = IntervalWatch(prof._core, data=True)
            hooks = GlobalPhaseHooks(prof._core, steps=True, intervals=intervals)
            try:
                t0 = pc()
                for _ in range(n):
                    step()
                elapsed = pc() - t0
            finally:
                hooks.remove()
                intervals.remove()
            prof.flush()
            return elapsed
        return run_global if name == "global" else run

    profilers: Dict[str, steptrace.Profiler] = {}
    variants = {"none": loop_none("none"), "none-again": loop_none("none-again"),
                "explicit": loop_profiled("explicit"), "watch": loop_profiled("watch"),
                "global": loop_profiled("global")}
    for run in variants.values():  # warm-up
        run(50)
    per_step: Dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    gc.disable()
    try:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                per_step[name].append(variants[name](args.steps) / args.steps / 1000.0)
    finally:
        gc.enable()
    for prof in profilers.values():
        prof.close()
    # the watched run must have recorded the five phases
    steps = [rec for rec in steptrace.read(profilers["watch"].log_path) if rec["kind"] == "step"]
    assert set(steps[-1]["phases_ms"]) == {"forward", "loss", "backward", "clip", "optimizer"}, steps[-1]
    shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in per_step.items()}
    low = {k: min(v) for k, v in per_step.items()}  # the least disturbed round: robust to other load
    cost = {k: med[k] - med["none"] for k in med}
    cost_min = {k: low[k] - low["none"] for k in low}
    print(f"tiny CPU step, {args.rounds} rounds x {args.steps} steps, per-step time (us), median and min of the rounds:")
    for k in names:
        print(f"  {k:11s} median {med[k]:8.2f}  cost {cost[k]:+7.2f} ({100 * cost[k] / med['none']:+5.1f}%)"
              f"   min {low[k]:8.2f}  cost {cost_min[k]:+7.2f} ({100 * cost_min[k] / low['none']:+5.1f}%)")

    def ratio(c: dict, k: str) -> float:
        return c[k] / c["explicit"] if c["explicit"] > 0 else float("nan")

    print(f"A/A noise (none-again - none): median {cost['none-again']:+.2f} us, min {cost_min['none-again']:+.2f} us")
    print(f"watch cost / explicit cost: median {ratio(cost, 'watch'):.2f}, min {ratio(cost_min, 'watch'):.2f}; "
          f"global / explicit: median {ratio(cost, 'global'):.2f}, min {ratio(cost_min, 'global'):.2f}")
    print(f"watch - explicit per step: median {cost['watch'] - cost['explicit']:+.2f} us, "
          f"min {cost_min['watch'] - cost_min['explicit']:+.2f} us")
    if args.json:
        print(json.dumps({"median_us": med, "min_us": low, "cost_us": cost, "cost_min_us": cost_min}))


if __name__ == "__main__":
    main()
