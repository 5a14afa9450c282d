"""What a torch.profiler capture of a few steps says, and what changed against a baseline
(issue 54): pure analysis, no ``steptrace._core`` and no torch import.

:func:`summarize_events` turns a capture's events into a small per-step summary (JSON, it
goes into the ``details.evidence`` of an ``alert_update`` record): per phase, per op (and per CUDA kernel when present),
calls and self time per step (typical: an op's or phase's least time over the steps it
ran in, times the share of steps it ran in); host-device syncs; the steps' wall time and
the time between them (medians).
:func:`diff` compares two summaries and says in one line what changed.

Phases come from the ranges a capture adds (``record_function("steptrace/<phase>")``, and
``steptrace/step`` around each step); an op belongs to the phase range its start falls in
(on any thread: a GPU backward runs on autograd's device thread), else ``step`` inside a
step range, else ``between`` (the loader, host work between steps).

What is read of a torch event is what torch 2.x's ``FunctionEvent`` has had throughout
(``name``, ``time_range``, ``self_cpu_time_total``, ``device_type``, ``kernels``), with
``self_device_time_total`` falling back to the older ``self_cuda_time_total``:
:func:`events_from_torch` does that once, so the rest works on plain tuples.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, NamedTuple, Optional

PHASE_PREFIX = "steptrace/"
STEP_RANGE = PHASE_PREFIX + "step"
BETWEEN = "between"  # ops outside any step range: the loader, host work between steps
IN_STEP = "step"  # ops in a step but in no phase range

#: Ops and runtime calls that make the host wait for the device. A device-to-host copy
#: shows as a GPU memcpy event named "Memcpy DtoH ..." (Kineto), a blocking cudaMemcpy as
#: its runtime call.
SYNC_OPS = frozenset({"aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize",
                      "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})

MAX_ROWS = 20  # rows of a summary's op table and of a diff's tables
MAX_NAMES = 200  # op names kept per summary (to tell a new op from one below the table's cut)


def is_sync(name: str) -> bool:
    return name in SYNC_OPS or name.startswith("Memcpy DtoH")


class Event(NamedTuple):
    """One event of a capture: ``kind`` "cpu" (an op, a runtime call or a range) or
    "kernel" (device work; ``self_us`` its duration), start and end in microseconds on
    the capture's clock."""

    name: str
    kind: str
    start_us: float
    end_us: float
    self_us: float
    device_us: float = 0.0  # a CPU op's self device time (its kernels), where known


def events_from_torch(events: Iterable[Any]) -> list[Event]:
    """The events of a torch.profiler capture (``prof.events()``) as :class:`Event`s.
    Kernels come from each CPU op's ``kernels`` (where the op launched them) when torch
    fills that in, else from the device events themselves."""
    out: list[Event] = []
    device_events: list[Event] = []
    launched = False
    for e in events:
        tr = getattr(e, "time_range", None)
        if tr is None:
            continue
        start, end = float(tr.start), float(tr.end)
        dtype = str(getattr(e, "device_type", "DeviceType.CPU"))
        name = str(e.name)
        if "CPU" not in dtype:  # a kernel or memcpy on the device
            device_events.append(Event(name, "kernel", start, end, max(end - start, 0.0)))
            continue
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        out.append(Event(name, "cpu", start, end, float(e.self_cpu_time_total), float(dev or 0.0)))
        for k in getattr(e, "kernels", None) or ():
            launched = True
            # the kernel at the op's start: its phase is the launching op's
            out.append(Event(str(k.name), "kernel", start, start, float(getattr(k, "duration", 0.0))))
    if not launched:
        out.extend(device_events)
    return out


def _typical(values: list[float]) -> float:
    """Per step, what a piece of work costs when the host leaves it alone: its least time
    over the steps it ran in (a busy host only ever adds to it; measured beside a full test
    run on 2 cores, medians of 3 steps still differed 5x between an op and its phase),
    times the share of steps it ran in."""
    ran = [v for v in values if v > 0]
    return min(ran) * len(ran) / len(values) if ran else 0.0


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


