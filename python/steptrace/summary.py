"""Summarize a steptrace run: per-phase percentiles, shares, where the wall clock went,
memory, alerts, end reason.

:func:`summarize` turns an iterable of records (one run, one or several ranks) into a
JSON-serializable dict; :func:`format_summary` renders that dict as an aligned text
table and :func:`render_rich` as rich tables (for a terminal). The records are collected
into columns (:mod:`steptrace._table`) in one pass; the statistics use numpy when it is
installed and pure Python otherwise, with the same results.
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Iterable, Optional, Sequence

from steptrace._table import GROUPS, INTERVAL_KINDS, HwSeries, StepTable, as_object, collect, numpy
from steptrace._terminal import printable

#: The phases the summary knows, listed first and in this order when present.
DEFAULT_PHASES = ("forward", "loss", "backward", "clip", "optimizer")
#: Memory fields reported (start / peak / end), in this order, when present.
MEMORY_FIELDS = ("allocated_bytes", "reserved_bytes", "peak_bytes", "rss_bytes", "heap_bytes", "device_used_bytes")
MISSING_END = "missing (no run_end: the run crashed or is still running)"
#: Steps skipped by the memory trend when the run_start config does not say.
DEFAULT_WARMUP = 10
#: The memory trend needs this many steps after warmup, else it uses every step.
MIN_TREND_STEPS = 10
#: A memory trend is "rising"/"falling" when it moves this much over the run...
TREND_MIN_FRACTION = 0.01
#: ...and at least this many bytes (so a few pages of RSS noise stay "flat").
TREND_MIN_BYTES = 1 << 20
#: The parts of run_end's ``goodput`` (seconds), in the order the summary lists them;
#: they add up to ``wall_s``.
GOODPUT_PARTS = ("startup_s", "steps_s", "data_s", "eval_s", "checkpoint_s", "other_s", "after_last_step_s")
#: The per-step rates of useful work the summary reports (the step's ``work`` object).
WORK_RATES = ("samples_per_s", "tokens_per_s", "tflops_per_s", "mfu_pct")
#: A work rate's trend is "rising"/"falling" when its fitted line moves this share of its
#: median over the steps after warmup, else "flat".
WORK_TREND_MIN_FRACTION = 0.05


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


# --------------------------------------------------------------------------- column ops


class _PyOps:
    """Column operations on ``array``/list columns in pure Python (no numpy installed)."""

    @staticmethod
    def col(a: Any) -> Any:
        return a

    @staticmethod
    def timed(ok: Any, step_ms: Any) -> list[int]:
        return [i for i, (o, s) in enumerate(zip(ok, step_ms)) if o and s == s]

    @staticmethod
    def take(col: Any, idx: Sequence[int]) -> list[float]:
        return [col[i] for i in idx]

    @staticmethod
    def nonnan(v: Sequence[float]) -> list[float]:
        return [x for x in v if x == x]

    @staticmethod
    def present(v: Sequence[float]) -> list[int]:
        return [i for i, x in enumerate(v) if x == x]

    @staticmethod
    def present_ns(v: Sequence[int]) -> list[int]:
        return [i for i, x in enumerate(v) if x >= 0]

    @staticmethod
    def nan_to_zero(v: Sequence[float]) -> list[float]:
        return [x if x == x else 0.0 for x in v]

    @staticmethod
    def add(a: Sequence[float], b: Sequence[float]) -> list[float]:
        return [x + y for x, y in zip(a, b)]

    @staticmethod
    def sort(v: Sequence[float]) -> list[float]:
        return sorted(v)

    @staticmethod
    def total(v: Sequence[float]) -> float:
        return math.fsum(v)

    @staticmethod
    def ranks_rows(rank: Any, ranks: Sequence[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {r: [] for r in ranks}
        for i, r in enumerate(rank):
            if r in out:
                out[r].append(i)
        return out

    @staticmethod
    def slope(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
        n = len(x)
        if n < 3:
            return None
        mx, my = math.fsum(x) / n, math.fsum(y) / n
        sxx = math.fsum((a - mx) ** 2 for a in x)
        if sxx <= 0:
            return None
        return math.fsum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx


class _NpOps:
    """The same operations with numpy (fast on a million steps)."""

    def __init__(self, np: Any) -> None:
        self.np = np

    def col(self, a: Any) -> Any:
        np = self.np
        if isinstance(a, array):
            dtype = {"d": np.float64, "q": np.int64, "b": np.int8}[a.typecode]
            return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype=dtype)
        return np.asarray(a)

    def timed(self, ok: Any, step_ms: Any) -> Any:
        return self.np.flatnonzero((ok != 0) & ~self.np.isnan(step_ms))

    @staticmethod
    def take(col: Any, idx: Any) -> Any:
        return col[idx]

    def nonnan(self, v: Any) -> Any:
        return v[~self.np.isnan(v)]

    def present(self, v: Any) -> Any:
        return self.np.flatnonzero(~self.np.isnan(v))

    def present_ns(self, v: Any) -> Any:
        return self.np.flatnonzero(v >= 0)

    def nan_to_zero(self, v: Any) -> Any:
        return self.np.where(self.np.isnan(v), 0.0, v)

    @staticmethod
    def add(a: Any, b: Any) -> Any:
        return a + b

    def sort(self, v: Any) -> Any:
        return self.np.sort(v)

    @staticmethod
    def total(v: Any) -> float:
        # exactly rounded, like the pure-Python path: both give the same numbers
        return math.fsum(v.tolist()) if len(v) else 0.0

    def ranks_rows(self, rank: Any, ranks: Sequence[int]) -> dict[int, Any]:
        np = self.np
        if len(ranks) == 1:
            return {ranks[0]: np.flatnonzero(rank == ranks[0])}
        order = np.argsort(rank, kind="stable")
        sorted_r = rank[order]
        out = {}
        for r in ranks:
            lo, hi = np.searchsorted(sorted_r, [r, r + 1])
            out[r] = np.sort(order[lo:hi])
        return out

    def slope(self, x: Any, y: Any) -> Optional[float]:
        np = self.np
        if len(x) < 3:
            return None
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        with np.errstate(all="ignore"):  # a corrupt 1e300 overflows: no trend, not a warning
            dx = x - x.mean()
            sxx = float(dx @ dx)
            if not 0 < sxx < math.inf:
                return None
            slope = float(dx @ (y - y.mean())) / sxx
        return slope if math.isfinite(slope) else None


def _ops() -> Any:
    np = numpy()
    return _NpOps(np) if np is not None else _PyOps()


def _stats(values: Any, ops: Any, iteration_total: float) -> dict[str, Any]:
    """count, mean, p50/p95/p99, max and share of the iteration of one timing."""
    s = ops.sort(values)
    n = len(s)
    total = ops.total(s)
    return {
        "count": n,
        "mean_ms": total / n,
        "p50_ms": float(percentile(s, 50)),
        "p95_ms": float(percentile(s, 95)),
        "p99_ms": float(percentile(s, 99)),
        "max_ms": float(s[-1]),
        # share of the mean iteration = sum over steps / sum of iterations; a step
        # without this phase counts as 0 for it
        "share_pct": 100.0 * total / iteration_total if iteration_total > 0 else None,
    }


def _intish(v: float) -> Any:
    return int(v) if v == v and float(v).is_integer() else float(v)


def _memory_trend(slope: Optional[float], span: int, peak: float) -> dict[str, Any]:
    """How memory moved over the steady part of the run: rising, falling or flat."""
    if slope is None:
        return {"bytes_per_step": None, "change_bytes": None, "trend": "unknown"}
    change = slope * span
    label = "flat"
    if abs(change) >= max(TREND_MIN_BYTES, TREND_MIN_FRACTION * abs(peak)):
        label = "rising" if change > 0 else "falling"
    return {"bytes_per_step": slope, "change_bytes": change, "trend": label}


def _warmup_of(table: StepTable) -> int:
    for rs in table.run_starts:
        cfg = rs.get("config")
        if isinstance(cfg, dict) and _is_num(cfg.get("warmup_steps")):
            return max(0, int(cfg["warmup_steps"]))
    return DEFAULT_WARMUP


def summarize(records: Iterable[dict[str, Any]], *, source: Optional[str] = None) -> dict[str, Any]:
    """Summarize the records of one run (any number of ranks) into a JSON-ready dict.

    Timing statistics (p50/p95/p99/max, shares) cover the steps with status "ok", pooled
    over ranks; an iteration is data_ms + other_ms + step_ms - interval_in_step_ms (the
    training iteration the slow-step rules judge: evaluation and checkpoints are not part
    of it; older logs have data_ms + step_ms) and each share is that timing's fraction of
    the mean iteration. ``goodput`` is where the wall clock went (:func:`goodput`). ``steps`` is the most steps any rank recorded;
    ``error_steps`` is summed over ranks; steps_per_s is the mean of the per-rank rates.
    Memory values are the largest across ranks; ``memory_trend`` is the least-squares
    slope of each field over the steps after warmup (the steepest rank's). Missing or
    non-numeric fields are ignored, not errors.
    """
    if isinstance(records, StepTable):
        return summarize_table(records, source=source)
    from steptrace.goodput import StepExtras

    extras = StepExtras()
    return summarize_table(collect(extras.tee(records)), source=source, extras=extras)


def summarize_job(path: Any, *, skip_bad: bool = False, progress: bool = False) -> dict[str, Any]:
    """:func:`summarize` of a run folder, a log file or a job root with several attempts
    (docs/goodput.md): the phases pooled over every attempt, and ``waste``, the job's
    goodput across them (:func:`steptrace.goodput.job_goodput`); with several attempts
    ``goodput`` (one run's wall clock) is None and ``attempts`` says how many."""
    from steptrace.goodput import account, job_attempts, load_job
    from steptrace.reader import read

    attempts = job_attempts(path)
    source = str(path)
    if len(attempts) == 1:
        return summarize(read(attempts[0].path, skip_bad=skip_bad, progress=progress), source=source)
    loaded = load_job(path, skip_bad=skip_bad, progress=progress)
    out = summarize_table(collect(read([a.path for a in attempts], skip_bad=skip_bad)), source=source, waste=False)
    out["goodput"] = None  # one run's account: the waste report covers every attempt
    out["attempts"] = len(attempts)
    out["waste"] = account(loaded, root=source)
    return out


def _waste(table: StepTable, source: Optional[str], extras: Any) -> Optional[dict[str, Any]]:
    """The waste report of one run (a job of one attempt), None for a log that does not
    account its wall clock."""
    from steptrace.errors import LogFormatError
    from steptrace.goodput import account

    if not table.run_starts:
        return None
    try:
        return account([(0, source or "", table, extras)], root=source)
    except (LogFormatError, OverflowError, ValueError):  # an older or corrupt log: no report
        return None


def summarize_table(table: StepTable, *, source: Optional[str] = None,
                    hw: Optional["HwSeries"] = None, extras: Any = None, waste: bool = True) -> dict[str, Any]:
    """:func:`summarize` of records already collected into a :class:`StepTable`; ``hw``
    the steps' NVML readings (:class:`HwSeries`) for the "hw" part, by default the
    table's own (``table.hw``); ``extras`` the steps' :class:`steptrace.goodput.StepExtras`
    (progress, compile and restore times) for the waste report, where collected;
    ``waste=False``: no waste report (the table pools several attempts)."""
    hw = table.hw if hw is None else hw
    ops = _ops()
    ok = ops.col(table.ok)
    step_ms = ops.col(table.step_ms)
    data_ms = ops.col(table.data_ms)
    rank = ops.col(table.rank)
    start_ns = ops.col(table.start_ns)
    stepidx = ops.col(table.step)
    n = table.n

    other_ms = ops.col(table.between["other_ms"])
    in_step_ms = ops.col(table.between["interval_in_step_ms"])
    iteration_ms = _iteration(ops, data_ms, other_ms, step_ms, in_step_ms)

    timed = ops.timed(ok, step_ms)
    t_step = ops.take(step_ms, timed)
    t_data = ops.nan_to_zero(ops.take(data_ms, timed))
    t_iter = ops.take(iteration_ms, timed)
    it_total = ops.total(t_iter)
    have = len(timed) > 0
    t_other = ops.nonnan(ops.take(other_ms, timed))

    phases: dict[str, Any] = {}
    names = table.phase_names()
    ordered = [p for p in DEFAULT_PHASES if p in names] + [p for p in names if p not in DEFAULT_PHASES]
    for name in ordered:
        v = ops.nonnan(ops.take(ops.col(table.phases.cols[name]), timed))
        if len(v):
            phases[name] = _stats(v, ops, it_total)

    ranks = table.ranks()
    rows_by_rank = ops.ranks_rows(rank, ranks) if n else {r: [] for r in ranks}
    error_steps = n - int(ops.total(ok)) if n else 0
    warmup = _warmup_of(table)

    rates: list[float] = []
    steps_by_rank: dict[str, int] = {}
    mem_by_rank: dict[str, list[list[float]]] = {}
    trend_by_field: dict[str, tuple[Optional[float], int]] = {}
    mem_cols = {f: ops.col(table.groups["memory"].cols[f]) for f in MEMORY_FIELDS if f in table.groups["memory"].cols}
    for r in ranks:
        idx = rows_by_rank.get(r, [])
        cnt = len(idx)
        steps_by_rank[str(r)] = cnt
        rate = None
        starts = ops.take(start_ns, ops.take(idx, ops.present_ns(ops.take(start_ns, idx)))) if cnt else []
        if cnt >= 2 and len(starts) >= 2:
            span_s = (int(max(starts)) - int(min(starts))) / 1e9
            if span_s > 0:
                rate = (cnt - 1) / span_s
        if rate is None and cnt:
            it = ops.total(ops.nonnan(ops.take(iteration_ms, idx)))
            if it > 0:
                rate = cnt / (it / 1000.0)
        if rate is not None:
            rates.append(rate)
        for field, col in mem_cols.items():
            v = ops.take(col, idx)
            present = ops.present(v)
            if not len(present):
                continue
            vals = ops.take(v, present)
            mem_by_rank.setdefault(field, []).append([float(vals[0]), float(max(vals)), float(vals[-1])])
            xs = ops.take(ops.take(stepidx, idx), present)
            cut = warmup if len(vals) >= warmup + MIN_TREND_STEPS else 0
            slope = ops.slope(xs[cut:], vals[cut:])
            if slope is not None:
                span = int(xs[-1]) - int(xs[cut])
                best = trend_by_field.get(field)
                if best is None or best[0] is None or abs(slope) > abs(best[0]):
                    trend_by_field[field] = (slope, span)

    memory: dict[str, dict[str, Any]] = {}
    memory_trend: dict[str, dict[str, Any]] = {}
    for field in MEMORY_FIELDS:
        vals = mem_by_rank.get(field)
        if vals:
            memory[field] = {
                "start": _intish(max(v[0] for v in vals)),
                "peak": _intish(max(v[1] for v in vals)),
                "end": _intish(max(v[2] for v in vals)),
            }
            slope, span = trend_by_field.get(field, (None, 0))
            memory_trend[field] = _memory_trend(slope, span, memory[field]["peak"])

    averages: dict[str, dict[str, float]] = {}
    for group, _prefix in GROUPS:
        if group in ("memory", "meta", "work", "gc"):  # meta: labels (global step, lr); work, gc: their own parts
            continue
        for field, col in table.groups[group].cols.items():
            v = ops.nonnan(ops.take(ops.col(col), timed))
            if len(v):
                averages.setdefault(group, {})[field] = ops.total(v) / len(v)

    alerts: dict[str, dict[str, Any]] = {}
    alert_first: dict[str, dict[str, Any]] = {}
    for a in table.alerts:
        typ = str(a.get("type", "unknown"))
        st = a.get("step")
        st = st if _is_num(st) else None
        entry = alerts.get(typ)
        if entry is None:
            alerts[typ] = {"count": 1, "first_step": st}
        else:
            entry["count"] += 1
            if st is not None and (entry["first_step"] is None or st < entry["first_step"]):
                entry["first_step"] = st
        first = alert_first.get(typ)
        if first is None or (st is not None and (first["step"] is None or st < first["step"])):
            alert_first[typ] = {
                "step": st,
                "rank": a.get("rank") if _is_num(a.get("rank")) else None,
                "phase": a.get("phase") if isinstance(a.get("phase"), str) else None,
                # only a string: str() of a deeply nested value (a corrupt log) recurses
                "message": a.get("message") if isinstance(a.get("message"), str) else "",
            }

    run_id: Optional[str] = None
    world_size: Optional[int] = None
    for rs in table.run_starts:
        if run_id is None and isinstance(rs.get("run_id"), str):
            run_id = rs["run_id"]
        if world_size is None and _is_num(rs.get("world_size")):
            world_size = rs["world_size"]

    ends: dict[Any, str] = {}
    for e in table.run_ends:
        reason, r = e.get("reason"), e.get("rank", 0)
        if isinstance(r, int):  # a corrupt rank (an object, say) names no rank
            ends[r] = reason if isinstance(reason, str) else "unknown"
    end_reasons = {str(r): ends.get(r, MISSING_END) for r in ranks}
    distinct = set(end_reasons.values())
    if not end_reasons:
        end_reason = MISSING_END
    elif len(distinct) == 1:
        end_reason = next(iter(distinct))
    else:
        end_reason = ", ".join(f"rank {r} {why}" for r, why in end_reasons.items())

    top_kernels = _top_kernels(table.run_ends)
    device_backends = _device_backends(table.run_starts)

    clocks = [c for c in table.clocks if c != "?"] or list(table.clocks)
    if not clocks:
        clock = None
    elif len(clocks) == 1:
        clock = clocks[0]
    else:
        clock = "mixed (" + ", ".join(clocks) + ")"

    out = {
        "source": source,
        "run_id": run_id,
        "world_size": world_size,
        "ranks": ranks,
        "steps": max(steps_by_rank.values(), default=0),
        "steps_by_rank": steps_by_rank,
        "error_steps": error_steps,
        "steps_per_s": sum(rates) / len(rates) if rates else None,
        "clock": clock,
        "data": _stats(t_data, ops, it_total) if have else None,
        # the rest of the time between steps (only in logs that have other_ms)
        "other": _stats(t_other, ops, it_total) if have and len(t_other) else None,
        "phases": phases,
        "step": _stats(t_step, ops, it_total) if have else None,
        "iteration": _stats(t_iter, ops, it_total) if have else None,
        "memory": memory,
        "memory_trend": memory_trend,
        "counters": averages.get("counters", {}),
        "kernels": averages.get("kernels", {}),
        "telemetry": averages.get("telemetry", {}),
        "top_kernels": top_kernels,
        "device_backends": device_backends,
        "alerts": alerts,
        "alert_first": alert_first,
        "end_reason": end_reason,
        "end_reasons": end_reasons,
        "warmup_steps": warmup,
        "goodput": goodput(table, ops=ops, rows_by_rank=rows_by_rank,
                           restore=ops.col(extras.restore_ms) if extras is not None else None),
        "waste": _waste(table, source, extras) if waste else None,
        "intervals": table.intervals.totals(),
        "runq": _runq(table, ops),
        "gc": _gc(table, ops, it_total),
    }
    hw_part = hw_summary(hw, table.run_ends, table.run_starts)
    if hw_part is not None:  # only for a log with NVML readings: nothing changes otherwise
        out["hw"] = hw_part
    work_part = work_summary(table, ops=ops, rows_by_rank=rows_by_rank, warmup=warmup)
    if work_part is not None:  # only for a log with useful work: nothing changes otherwise
        out["work"] = work_part
    return out


# --------------------------------------------------------------------------- useful work


def _work_trend(slope: Optional[float], span: int, p50: float) -> dict[str, Any]:
    """How a work rate moved over the steps after warmup: the least-squares line's change
    over them, as a share of the median."""
    if slope is None or not p50 > 0:
        return {"per_step": slope, "change": None, "change_pct": None, "steps": span, "trend": "unknown"}
    change = slope * span
    pct = 100.0 * change / p50
    label = "flat"
    if abs(change) >= WORK_TREND_MIN_FRACTION * p50:
        label = "rising" if change > 0 else "falling"
    return {"per_step": slope, "change": change, "change_pct": pct, "steps": span, "trend": label}


def work_summary(table: StepTable, *, ops: Any = None, rows_by_rank: Optional[dict[int, Any]] = None,
                 warmup: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The "work" part of the summary (docs/useful-work.md): for each per-step rate
    (samples/s, tokens/s, TFLOP/s, MFU %) over the "ok" steps that have it, pooled over
    ranks: ``p50``, ``mean``, ``steps``, each rank's ``p50`` (``by_rank``), ``job_p50``
    (the ranks' medians summed: the job's throughput; not for MFU) and ``trend`` (the
    least-squares line over the steps after warmup, the rank whose rate moved most); then
    ``run`` from run_end's totals (ranks' tokens and energy summed: ``energy_j``,
    ``j_per_token``, ``tokens_per_kwh``; ``mfu_pct`` the mean of the ranks' run MFU) and
    the peak MFU divides by (``peak_tflops``, ``mfu_dtype``, ``chip``) or why there is
    none (``mfu_unavailable``). None when the log has no useful work."""
    ops = ops if ops is not None else _ops()
    cols = table.groups["work"].cols
    ends = [(e.get("rank", 0), e["work"]) for e in table.run_ends if isinstance(e.get("work"), dict)]
    starts = [rs["work"] for rs in table.run_starts if isinstance(rs.get("work"), dict)]
    if not any(f in cols for f in WORK_RATES) and not ends:
        return None
    ranks = table.ranks()
    if rows_by_rank is None:
        rows_by_rank = ops.ranks_rows(ops.col(table.rank), ranks) if table.n else {r: [] for r in ranks}
    warmup = _warmup_of(table) if warmup is None else warmup
    ok = ops.col(table.ok)
    stepidx = ops.col(table.step)
    out: dict[str, Any] = {}
    for field in WORK_RATES:
        if field not in cols:
            continue
        col = ops.col(cols[field])
        pooled = ops.sort(ops.take(col, ops.timed(ok, col)))
        if not len(pooled):
            continue
        p50 = float(percentile(pooled, 50))
        by_rank: dict[str, float] = {}
        best: Optional[dict[str, Any]] = None
        for r in ranks:
            idx = rows_by_rank.get(r, [])
            if not len(idx):
                continue
            vals = ops.take(col, idx)
            keep = ops.timed(ops.take(ok, idx), vals)
            if not len(keep):
                continue
            v = ops.take(vals, keep)
            rank_p50 = float(percentile(ops.sort(v), 50))
            by_rank[str(r)] = rank_p50
            xs = ops.take(ops.take(stepidx, idx), keep)
            cut = warmup if len(v) >= warmup + MIN_TREND_STEPS else 0
            slope = ops.slope(xs[cut:], v[cut:])
            span = int(xs[-1]) - int(xs[cut]) if len(xs) > cut else 0
            trend = _work_trend(slope, span, rank_p50)
            if best is None or (trend["change_pct"] is not None
                                and (best["change_pct"] is None or abs(trend["change_pct"]) > abs(best["change_pct"]))):
                best = trend
        total = ops.total(pooled)
        entry: dict[str, Any] = {"p50": p50, "mean": total / len(pooled) if math.isfinite(total) else None,
                                 "steps": len(pooled), "by_rank": by_rank,
                                 "trend": best or _work_trend(None, 0, p50)}
        if field != "mfu_pct" and len(by_rank) > 1:
            entry["job_p50"] = math.fsum(by_rank.values())
        out[field] = entry

    run: dict[str, Any] = {}
    for key in ("samples", "tokens", "flops"):
        vals = [float(w[key]) for _, w in ends if _finite(w.get(key))]
        if vals:
            run[key] = math.fsum(vals)
    mfus = [float(w["mfu_pct"]) for _, w in ends if _finite(w.get("mfu_pct"))]
    if mfus:
        run["mfu_pct"] = math.fsum(mfus) / len(mfus)
    energy = [(float(w["energy_j"]), float(w["j_per_token"])) for _, w in ends
              if _finite(w.get("energy_j")) and _finite(w.get("j_per_token")) and w["j_per_token"] > 0]
    if energy:
        joules = math.fsum(e for e, _ in energy)
        tokens = math.fsum(e / j for e, j in energy)
        run["energy_j"] = joules
        if tokens > 0 and joules > 0:
            run["j_per_token"] = joules / tokens
            run["tokens_per_kwh"] = 3.6e6 * tokens / joules
    peak: dict[str, Any] = {}
    for w in [w for _, w in ends] + starts:
        for key in ("peak_tflops", "mfu_dtype", "chip", "source", "mfu_unavailable", "mfu_dtype_assumed"):
            if key not in peak and w.get(key) is not None and isinstance(w.get(key), (str, int, float)):
                peak[key] = w[key]
    if "peak_tflops" in peak:
        peak.pop("mfu_unavailable", None)
    out["run"] = run
    out["peak"] = peak
    return out


def _iteration(ops: Any, data: Any, other: Any, step: Any, in_step: Any) -> Any:
    """The training iteration of each step: data + other + step - intervals inside the
    step (NaN data / other / inside count as 0; NaN step stays NaN)."""
    it = ops.add(ops.add(ops.nan_to_zero(data), ops.nan_to_zero(other)), step)
    inside = ops.nan_to_zero(in_step)
    if isinstance(it, list):
        return [a - b for a, b in zip(it, inside)]
    return it - inside


def _runq(table: StepTable, ops: Any) -> Optional[dict[str, Any]]:
    """The training thread's run-queue wait summed over the steps that read it (all
    ranks), with the time those readings spanned; None when no step has one."""
    runq = ops.nonnan(ops.col(table.host["runq_ms"]))
    if not len(runq):
        return None
    span = ops.nonnan(ops.col(table.host["runq_span_ms"]))
    total, over = ops.total(runq), ops.total(span)
    if not (math.isfinite(total) and math.isfinite(over)):
        return None
    steal = ops.nonnan(ops.col(table.host["steal_ms"]))
    stolen = ops.total(steal) if len(steal) else None
    return {"total_ms": total, "span_ms": over, "share_pct": 100.0 * total / over if over > 0 else None,
            "readings": len(runq), "steal_ms": stolen if stolen is not None and math.isfinite(stolen) else None}


def _gc(table: StepTable, ops: Any, iteration_ms: float) -> Optional[dict[str, Any]]:
    """Python's garbage collections over the steps (all ranks): in the steps and in the gaps
    before them, by generation (2, and the younger ones), their count and their share of
    the training iterations; None when no step has a ``gc`` object."""
    cols = table.groups["gc"].cols
    if "count" not in cols:
        return None

    def total(field: str) -> float:
        col = cols.get(field)
        if col is None:
            return 0.0
        v = ops.nonnan(ops.col(col))
        return float(ops.total(v)) if len(v) else 0.0

    out = {f: total(f) for f in ("ms", "gen2_ms", "between_ms", "between_gen2_ms")}
    out["count"] = int(total("count"))
    out["total_ms"] = out["ms"] + out["between_ms"]
    out["gen2_total_ms"] = out["gen2_ms"] + out["between_gen2_ms"]
    out["share_pct"] = 100.0 * out["total_ms"] / iteration_ms if iteration_ms > 0 else None
    return out if out["count"] > 0 and math.isfinite(out["total_ms"]) else None


def _finite(v: Any) -> bool:
    return _is_num(v) and math.isfinite(v)


def _goodput_of_end(end: dict[str, Any]) -> Optional[dict[str, Any]]:
    """run_end's goodput when it is whole (every part a finite number), else None."""
    g = end.get("goodput")
    if not isinstance(g, dict) or not all(_finite(g.get(k)) for k in ("wall_s", *GOODPUT_PARTS)):
        return None
    out = {k: float(g[k]) for k in ("wall_s", *GOODPUT_PARTS)}
    # checkpoint restore (newer logs): a part of its own, 0 where the log has none
    out["restore_s"] = float(g["restore_s"]) if _finite(g.get("restore_s")) and g["restore_s"] > 0 else 0.0
    end_ns = end.get("end_unix_ns")
    if isinstance(end_ns, int) and not isinstance(end_ns, bool):
        out["end_unix_ns"] = end_ns
        out["start_unix_ns"] = end_ns - round(out["wall_s"] * 1e9)
    out["training_pct"] = float(g["training_pct"]) if _finite(g.get("training_pct")) else (
        100.0 * out["steps_s"] / out["wall_s"] if out["wall_s"] > 0 else 0.0)
    out["from"] = g.get("from") if g.get("from") in ("process_start", "profiler_start") else "unknown"
    out["source"] = "run_end"
    return out


def _goodput_of_steps(table: StepTable, ops: Any, rank: int, idx: Any,
                      end: Optional[dict[str, Any]], restore: Any = None) -> Optional[dict[str, Any]]:
    """A rank's goodput computed from its step and interval records (no run_end, or one
    without goodput): from the profiler's start (its run_start) to the end of the last
    step or interval (run_end's end when there is one). ``restore``: the steps'
    ``restore_ms`` (a column beside the table's, :class:`steptrace.goodput.StepExtras`),
    a part of its own where given. None for a log whose steps do not account the time
    between steps (older logs: no other_ms) or that has no usable step."""
    if not len(idx) or not len(ops.nonnan(ops.take(ops.col(table.between["other_ms"]), idx))):
        return None
    start_ns = ops.col(table.start_ns)
    host = ops.col(table.host_ms)
    cols = {f: ops.col(table.between[f]) for f in ("other_ms", "eval_ms", "checkpoint_ms", "interval_in_step_ms")}
    data = ops.col(table.data_ms)

    def total(col: Any) -> float:
        return ops.total(ops.nan_to_zero(ops.take(col, idx)))

    def timed_row(order: Any) -> Optional[int]:  # the first row in ``order`` with a start and a host time
        for i in order:
            i = int(i)
            if start_ns[i] >= 0 and _finite(float(host[i])):
                return i
        return None

    first, last = timed_row(idx), timed_row(idx[::-1])
    if first is None or last is None:
        return None

    def v(col: Any, i: int) -> float:
        x = float(col[i])
        return x if x == x else 0.0

    first_start = int(start_ns[first])
    last_end = int(start_ns[last]) + round(v(host, last) * 1e6)
    # the time between steps before the first step: the loader's wait and the intervals
    # listed with it that did not run inside it
    restore_first = v(restore, first) if restore is not None else 0.0
    before_first = (v(data, first) + v(cols["other_ms"], first) + v(cols["eval_ms"], first)
                    + v(cols["checkpoint_ms"], first) + restore_first - v(cols["interval_in_step_ms"], first))
    # intervals listed for a step that never came: after the last step
    tail_eval = tail_ckpt = 0.0
    tail_end = -1
    last_listed = table.intervals.last.get(rank)
    steps_of = ops.take(ops.col(table.step), idx)
    max_step = int(steps_of.max() if hasattr(steps_of, "max") else max(steps_of)) if len(steps_of) else -1
    if last_listed is not None and last_listed[0] > max_step:
        tail_eval, tail_ckpt, tail_end = last_listed[1], last_listed[2], int(last_listed[3])
    origin = next((rs.get("start_unix_ns") for rs in table.run_starts
                   if rs.get("rank", 0) == rank and _is_num(rs.get("start_unix_ns"))), None)
    origin = int(origin) if origin is not None and 0 < origin <= first_start else first_start
    end_ns = max(last_end, tail_end)
    if end is not None and isinstance(end.get("end_unix_ns"), int) and end["end_unix_ns"] >= end_ns:
        end_ns = end["end_unix_ns"]
    wall_s = max(0.0, (end_ns - origin) / 1e9)
    steps_s = (total(host) - total(cols["interval_in_step_ms"])) / 1e3
    out = {
        "wall_s": wall_s,
        "startup_s": max(0.0, (first_start - origin) / 1e9 - before_first / 1e3),
        "steps_s": steps_s,
        "data_s": total(data) / 1e3,
        "eval_s": (total(cols["eval_ms"]) + tail_eval) / 1e3,
        "checkpoint_s": (total(cols["checkpoint_ms"]) + tail_ckpt) / 1e3,
        "restore_s": total(restore) / 1e3 if restore is not None else 0.0,
        "other_s": total(cols["other_ms"]) / 1e3,
        "after_last_step_s": max(0.0, (end_ns - last_end) / 1e9 - (tail_eval + tail_ckpt) / 1e3),
        "training_pct": 100.0 * steps_s / wall_s if wall_s > 0 else 0.0,
        "from": "profiler_start",
        "source": "steps",
        "start_unix_ns": origin,
        "end_unix_ns": end_ns,
    }
    if not all(_finite(out[k]) for k in ("wall_s", "training_pct", *GOODPUT_PARTS)):
        return None
    return out


def goodput(table: StepTable, *, ops: Any = None, rows_by_rank: Optional[dict[int, Any]] = None,
            restore: Any = None) -> Optional[dict[str, Any]]:
    """Where the wall clock went: each rank's run_end ``goodput`` (startup, steps, data,
    eval, checkpoint, other, after the last step, in seconds; they add up to ``wall_s``),
    or, for a rank without one (a crashed run), the same computed from its step and
    interval records from the profiler's start to its last record. Summed over ranks;
    ``training_pct`` is the steps' share of the wall clock, ``parts_pct`` each part's,
    ``source`` ``run_end``, ``steps`` or ``mixed``, ``from`` where the wall clock starts
    (``process_start``, ``profiler_start`` or ``mixed``), ``by_rank`` each rank's figures.
    None when no rank has them (an older log that does not account the time between
    steps)."""
    ops = ops if ops is not None else _ops()
    ranks = table.ranks()
    if rows_by_rank is None:
        rows_by_rank = ops.ranks_rows(ops.col(table.rank), ranks) if table.n else {r: [] for r in ranks}
    ends: dict[int, dict[str, Any]] = {}
    for e in table.run_ends:
        r = e.get("rank", 0)
        if isinstance(r, int) and not isinstance(r, bool):
            ends[r] = e
    by_rank: dict[str, dict[str, Any]] = {}
    for r in ranks:
        end = ends.get(r)
        g = _goodput_of_end(end) if end is not None else None
        if g is None:
            try:
                g = _goodput_of_steps(table, ops, r, rows_by_rank.get(r, []), end, restore)
            except (OverflowError, ValueError):  # a corrupt log's 1e308 ms: no account, not an error
                g = None
        if g is not None:
            by_rank[str(r)] = g
    if not by_rank:
        return None
    parts = list(by_rank.values())
    out: dict[str, Any] = {k: math.fsum(g[k] for g in parts) for k in ("wall_s", *GOODPUT_PARTS, "restore_s")}
    wall = out["wall_s"]
    if len(parts) == 1:
        out["training_pct"] = parts[0]["training_pct"]
    else:
        out["training_pct"] = 100.0 * out["steps_s"] / wall if wall > 0 else 0.0
    out["parts_pct"] = {k[:-2]: (100.0 * out[k] / wall if wall > 0 else None) for k in GOODPUT_PARTS
                        + (("restore_s",) if out["restore_s"] > 0 else ())}
    sources = {g["source"] for g in parts}
    origins = {g["from"] for g in parts}
    out["source"] = sources.pop() if len(sources) == 1 else "mixed"
    out["from"] = origins.pop() if len(origins) == 1 else "mixed"
    out["ranks"] = len(parts)
    out["by_rank"] = by_rank
    return out


# --------------------------------------------------------------------------- hw (NVML)


def _present(v: Sequence[float]) -> list[float]:
    return [x for x in v if x == x]


def hw_summary(hw: Optional[HwSeries], run_ends: Sequence[dict[str, Any]] = (),
               run_starts: Sequence[dict[str, Any]] = ()) -> Optional[dict[str, Any]]:
    """The "hw" part of the summary: power (mean over the steps of each step's average,
    and the lowest reading), energy per step (mean) and in all (run_end's energy counter
    rise when the run ended, else the sum over the steps; all ranks' GPUs together), energy
    per 1,000 steps (each rank's, summed over ranks), the hottest reading, the mean SM
    clock, the power limit and the throttle reasons seen (reason -> steps). None when
    neither the steps nor run_end have NVML readings."""
    ends = [e["hw"] for e in run_ends if isinstance(e.get("hw"), dict)]
    if (hw is None or not len(hw)) and not ends:
        return None
    hw = hw if hw is not None else HwSeries()
    vals = {f: _present(v) for f, v in hw.values.items()}
    power, low, energy = vals["power_w"], vals["min_power_w"], vals["energy_j"]
    temp, clock = vals["max_temp_c"], vals["sm_clock_mhz"]

    def mean(v: list[float]) -> Optional[float]:
        return math.fsum(v) / len(v) if v else None

    throttle: dict[str, int] = {}
    for reasons in hw.throttle:
        for r in dict.fromkeys(reasons):
            throttle[r] = throttle.get(r, 0) + 1
    throttle_steps = sum(1 for reasons in hw.throttle if reasons)

    steps_energy = math.fsum(energy) if energy else None
    per_1000: Optional[float] = None
    by_rank: dict[Any, list[float]] = {}
    for r, e in zip(hw.rank, hw.values["energy_j"]):
        if e == e:
            by_rank.setdefault(r, []).append(e)
    if by_rank:
        per_1000 = math.fsum(1000.0 * math.fsum(v) / len(v) for v in by_rank.values())
    elif ends and all(_is_num(e.get("energy_j_per_1000_steps")) for e in ends):
        per_1000 = math.fsum(float(e["energy_j_per_1000_steps"]) for e in ends)
    if steps_energy is None and ends and all(_is_num(e.get("steps_energy_j")) for e in ends):
        steps_energy = math.fsum(float(e["steps_energy_j"]) for e in ends)
    counter = [float(e["energy_j"]) for e in ends if _is_num(e.get("energy_j"))]
    total = math.fsum(counter) if counter and len(counter) == len(ends) else steps_energy

    limits = vals["power_limit_w"] + [float(e["power_limit_w"]) for e in ends if _is_num(e.get("power_limit_w"))]
    for rs in run_starts:
        t = as_object(rs.get("backends")).get("telemetry")
        if isinstance(t, dict) and _is_num(t.get("power_limit_w")):
            limits.append(float(t["power_limit_w"]))
    limit = max(limits) if limits else None
    mean_power = mean(power)
    sources = sorted({str(e["source"]) for e in ends if isinstance(e.get("source"), str)})
    return {
        "source": ", ".join(sources) if sources else "nvml",
        "steps_with_hw": len(hw) if len(hw) else sum(int(e["steps_with_hw"]) for e in ends
                                                     if _is_num(e.get("steps_with_hw"))
                                                     and math.isfinite(e["steps_with_hw"])),
        "mean_power_w": mean_power,
        "min_power_w": min(low) if low else (min(power) if power else None),
        "max_power_w": max(power) if power else None,
        "power_limit_w": limit,
        "power_pct_of_limit": 100.0 * mean_power / limit if mean_power is not None and limit else None,
        "energy_per_step_j": mean(energy),
        "steps_energy_j": steps_energy,
        "energy_j": total,
        "energy_j_per_1000_steps": per_1000,
        "max_temp_c": max(temp) if temp else None,
        "mean_sm_clock_mhz": mean(clock),
        "throttle_reasons": throttle,
        "throttled_steps": throttle_steps,
    }


def _num(v: Optional[float], fmt: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{unit}"


def _energy(j: Optional[float]) -> str:
    """Joules, as kJ / MJ / kWh beyond a few thousand."""
    if j is None:
        return "-"
    if abs(j) >= 3.6e6:
        return f"{j / 3.6e6:.2f} kWh"
    if abs(j) >= 1e4:
        return f"{j / 1e3:.1f} kJ"
    return f"{j:.3g} J" if abs(j) < 10 else f"{j:.1f} J"


def hw_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The GPU hardware table (header first; empty when the log has no NVML readings)."""
    hw = summary.get("hw")
    if not hw:
        return []
    power = _num(hw.get("mean_power_w"), ".0f", " W")
    if hw.get("power_pct_of_limit") is not None:
        power += f" ({hw['power_pct_of_limit']:.0f}% of {hw['power_limit_w']:.0f} W)"
    rows = [["gpu (" + str(hw.get("source") or "nvml") + ")", "value"],
            ["power mean", power],
            ["power min", _num(hw.get("min_power_w"), ".0f", " W")],
            ["energy per step", _energy(hw.get("energy_per_step_j"))],
            ["energy per 1000 steps", _energy(hw.get("energy_j_per_1000_steps"))],
            ["energy total", _energy(hw.get("energy_j"))],
            ["temperature max", _num(hw.get("max_temp_c"), ".0f", " C")]]
    if hw.get("mean_sm_clock_mhz") is not None:
        rows.append(["sm clock mean", _num(hw.get("mean_sm_clock_mhz"), ".0f", " MHz")])
    reasons = hw.get("throttle_reasons") or {}
    rows.append(["throttle", ", ".join(f"{r} ({n} steps)" for r, n in reasons.items()) if reasons else "none"])
    return rows


_WORK_LABELS = {"samples_per_s": "samples/s", "tokens_per_s": "tokens/s", "tflops_per_s": "TFLOP/s",
                "mfu_pct": "MFU"}


def rate_text(v: Optional[float]) -> str:
    """A rate with the digits that matter: ``13,194``, ``412.3``, ``0.00243``."""
    if v is None or v != v:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def work_value_text(field: str, v: Optional[float]) -> str:
    """A work rate as the tables show it (MFU in %)."""
    if v is None:
        return "-"
    return f"{v:.1f}%" if field == "mfu_pct" and abs(v) >= 0.1 else (
        f"{v:.3g}%" if field == "mfu_pct" else rate_text(v))


def work_trend_text(trend: Optional[dict[str, Any]]) -> str:
    """``flat``, ``falling -8.1% over 900 steps`` or ``-``."""
    if not trend or trend.get("trend") in (None, "unknown"):
        return "-"
    if trend["trend"] == "flat":
        return "flat"
    pct = trend.get("change_pct") or 0.0
    return f"{trend['trend']} {pct:+.1f}% over {trend.get('steps', 0)} steps"


def work_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The useful-work table (header first; empty without work): each rate's median, the
    job's (the ranks' medians summed) where there are several ranks, and its trend."""
    w = summary.get("work") or {}
    fields = [f for f in WORK_RATES if f in w]
    if not fields:
        return []
    multi = any("job_p50" in w[f] for f in fields)
    head = ["work (per rank)" if multi else "work", "p50"] + (["job"] if multi else []) + ["trend"]
    rows = [head]
    for f in fields:
        e = w[f]
        row = [_WORK_LABELS[f], work_value_text(f, e.get("p50"))]
        if multi:
            row.append(rate_text(e["job_p50"]) if "job_p50" in e else "-")
        rows.append(row + [work_trend_text(e.get("trend"))])
    return rows


def work_lines(summary: dict[str, Any]) -> list[str]:
    """The lines under the work table: the peak MFU divides by (or why there is no MFU),
    the run's MFU and its energy per token (run_end)."""
    w = summary.get("work")
    if not w:
        return []
    out = []
    peak, run = w.get("peak") or {}, w.get("run") or {}
    if _is_num(peak.get("peak_tflops")):
        what = ", ".join(str(peak[k]) for k in ("mfu_dtype", "chip") if isinstance(peak.get(k), str))
        assumed = " (dtype assumed)" if peak.get("mfu_dtype_assumed") is True else ""
        out.append(f"MFU against a peak of {peak['peak_tflops']:g} TFLOP/s" + (f" ({what})" if what else "") + assumed)
    elif isinstance(peak.get("mfu_unavailable"), str):
        out.append(f"no MFU: {peak['mfu_unavailable']}")
    if _is_num(run.get("mfu_pct")):
        out.append(f"MFU over the whole run (run_end): {work_value_text('mfu_pct', run['mfu_pct'])}")
    if _is_num(run.get("j_per_token")):
        line = f"energy per token: {run['j_per_token']:.3g} J"
        if _is_num(run.get("tokens_per_kwh")):
            kwh = float(run["tokens_per_kwh"])
            line += f", {kwh / 1e6:,.1f} M tokens/kWh" if kwh >= 1e6 else f", {rate_text(kwh)} tokens/kWh"
        out.append(line + f" ({_energy(run.get('energy_j'))} in all)")
    return out


def _top_kernels(run_ends: Sequence[dict[str, Any]], limit: int = 10) -> list[dict[str, Any]]:
    """The kernels with the most device time over all ranks, from run_end's device_activity."""
    merged: dict[str, dict[str, Any]] = {}
    for e in run_ends:
        activity = e.get("device_activity")
        kernels = activity.get("kernels") if isinstance(activity, dict) else None
        top = kernels.get("top") if isinstance(kernels, dict) else None
        for k in top if isinstance(top, list) else ():
            name = k.get("name") if isinstance(k, dict) else None
            if not isinstance(name, str) or not _is_num(k.get("total_ms")):
                continue
            work = k.get("work")
            m = merged.setdefault(name, {"name": name, "work": work if isinstance(work, str) else "compute",
                                         "total_ms": 0.0, "count": 0})
            m["total_ms"] += float(k["total_ms"])
            count = k.get("count")
            m["count"] += int(count) if _is_num(count) and math.isfinite(count) else 0
    top = sorted(merged.values(), key=lambda k: -k["total_ms"])[:limit]
    total = sum(k["total_ms"] for k in merged.values())
    for k in top:
        k["share_pct"] = 100.0 * k["total_ms"] / total if total > 0 else 0.0
    return top


def _device_backends(run_starts: Sequence[dict[str, Any]]) -> dict[str, str]:
    """What collected kernel activity and counters ("cupti", ...) or why nothing did,
    from the first run_start that says."""
    out: dict[str, str] = {}
    for rs in run_starts:
        backends = rs.get("backends")
        if not isinstance(backends, dict):  # an unvalidated log: nothing said
            continue
        for key in ("kernel_activity", "counters"):
            entry = backends.get(key)
            if key in out or not isinstance(entry, dict):
                continue
            active = entry.get("active")
            active = [a for a in active if isinstance(a, str)] if isinstance(active, list) else []
            reasons = entry.get("unavailable")
            reasons = [r for r in reasons.values() if isinstance(r, str)] if isinstance(reasons, dict) else []
            out[key] = ", ".join(active) if active else "unavailable: " + "; ".join(reasons)
    return out


def top_kernel_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The top kernels by device time (header first; empty when none were recorded)."""
    top = summary.get("top_kernels") or []
    if not top:
        return []
    rows = [["kernel", "work", "total ms", "calls", "share"]]
    for k in top:
        name = k["name"] if len(k["name"]) <= 80 else k["name"][:77] + "..."
        rows.append([name, str(k["work"]), _ms(k["total_ms"]), str(k["count"]), _pct(k["share_pct"])])
    return rows


def device_lines(summary: dict[str, Any]) -> list[str]:
    """One line per device backend, shown when one of them collected anything."""
    backends = summary.get("device_backends") or {}
    if not any(not v.startswith("unavailable") for v in backends.values()):
        return []
    labels = {"kernel_activity": "kernel activity", "counters": "counters"}
    return [f"{labels[k]}: {v}" for k, v in backends.items()]


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


def _table(rows: list[list[str]], gap: str = "   ", left: Sequence[int] = (0,)) -> list[str]:
    """Align a table: the columns in ``left`` (default the first) to the left, the others
    to the right. Cells come from the log (phase, kernel and host names): control
    characters in them are shown as escapes, never sent to the terminal."""
    rows = [[printable(c, one_line=True) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append(gap.join(cells).rstrip())
    return out


def trend_text(trend: Optional[dict[str, Any]]) -> str:
    """``flat``, ``rising +1.0 MiB/step``, ``falling -12 KiB/step`` or ``-``."""
    if not trend or trend.get("trend") in (None, "unknown"):
        return "-"
    label = trend["trend"]
    if label == "flat":
        return "flat"
    slope = trend.get("bytes_per_step") or 0.0
    sign = "+" if slope >= 0 else "-"
    return f"{label} {sign}{_bytes(abs(slope))}/step"


def _field_label(field: str) -> str:
    for suffix in ("_bytes", "_pct", "_ms", "_w", "_c", "_mhz"):
        if field.endswith(suffix):
            return field[: -len(suffix)]
    return field


def _unit_value(field: str, v: float) -> str:
    if field.endswith("_pct"):
        return f"{v:.1f}%"
    if field.endswith("_ms"):
        return f"{v:.3f} ms"
    if field.endswith("_w"):
        return f"{v:.0f} W"
    if field.endswith("_c"):
        return f"{v:.1f} C"
    if field.endswith("_mhz"):
        return f"{v:.0f} MHz"
    return f"{v:.3g}"


def headline(summary: dict[str, Any]) -> str:
    """The first line of the summary: run, steps, errors, rate, clock, end reason."""
    name = summary.get("source") or summary.get("run_id") or "?"
    ranks = summary.get("ranks") or []
    errors = summary.get("error_steps", 0)
    head = f"job {name}, {summary['attempts']} attempts: " if summary.get("attempts", 1) > 1 else f"run {name}: "
    if len(ranks) > 1:
        head += f"{len(ranks)} ranks, "
    head += f"{summary.get('steps', 0)} steps ({errors} error{'' if errors == 1 else 's'})"
    rate = summary.get("steps_per_s")
    head += f", {rate:.1f} steps/s" if rate is not None else ", - steps/s"
    head += f", clock {summary.get('clock') or '-'}, ended {summary.get('end_reason')}"
    return head


def phase_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The per-phase table (header first): p50/p95/p99/max in ms and share of the iteration."""
    rows = [["phase", "p50 ms", "p95 ms", "p99 ms", "max ms", "share"]]

    def row(label: str, st: dict[str, Any]) -> None:
        rows.append([label, _ms(st["p50_ms"]), _ms(st["p95_ms"]), _ms(st.get("p99_ms")), _ms(st["max_ms"]),
                     _pct(st["share_pct"])])

    row("data", summary["data"])
    if summary.get("other"):
        row("other", summary["other"])
    for phase, st in summary.get("phases", {}).items():
        row(phase, st)
    row("step", summary["step"])
    row("iteration", summary["iteration"])
    return rows


_GOODPUT_LABELS = {"startup_s": "startup", "steps_s": "steps (training)", "data_s": "data",
                   "eval_s": "eval", "checkpoint_s": "checkpoint", "restore_s": "restore", "other_s": "other",
                   "after_last_step_s": "after last step"}
_ORIGIN_TEXT = {"process_start": "from process start", "profiler_start": "from profiler start",
                "mixed": "from process or profiler start"}


def _duration(ms: float) -> str:
    """Milliseconds as ``12.5 ms`` below a second, else ``3.21 s``."""
    return f"{ms:.2f} ms" if abs(ms) < 1000 else f"{ms / 1e3:.2f} s"


def _seconds(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 10 else f"{v:.3f}"


def goodput_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The "where the wall clock went" table (header first; empty without goodput): each
    part in seconds and as a share of the wall clock, and for eval, checkpoint and other
    the intervals recorded (how many, the longest)."""
    g = summary.get("goodput")
    if not g:
        return []
    intervals = summary.get("intervals") or {}
    origin = _ORIGIN_TEXT.get(g.get("from"), "")
    ranks = g.get("ranks") or 1
    head = "wall clock" + (f" ({ranks} ranks, summed)" if ranks > 1 else "")
    rows = [[head, "seconds", "share", "intervals"]]
    pct = g.get("parts_pct") or {}
    keys = list(GOODPUT_PARTS)
    if g.get("restore_s"):  # newer logs that restored a checkpoint
        keys.insert(keys.index("checkpoint_s") + 1, "restore_s")
    for key in keys:
        name = key[:-2]
        iv = intervals.get(name) if name in INTERVAL_KINDS else None
        note = f"{iv['count']}, longest {_duration(1e3 * iv['max_s'])}" if iv else ""
        rows.append([_GOODPUT_LABELS[key], _seconds(g.get(key)), _pct(pct.get(name)), note])
    rows.append([f"total ({origin})" if origin else "total", _seconds(g.get("wall_s")),
                 _pct(100.0) if g.get("wall_s") else "-", ""])
    return rows


def goodput_lines(summary: dict[str, Any]) -> list[str]:
    """The lines under the wall-clock table: the training share, the run-queue wait and
    Python's garbage collections."""
    out = []
    g = summary.get("goodput")
    if g:
        src = " (computed from the step records: no run_end)" if g.get("source") == "steps" else (
            " (some ranks computed from their step records: no run_end)" if g.get("source") == "mixed" else "")
        out.append(f"training share (goodput): {_pct(g.get('training_pct'))} of the wall clock{src}")
    rq = summary.get("runq")
    if rq:
        share = f", {rq['share_pct']:.1f}% of the time it was read over" if rq.get("share_pct") is not None else ""
        n = (summary.get("alerts") or {}).get("host_contention", {}).get("count")
        alerts = f"; {n} host_contention alert{'s' if n != 1 else ''}" if n else ""
        out.append(f"run-queue wait (runnable, waiting for a CPU): {_duration(rq['total_ms'])}{share}{alerts}")
        if rq.get("steal_ms"):
            out.append(f"CPU time the hypervisor took (steal): {_duration(rq['steal_ms'])}")
    gc = summary.get("gc")
    if gc:
        share = f", {gc['share_pct']:.1f}% of the training iterations" if gc.get("share_pct") is not None else ""
        n = (summary.get("alerts") or {}).get("gc_pause", {}).get("count")
        alerts = f"; {n} gc_pause alert{'s' if n != 1 else ''}" if n else ""
        young = gc["total_ms"] - gc["gen2_total_ms"]
        out.append(f"garbage collection (Python): {_duration(gc['total_ms'])} in {gc['count']} collection"
                   f"{'s' if gc['count'] != 1 else ''}{share} (generation 2: {_duration(gc['gen2_total_ms'])}, "
                   f"generations 0-1: {_duration(young)}; in steps {_duration(gc['ms'])}, between steps "
                   f"{_duration(gc['between_ms'])}){alerts}")
    return out


def waste_parts(summary: dict[str, Any]) -> list[Any]:
    """The waste report of the summary (docs/goodput.md): its lines (the sentence, the
    goodput, the ideal step time), then (rows, left-aligned columns) for the table per
    cause and, with several attempts, per attempt; empty without a report."""
    job = summary.get("waste")
    if not job:
        return []
    from steptrace.goodput import attempt_rows, cause_rows, header_lines

    out: list[Any] = [header_lines(job), (cause_rows(job), (0,))]
    if len(job["attempts"]) > 1:
        out.append((attempt_rows(job), (0, 2, 8)))
    return out


def memory_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = [["memory", "start", "peak", "end", "trend"]]
    trends = summary.get("memory_trend") or {}
    for field, v in (summary.get("memory") or {}).items():
        rows.append([_field_label(field), _bytes(v["start"]), _bytes(v["peak"]), _bytes(v["end"]),
                     trend_text(trends.get(field))])
    return rows


def counter_rows(summary: dict[str, Any]) -> list[list[str]]:
    """Mean of each counter, kernel and telemetry field (header first; empty when none)."""
    rows: list[list[str]] = []
    for group in ("counters", "kernels", "telemetry"):
        for field, v in (summary.get(group) or {}).items():
            label = f"kernel {_field_label(field)}" if group == "kernels" else _field_label(field)
            rows.append([label, _unit_value(field, v) if group != "kernels" or field != "count" else f"{v:.1f}"])
    return [["counter", "mean"]] + rows if rows else []


def alert_rows(summary: dict[str, Any]) -> list[list[str]]:
    alerts = summary.get("alerts") or {}
    first = summary.get("alert_first") or {}
    rows = [["alert", "count", "first step", "first message"]]
    order = sorted(alerts.items(), key=lambda kv: (kv[1].get("first_step") is None, kv[1].get("first_step") or 0))
    for typ, a in order:
        fs = a.get("first_step")
        msg = (first.get(typ) or {}).get("message") or ""
        rows.append([typ, str(a["count"]), "-" if fs is None else str(fs), msg])
    return rows


def format_summary(summary: dict[str, Any]) -> str:
    """Render a :func:`summarize` dict as a plain aligned text table (no trailing newline)."""
    lines = [headline(summary)]
    if summary.get("iteration"):
        lines += _table(phase_rows(summary))
    else:
        lines.append("no completed steps recorded")

    wall = goodput_rows(summary)
    extra = goodput_lines(summary)
    if wall or extra:
        lines.append("")
    if wall:
        lines += _table(wall, left=(0, 3))
    lines += extra
    waste = waste_parts(summary)
    if waste:
        lines.append("")
        lines += waste[0]
        for k, (rows, left) in enumerate(waste[1:]):
            lines += [""] * (k > 0) + _table(rows, left=left)

    if summary.get("memory"):
        lines.append("")
        lines += _table(memory_rows(summary), left=(0, 4))

    counters = counter_rows(summary)
    if counters:
        lines.append("")
        lines += _table(counters)
    work = work_rows(summary)
    work_extra = work_lines(summary)
    if work or work_extra:
        lines.append("")
    if work:
        lines += _table(work, left=(0, len(work[0]) - 1))
    lines += work_extra
    hw = hw_rows(summary)
    if hw:
        lines.append("")
        lines += _table(hw, left=(0, 1))
    top = top_kernel_rows(summary)
    if top:
        lines.append("")
        lines += _table(top, left=(0, 1))
    device = device_lines(summary)
    if device:
        lines.append("")
        lines += device

    lines.append("")
    if summary.get("alerts"):
        rows = alert_rows(summary)
        # the message column is free text: left-aligned, last, never padded
        body = _table([r[:3] for r in rows])
        lines += [f"{b}   {r[3]}".rstrip() for b, r in zip(body, rows)]
    else:
        lines.append("alerts: none")
    # every line may hold log text (an alert's message, a device name): one line each
    return "\n".join(printable(line, one_line=True) for line in lines)


def render_rich(summary: dict[str, Any], console: Any) -> None:
    """Print a :func:`summarize` dict on a ``rich.console.Console`` as tables."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    def text(line: str, style: str = "") -> Any:
        # log text as a Text: rich reads no markup in it ("[link=...]" would become an OSC 8
        # link), and its control characters are shown as escapes
        return Text(printable(line, one_line=True), style=style)

    console.print(text(headline(summary), style="bold"))

    def table(rows: list[list[str]], left: Sequence[int] = (0,), first_style: Optional[str] = None) -> Any:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for i, h in enumerate(rows[0]):
            t.add_column(text(h), justify="left" if i in left else "right", style=first_style if i == 0 else None,
                         overflow="fold")
        for r in rows[1:]:
            t.add_row(*(text(c) for c in r))
        return t

    if summary.get("iteration"):
        console.print(table(phase_rows(summary), first_style="cyan"))
    else:
        console.print("no completed steps recorded")
    wall = goodput_rows(summary)
    if wall:
        console.print(table(wall, left=(0, 3)))
    for line in goodput_lines(summary):
        console.print(text(line))
    waste = waste_parts(summary)
    if waste:
        for line in waste[0]:
            console.print(text(line))
        for rows, left in waste[1:]:
            console.print(table(rows, left=left))
    if summary.get("memory"):
        console.print(table(memory_rows(summary), left=(0, 4)))
    counters = counter_rows(summary)
    if counters:
        console.print(table(counters))
    work = work_rows(summary)
    if work:
        console.print(table(work, left=(0, len(work[0]) - 1)))
    for line in work_lines(summary):
        console.print(text(line))
    hw = hw_rows(summary)
    if hw:
        console.print(table(hw, left=(0, 1)))
    top = top_kernel_rows(summary)
    if top:
        console.print(table(top, left=(0, 1)))
    for line in device_lines(summary):
        console.print(text(line))
    if summary.get("alerts"):
        console.print(table(alert_rows(summary), left=(0, 3), first_style="red"))
    else:
        console.print("alerts: none", style="green")


__all__ = [
    "summarize",
    "summarize_table",
    "format_summary",
    "goodput",
    "goodput_rows",
    "GOODPUT_PARTS",
    "hw_summary",
    "hw_rows",
    "work_summary",
    "work_rows",
    "work_lines",
    "WORK_RATES",
    "HwSeries",
    "render_rich",
    "percentile",
    "DEFAULT_PHASES",
    "MISSING_END",
]
