"""Offline: the cross-rank view of a whole run from its records (``steptrace cluster
RUN_DIR``), through the same summaries and rules as the live view."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Optional

from steptrace import flight_recorder
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


def analyze_records(records: Iterable[Mapping[str, Any]], options: Optional[Mapping[str, Any]] = None,
                    ) -> dict[str, Any]:
    """The cross-rank view of a whole run from its records (all ranks): the per-window
    cluster records, the alerts, a per-rank table over the whole run, and ``hang``: where
    the ranks part, from each rank's last hang alert's flight recorder state (None without
    one). Step records
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
        alerts += found
        last_step = record["step"]
    alerts += analyzer.finish(last_step)
    whole = {}
    for r, steps in sorted(by_rank.items()):
        summary = window_summary(r, -1, steps, hosts.get(r, ""))
        if summary is not None:
            whole[r] = summary
    table = ClusterAnalyzer(opts).window(whole, world_size=world or len(whole), all_rows=True)[0] if whole else None
    # where the ranks part, from the flight recorder state of each rank's last hang alert
    try:
        parted = flight_recorder.parting(hung) if hung else None
    except (KeyError, TypeError, AttributeError, ValueError, IndexError):  # an unvalidated log's odd state
        parted = None
    return {"windows": clusters, "alerts": alerts, "table": table, "interval": size,
            "ranks": sorted(by_rank), "hang": {"ranks": {str(r): c for r, c in sorted(hung.items())},
                                               "parted": parted} if hung else None}

