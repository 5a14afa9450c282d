"""Summarize a steptrace run: per-phase percentiles, shares, where the wall clock went,
memory, alerts, end reason.

:func:`summarize` turns an iterable of records (one run, one or several ranks) into a
JSON-serializable dict; :func:`format_summary` renders that dict as an aligned text
table and :func:`render_rich` as rich tables (for a terminal). The records are collected
into columns (:mod:`steptrace._table`) in one pass; the statistics use numpy when it is
installed and pure Python otherwise, with the same results (:mod:`steptrace.analysis._column_ops`).

This module computes; :mod:`steptrace.analysis.summary_render` renders (the text and rich tables,
the cell formats). The rendering names are reachable from here too
(``from steptrace.analysis.summary import format_summary``), loaded on first use.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

from steptrace.analysis._column_ops import _is_num, _ops, _stats, percentile
from steptrace.analysis.evidence_view import evidence_summary
from steptrace._table import GROUPS, HwSeries, StepTable, as_object, collect

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
    from steptrace.analysis.goodput import StepExtras

    extras = StepExtras()
    return summarize_table(collect(extras.tee(records)), source=source, extras=extras)


def summarize_job(path: Any, *, skip_bad: bool = False, progress: bool = False) -> dict[str, Any]:
    """:func:`summarize` of a run folder, a log file or a job root with several attempts
    (docs/goodput.md): the phases pooled over every attempt, and ``waste``, the job's
    goodput across them (:func:`steptrace.analysis.goodput.job_goodput`); with several attempts
    ``goodput`` (one run's wall clock) is None and ``attempts`` says how many."""
    from steptrace.analysis.goodput import account, job_attempts, load_job
    from steptrace.analysis.reader import read

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
    from steptrace.analysis.goodput import account

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
    table's own (``table.hw``); ``extras`` the steps' :class:`steptrace.analysis.goodput.StepExtras`
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
    evidence = evidence_summary(table)
    if evidence:  # only for a log with evidence records (issue 54): nothing changes otherwise
        out["evidence"] = evidence
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
    ``restore_ms`` (a column beside the table's, :class:`steptrace.analysis.goodput.StepExtras`),
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


#: The names :mod:`steptrace.analysis.summary_render` defines that callers import from here. The
#: renderer imports this module's constants, so it is loaded on first use (PEP 562) rather
#: than at the end of this file: importing either module first works.
_RENDER_NAMES = frozenset((
    "format_summary", "render_rich", "headline", "phase_rows", "goodput_rows", "goodput_lines", "waste_parts",
    "memory_rows", "counter_rows", "alert_rows", "hw_rows", "work_rows", "work_lines", "top_kernel_rows",
    "device_lines", "rate_text", "work_value_text", "work_trend_text", "trend_text",
    "_num", "_energy", "_ms", "_pct", "_bytes", "_table", "_duration", "_seconds", "_field_label", "_unit_value",
))


def __getattr__(name: str) -> Any:
    if name in _RENDER_NAMES:
        from steptrace.analysis import summary_render

        return getattr(summary_render, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
