"""One rank's window summary (:func:`window_summary`, built on :func:`step_split`) and
the medians the cross-rank rules compare."""

from __future__ import annotations

import bisect
import statistics
from typing import Any, Iterable, Mapping, Optional


#: The per-step work rates a window summary carries (each rank's median; the cluster
#: record's rows and the ``steptrace cluster`` table show them).
WORK_KEYS = ("mfu_pct", "tokens_per_s")


def _median(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def _medians_without_each(values: Mapping[int, Optional[float]]) -> dict[int, Optional[float]]:
    """For every rank r, ``_median`` of the other ranks' values (None values left out), for
    all ranks in O(n log n): one sort, then the middle of the sorted list without r's own
    value, read off in O(1) (the same floats as sorting each rank's list of the others)."""
    present = sorted(v for v in values.values() if v is not None)
    everyone = round(statistics.median(present), 4) if present else None
    k = len(present) - 1  # the others' count when r's own value is among them
    out: dict[int, Optional[float]] = {}
    for r, v in values.items():
        if v is None:
            out[r] = everyone
        elif k == 0:
            out[r] = None
        else:
            i = bisect.bisect_left(present, v)  # one occurrence of r's value (equal values are alike)
            lo = present[k // 2 - 1] if k // 2 - 1 < i else present[k // 2]
            hi = present[k // 2] if k // 2 < i else present[k // 2 + 1]
            out[r] = round(hi if k % 2 else (lo + hi) / 2, 4)
    return out


def _p95(values: list[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4)


def step_split(record: Mapping[str, Any]) -> dict[str, Any]:
    """One step's compute / communication / blocked split, and its own phase times (the
    blocked time taken out of the phase it happened in)."""
    step_ms = float(record.get("host_ms", record.get("step_ms", 0.0)))
    phases = dict(record.get("phases_ms") or {})
    comm = record.get("comm")
    kernels = record.get("kernels")
    if comm:
        exposed = float(comm.get("exposed_ms", 0.0))
        where = comm.get("exposed_in")
        if where in phases:
            phases[where] = max(0.0, phases[where] - exposed)
        return {"method": comm.get("method", "host"), "comm_ms": float(comm.get("comm_ms", 0.0)),
                "exposed_ms": exposed, "compute_ms": max(0.0, step_ms - exposed), "phases": phases,
                "busbw_gbps": comm.get("busbw_gbps")}
    if kernels and float(kernels.get("nccl_ms", 0.0)) > 0:
        exposed = float(kernels.get("exposed_nccl_ms", kernels["nccl_ms"]))
        return {"method": "cupti", "comm_ms": float(kernels["nccl_ms"]), "exposed_ms": exposed,
                "compute_ms": max(0.0, float(record.get("step_ms", step_ms)) - exposed), "phases": phases}
    return {"method": None, "comm_ms": None, "exposed_ms": None, "compute_ms": step_ms, "phases": phases}


def _blocked_between_ms(record: Mapping[str, Any]) -> float:
    comm = record.get("comm")
    return float(comm.get("blocked_between_ms", 0.0)) if isinstance(comm, dict) else 0.0


def _host_wait_ms(record: Mapping[str, Any], own_ms: float) -> Optional[float]:
    """The step's run-queue wait and steal (its host reading), capped at its own time; None
    without a reading."""
    host = record.get("host")
    if not isinstance(host, dict) or not isinstance(host.get("runq_ms"), (int, float)):
        return None
    steal = host.get("steal_ms")
    wait = float(host["runq_ms"]) + (float(steal) if isinstance(steal, (int, float)) else 0.0)
    return min(wait, own_ms)


def _gc_ms(record: Mapping[str, Any], own_ms: float) -> float:
    """Python's garbage collections in the step and the gap before it (its ``gc``), capped
    at its own time."""
    gc = record.get("gc")
    if not isinstance(gc, dict):
        return 0.0
    ms = sum(float(v) for k in ("ms", "between_ms")
             if isinstance(v := gc.get(k), (int, float)) and not isinstance(v, bool) and v > 0)
    return min(ms, own_ms)


def window_summary(rank: int, window: int, steps: list[Mapping[str, Any]], host: str = "") -> Optional[dict]:
    """The summary one rank publishes for one window of its step records (None when the
    window holds no completed step)."""
    ok = [s for s in steps if s.get("status", "ok") == "ok"]
    if not ok:
        return None
    splits = [step_split(s) for s in ok]
    step_ms = [float(s["step_ms"]) for s in ok]
    data_ms = [float(s.get("data_ms", 0.0)) for s in ok]
    # the rank's own time between steps: the loader's wait and other host work (evaluation
    # and checkpoints are not training work, and every rank has them at the same steps), less
    # its waits in collectives there (a barrier for rank 0's checkpoint)
    gap_ms = [d + max(0.0, float(s.get("other_ms", 0.0)) - _blocked_between_ms(s)) for s, d in zip(ok, data_ms)]
    methods = {sp["method"] for sp in splits}
    method = methods.pop() if len(methods) == 1 else ("mixed" if methods - {None} else None)
    names: dict[str, None] = {}  # in the order the steps run them (the rules use it)
    for sp in splits:
        names.update(dict.fromkeys(sp["phases"]))
    summary: dict[str, Any] = {
        "rank": rank, "host": host, "window": window,
        "first_step": int(ok[0]["step"]), "last_step": int(ok[-1]["step"]), "steps": len(ok),
        "step_ms": _median(step_ms), "step_p95_ms": _p95(step_ms), "data_ms": _median(data_ms),
        "compute_ms": _median(sp["compute_ms"] for sp in splits),
        "own_ms": _median(sp["compute_ms"] + g for sp, g in zip(splits, gap_ms)),
        "comm_ms": _median(sp["comm_ms"] for sp in splits),
        "exposed_ms": _median(sp["exposed_ms"] for sp in splits),
        "method": method,
        "phases_ms": {n: _median(sp["phases"].get(n, 0.0) for sp in splits) for n in names},
    }
    # when the window ran (on this rank's clock): how long a rule's streak of windows lasted
    starts = [s.get("start_unix_ns") for s in (ok[0], ok[-1])]
    if all(isinstance(t, int) and 0 <= t < 1 << 63 for t in starts) and 0 <= step_ms[-1] < 1e9:
        summary["start_unix_ns"] = starts[0]  # (a corrupt log's odd values: no times, windows alone)
        summary["end_unix_ns"] = starts[1] + int(1e6 * step_ms[-1])
    # time the training thread waited for a CPU (run queue, steal), at most the step's own time:
    # a rank slower only for that is on an oversubscribed host, not slower at its work
    waits = [_host_wait_ms(s, sp["compute_ms"] + g) for s, sp, g in zip(ok, splits, gap_ms)]
    if any(w is not None for w in waits):
        summary["runq_ms"] = _median(w or 0.0 for w in waits)
    # time Python's collector ran (issue 52): a rank slower by it is slowed by its collector
    if any(isinstance(s.get("gc"), dict) for s in ok):
        summary["gc_ms"] = _median(_gc_ms(s, sp["compute_ms"] + g) for s, sp, g in zip(ok, splits, gap_ms))
    busbw = [sp["busbw_gbps"] for sp in splits if isinstance(sp.get("busbw_gbps"), (int, float))]
    if busbw:  # nccl-tests' bus bandwidth of the rank's collectives (waiting included)
        summary["busbw_gbps"] = _median(busbw)
    for key in WORK_KEYS:  # useful work (docs/useful-work.md), on the steps that knew it
        rates = [w.get(key) for w in (s.get("work") or {} for s in ok)]
        rates = [float(v) for v in rates if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if rates:
            summary[key] = _median(rates)
    memory = [max(int(m.get(k, 0) or 0) for k in ("peak_bytes", "allocated_bytes", "rss_bytes"))
              for m in (s.get("memory") or {} for s in ok)]
    if any(memory):
        summary["memory_bytes"] = max(memory)
    hw = [s.get("hw") or s.get("telemetry") for s in ok]
    hw = [h for h in hw if h]
    if hw:
        summary["hw"] = {k: _median(h.get(k) for h in hw)
                         for k in sorted({k for h in hw for k, v in h.items() if isinstance(v, (int, float))})}
    return summary


def _common(values: Iterable[Optional[str]]) -> Optional[str]:
    found = {v for v in values}
    if len(found) == 1:
        return found.pop()
    return "mixed" if found - {None} else None
