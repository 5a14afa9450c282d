"""The cross-rank view: which rank holds the others up.

One code path serves the live run and the offline ``steptrace cluster RUN_DIR``:

- :func:`window_summary` turns one rank's step records of a window (``cluster_interval``
  steps) into a small summary: medians of step time, data wait, compute / communication /
  blocked time and the phases, with the blocked time taken out of the phase it happened in.
- :class:`ClusterAnalyzer` compares the ranks' summaries of a window and keeps the alert
  episodes: ``straggler`` (a rank's own work, compute + data, above the median of the
  other ranks), ``comm_straggler`` (a rank's communication above the others'),
  ``comm_heavy`` (communication a large share of the step) and ``rank_silent`` (a rank
  that stopped making progress while the others wait for it, or stopped publishing).
- :class:`ClusterExchange` (live) publishes this rank's summaries and heartbeats through
  torch.distributed's own store from a background thread; the aggregating rank reads
  them, and writes ``cluster`` records and the alerts into its own log.

Waiting is measured, not guessed: a rank blocked in a collective because a peer is late
shows it as exposed communication time; what every rank is blocked for (the least any
rank is blocked) is the communication itself, the rest of a rank's exposed time is
waiting for the slowest peer.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import socket
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional

from steptrace.errors import ConfigError

logger = logging.getLogger("steptrace")

# Options of the cross-rank view (keyword arguments of steptrace.Profiler) and defaults.
CLUSTER_OPTIONS: dict[str, Any] = {
    "cluster": "auto",  # auto: on when torch.distributed runs with more than one rank
    "cluster_interval": 50,  # steps per window
    "cluster_rank": 0,  # the rank that aggregates and writes cluster records
    "cluster_poll_s": 1.0,  # how often summaries and heartbeats are published and read
    "cluster_silent_s": 10.0,  # a rank stuck this long (and > 10 median steps) is silent
    "straggler_pct": 10.0,  # own work above the other ranks' median by more than this
    "straggler_windows": 2,  # ... for this many windows in a row
    "straggler_min_ms": 1.0,  # ... and by at least this much (noise floor)
    "comm_imbalance_pct": 50.0,  # a rank's communication above the others' median by this
    "comm_share_pct": 25.0,  # communication above this share of the step: comm_heavy
    "compute_comm_ratio": 4.0,  # ... or compute below this multiple of communication
    "cluster_max_rows": 64,  # per-rank rows in a cluster record at most (the notable ranks)
    "hot_gpu_c": 5.0,  # a GPU this much above the median of GPUs at similar power: hot_gpu
    "hot_gpu_power_pct": 15.0,  # "similar power": within this % of the GPU's own power
}

_RANGES: dict[str, tuple[float, float]] = {
    "cluster_interval": (2, 1_000_000),
    "cluster_rank": (0, 1 << 20),
    "cluster_poll_s": (0.05, 600),
    "cluster_silent_s": (0.1, 86_400),
    "straggler_pct": (0.1, 1000),
    "straggler_windows": (1, 1000),
    "straggler_min_ms": (0, 1e6),
    "comm_imbalance_pct": (0.1, 1000),
    "comm_share_pct": (0.1, 100),
    "compute_comm_ratio": (0.01, 1000),
    "cluster_max_rows": (1, 1 << 20),
    "hot_gpu_c": (0.1, 100),
    "hot_gpu_power_pct": (0.1, 1000),
}

# The step record's hw fields the cross-rank view compares (issue 14's NVML figures).
HW_TEMP_KEY = "max_temp_c"
HW_POWER_KEY = "power_w"

_PHASE_ADVICE = {
    "data": "its input pipeline is slower: give its DataLoader more workers or pinned memory, "
            "and check that host's CPU and disk",
    "optimizer": "its optimizer step is slower: check its GPU's clocks and throttling, and "
                 "CPU contention on its host",
}
_COMPUTE_ADVICE = ("it computes slower: check its GPU (clocks, thermal or power throttling, "
                   "ECC errors), CPU contention on its host, or an uneven batch")


def check_cluster_options(options: Mapping[str, Any]) -> None:
    """Raises ConfigError naming a bad value and what is allowed."""
    mode = options["cluster"]
    if mode not in ("auto", "on", "off"):
        raise ConfigError(f"option cluster={mode!r} is not allowed; allowed: 'auto', 'on', 'off'")
    for key, (lo, hi) in _RANGES.items():
        value = options[key]
        if not lo <= value <= hi:
            raise ConfigError(f"option {key}={value!r} is out of range; allowed: {lo:g}..{hi:g}")


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
                "exposed_ms": exposed, "compute_ms": max(0.0, step_ms - exposed), "phases": phases}
    if kernels and float(kernels.get("nccl_ms", 0.0)) > 0:
        exposed = float(kernels.get("exposed_nccl_ms", kernels["nccl_ms"]))
        return {"method": "cupti", "comm_ms": float(kernels["nccl_ms"]), "exposed_ms": exposed,
                "compute_ms": max(0.0, float(record.get("step_ms", step_ms)) - exposed), "phases": phases}
    return {"method": None, "comm_ms": None, "exposed_ms": None, "compute_ms": step_ms, "phases": phases}


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
    # and checkpoints are not training work, and every rank has them at the same steps)
    gap_ms = [d + float(s.get("other_ms", 0.0)) for s, d in zip(ok, data_ms)]
    methods = {sp["method"] for sp in splits}
    method = methods.pop() if len(methods) == 1 else ("mixed" if methods - {None} else None)
    names: set[str] = set()
    for sp in splits:
        names.update(sp["phases"])
    summary: dict[str, Any] = {
        "rank": rank, "host": host, "window": window,
        "first_step": int(ok[0]["step"]), "last_step": int(ok[-1]["step"]), "steps": len(ok),
        "step_ms": _median(step_ms), "step_p95_ms": _p95(step_ms), "data_ms": _median(data_ms),
        "compute_ms": _median(sp["compute_ms"] for sp in splits),
        "own_ms": _median(sp["compute_ms"] + g for sp, g in zip(splits, gap_ms)),
        "comm_ms": _median(sp["comm_ms"] for sp in splits),
        "exposed_ms": _median(sp["exposed_ms"] for sp in splits),
        "method": method,
        "phases_ms": {n: _median(sp["phases"].get(n, 0.0) for sp in splits) for n in sorted(names)},
    }
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


class _Episode:
    __slots__ = ("streak", "fired", "first_step", "repeats")

    def __init__(self) -> None:
        self.streak = 0
        self.fired = False
        self.first_step = 0
        self.repeats = 0


class ClusterAnalyzer:
    """The cross-rank rules over windows of per-rank summaries, with alert episodes (one
    alert per episode, a ``resolved`` record when it ends). Feed it windows in order."""

    def __init__(self, options: Optional[Mapping[str, Any]] = None, rank: int = 0) -> None:
        self.options = {**CLUSTER_OPTIONS, **(options or {})}
        self.rank = rank
        self._episodes: dict[tuple[str, int], _Episode] = {}
        self.alert_counts: dict[str, int] = {}
        self.last_cluster: Optional[dict] = None

    # ---- one window ----
    def window(self, summaries: Mapping[int, Mapping[str, Any]], world_size: Optional[int] = None,
               unix_ns: Optional[int] = None, all_rows: bool = False) -> tuple[dict, list[dict]]:
        """The cluster record for one window and the alert / resolved records it causes.
        Beyond ``cluster_max_rows`` ranks the record lists only the ranks that matter (see
        :meth:`_keep_rows`) unless ``all_rows``."""
        o = self.options
        ranks = sorted(summaries)
        s = {r: summaries[r] for r in ranks}
        exposed = {r: s[r].get("exposed_ms") for r in ranks}
        shared_exposed = min(exposed.values()) if all(v is not None for v in exposed.values()) else None
        latest_own = max(s[r]["own_ms"] for r in ranks)
        rows = []
        others_own = _medians_without_each({r: s[r].get("own_ms") for r in ranks})
        for r in ranks:
            # Waiting: blocked longer than the least-blocked rank, but at most as long as the
            # latest peer arrived after this rank; the rest is this rank's own communication.
            wait = None if shared_exposed is None else round(
                min(max(0.0, exposed[r] - shared_exposed), max(0.0, latest_own - s[r]["own_ms"])), 4)
            comm = s[r].get("comm_ms")
            comm_net = None if comm is None else round(max(0.0, comm - (wait or 0.0)), 4)
            other_own = others_own[r]
            row = {"rank": r, "host": s[r].get("host", ""), "steps": s[r]["steps"],
                   "step_ms": s[r]["step_ms"], "step_p95_ms": s[r]["step_p95_ms"],
                   "data_ms": s[r]["data_ms"], "compute_ms": s[r]["compute_ms"],
                   "comm_ms": comm_net, "wait_ms": wait, "own_ms": s[r]["own_ms"],
                   "straggler_pct": (round(100.0 * (s[r]["own_ms"] / other_own - 1.0), 2)
                                     if other_own and other_own > 0 else None)}
            for key in ("memory_bytes", "hw"):
                if key in s[r]:
                    row[key] = s[r][key]
            rows.append(row)
        record: dict[str, Any] = {
            "kind": "cluster", "rank": self.rank,
            "step": max(int(x["last_step"]) for x in s.values()),
            "window": min(int(x["window"]) for x in s.values()),
            "first_step": min(int(x["first_step"]) for x in s.values()),
            "interval": int(o["cluster_interval"]),
            "world_size": world_size if world_size is not None else len(ranks),
            "ranks_reporting": len(ranks),
            "method": _common(x.get("method") for x in s.values()),
            "median_step_ms": _median(x["step_ms"] for x in s.values()),
            "ranks": rows, "stragglers": [],
        }
        if unix_ns is not None:
            record["unix_ns"] = unix_ns
        alerts: list[dict] = []
        if len(ranks) < 2:
            self.last_cluster = record
            return record, alerts
        scored = [row for row in rows if row["straggler_pct"] is not None]
        if scored:
            slowest = max(scored, key=lambda row: row["straggler_pct"])
            record["slowest_rank"] = slowest["rank"]
            record["slowest_excess_pct"] = round(slowest["straggler_pct"], 2)
        step = record["step"]
        others_comm = _medians_without_each({row["rank"]: row["comm_ms"] for row in rows})
        slower_phase = self._slower_phases(s)

        # straggler: own work (compute + data, not waiting) above the others' median
        for row in rows:
            r = row["rank"]
            other_own = others_own[r]
            excess = row["own_ms"] - other_own if other_own is not None else 0.0
            hit = (other_own is not None and row["straggler_pct"] is not None
                   and row["straggler_pct"] > o["straggler_pct"] and excess > o["straggler_min_ms"])
            if hit:
                record["stragglers"].append(r)
            phase, phase_excess = slower_phase(r)
            advice = _PHASE_ADVICE.get(phase, _COMPUTE_ADVICE)
            alerts += self._episode(
                "straggler", r, hit, step, o["straggler_windows"], unix_ns,
                lambda: {"value": row["own_ms"], "baseline": other_own,
                         "threshold": round(other_own * (1 + o["straggler_pct"] / 100.0), 4), "phase": phase,
                         "message": (f"rank {r} (host {row['host'] or '?'}) is a straggler: its own work "
                                     f"(compute + data) is {row['straggler_pct']:.0f}% above the other ranks' "
                                     f"median ({row['own_ms']:.1f} ms vs {other_own:.1f} ms), slower in "
                                     f"{phase}; every rank waits for it at each collective: {advice}"),
                         "details": {"host": row["host"], "excess_pct": round(row["straggler_pct"], 2),
                                     "excess_ms": round(excess, 3), "phase_excess_ms": round(phase_excess, 3),
                                     "windows": o["straggler_windows"], "advice": advice}},
                f"rank {r} no longer a straggler")

        # comm_straggler: a rank's communication (net of waiting) above the others'
        for row in rows:
            r = row["rank"]
            other_comm = others_comm[r]
            hit = (row["comm_ms"] is not None and other_comm is not None and other_comm > 0
                   and row["comm_ms"] > other_comm * (1 + o["comm_imbalance_pct"] / 100.0)
                   and row["comm_ms"] - other_comm > o["straggler_min_ms"])
            alerts += self._episode(
                "comm_straggler", r, hit, step, o["straggler_windows"], unix_ns,
                lambda: {"value": row["comm_ms"], "baseline": other_comm,
                         "threshold": round(other_comm * (1 + o["comm_imbalance_pct"] / 100.0), 4),
                         "phase": None,
                         "message": (f"rank {r} (host {row['host'] or '?'}) spends "
                                     f"{row['comm_ms']:.1f} ms per step communicating, "
                                     f"{100 * (row['comm_ms'] / other_comm - 1):.0f}% more than the other ranks "
                                     f"({other_comm:.1f} ms): check its interconnect, NIC and topology "
                                     f"(NCCL_DEBUG=INFO shows the rings it uses)"),
                         "details": {"host": row["host"], "windows": o["straggler_windows"]}},
                f"rank {r}'s communication is back in line with the other ranks'")

        alerts += self._hot_gpus(s, record, step, unix_ns)

        # comm_heavy: communication is a large share of the step on the median rank
        comm_med = _median(row["comm_ms"] for row in rows)
        step_med = _median(row["step_ms"] for row in rows)
        compute_med = _median(row["compute_ms"] for row in rows)
        hit = False
        share = ratio = None
        if comm_med is not None and step_med and comm_med > o["straggler_min_ms"]:
            share = 100.0 * comm_med / step_med
            compute_only = max(0.0, compute_med - comm_med) if record["method"] == "cupti" else compute_med
            ratio = compute_only / comm_med if comm_med > 0 else None
            hit = share > o["comm_share_pct"] or (ratio is not None and ratio < o["compute_comm_ratio"])
            record["comm_share_pct"] = round(share, 2)
        alerts += self._episode(
            "comm_heavy", -1, hit, step, o["straggler_windows"], unix_ns,
            lambda: {"value": share, "baseline": None, "threshold": o["comm_share_pct"], "phase": None,
                     "message": (f"communication takes {share:.0f}% of the step on the median rank "
                                 f"(compute is {ratio:.1f}x communication): accumulate gradients over "
                                 f"more micro-batches, overlap communication with backward (bucket sizes), "
                                 f"or use a faster interconnect"),
                     "details": {"comm_ms": comm_med, "step_ms": step_med, "compute_to_comm": ratio,
                                 "compute_comm_ratio": o["compute_comm_ratio"]}},
            "communication is no longer a large share of the step")
        if not all_rows and len(rows) > o["cluster_max_rows"]:
            self._keep_rows(record, alerts)
        self.last_cluster = record
        return record, alerts

    def _keep_rows(self, record: dict, alerts: list[dict]) -> None:
        """Bounds the record at scale (a row is ~200 bytes: 1,024 ranks would add 200 KB to
        the log every window): the ranks alerts name, the stragglers, then the slowest by
        straggler score, up to ``cluster_max_rows``; ``ranks_omitted`` counts the rest."""
        limit = int(self.options["cluster_max_rows"])
        named = {a.get("subject_rank") for a in alerts} | set(record["stragglers"])
        rows = record["ranks"]
        keep = {row["rank"] for row in rows if row["rank"] in named}
        for row in sorted(rows, key=lambda x: -(x["straggler_pct"] if x["straggler_pct"] is not None else -1e9)):
            if len(keep) >= limit:
                break
            keep.add(row["rank"])
        record["ranks"] = [row for row in rows if row["rank"] in keep]
        record["ranks_omitted"] = len(rows) - len(record["ranks"])

    def _hot_gpus(self, s: Mapping[int, Mapping[str, Any]], record: dict, step: int,
                  unix_ns: Optional[int]) -> list[dict]:
        """hot_gpu: a GPU more than ``hot_gpu_c`` above the median temperature of the job's
        other GPUs drawing similar power (within ``hot_gpu_power_pct``): cooling, not load."""
        o = self.options
        temp = {r: (x.get("hw") or {}).get(HW_TEMP_KEY) for r, x in s.items()}
        power = {r: (x.get("hw") or {}).get(HW_POWER_KEY) for r, x in s.items()}
        measured = [r for r in s if temp[r] is not None]
        if len(measured) < 2:
            return []
        band = o["hot_gpu_power_pct"] / 100.0
        deltas: dict[str, float] = {}
        alerts: list[dict] = []
        for r in measured:
            peers = [q for q in measured if q != r and (
                power[r] is None or power[q] is None or abs(power[q] - power[r]) <= band * max(power[r], 1.0))]
            base = _median(temp[q] for q in peers)
            delta = None if base is None else round(temp[r] - base, 2)
            if delta is not None and abs(delta) >= o["hot_gpu_c"] / 2:
                deltas[str(r)] = delta
            hit = delta is not None and delta > o["hot_gpu_c"]
            host = s[r].get("host", "")
            alerts += self._episode(
                "hot_gpu", r, hit, step, o["straggler_windows"], unix_ns,
                lambda: {"value": temp[r], "baseline": base, "threshold": round(base + o["hot_gpu_c"], 2),
                         "phase": None,
                         "message": (f"rank {r}'s GPU (host {host or '?'}) runs {delta:.1f} C hotter than the "
                                     f"median of {len(peers)} GPUs at similar power ({temp[r]:.0f} C vs "
                                     f"{base:.0f} C): check its cooling (fans, airflow, a failing pump) "
                                     f"before it throttles"),
                         "details": {"host": host, "delta_c": delta, "power_w": power[r], "peers": len(peers)}},
                f"rank {r}'s GPU temperature is back in line")
        if deltas:
            record["temp_delta_c"] = deltas
        return alerts

    def _slower_phases(self, s: Mapping[int, Mapping[str, Any]]) -> Callable[[int], tuple[str, float]]:
        """``_slower_phase`` for every rank, in O(phases x n log n) for all: each phase's
        median over the other ranks comes from one sort (a phase a rank lacks counts as 0)."""
        names = {n for x in s.values() for n in (x.get("phases_ms") or {})} - {"data"}
        base = {n: _medians_without_each({q: (x.get("phases_ms") or {}).get(n, 0.0) for q, x in s.items()})
                for n in names}
        base["data"] = _medians_without_each({q: x.get("data_ms") or 0.0 for q, x in s.items()})

        def slower(r: int) -> tuple[str, float]:
            mine = dict(s[r].get("phases_ms") or {})
            mine["data"] = s[r].get("data_ms") or 0.0
            best, best_excess = "compute", 0.0
            for name, value in mine.items():
                b = base[name][r]
                if b is not None and value - b > best_excess:
                    best, best_excess = name, value - b
            return best, best_excess

        return slower

    # ---- silence ----
    def silence(self, heartbeats: Mapping[int, Mapping[str, Any]], now: float, median_step_s: float,
                expected: Iterable[int], unix_ns: Optional[int] = None) -> list[dict]:
        """rank_silent for ranks stuck outside a collective while others wait in one, or whose
        heartbeats stopped; ``heartbeats[r]`` has ``t`` (last publish, seconds), ``progress_t``
        (last step change), ``step``, ``phase`` and ``in_collective``."""
        o = self.options
        limit = max(o["cluster_silent_s"], 10 * median_step_s)
        waiting = {r for r, hb in heartbeats.items() if hb.get("in_collective") and now - hb["progress_t"] > limit}
        alerts: list[dict] = []
        for r in sorted(expected):
            hb = heartbeats.get(r)
            if hb is None:
                continue  # never seen: not yet started (reported once it was seen)
            stopped_publishing = now - hb["t"] > limit + 2 * o["cluster_poll_s"]
            stuck = (now - hb["progress_t"] > limit and not hb.get("in_collective")
                     and bool(waiting - {r}))
            hit = stopped_publishing or stuck
            where = hb.get("phase") or "between steps"
            reason = ("stopped publishing" if stopped_publishing
                      else f"blocked outside communication in {where}")
            alerts += self._episode(
                "rank_silent", r, hit, int(hb.get("step", 0)), 1, unix_ns,
                lambda: {"value": round(now - min(hb["t"], hb["progress_t"]), 3), "baseline": None,
                         "threshold": limit, "phase": hb.get("phase") or None,
                         "message": (f"rank {r} (host {hb.get('host') or '?'}) has made no progress for "
                                     f"{now - hb['progress_t']:.1f} s ({reason}; last step {hb.get('step')}) "
                                     f"while {len(waiting - {r})} other rank(s) wait in a collective: "
                                     f"look at that rank's stacks (py-spy dump, or its hang alert)"),
                         "details": {"host": hb.get("host", ""), "last_step": hb.get("step"),
                                     "reason": reason, "waiting_ranks": sorted(waiting - {r})}},
                f"rank {r} makes progress again")
        return alerts

    def finish(self, step: int) -> list[dict]:
        """Resolves the episodes still open at the end of the run."""
        out = []
        for (kind, r), ep in sorted(self._episodes.items()):
            if ep.fired:
                out.append(self._resolved(kind, r, step, ep, "open at the end of the run"))
                ep.fired = False
        return out

    def _episode(self, kind: str, r: int, hit: bool, step: int, needed: int, unix_ns: Optional[int],
                 make: Callable[[], dict], resolved_text: str) -> list[dict]:
        ep = self._episodes.get((kind, r))
        if ep is None:  # state only for (kind, rank) that ever hit: not 3 per rank of the job
            if not hit:
                return []
            ep = self._episodes[(kind, r)] = _Episode()
        if not hit:
            ep.streak = 0
            if ep.fired:
                ep.fired = False
                return [self._resolved(kind, r, step, ep, resolved_text)]
            return []
        ep.streak += 1
        if ep.fired:
            ep.repeats += 1
            return []
        if ep.streak < needed:
            return []
        ep.fired, ep.first_step, ep.repeats = True, step, 0
        self.alert_counts[kind] = self.alert_counts.get(kind, 0) + 1
        body = make()
        alert = {"kind": "alert", "rank": self.rank, "type": kind, "step": step, **body}
        if r >= 0:
            alert["subject_rank"] = r
        if unix_ns is not None:
            alert["unix_ns"] = unix_ns
        return [alert]

    def _resolved(self, kind: str, r: int, step: int, ep: _Episode, text: str) -> dict:
        rec = {"kind": "resolved", "rank": self.rank, "type": kind, "step": step,
               "first_step": ep.first_step, "repeats": ep.repeats, "message": text}
        if r >= 0:
            rec["subject_rank"] = r
        return rec


def _common(values: Iterable[Optional[str]]) -> Optional[str]:
    found = {v for v in values}
    if len(found) == 1:
        return found.pop()
    return "mixed" if found - {None} else None


# ---- offline: a run folder ----
def _whole(v: Any, default: Optional[int] = None) -> Optional[int]:
    """``v`` when it is an int >= 0 (not a bool), else ``default``."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _numbers(obj: Any) -> dict[str, float]:
    """The finite numeric fields of a record's nested object ({} for anything else)."""
    return {k: float(v) for k, v in obj.items() if _finite(v)} if isinstance(obj, dict) else {}


