"""Offline: the cross-rank view of a whole run from its records (``steptrace cluster
RUN_DIR``), through the same summaries and rules as the live view."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping, Optional

from steptrace.live import flight_recorder
from steptrace.cluster.options import _RANGES, CLUSTER_OPTIONS
from steptrace.cluster.rules import ClusterAnalyzer
from steptrace.cluster.stats import window_summary


def _whole(v: Any, default: Optional[int] = None) -> Optional[int]:
    """``v`` when it is an int >= 0 (not a bool), else ``default``."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _numbers(obj: Any) -> dict[str, float]:
    """The finite numeric fields of a record's nested object ({} for anything else)."""
    return {k: float(v) for k, v in obj.items() if _finite(v)} if isinstance(obj, dict) else {}


_STEP_GROUPS = ("phases_ms", "memory", "kernels", "hw", "telemetry", "work", "host")
_MAX_PHASES = 4096  # as steptrace._table.MAX_KEYS: the profiler writes at most 32


def _clean_step(rec: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """A step record of an unvalidated log as :func:`window_summary` expects it (the live
    view gets the core's own records): None without a rank, step index and step time;
    fields of the wrong type are dropped, as the summary ignores them."""
    rank, step, step_ms = _whole(rec.get("rank")), _whole(rec.get("step")), rec.get("step_ms")
    if rank is None or step is None or not _finite(step_ms):
        return None
    out: dict[str, Any] = {"rank": rank, "step": step, "step_ms": float(step_ms),
                           "status": rec.get("status") if isinstance(rec.get("status"), str) else "ok"}
    for key in ("host_ms", "data_ms", "other_ms"):  # every input the live view's summary reads
        if _finite(rec.get(key)):
            out[key] = float(rec[key])
    if _whole(rec.get("start_unix_ns")) is not None:
        out["start_unix_ns"] = int(rec["start_unix_ns"])
    for key in _STEP_GROUPS:
        if isinstance(rec.get(key), dict):
            out[key] = _numbers(rec[key])
    if len(out.get("phases_ms", ())) > _MAX_PHASES:  # a corrupt line with a million names
        out["phases_ms"] = dict(list(out["phases_ms"].items())[:_MAX_PHASES])
    kernels = out.get("kernels")
    if kernels is not None and "nccl_ms" not in kernels:
        del out["kernels"]
    comm = rec.get("comm")
    if isinstance(comm, dict):
        out["comm"] = {**_numbers(comm), "method": comm.get("method") if isinstance(comm.get("method"), str) else "host"}
        if isinstance(comm.get("exposed_in"), str):
            out["comm"]["exposed_in"] = comm["exposed_in"]
    return out


def _longest_streak_s(r: int, clusters: list[dict], spans: list[dict]) -> tuple[int, Optional[float]]:
    """The longest run of compared windows in a row that named rank ``r`` a straggler: how
    many windows, and how long they lasted on ``r``'s clock (None where a window has no
    times), as the alert's floor measures it."""
    best, best_s, n, start = 0, None, 0, None
    for record, span in zip(clusters, spans):
        if r not in record["stragglers"]:
            n, start = 0, None
            continue
        first, last = span.get(r, (None, None))
        n += 1
        if n == 1:
            start = first
        length = (last - start) / 1e9 if start is not None and last is not None else None
        if n > best or (n == best and length is not None and (best_s is None or length > best_s)):
            best, best_s = n, length
    return best, best_s


def _others_median(rows: Mapping[int, Mapping[str, Any]], r: int) -> Optional[float]:
    own = [x["own_ms"] for q, x in rows.items() if q != r and x.get("own_ms") is not None]
    return statistics.median(own) if own else None


def _verdict(table: Optional[dict], whole: Mapping[int, Mapping[str, Any]], view: ClusterAnalyzer,
             clusters: list[dict], spans: list[dict], alerts: list[dict], opts: Mapping[str, Any],
             ) -> Optional[dict[str, Any]]:
    """Which rank held the others up over the whole run, apart from whether the alert's
    floor (``straggler_windows`` windows in a row lasting ``straggler_min_s``) was met: the
    floor keeps a live page from a rank slower for seconds, not a short run's verdict
    from the rank that was slower all along. A rank is the straggler when the rule names
    it over the whole run (its medians), in at least half the windows compared (a rank
    slower only in turns with another, as ranks moved between a VM's vCPUs, is not), and
    the others' median wait is at least half its excess (it held them up); None with fewer
    than two ranks."""
    if table is None or len(table["ranks"]) < 2:
        return None
    rows = {row["rank"]: row for row in table["ranks"]}
    named = {r: sum(1 for c in clusters if r in c["stragglers"]) for r in rows}

    def others_wait(r: int) -> Optional[float]:
        waits = [x["wait_ms"] for q, x in rows.items() if q != r and x["wait_ms"] is not None]
        return statistics.median(waits) if waits else None

    def held_up(r: int) -> bool:
        # A straggler costs the others its excess in waiting at the collective. A rank whose
        # medians are higher while the others hardly wait was not holding them up: on a busy
        # 2-core host a clean run's load moved between the ranks window by window (one rank
        # +39% over the run, the other waiting 0.2 ms of a 23 ms step).
        wait, others_own = others_wait(r), _others_median(rows, r)
        if wait is None or others_own is None:  # not timed: the phase rule required the wait
            return True
        return wait >= 0.5 * (rows[r]["own_ms"] - others_own)

    candidates = [r for r in table["stragglers"]
                  if (not clusters or 2 * named[r] >= len(clusters)) and held_up(r)]
    out: dict[str, Any] = {"straggler": None, "windows": len(clusters),
                           "slowest_rank": table.get("slowest_rank"),
                           "slowest_excess_pct": table.get("slowest_excess_pct"),
                           "method": table["method"], "straggler_min_s": float(opts["straggler_min_s"]),
                           "straggler_windows": int(opts["straggler_windows"])}
    if out["slowest_rank"] in rows and others_wait(out["slowest_rank"]) is not None:
        out["slowest_others_wait_ms"] = round(others_wait(out["slowest_rank"]), 4)
    if not candidates:
        return out
    r = max(candidates, key=lambda q: rows[q]["straggler_pct"] if rows[q]["straggler_pct"] is not None else -1e9)
    row = rows[r]
    phase, phase_excess_ms, phases_wait_ms = view._slower_phases(whole)(r)
    others = [x for q, x in rows.items() if q != r]
    wait = others_wait(r)
    shares = [100.0 * x["wait_ms"] / x["step_ms"] for x in others if x["wait_ms"] is not None and x["step_ms"]]
    others_own = _others_median(rows, r)
    alerted = [a for a in alerts if a["kind"] == "alert" and a["type"] == "straggler" and a.get("subject_rank") == r]
    streak, streak_s = _longest_streak_s(r, clusters, spans)
    if alerted:
        floor = f"met the alert's floor: alerted at step {alerted[0]['step']}"
    elif streak < out["straggler_windows"]:
        floor = (f"named in at most {streak} window(s) in a row, fewer than straggler_windows="
                 f"{out['straggler_windows']}, so no alert would fire")
    else:
        floor = (f"{'its windows in a row lasted ' + format(streak_s, '.1f') + ' s, ' if streak_s is not None else ''}"
                 f"shorter than straggler_min_s={out['straggler_min_s']:g} s, so no alert would fire")
    out.update({
        "straggler": r, "host": row["host"], "phase": phase,
        "confidence": "low" if table["method"] is None else "measured",
        "excess_pct": row["straggler_pct"], "own_ms": row["own_ms"],
        "others_own_ms": None if others_own is None else round(others_own, 4),
        "excess_ms": None if others_own is None else round(row["own_ms"] - others_own, 4),
        "phase_excess_ms": round(phase_excess_ms, 4),
        # what it cost the others: the time they waited for it, measured (comm timed) or, from
        # the phases alone, the most they spend above it in a later phase of the step
        "others_wait_ms": round(wait if wait is not None else phases_wait_ms, 4),
        "others_wait_pct": round(statistics.median(shares), 3) if shares else None,
        "windows_named": named[r], "longest_streak_windows": streak,
        "longest_streak_s": None if streak_s is None else round(streak_s, 3),
        "alerted": bool(alerted), "alert_step": alerted[0]["step"] if alerted else None, "floor": floor,
    })
    return out


def analyze_records(records: Iterable[Mapping[str, Any]], options: Optional[Mapping[str, Any]] = None,
                    ) -> dict[str, Any]:
    """The cross-rank view of a whole run from its records (all ranks): the per-window
    cluster records, the alerts, a per-rank table over the whole run, and ``hang``: where
    the ranks part, from each rank's last hang alert's flight recorder state (None without
    one), and ``verdict``: the rank that held the others up over the run (``straggler``,
    None when none did), its excess, the others' wait, and whether the alert's floor was
    met (``alerted``, ``floor``), told apart (see :func:`_verdict`). Step records
    without a whole rank, step index and finite step time are left out (an unvalidated
    log is tolerated, as by the summary)."""
    by_rank: dict[int, list[Mapping[str, Any]]] = {}
    hung: dict[int, Any] = {}  # each rank's last hang alert's flight recorder state (compact)
    hosts: dict[int, str] = {}
    world = 0
    interval = None
    for rec in records:
        kind = rec.get("kind")
        if kind == "step":
            clean = _clean_step(rec)
            if clean is not None:
                by_rank.setdefault(clean["rank"], []).append(clean)
        elif kind == "run_start":
            host = rec.get("host")
            hosts[_whole(rec.get("rank"), 0)] = host if isinstance(host, str) else ""
            world = max(world, _whole(rec.get("world_size"), 1))
        elif kind == "alert" and rec.get("type") == "hang" and _whole(rec.get("rank")) is not None:
            fr = (rec.get("details") or {}).get("flight_recorder") if isinstance(rec.get("details"), dict) else None
            if isinstance(fr, dict) and fr.get("recorder") == "on" and isinstance(fr.get("groups"), list):
                try:
                    hung[int(rec["rank"])] = flight_recorder.compact(fr)
                except (KeyError, TypeError, AttributeError, ValueError, IndexError):  # an odd record: left out
                    pass
        elif kind == "cluster" and interval is None:
            interval = _whole(rec.get("interval"))  # the live view's window
            if interval is not None and not 2 <= interval <= _RANGES["cluster_interval"][1]:
                interval = None
    opts = {**CLUSTER_OPTIONS, **(options or {})}
    if options is None or "cluster_interval" not in options:
        opts["cluster_interval"] = int(interval or CLUSTER_OPTIONS["cluster_interval"])
    size = int(opts["cluster_interval"])
    analyzer = ClusterAnalyzer(opts, rank=min(by_rank) if by_rank else 0)
    windows: dict[int, dict[int, list]] = {}
    for r, steps in by_rank.items():
        for rec in steps:
            windows.setdefault(int(rec["step"]) // size, {}).setdefault(r, []).append(rec)
    clusters, alerts = [], []
    spans: list[dict[int, tuple[Optional[int], Optional[int]]]] = []  # each compared window's, by rank
    last_step = 0
    for w in sorted(windows):
        summaries = {}
        for r, steps in windows[w].items():
            summary = window_summary(r, w, steps, hosts.get(r, ""))
            if summary is not None and summary["steps"] >= max(1, size // 2):
                summaries[r] = summary
        if len(summaries) < 2:
            continue
        record, found = analyzer.window(summaries, world_size=world or len(by_rank))
        clusters.append(record)
        spans.append({r: (x.get("start_unix_ns"), x.get("end_unix_ns")) for r, x in summaries.items()})
        alerts += found
        last_step = record["step"]
    alerts += analyzer.finish(last_step)
    whole = {}
    for r, steps in sorted(by_rank.items()):
        summary = window_summary(r, -1, steps, hosts.get(r, ""))
        if summary is not None:
            whole[r] = summary
    whole_view = ClusterAnalyzer(opts)
    table = whole_view.window(whole, world_size=world or len(whole), all_rows=True)[0] if whole else None
    verdict = _verdict(table, whole, whole_view, clusters, spans, alerts, opts)
    # where the ranks part, from the flight recorder state of each rank's last hang alert
    try:
        parted = flight_recorder.parting(hung) if hung else None
    except (KeyError, TypeError, AttributeError, ValueError, IndexError):  # an unvalidated log's odd state
        parted = None
    return {"windows": clusters, "alerts": alerts, "table": table, "interval": size, "verdict": verdict,
            "ranks": sorted(by_rank), "hang": {"ranks": {str(r): c for r, c in sorted(hung.items())},
                                               "parted": parted} if hung else None}