class _Ranges:
    """Non-overlapping ranges by start, for 'which range is this moment in'."""

    def __init__(self, ranges: list[tuple[float, float, str]]) -> None:
        self.ranges = sorted(ranges)
        self.starts = [r[0] for r in self.ranges]

    def find(self, t: float) -> Optional[str]:
        i = bisect.bisect_right(self.starts, t) - 1
        if i >= 0 and t < self.ranges[i][1]:
            return self.ranges[i][2]
        return None


def summarize_events(events: list[Event], steps: int, max_rows: int = MAX_ROWS) -> dict:
    """The per-step summary of ``steps`` captured steps (see the module's docstring):
    ``{"steps", "step_ms", "between_ms", "phases_ms", "ops": [{"phase", "op", "kind",
    "calls", "self_ms", "device_ms"}] (per step, the top ``max_rows`` by time), "syncs":
    [same rows, the host-device syncs], "phase_ops_ms": {phase: ops' self ms per step},
    "names": {phase: [op names]}}``."""
    steps = max(int(steps), 1)
    phase_ranges: list[tuple[float, float, str]] = []
    step_ranges: list[tuple[float, float, str]] = []
    ops: list[Event] = []
    for e in events:
        if e.kind == "cpu" and e.name.startswith(PHASE_PREFIX):
            if e.name == STEP_RANGE:
                step_ranges.append((e.start_us, e.end_us, IN_STEP))
            else:
                phase_ranges.append((e.start_us, e.end_us, e.name[len(PHASE_PREFIX):]))
        else:
            ops.append(e)
    phases = _Ranges(phase_ranges)
    in_steps = _Ranges([(a, b, str(i)) for i, (a, b, _) in enumerate(sorted(step_ranges))])
    # each step range by its index, so that an op's time per step is its typical one over
    # the steps (_typical: a step preempted on a busy host does not make its ops look grown)
    n_steps = len(step_ranges)
    # (phase, op) -> [kind, calls, self_us, device_us, self_us by step]
    table: dict[tuple[str, str], list] = {}
    for e in ops:
        step = in_steps.find(e.start_us)
        phase = phases.find(e.start_us) or (IN_STEP if step is not None else BETWEEN)
        row = table.setdefault((phase, e.name), [e.kind, 0, 0.0, 0.0, [0.0] * n_steps])
        row[1] += 1
        row[2] += e.self_us
        row[3] += e.device_us
        if step is not None:
            row[4][int(step)] += e.self_us
    if n_steps >= 2:  # the typical step's self time, where there are steps to take it from
        for row in table.values():
            if row[0] == "cpu" and row[4] and any(row[4]):
                row[2] = _typical(row[4]) * steps
    by_step: dict[str, list[float]] = {}  # phase -> its wall time in each step
    phases_ms: dict[str, float] = {}
    for start, end, name in phase_ranges:
        phases_ms[name] = phases_ms.get(name, 0.0) + (end - start) / 1e3 / steps
        step = in_steps.find(start)
        if step is not None:
            by_step.setdefault(name, [0.0] * n_steps)[int(step)] += (end - start) / 1e3
    if n_steps >= 2:
        phases_ms.update({name: _typical(v) for name, v in by_step.items()})
    ordered = sorted(step_ranges)
    durations = [(end - start) / 1e3 for start, end, _ in ordered]
    step_ms = (_median(durations) if n_steps >= 3 else sum(durations) / steps) if durations else 0.0
    gaps = [(b[0] - a[1]) / 1e3 for a, b in zip(ordered, ordered[1:]) if b[0] >= a[1]]
    between_ms = _median(gaps) if gaps else 0.0

    def row_of(key: tuple[str, str], v: list) -> dict:
        return {"phase": key[0], "op": key[1], "kind": v[0], "calls": round(v[1] / steps, 3),
                "self_ms": round(v[2] / 1e3 / steps, 4), "device_ms": round(v[3] / 1e3 / steps, 4)}

    rows = sorted(table.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))
    phase_ops: dict[str, float] = {}
    names: dict[str, list[str]] = {}
    for (phase, op), v in rows:
        if v[0] == "cpu":
            phase_ops[phase] = phase_ops.get(phase, 0.0) + v[2] / 1e3 / steps
        kept = names.setdefault(phase, [])
        if len(kept) < MAX_NAMES:
            kept.append(op)
    return {
        "steps": steps,
        "step_ms": round(step_ms, 4),
        "between_ms": round(between_ms, 4),
        "phases_ms": {k: round(v, 4) for k, v in phases_ms.items()},
        "phase_ops_ms": {k: round(v, 4) for k, v in phase_ops.items()},
        "ops": [row_of(k, v) for k, v in rows[:max_rows]],
        "syncs": [row_of(k, v) for k, v in rows if is_sync(k[1])][:max_rows],
        "names": names,
    }