_STEP_GROUPS = ("phases_ms", "memory", "kernels", "hw", "telemetry")
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
    for key in ("host_ms", "data_ms"):
        if _finite(rec.get(key)):
            out[key] = float(rec[key])
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
    cluster records, the alerts, and a per-rank table over the whole run. Step records
    without a whole rank, step index and finite step time are left out (an unvalidated
    log is tolerated, as by the summary)."""
    by_rank: dict[int, list[Mapping[str, Any]]] = {}
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
    return {"windows": clusters, "alerts": alerts, "table": table, "interval": size,
            "ranks": sorted(by_rank)}


# ---- live: the exchange through torch.distributed's store ----
def _default_store() -> Any:
    import torch.distributed as dist  # the caller checked that torch.distributed is initialized

    from torch.distributed import distributed_c10d

    if not dist.is_available() or not dist.is_initialized():
        return None
    return distributed_c10d._get_default_store()


_PROBES = 64  # most existence checks of not-yet-seen ranks per poll


class LogTail:
    """The whole lines a log file gained since the last call, for the background threads
    that follow what this rank's writer wrote (the cross-rank exchange, the OTLP export)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_lines(self) -> list[bytes]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the next read
        return lines


class ClusterExchange:
    """Publishes this rank's window summaries and heartbeats through a c10d Store and, on
    the aggregating rank, writes the cross-rank view into this rank's log. One daemon
    thread; a step never waits for it (it reads the log file the writer already wrote and
    a few atomics of the core)."""

    def __init__(self, core: Any, options: Mapping[str, Any], *, store: Any = None,
                 get_store: Callable[[], Any] = _default_store,
                 clock: Callable[[], float] = time.time) -> None:
        self._core = core
        self.options = dict(options)
        config = core.config
        self.rank = int(config.rank)
        self.world = int(config.world_size)
        self.host = socket.gethostname()
        self._prefix = f"steptrace/{config.run_id}/"
        self._store = store
        self._get_store = get_store
        self._clock = clock
        self._interval = int(self.options["cluster_interval"])
        self._aggregator = self.rank == int(self.options["cluster_rank"])
        self._analyzer = ClusterAnalyzer(self.options, rank=self.rank)
        self._stop = threading.Event()
        self._log = LogTail(core.log_path)
        self._window_steps: list[dict] = []
        self._window_index: Optional[int] = None
        self._published_window = -1
        self._step_seen = -1
        self._activity_seen: tuple = ()
        self._progress_t = clock()
        self._step_ms: list[float] = []
        # aggregator state
        self._seen: set[int] = set()
        self._hb: dict[int, dict] = {}
        self._hb_raw: dict[int, bytes] = {}
        self._hosts: dict[int, str] = {}
        self._windows_done = -1
        self._probe = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="steptrace-cluster", daemon=True)

    def start(self) -> "ClusterExchange":
        self._thread.start()
        return self

    def stop(self, final_step: Optional[int] = None) -> None:
        """Stops the thread; the aggregator writes what its last poll found and resolves
        its open episodes."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 3 * float(self.options["cluster_poll_s"])))
        if self._aggregator and self._store is not None:
            step = final_step if final_step is not None else max(self._step_seen, 0)
            self._write_all(self._analyzer.finish(step))

    # ---- the thread ----
    def _run(self) -> None:
        poll = float(self.options["cluster_poll_s"])
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # never into training: say it once, keep going
                self.errors += 1
                if self.errors == 1:
                    logger.warning("steptrace: cross-rank exchange failed (%s: %s); will retry",
                                   type(exc).__name__, exc)
            self._stop.wait(poll)
        try:
            self.poll_once()  # what the last steps published
        except Exception:
            self.errors += 1

    def poll_once(self) -> None:
        if self._store is None:
            self._store = self._get_store()
            if self._store is None:
                return  # torch.distributed not initialized yet
        self._read_own_log()
        self._publish_heartbeat()
        if self._aggregator:
            self._aggregate()

    # ---- this rank ----
    def _read_own_log(self) -> None:
        for line in self._log.new_lines():
            if not line.startswith(b'{"kind":"step"'):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            self._add_step(rec)

    def _add_step(self, rec: dict) -> None:
        step = int(rec["step"])
        self._step_seen = max(self._step_seen, step)
        self._step_ms.append(float(rec.get("host_ms", rec.get("step_ms", 0.0))))
        del self._step_ms[:-200]
        index = step // self._interval
        if self._window_index is not None and index != self._window_index:
            self._publish_window()
        self._window_index = index
        self._window_steps.append(rec)
        if step % self._interval == self._interval - 1:
            self._publish_window()

    def _publish_window(self) -> None:
        steps, index = self._window_steps, self._window_index
        self._window_steps = []
        if index is None or index <= self._published_window or len(steps) < max(1, self._interval // 2):
            return
        summary = window_summary(self.rank, index, steps, self.host)
        if summary is None:
            return
        self._store.set(self._prefix + f"w{self.rank}", json.dumps(summary, separators=(",", ":")))
        self._published_window = index

    def _publish_heartbeat(self) -> None:
        core = self._core
        in_step = bool(core.in_step)
        begun = int(core.step_index)
        phase = core.current_phase if in_step else ""
        in_collective = int(core.collectives_in_flight > 0)
        now = self._clock()
        # Progress is any change of step, phase or collective state since the last poll, not
        # only a step boundary: a rank whose all-reduce just completed (now in its optimizer)
        # is not stuck, even while the peer it waited for is still in that collective.
        activity = (begun, in_step, phase, in_collective)
        if activity != self._activity_seen:
            self._activity_seen, self._progress_t = activity, now
        # Short keys: the aggregator reads every rank's heartbeat at each poll.
        hb = {"t": round(now, 3), "p": round(self._progress_t, 3), "s": max(begun - 1, 0),
              "ph": phase, "c": in_collective,
              "w": self._published_window,
              "m": round(statistics.median(self._step_ms) / 1000.0, 4) if self._step_ms else 0.0}
        self._store.set(self._prefix + f"h{self.rank}", json.dumps(hb, separators=(",", ":")))

    # ---- the aggregating rank ----
    def _fetch(self, kind: str, ranks: list[int]) -> dict[int, bytes]:
        keys = [self._prefix + f"{kind}{r}" for r in ranks]
        if not keys:
            return {}
        values = self._store.multi_get(keys)
        return dict(zip(ranks, values))

    def _aggregate(self) -> None:
        store = self._store
        if len(self._seen) < self.world:  # keys are never deleted: seen once, readable from now on
            unseen = [r for r in range(self.world) if r not in self._seen]
            if store.check([self._prefix + f"h{r}" for r in unseen]):
                self._seen.update(unseen)  # one round trip once every rank runs
            else:  # some have not started yet: at most _PROBES round trips per poll, in turn
                start = self._probe % len(unseen)
                for r in (unseen[start:] + unseen[:start])[:_PROBES]:
                    if store.check([self._prefix + f"h{r}"]):
                        self._seen.add(r)
                self._probe += _PROBES
        raw = self._fetch("h", sorted(self._seen))
        now = self._clock()
        # unchanged: the rank published nothing since the last poll; the others in one parse
        changed = [(r, value) for r, value in raw.items() if self._hb_raw.get(r) != value]
        parsed = json.loads(b"[" + b",".join(bytes(v) for _, v in changed) + b"]") if changed else []
        for (r, value), raw_hb in zip(changed, parsed):
            self._hb_raw[r] = value
            # On this rank's clock (hosts' clocks differ): seen now, progress as old as the
            # publisher says (a difference of its own clock's readings).
            age = max(0.0, float(raw_hb["t"]) - float(raw_hb["p"]))
            self._hb[r] = {"t": now, "progress_t": now - age, "step": int(raw_hb["s"]),
                           "phase": raw_hb["ph"], "in_collective": bool(raw_hb["c"]),
                           "window": int(raw_hb["w"]), "median_step_s": float(raw_hb["m"]),
                           "host": self._hosts.get(r, "")}
        median_step_s = _median(hb.get("median_step_s", 0.0) for hb in self._hb.values()) or 0.0
        unix_ns = time.time_ns()
        self._write_all(self._analyzer.silence(self._hb, now, median_step_s, self._seen, unix_ns))
        published = {r: int(hb.get("window", -1)) for r, hb in self._hb.items()}
        if len(published) < 2:
            return
        # A rank more than one window behind the newest (stopped, or hung: rank_silent says
        # so) does not hold the view back; the record's ranks_reporting shows it is missing.
        newest = max(published.values())
        target = min(w for w in published.values() if w >= newest - 1)
        if target <= self._windows_done:
            return
        ready = [r for r, w in published.items() if w >= target]
        fetched = self._fetch("w", ready)
        parsed = json.loads(b"[" + b",".join(bytes(v) for v in fetched.values()) + b"]")  # one parse
        summaries = dict(zip(fetched, parsed))
        for r, summary in summaries.items():
            self._hosts[r] = summary.get("host", "")
        record, alerts = self._analyzer.window(summaries, world_size=self.world, unix_ns=unix_ns)
        self._windows_done = target
        self._write_all([record, *alerts])

    def _write_all(self, records: list[dict]) -> None:
        for rec in records:
            try:
                self._core.write_record(json.dumps(rec, separators=(",", ":")))
            except Exception as exc:
                self.errors += 1
                logger.debug("steptrace: cluster record not written: %s", exc)


def wants_exchange(mode: str, world_size: int) -> bool:
    """Whether a profiler with option ``cluster=mode`` runs the exchange: never for a single
    process; with ``auto`` whenever the run has several ranks (the store is looked up once
    torch.distributed is initialized)."""
    return mode != "off" and world_size >= 2


def _fmt(v: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _share(part: Optional[float], whole: Optional[float]) -> str:
    return "-" if part is None or not whole else f"{100.0 * part / whole:.0f}%"


def stragglers_found(result: Mapping[str, Any]) -> list[int]:
    """Ranks a straggler alert named in an :func:`analyze_records` result."""
    return sorted({a["subject_rank"] for a in result["alerts"]
                   if a["kind"] == "alert" and a["type"] == "straggler"})


def format_cluster(result: Mapping[str, Any], source: str = "") -> str:
    """The per-rank table and the verdict of :func:`analyze_records`, as text."""
    table = result["table"]
    lines = []
    if table is None:
        return f"{source or 'run'}: no completed steps"
    lines.append(f"cluster view of {source or 'run'}: {len(table['ranks'])} rank(s), "
                 f"windows of {result['interval']} steps, communication timed by: "
                 f"{table['method'] or 'nothing (call prof.watch(ddp_model))'}")
    head = ["rank", "host", "steps", "p50 ms", "p95 ms", "compute", "comm", "wait", "data",
            "straggler", "memory"]
    # the GPU's power and temperature (NVML), where any rank has them: hot_gpu compares these
    with_hw = any(row.get("hw") for row in table["ranks"])
    if with_hw:
        head += ["power", "temp"]
    rows = [head]
    for row in table["ranks"]:
        mem = row.get("memory_bytes")
        rows.append([str(row["rank"]), row.get("host") or "?", str(row["steps"]), _fmt(row["step_ms"], ".2f"),
                     _fmt(row["step_p95_ms"], ".2f"), _share(row["compute_ms"], row["step_ms"]),
                     _share(row["comm_ms"], row["step_ms"]), _share(row["wait_ms"], row["step_ms"]),
                     _share(row["data_ms"], row["step_ms"]), _fmt(row["straggler_pct"], "+.1f", "%"),
                     "-" if not mem else f"{mem / 2**20:.0f} MiB"])
        if with_hw:
            hw = row.get("hw") or {}
            rows[-1] += [_fmt(hw.get(HW_POWER_KEY), ".0f", " W"), _fmt(hw.get(HW_TEMP_KEY), ".0f", " C")]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i not in (1,) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.append("(compute / comm / wait / data: shares of the median step; straggler: own work, "
                 "compute + data, against the median of the other ranks)")
    windows = len(result["windows"])
    found = stragglers_found(result)
    for r in found:
        alerts = [a for a in result["alerts"] if a["kind"] == "alert" and a["type"] == "straggler"
                  and a["subject_rank"] == r]
        hit = sum(1 for w in result["windows"] if r in w["stragglers"])
        a = alerts[0]
        lines.append(f"STRAGGLER: rank {r} (host {a['details']['host'] or '?'}): own work "
                     f"{a['details'].get('excess_pct', 0):.0f}% above the other ranks' median at its first "
                     f"alert (step {a['step']}); a straggler in {hit} of {windows} windows; slower in {a['phase']}")
        lines.append(f"  {a['message']}")
    for a in result["alerts"]:
        if a["kind"] == "alert" and a["type"] != "straggler":
            lines.append(f"{a['type'].upper()} at step {a['step']}: {a['message']}")
    if not found and len(table["ranks"]) >= 2:
        slowest = table.get("slowest_rank")
        lines.append(f"no straggler: the slowest rank ({slowest}) is {table.get('slowest_excess_pct', 0):+.1f}% "
                     f"against the other ranks' median over the run, in {windows} windows compared")
    elif len(table["ranks"]) < 2:
        lines.append("one rank only: nothing to compare across ranks")
    return "\n".join(lines)
