"""The cross-rank rules over windows of per-rank summaries (``straggler``,
``comm_straggler``, ``hot_gpu``, ``comm_heavy``) and over heartbeats (``rank_silent``),
each a stream of alert episodes kept by one :class:`EpisodeTracker`."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

from steptrace.cluster.episodes import EpisodeTracker
from steptrace.cluster.options import CLUSTER_OPTIONS, HW_POWER_KEY, HW_TEMP_KEY
from steptrace.cluster.stats import WORK_KEYS, _common, _median, _medians_without_each
from steptrace.live.flight_recorder import cross_rank

_PHASE_ADVICE = {
    "data": "its input pipeline is slower: give its DataLoader more workers or pinned memory, "
            "and check that host's CPU and disk",
    "optimizer": "its optimizer step is slower: check its GPU's clocks and throttling, and "
                 "CPU contention on its host",
}
_COMPUTE_ADVICE = ("it computes slower: check its GPU (clocks, thermal or power throttling, "
                   "ECC errors), CPU contention on its host, or an uneven batch")
_GC_ADVICE = ("Python's garbage collector stops it for most of its excess: gc.freeze() after set-up, "
              "or gc.disable() and gc.collect() every N steps on every rank at the same step "
              "(Megatron-LM's --manual-gc)")


class ClusterAnalyzer:
    """The cross-rank rules over windows of per-rank summaries, with alert episodes (one
    alert per episode, a ``resolved`` record when it ends). Feed it windows in order."""

    def __init__(self, options: Optional[Mapping[str, Any]] = None, rank: int = 0) -> None:
        self.options = {**CLUSTER_OPTIONS, **(options or {})}
        self.rank = rank
        self._episodes = EpisodeTracker(rank)
        self._spans: dict[int, tuple[Optional[int], Optional[int]]] = {}  # the window's, by rank (-1: all)
        self.last_cluster: Optional[dict] = None

    @property
    def alert_counts(self) -> dict[str, int]:
        """How many alerts each kind raised (one per episode)."""
        return self._episodes.alert_counts

    def _window_rule(self, kind: str, r: int, hit: bool, step: int, unix_ns: Optional[int],
                     make: Callable[[], dict], resolved_text: str) -> list[dict]:
        """One window's observation of a window rule: an episode opens after
        ``straggler_windows`` windows in a row lasting ``straggler_min_s`` (the subject rank's
        windows' own times; the job's for ``r`` < 0). A rank slower only for a few seconds,
        or one that changes every few windows (ranks moved between a VM's slower and faster
        CPUs), costs the job little and says nothing about a rank."""
        o = self.options
        return self._episodes.update(kind, r, hit, step, o["straggler_windows"], unix_ns, make, resolved_text,
                                     span=self._spans.get(r, (None, None)),
                                     min_ns=int(o["straggler_min_s"] * 1e9))

    # ---- one window ----
    def window(self, summaries: Mapping[int, Mapping[str, Any]], world_size: Optional[int] = None,
               unix_ns: Optional[int] = None, all_rows: bool = False) -> tuple[dict, list[dict]]:
        """The cluster record for one window and the alert / resolved records it causes.
        Beyond ``cluster_max_rows`` ranks the record lists only the ranks that matter (see
        :meth:`_keep_rows`) unless ``all_rows``."""
        o = self.options
        ranks = sorted(summaries)
        s = {r: summaries[r] for r in ranks}
        self._spans = {r: (s[r].get("start_unix_ns"), s[r].get("end_unix_ns")) for r in ranks}
        starts, ends = [a for a, _ in self._spans.values()], [b for _, b in self._spans.values()]
        self._spans[-1] = ((min(starts), max(ends)) if ranks and None not in starts and None not in ends
                           else (None, None))
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
            for key in ("runq_ms", "gc_ms", "memory_bytes", "hw", "busbw_gbps", *WORK_KEYS):
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

        # straggler: own work (compute + data, not waiting) above the others' median. Where
        # communication was not timed, every rank's step includes the wait, so step times
        # agree: then a rank is named from its phases, with lower confidence, when one of its
        # phases runs above the others' and they show the matching wait in another phase.
        inferred = record["method"] is None
        others_step = _medians_without_each({r: s[r]["step_ms"] for r in ranks})
        # Waiting for a CPU is the host's doing (host_contention on the rank itself), not the
        # rank's work: the part of a rank's excess that is run-queue wait above the others'
        # does not make it a straggler (a CPU hog beside a 2-rank job moves between the ranks).
        others_runq = _medians_without_each({r: s[r].get("runq_ms") for r in ranks})
        # Python's garbage collector: a straggler whose excess is mostly collection is named
        # with that cause and its advice (issue 52)
        others_gc = _medians_without_each({r: s[r].get("gc_ms") for r in ranks})
        for row in rows:
            r = row["rank"]
            other_own = others_own[r]
            excess = row["own_ms"] - other_own if other_own is not None else 0.0
            phase, phase_excess, others_wait = slower_phase(r)
            if inferred:
                base_step = others_step[r]
                excess = phase_excess
                pct = 100.0 * phase_excess / base_step if base_step else None
                hit = (pct is not None and pct > o["straggler_pct"] and phase_excess > o["straggler_min_ms"]
                       and others_wait >= 0.5 * phase_excess)
            else:
                pct = row["straggler_pct"]
                contention = max(0.0, (s[r].get("runq_ms") or 0.0) - (others_runq[r] or 0.0))
                hit = (other_own is not None and pct is not None
                       and pct > o["straggler_pct"] and excess > o["straggler_min_ms"]
                       and excess - contention > max(o["straggler_min_ms"],
                                                     other_own * o["straggler_pct"] / 100.0))
            if hit:
                record["stragglers"].append(r)
            advice = _PHASE_ADVICE.get(phase, _COMPUTE_ADVICE)
            gc_excess = max(0.0, (s[r].get("gc_ms") or 0.0) - (others_gc[r] or 0.0))
            if not inferred and excess > 0 and gc_excess >= 0.5 * excess:
                phase, advice = "garbage collection", _GC_ADVICE
            if inferred:
                alerts += self._window_rule(
                    "straggler", r, hit, step, unix_ns,
                    lambda: self._inferred_straggler(row, phase, phase_excess, others_wait, others_step[r],
                                                     pct, advice),
                    f"rank {r} no longer a straggler")
                continue
            alerts += self._window_rule(
                "straggler", r, hit, step, unix_ns,
                lambda: {"value": row["own_ms"], "baseline": other_own,
                         "threshold": round(other_own * (1 + o["straggler_pct"] / 100.0), 4), "phase": phase,
                         "message": (f"rank {r} (host {row['host'] or '?'}) is a straggler: its own work "
                                     f"(compute + data) is {row['straggler_pct']:.0f}% above the other ranks' "
                                     f"median ({row['own_ms']:.1f} ms vs {other_own:.1f} ms), slower in "
                                     f"{phase}; every rank waits for it at each collective: {advice}"),
                         "details": {"host": row["host"], "excess_pct": round(row["straggler_pct"], 2),
                                     "excess_ms": round(excess, 3), "phase_excess_ms": round(phase_excess, 3),
                                     "gc_excess_ms": round(gc_excess, 3),
                                     "windows": o["straggler_windows"], "advice": advice}},
                f"rank {r} no longer a straggler")

        # comm_straggler: a rank's communication (net of waiting) above the others'
        for row in rows:
            r = row["rank"]
            other_comm = others_comm[r]
            hit = (row["comm_ms"] is not None and other_comm is not None and other_comm > 0
                   and row["comm_ms"] > other_comm * (1 + o["comm_imbalance_pct"] / 100.0)
                   and row["comm_ms"] - other_comm > o["straggler_min_ms"])
            alerts += self._window_rule(
                "comm_straggler", r, hit, step, unix_ns,
                lambda: {"value": row["comm_ms"], "baseline": other_comm,
                         "threshold": round(other_comm * (1 + o["comm_imbalance_pct"] / 100.0), 4),
                         "phase": None,
                         "message": (f"rank {r} (host {row['host'] or '?'}) spends "
                                     f"{row['comm_ms']:.1f} ms per step communicating, "
                                     f"{100 * (row['comm_ms'] / other_comm - 1):.0f}% more than the other ranks "
                                     f"({other_comm:.1f} ms): check its interconnect, NIC and topology "
                                     f"(NCCL_DEBUG=INFO shows the rings it uses)"),
                         "details": {"host": row["host"], "windows": o["straggler_windows"],
                                     "busbw_gbps": row.get("busbw_gbps"),
                                     "others_busbw_gbps": _median(x.get("busbw_gbps") for q, x in s.items()
                                                                  if q != r and x.get("busbw_gbps") is not None)}},
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
        alerts += self._window_rule(
            "comm_heavy", -1, hit, step, unix_ns,
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
            alerts += self._window_rule(
                "hot_gpu", r, hit, step, unix_ns,
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

    def _inferred_straggler(self, row: Mapping[str, Any], phase: str, excess: float, others_wait: float,
                            others_step: float, pct: float, advice: str) -> dict:
        """The straggler alert named from phases alone (communication not timed)."""
        r = row["rank"]
        return {"value": round(excess, 4), "baseline": others_step,
                "threshold": round(others_step * self.options["straggler_pct"] / 100.0, 4), "phase": phase,
                "message": (f"rank {r} (host {row['host'] or '?'}) is likely a straggler: its {phase} runs "
                            f"{excess:.1f} ms above the other ranks' ({pct:.0f}% of their step), and they "
                            f"spend {others_wait:.1f} ms more than it in another phase, waiting for it at the "
                            f"collective; lower confidence: communication was not timed (comm_timing, "
                            f"docs/distributed.md): {advice}"),
                "details": {"host": row["host"], "excess_pct": round(pct, 2), "excess_ms": round(excess, 3),
                            "phase_excess_ms": round(excess, 3), "others_wait_ms": round(others_wait, 3),
                            "confidence": "low", "from": "phases",
                            "windows": self.options["straggler_windows"], "advice": advice}}

    def _slower_phases(self, s: Mapping[int, Mapping[str, Any]]) -> Callable[[int], tuple[str, float, float]]:
        """For every rank: the phase (data included) that runs longest above the other ranks'
        median, that excess, and the matching wait: the most the other ranks spend above
        this rank in a later phase of the step (where they wait for it at the collective). In
        O(phases x n log n) for all: each phase's median over the other ranks comes from one
        sort (a phase a rank lacks counts as 0)."""
        names = {n for x in s.values() for n in (x.get("phases_ms") or {})} - {"data"}
        base = {n: _medians_without_each({q: (x.get("phases_ms") or {}).get(n, 0.0) for q, x in s.items()})
                for n in names}
        base["data"] = _medians_without_each({q: x.get("data_ms") or 0.0 for q, x in s.items()})

        def slower(r: int) -> tuple[str, float, float]:
            mine = dict(s[r].get("phases_ms") or {})
            mine["data"] = s[r].get("data_ms") or 0.0
            best, best_excess = "compute", 0.0
            for name, value in mine.items():
                b = base[name][r]
                if b is not None and value - b > best_excess:
                    best, best_excess = name, value - b
            # the wait comes after its cause, at the collective: only a later phase counts
            # (so the waiting ranks, whose wait phase runs long, are not named in its place)
            order = {n: i for i, n in enumerate(s[r].get("phases_ms") or {})}
            order["data"] = -1
            at = order.get(best, len(order))
            others_wait = max((base[n][r] - mine.get(n, 0.0) for n in base
                               if order.get(n, -2) > at and base[n][r] is not None), default=0.0)
            return best, best_excess, max(0.0, others_wait)

        return slower

    # ---- silence ----
    def silence(self, heartbeats: Mapping[int, Mapping[str, Any]], now: float, median_step_s: float,
                expected: Iterable[int], unix_ns: Optional[int] = None) -> list[dict]:
        """rank_silent for ranks stuck outside a collective while others wait in one, or whose
        heartbeats stopped; ``heartbeats[r]`` has ``t`` (last publish, seconds), ``progress_t``
        (last step change), ``step``, ``phase``, ``in_collective`` and ``interval`` (the
        evaluation or checkpoint the rank is in, or empty)."""
        limit = self.silence_limit(median_step_s)
        publishing = self.publishing_limit(median_step_s)
        waiting = {r for r, hb in heartbeats.items() if hb.get("in_collective") and now - hb["progress_t"] > limit}
        alerts: list[dict] = []
        for r in sorted(expected):
            hb = heartbeats.get(r)
            if hb is None:
                continue  # never seen: not yet started (reported once it was seen)
            stopped_publishing = now - hb["t"] > publishing
            # a rank in a marked evaluation or checkpoint does planned work while the others
            # wait (nanoGPT's rank 0 alone); its own interval_hang watches how long it takes
            stuck = (now - hb["progress_t"] > limit and not hb.get("in_collective")
                     and not hb.get("interval") and bool(waiting - {r}))
            hit = stopped_publishing or stuck
            where = hb.get("phase") or "between steps"
            reason = ("stopped publishing" if stopped_publishing
                      else f"blocked outside communication in {where}")
            alerts += self._episodes.update(
                "rank_silent", r, hit, int(hb.get("step", 0)), 1, unix_ns,
                lambda: self._silent_alert(r, hb, heartbeats, waiting, now, limit, reason),
                f"rank {r} makes progress again")
        return alerts

    def silence_limit(self, median_step_s: float) -> float:
        """How long a rank may make no progress before it is silent (s)."""
        return max(self.options["cluster_silent_s"], 10 * median_step_s)

    def publishing_limit(self, median_step_s: float) -> float:
        """How long since its last heartbeat a rank has stopped publishing (s)."""
        return self.silence_limit(median_step_s) + 2 * float(self.options["cluster_poll_s"])

    @staticmethod
    def _silent_alert(r: int, hb: Mapping[str, Any], heartbeats: Mapping[int, Mapping[str, Any]],
                      waiting: set, now: float, limit: float, reason: str) -> dict:
        fr = cross_rank(heartbeats)
        parted = fr.get("parted") if fr else None
        return {"value": round(now - min(hb["t"], hb["progress_t"]), 3), "baseline": None,
                "threshold": limit, "phase": hb.get("phase") or None,
                "message": (f"rank {r} (host {hb.get('host') or '?'}) has made no progress for "
                            f"{now - hb['progress_t']:.1f} s ({reason}; last step {hb.get('step')}) "
                            f"while {len(waiting - {r})} other rank(s) wait in a collective"
                            + (f"; {parted['message']}" if parted else "")
                            + ": look at that rank's stacks (py-spy dump, or its hang alert)"),
                "details": {"host": hb.get("host", ""), "last_step": hb.get("step"),
                            "reason": reason, "waiting_ranks": sorted(waiting - {r}),
                            **({"flight_recorder": fr} if fr else {})}}

    def finish(self, step: int) -> list[dict]:
        """Resolves the episodes still open at the end of the run."""
        return self._episodes.close_all(step, "open at the end of the run")