def summarize_profile(prof: Any, steps: int, max_rows: int = MAX_ROWS) -> dict:
    """:func:`summarize_events` of a stopped ``torch.profiler.profile``."""
    return summarize_events(events_from_torch(prof.events()), steps, max_rows)


def _rows(summary: dict) -> dict[tuple[str, str], dict]:
    out = {(r["phase"], r["op"]): r for r in summary.get("ops", ())}
    for r in summary.get("syncs", ()):
        out.setdefault((r["phase"], r["op"]), r)
    return out


def _time(row: Optional[dict]) -> float:
    return 0.0 if row is None else float(row["self_ms"]) + float(row.get("device_ms", 0.0))


def _seen(summary: dict, phase: str, op: str) -> bool:
    return op in summary.get("names", {}).get(phase, ())


def diff(base: dict, cap: dict, max_rows: int = MAX_ROWS) -> dict:
    """What changed from ``base`` to ``cap`` (two summaries), per step: ``{"verdict",
    "step_ms": [base, cap], "between_ms": [...], "phases_ms": {phase: [base, cap]},
    "grew": [{"phase", "op", "delta_ms", "pct", "calls": [base, cap]}] (most grown first),
    "new": [{"phase", "op", "ms", "calls", "sync"}], "vanished": [...], "ops_changed":
    bool}``. An op is new only when the baseline did not see its name in that phase at all
    (not merely below its table's cut)."""
    b_rows, c_rows = _rows(base), _rows(cap)
    b_iter = float(base.get("step_ms", 0.0)) + float(base.get("between_ms", 0.0))
    c_iter = float(cap.get("step_ms", 0.0)) + float(cap.get("between_ms", 0.0))
    grown_ms = c_iter - b_iter
    # A change worth naming: above the noise of a busy host's op timings (5% of the step,
    # 50 us at least) and, for an op seen before, a quarter of its own time.
    floor = max(0.05, 0.05 * max(b_iter, 0.0))
    grew, new, vanished = [], [], []
    for key, c in c_rows.items():
        b = b_rows.get(key)
        if b is None:
            if _seen(base, *key):
                continue  # below the baseline's cut: its time there is unknown
            sync = is_sync(key[1])
            if sync or _time(c) >= floor:
                new.append({"phase": key[0], "op": key[1], "ms": round(_time(c), 4), "calls": c["calls"],
                            "sync": sync})
            continue
        delta = _time(c) - _time(b)
        more_calls = float(c["calls"]) > float(b["calls"]) + 0.5
        if delta >= floor and (delta >= 0.25 * _time(b) or more_calls):
            grew.append({"phase": key[0], "op": key[1], "delta_ms": round(delta, 4),
                         "pct": round(100.0 * delta / _time(b), 1) if _time(b) > 0 else None,
                         "calls": [b["calls"], c["calls"]]})
    for key, b in b_rows.items():
        if key not in c_rows and not _seen(cap, *key) and (is_sync(key[1]) or _time(b) >= floor):
            vanished.append({"phase": key[0], "op": key[1], "ms": round(_time(b), 4), "calls": b["calls"],
                             "sync": is_sync(key[1])})
    grew.sort(key=lambda r: -r["delta_ms"])
    new.sort(key=lambda r: (not r["sync"], -r["ms"]))
    vanished.sort(key=lambda r: -r["ms"])
    phases = sorted(set(base.get("phases_ms", {})) | set(cap.get("phases_ms", {})))
    phases_ms = {p: [base.get("phases_ms", {}).get(p, 0.0), cap.get("phases_ms", {}).get(p, 0.0)] for p in phases}
    ops_ms = sum(r["delta_ms"] for r in grew) + sum(r["ms"] for r in new) - sum(r["ms"] for r in vanished)
    new_syncs = [r for r in new if r["sync"]]
    more_calls = [r for r in grew if r["calls"][1] >= r["calls"][0] + 0.5]
    # The ops changed when a sync appeared, an op is called more often, or the grown and
    # new ops carry a good part of the change (else it is outside them).
    ops_changed = bool(new_syncs or more_calls) or (bool(grew or new) and (grown_ms <= 0 or ops_ms >= 0.25 * grown_ms))
    result = {
        "step_ms": [base.get("step_ms", 0.0), cap.get("step_ms", 0.0)],
        "between_ms": [base.get("between_ms", 0.0), cap.get("between_ms", 0.0)],
        "phases_ms": phases_ms,
        "grew": grew[:max_rows],
        "new": new[:max_rows],
        "vanished": vanished[:max_rows],
        "ops_changed": ops_changed,
    }
    result["verdict"] = _verdict(result, grown_ms, ops_ms, floor)
    return result


