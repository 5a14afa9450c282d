"""Summarize a steptrace run: per-phase percentiles, shares, memory, alerts, end reason.

:func:`summarize` turns an iterable of records (one run, one or several ranks) into a
JSON-serializable dict; :func:`format_summary` renders that dict as an aligned text
table. Pure Python (no numpy), one pass over the records.
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Iterable, Optional, Sequence

#: The phases the summary knows, listed first and in this order when present.
DEFAULT_PHASES = ("forward", "loss", "backward", "clip", "optimizer")
#: Memory fields reported (start / peak / end), in this order, when present.
MEMORY_FIELDS = ("allocated_bytes", "reserved_bytes", "rss_bytes", "device_used_bytes")
MISSING_END = "missing (no run_end: the run crashed or is still running)"


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, interpolated linearly
    between the two nearest ranks (numpy's default "linear" method)."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values")
    h = (n - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo])


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# The hot loop tests `type(v) in _NUM or _is_num(v)`: exact int/float (what json gives)
# costs one set lookup; float subclasses (numpy) still pass through the slow check.
_NUM = frozenset((int, float))


class _Series:
    """Values of one timing (a phase, data, step, iteration) over the ok steps."""

    __slots__ = ("values", "add")

    def __init__(self) -> None:
        self.values = array("d")  # 8 bytes a value: a million steps stay small
        self.add = self.values.append  # bound once: the loop calls it per step and phase

    @property
    def total(self) -> float:
        return math.fsum(self.values)  # exact, unlike a running sum over a million steps

    def stats(self, iteration_total: float) -> dict[str, Any]:
        s = sorted(self.values)
        n = len(s)
        total = math.fsum(s)
        return {
            "count": n,
            "mean_ms": total / n,
            "p50_ms": percentile(s, 50),
            "p95_ms": percentile(s, 95),
            "max_ms": s[-1],
            # share of the mean iteration = sum over steps / sum of iterations; a step
            # without this phase counts as 0 for it
            "share_pct": 100.0 * total / iteration_total if iteration_total > 0 else None,
        }


class _Rank:
    """What one rank contributes: step counts, timing span, memory, end reason."""

    __slots__ = ("steps", "first_ns", "last_ns", "iter_total", "memory", "end")

    def __init__(self) -> None:
        self.steps = 0
        self.first_ns: Optional[int] = None
        self.last_ns: Optional[int] = None
        self.iter_total = 0.0
        self.memory: dict[str, list[int]] = {}  # field -> [start, peak, end]
        self.end: Optional[str] = None

    def steps_per_s(self) -> Optional[float]:
        # From first to last step start there are steps-1 whole iterations; fall back to
        # the sum of iteration times when the span is unknown or zero.
        if self.steps >= 2 and self.first_ns is not None and self.last_ns is not None:
            span_s = (self.last_ns - self.first_ns) / 1e9
            if span_s > 0:
                return (self.steps - 1) / span_s
        if self.steps and self.iter_total > 0:
            return self.steps / (self.iter_total / 1000.0)
        return None


def summarize(records: Iterable[dict[str, Any]], *, source: Optional[str] = None) -> dict[str, Any]:
    """Summarize the records of one run (any number of ranks) into a JSON-ready dict.

    Timing statistics (p50/p95/max, shares) cover the steps with status "ok", pooled over
    ranks; an iteration is data_ms + step_ms and each share is that timing's fraction of
    the mean iteration. ``steps`` is the most steps any rank recorded; ``error_steps`` is
    summed over ranks; steps_per_s is the mean of the per-rank rates. Memory values are
    the largest across ranks. Missing or non-numeric fields are ignored, not errors.
    """
    ranks: dict[int, _Rank] = {}
    run_id: Optional[str] = None
    world_size: Optional[int] = None
    clocks: list[str] = []
    error_steps = 0
    data = _Series()
    step = _Series()
    iteration = _Series()
    phases: dict[str, _Series] = {}
    alerts: dict[str, dict[str, Any]] = {}
    data_add, step_add, iteration_add = data.add, step.add, iteration.add

    def rank_of(rec: dict[str, Any]) -> _Rank:
        r = rec.get("rank", 0)
        if type(r) not in _NUM and not _is_num(r):
            r = str(r)  # a malformed rank (unvalidated log) still gets its own bucket
        acc = ranks.get(r)
        if acc is None:
            acc = ranks[r] = _Rank()
        return acc

    for rec in records:
        kind = rec.get("kind")
        if kind == "step":
            acc = rank_of(rec)
            acc.steps += 1
            t = rec.get("start_unix_ns")
            if type(t) in _NUM or _is_num(t):
                if acc.first_ns is None or t < acc.first_ns:
                    acc.first_ns = t
                if acc.last_ns is None or t > acc.last_ns:
                    acc.last_ns = t
            clock = rec.get("clock")
            if isinstance(clock, str) and clock not in clocks:
                clocks.append(clock)
            mem = rec.get("memory")
            if isinstance(mem, dict):
                for field in MEMORY_FIELDS:
                    v = mem.get(field)
                    if v is not None and (type(v) in _NUM or _is_num(v)):
                        cur = acc.memory.get(field)
                        if cur is None:
                            acc.memory[field] = [v, v, v]
                        else:
                            if v > cur[1]:
                                cur[1] = v
                            cur[2] = v
            d = rec.get("data_ms")
            s = rec.get("step_ms")
            if not (type(d) in _NUM or _is_num(d)):
                d = 0.0
            s_ok = type(s) in _NUM or _is_num(s)
            if s_ok:
                acc.iter_total += d + s
            if rec.get("status", "ok") != "ok":
                # an error step stopped part-way: its timings would skew the percentiles
                error_steps += 1
                continue
            if not s_ok:
                continue
            data_add(d)
            step_add(s)
            iteration_add(d + s)
            pm = rec.get("phases_ms")
            if isinstance(pm, dict):
                for name, v in pm.items():
                    if type(v) in _NUM or _is_num(v):
                        series = phases.get(name)
                        if series is None:
                            series = phases[name] = _Series()
                        series.add(v)
        elif kind == "alert":
            rank_of(rec)
            typ = str(rec.get("type", "unknown"))
            st = rec.get("step")
            entry = alerts.get(typ)
            if entry is None:
                alerts[typ] = {"count": 1, "first_step": st if _is_num(st) else None}
            else:
                entry["count"] += 1
                if _is_num(st) and (entry["first_step"] is None or st < entry["first_step"]):
                    entry["first_step"] = st
        elif kind == "run_start":
            rank_of(rec)
            if run_id is None and isinstance(rec.get("run_id"), str):
                run_id = rec["run_id"]
            if world_size is None and _is_num(rec.get("world_size")):
                world_size = rec["world_size"]
        elif kind == "run_end":
            reason = rec.get("reason")
            rank_of(rec).end = reason if isinstance(reason, str) else "unknown"

    it_total = iteration.total
    ordered = [p for p in DEFAULT_PHASES if p in phases] + [p for p in phases if p not in DEFAULT_PHASES]
    rates = [r for r in (acc.steps_per_s() for acc in ranks.values()) if r is not None]

    memory: dict[str, dict[str, int]] = {}
    for field in MEMORY_FIELDS:
        vals = [acc.memory[field] for acc in ranks.values() if field in acc.memory]
        if vals:
            memory[field] = {
                "start": max(v[0] for v in vals),
                "peak": max(v[1] for v in vals),
                "end": max(v[2] for v in vals),
            }

    end_reasons = {str(r): (acc.end or MISSING_END) for r, acc in sorted(ranks.items(), key=_rank_sort)}
    distinct = set(end_reasons.values())
    if not end_reasons:
        end_reason = MISSING_END
    elif len(distinct) == 1:
        end_reason = next(iter(distinct))
    else:
        end_reason = ", ".join(f"rank {r} {why}" for r, why in end_reasons.items())

    if not clocks:
        clock = None
    elif len(clocks) == 1:
        clock = clocks[0]
    else:
        clock = "mixed (" + ", ".join(clocks) + ")"

    have = len(iteration.values) > 0
    return {
        "source": source,
        "run_id": run_id,
        "world_size": world_size,
        "ranks": [r for r, _ in sorted(ranks.items(), key=_rank_sort)],
        "steps": max((acc.steps for acc in ranks.values()), default=0),
        "steps_by_rank": {str(r): acc.steps for r, acc in sorted(ranks.items(), key=_rank_sort)},
        "error_steps": error_steps,
        "steps_per_s": sum(rates) / len(rates) if rates else None,
        "clock": clock,
        "data": data.stats(it_total) if have else None,
        "phases": {name: phases[name].stats(it_total) for name in ordered},
        "step": step.stats(it_total) if have else None,
        "iteration": iteration.stats(it_total) if have else None,
        "memory": memory,
        "alerts": alerts,
        "end_reason": end_reason,
        "end_reasons": end_reasons,
    }


def _rank_sort(item: tuple[Any, Any]) -> tuple[int, Any]:
    # ranks are ints in valid logs; keep anything else sortable rather than crash
    r = item[0]
    return (0, r) if _is_num(r) else (1, str(r))


# --------------------------------------------------------------------------- text


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}%"


def _bytes(v: Optional[int]) -> str:
    if v is None:
        return "-"
    x = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(v)  # pragma: no cover


def _table(rows: list[list[str]], gap: str = "   ") -> list[str]:
    """Left-align the first column, right-align the others."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        out.append(gap.join(cells).rstrip())
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """Render a :func:`summarize` dict as a plain aligned text table (no trailing newline)."""
    name = summary.get("source") or summary.get("run_id") or "?"
    ranks = summary.get("ranks") or []
    errors = summary.get("error_steps", 0)
    head = f"run {name}: "
    if len(ranks) > 1:
        head += f"{len(ranks)} ranks, "
    head += f"{summary.get('steps', 0)} steps ({errors} error{'' if errors == 1 else 's'})"
    rate = summary.get("steps_per_s")
    head += f", {rate:.1f} steps/s" if rate is not None else ", - steps/s"
    head += f", clock {summary.get('clock') or '-'}, ended {summary.get('end_reason')}"
    lines = [head]

    if summary.get("iteration"):
        rows = [["phase", "p50 ms", "p95 ms", "max ms", "share"]]

        def row(label: str, st: dict[str, Any]) -> None:
            rows.append([label, _ms(st["p50_ms"]), _ms(st["p95_ms"]), _ms(st["max_ms"]), _pct(st["share_pct"])])

        row("data", summary["data"])
        for phase, st in summary.get("phases", {}).items():
            row(phase, st)
        row("step", summary["step"])
        row("iteration", summary["iteration"])
        lines += _table(rows)
    else:
        lines.append("no completed steps recorded")

    memory = summary.get("memory") or {}
    if memory:
        lines.append("")
        rows = [["memory", "start", "peak", "end"]]
        for field, v in memory.items():
            label = field[: -len("_bytes")] if field.endswith("_bytes") else field
            rows.append([label, _bytes(v["start"]), _bytes(v["peak"]), _bytes(v["end"])])
        lines += _table(rows)

    alerts = summary.get("alerts") or {}
    lines.append("")
    if alerts:
        rows = [["alert", "count", "first step"]]
        for typ, a in alerts.items():
            first = a.get("first_step")
            rows.append([typ, str(a["count"]), "-" if first is None else str(first)])
        lines += _table(rows)
    else:
        lines.append("alerts: none")
    return "\n".join(lines)


__all__ = ["summarize", "format_summary", "percentile", "DEFAULT_PHASES", "MISSING_END"]