def _fmt_calls(calls: float) -> str:
    return f"{calls:g}" if calls == int(calls) else f"{calls:.1f}"


def _verdict(d: dict, grown_ms: float, ops_ms: float, floor: float) -> str:
    if not d["ops_changed"]:
        where = ""
        between = d["between_ms"][1] - d["between_ms"][0]
        if grown_ms > 0 and between > 0.5 * grown_ms:
            where = f" (between steps +{between:.1f} ms/step)"
        return (f"ops unchanged: the time is outside them — data/host/contention; step {grown_ms:+.1f} ms/step, "
                f"ops {ops_ms:+.1f} ms/step{where}")
    by_phase: dict[str, list[str]] = {}
    order: list[str] = []

    def add(phase: str, text: str) -> None:
        if phase not in by_phase:
            by_phase[phase] = []
            order.append(phase)
        by_phase[phase].append(text)

    for r in d["new"]:
        if r["sync"]:
            add(r["phase"], f"new host sync {r['op']} ({_fmt_calls(r['calls'])}/step)")
    for r in d["grew"][:3]:
        b, c = r["calls"]
        calls = f", calls {_fmt_calls(b)}→{_fmt_calls(c)}/step" if abs(c - b) >= 0.5 else ""
        add(r["phase"], f"{r['op']} +{r['delta_ms']:.2f} ms/step{calls}")
    for r in [r for r in d["new"] if not r["sync"]][:3]:
        add(r["phase"], f"new {r['op']} {r['ms']:.2f} ms/step")
    for r in [r for r in d["vanished"] if not r["sync"]][:2]:
        add(r["phase"], f"{r['op']} gone (-{r['ms']:.2f} ms/step)")
    parts = []
    for phase in order:
        b, c = d["phases_ms"].get(phase, [0.0, 0.0])
        head = f"{phase} {c - b:+.1f} ms/step" if phase in d["phases_ms"] else phase
        parts.append(f"{head}: " + "; ".join(by_phase[phase]))
    if grown_ms >= floor and ops_ms < 0.5 * grown_ms:
        parts.append(f"the rest of step {grown_ms:+.1f} ms/step is outside the ops (data/host/contention)")
    return "; ".join(parts)
