"""Collect a stream of steptrace records into compact columns: the engine of the
summary, the DataFrames, the CSV export and the plots.

A :class:`StepTable` keeps one ``array`` per step field (8 bytes a value: a million
steps with a dozen fields take ~100 MB, where Python lists of floats would take ~1 GB)
and the few other records (run_start, alert, resolved, cluster, run_end, evidence) as dicts;
``interval`` records are folded into per-rank, per-kind totals (:class:`IntervalStats`).
Steps are buffered in chunks of :data:`CHUNK` and turned into columns a field at a time
with ``map(itemgetter(...))``, about a microsecond a step. Missing or non-numeric values
become NaN (or -1 for integer fields): a malformed, unvalidated log is tolerated here,
never an error. Pure Python; numpy is used for the statistics where it is installed.
"""

from __future__ import annotations

import math
from array import array
from itertools import chain, repeat
from operator import itemgetter
from typing import Any, Iterable, Optional

NAN = float("nan")
_EMPTY: dict = {}

#: Nested numeric groups of a step record: (record key, column prefix).
GROUPS = (("memory", ""), ("counters", ""), ("kernels", "kernel_"), ("telemetry", ""), ("comm", "comm_"), ("meta", "meta_"),
          ("work", ""), ("gc", "gc_"))
#: Step fields with their own fixed columns (the names phases must not take).
FIXED_COLUMNS = (
    "run_id", "rank", "step", "start_unix_ns", "clock", "status",
    "step_ms", "data_ms", "host_ms", "iteration_ms", "waited",
    "other_ms", "eval_ms", "checkpoint_ms", "interval_in_step_ms", "runq_ms", "runq_span_ms",
    "on_cpu_ms", "steal_ms",
)
#: The time between steps, by kind, as step fields (after data_ms): fixed columns, NaN
#: where a step does not have the field (older logs have none of them; eval_ms,
#: checkpoint_ms and interval_in_step_ms are written only when > 0).
BETWEEN_FIELDS = ("other_ms", "eval_ms", "checkpoint_ms", "interval_in_step_ms")
#: The step's ``host`` object (run-queue wait, time on a CPU and steal, on the steps where
#: it was read).
HOST_FIELDS = ("runq_ms", "runq_span_ms", "on_cpu_ms", "steal_ms")
#: The kinds of an ``interval`` record.
INTERVAL_KINDS = ("eval", "checkpoint", "other")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def as_object(v: Any) -> dict:
    """``v`` when it is a JSON object, else ``{}``: a record field that a corrupt or edited
    log made a list, a string or a number reads as absent."""
    return v if isinstance(v, dict) else {}


def _num(v: Any) -> float:
    return float(v) if _is_num(v) else NAN


def _int(v: Any, default: int = -1, junk: int = -1) -> int:
    """``v`` as an int64: ``default`` when None (missing), ``junk`` when not a whole number."""
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return junk
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            return junk
        v = int(v)
    return v if -(2**63) <= v < 2**63 else junk


#: kind, rank, step, start_unix_ns, clock, status, step_ms, data_ms, host_ms, phases_ms, memory
_PLAIN_FIELDS = 11
#: Distinct keys a group keeps columns for; more are ignored. The profiler writes at most
#: 32 phases; a corrupt line with a million keys would otherwise make a million columns
#: that every later step fills (minutes and gigabytes).
MAX_KEYS = 4096
CHUNK = 1024  # steps buffered per column pass: big enough to amortize, small enough for the cache


def _take(dicts: list, key: str) -> list:  # noqa: D401
    """``[d[key] for d in dicts]`` at C speed; None where a dict lacks the key."""
    try:
        return list(map(itemgetter(key), dicts))
    except KeyError:
        return list(map(dict.get, dicts, repeat(key)))


def _floats(values: list) -> array:
    try:
        return array("d", values)
    except TypeError:  # None (missing) or junk somewhere: convert one by one
        return array("d", [_num(v) for v in values])


def _sparse_floats(values: list) -> array:
    """Like :func:`_floats` for a field most steps lack (None): NaN there, fast."""
    m = len(values)
    if values.count(None) == m:
        return array("d", [NAN]) * m
    try:
        return array("d", [NAN if v is None else v for v in values])
    except (TypeError, OverflowError):  # junk somewhere (a list, a 400-digit int)
        return array("d", [_num(v) for v in values])


def _ints(values: list, default: int = -1, junk: int = -1) -> array:
    try:
        return array("q", values)
    except (TypeError, OverflowError):
        return array("q", [_int(v, default, junk) for v in values])


class _Group:
    """Columns for one nested map of the steps (phases_ms, memory, counters, ...): one
    float array per key, NaN where a step lacks the key, in first-seen key order."""

    __slots__ = ("cols",)

    def __init__(self) -> None:
        self.cols: dict[str, array] = {}

    def extend(self, dicts: list, n0: int) -> None:
        """Append one row per element of ``dicts`` (dicts, or None/junk for none)."""
        m = len(dicts)
        cols = self.cols
        if dicts.count(None) == m:
            if cols:
                filler = array("d", [NAN]) * m
                for col in cols.values():
                    col.extend(filler)
            return
        types = set(map(type, dicts))
        if types != {dict}:
            dicts = [d if type(d) is dict else _EMPTY for d in dicts]
        lens = set(map(len, dicts))
        if not (len(lens) == 1 and len(cols) in lens):  # else every dict holds exactly the known keys
            for k in dict.fromkeys(chain.from_iterable(dicts)):
                if k not in cols and isinstance(k, str) and k and len(cols) < MAX_KEYS:
                    cols[k] = array("d", [NAN]) * n0
        for k, col in cols.items():
            col.extend(_floats(_take(dicts, k)))


class HwSeries:
    """The ``hw`` objects of the step records (NVML readings over each step), one list a
    field, in reading order (a StepTable keeps one, ``table.hw``, so the summary, the
    plots and the report never read the log again for them); ``tee`` collects them while
    the records pass through."""

    FIELDS = ("power_w", "min_power_w", "energy_j", "max_temp_c", "sm_clock_mhz", "power_limit_w")

    def __init__(self) -> None:
        self.rank: list[int] = []
        self.step: list[int] = []
        self.step_ms: list[float] = []
        self.values: dict[str, list[float]] = {f: [] for f in self.FIELDS}
        self.throttle: list[tuple[str, ...]] = []

    def __len__(self) -> int:
        return len(self.step)

    def add(self, rec: dict[str, Any]) -> None:
        hw = rec.get("hw")
        if not isinstance(hw, dict) or not _is_num(rec.get("step")):
            return
        r = rec.get("rank", 0)
        self.rank.append(r if _is_num(r) else 0)
        self.step.append(int(rec["step"]))
        sm = rec.get("step_ms")
        self.step_ms.append(float(sm) if _is_num(sm) else NAN)
        for f in self.FIELDS:
            v = hw.get(f)
            self.values[f].append(float(v) if _is_num(v) else NAN)
        reasons = hw.get("throttle_reasons")
        self.throttle.append(tuple(str(x) for x in reasons) if isinstance(reasons, list) else ())

    def tee(self, records: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
        add = self.add
        for rec in records:
            if rec.get("kind") == "step" and "hw" in rec:
                add(rec)
            yield rec

    @classmethod
    def of(cls, records: Iterable[dict[str, Any]]) -> "HwSeries":
        series = cls()
        for _ in series.tee(records):
            pass
        return series


class IntervalStats:
    """The ``interval`` records folded per rank and kind (a run that names its logging an
    interval writes one per step: they are not kept one by one). ``by_rank[rank][kind]``
    is ``[count, total_ms, max_ms, inside_step_count]``; ``last[rank]`` is the step the
    rank's latest intervals were listed for, with their eval and checkpoint ms and their
    latest end (unix ns): after the run's last step, those are the intervals that no
    step record lists. Records of an unknown kind or without a usable duration are
    ignored (an unvalidated log)."""

    __slots__ = ("by_rank", "last")

    def __init__(self) -> None:
        self.by_rank: dict[int, dict[str, list[float]]] = {}
        self.last: dict[int, list[float]] = {}  # rank -> [step, eval_ms, checkpoint_ms, end_unix_ns]

    def add(self, rec: dict[str, Any]) -> None:
        kind, ms = rec.get("interval"), rec.get("duration_ms")
        if not isinstance(kind, str) or kind not in INTERVAL_KINDS or not _is_num(ms) or not 0 <= ms < math.inf:
            return
        rank = _int(rec.get("rank", 0), 0, -1)
        if rank < 0:
            return
        kinds = self.by_rank.setdefault(rank, {})
        entry = kinds.get(kind)
        if entry is None:
            entry = kinds[kind] = [0, 0.0, 0.0, 0]
        entry[0] += 1
        entry[1] += ms
        entry[2] = max(entry[2], ms)
        entry[3] += rec.get("inside_step") is True
        step = _int(rec.get("step"), -1, -1)
        start = _int(rec.get("start_unix_ns"), -1, -1)
        last = self.last.get(rank)
        if last is None or step > last[0]:
            last = self.last[rank] = [step, 0.0, 0.0, -1]
        if step == last[0]:
            if kind == "eval":
                last[1] += ms
            elif kind == "checkpoint":
                last[2] += ms
            if start >= 0 and ms < 1e12:  # an end beyond 30 years is junk, not a time
                last[3] = max(last[3], start + round(ms * 1e6))

    def totals(self) -> dict[str, dict[str, Any]]:
        """Per kind over all ranks: ``count``, ``total_s``, ``max_s``, ``inside_step``."""
        out: dict[str, dict[str, Any]] = {}
        for kinds in self.by_rank.values():
            for kind in INTERVAL_KINDS:
                e = kinds.get(kind)
                if e is None:
                    continue
                t = out.setdefault(kind, {"count": 0, "total_s": 0.0, "max_s": 0.0, "inside_step": 0})
                t["count"] += e[0]
                t["total_s"] += e[1] / 1e3
                t["max_s"] = max(t["max_s"], e[2] / 1e3)
                t["inside_step"] += e[3]
        return {k: out[k] for k in INTERVAL_KINDS if k in out}


class StepTable:
    """Columns of the step records of one or more runs, plus their other records."""

    def __init__(self) -> None:
        self.n = 0
        self.src = array("q")  # index into run_starts of the run_start this step follows
        self.rank = array("q")
        self.step = array("q")
        self.start_ns = array("q")  # -1 when missing
        self.step_ms = array("d")
        self.data_ms = array("d")
        self.host_ms = array("d")
        # the time between steps by kind and the run-queue wait (NaN where absent)
        self.between = {f: array("d") for f in BETWEEN_FIELDS}
        self.host = {f: array("d") for f in HOST_FIELDS}
        self.ok = array("b")  # 1 for status "ok" (or none), 0 for "error"
        self.clock = array("b")  # index into clocks
        self.clocks: list[str] = []
        self.phases = _Group()
        self.host_phases = _Group()
        self.retained = _Group()  # phase_retained_bytes: bytes each phase left allocated
        self.groups = {key: _Group() for key, _ in GROUPS}
        self.run_starts: list[dict[str, Any]] = []
        self.run_ends: list[dict[str, Any]] = []
        self.alerts: list[dict[str, Any]] = []
        self.alert_src: list[int] = []  # the run_start each alert follows, like src for steps
        self.resolved: list[dict[str, Any]] = []
        self.evidence: list[dict[str, Any]] = []  # alert_update records with details.evidence (issue 54)
        self.clusters: list[dict[str, Any]] = []
        self.intervals = IntervalStats()
        self.hw = HwSeries()  # the steps' NVML readings (hw objects hold a list: not a group)
        self.other_ranks: list[Any] = []  # ranks of non-step records, in order seen

    # ----------------------------------------------------------------- collecting

    def add(self, records: Iterable[dict[str, Any]]) -> "StepTable":
        """Collect ``records`` (any iterable of record dicts); returns self."""
        buf: list[dict[str, Any]] = []
        push = buf.append
        flush = self._flush
        other = self.other_ranks.append
        hw = self.hw.add
        for rec in records:
            kind = rec.get("kind")
            if kind == "step":
                push(rec)
                if "hw" in rec:
                    hw(rec)
                if len(buf) >= CHUNK:
                    flush(buf)
                    buf = []
                    push = buf.append
                continue
            if kind == "run_start":
                if buf:  # steps before this run_start belong to the previous one
                    flush(buf)
                    buf = []
                    push = buf.append
                self.run_starts.append(rec)
                other(rec.get("rank", 0))
            elif kind == "alert":
                self.alerts.append(rec)
                self.alert_src.append(len(self.run_starts) - 1)
                other(rec.get("rank", 0))
            elif kind == "run_end":
                self.run_ends.append(rec)
                other(rec.get("rank", 0))
            elif kind == "resolved":
                self.resolved.append(rec)
            elif kind == "alert_update" and isinstance(rec.get("details"), dict) and "evidence" in rec["details"]:
                self.evidence.append(rec)
            elif kind == "cluster":
                self.clusters.append(rec)
            elif kind == "interval":
                self.intervals.add(rec)
        if buf:
            flush(buf)
        return self

    def _flush(self, steps: list[dict[str, Any]]) -> None:
        m, n0 = len(steps), self.n
        if set(map(type, steps)) != {dict}:  # pragma: no cover - read() yields dicts only
            steps = [s if type(s) is dict else {} for s in steps]
        complete = True  # every step had every field taken so far

        def take(key: str) -> list:
            nonlocal complete
            try:
                return list(map(itemgetter(key), steps))
            except KeyError:
                complete = False
                return list(map(dict.get, steps, repeat(key)))

        self.src.extend(array("q", [len(self.run_starts) - 1]) * m)
        # a missing or malformed rank (say 1e30, which orjson reads as a float) is the
        # rank of the file's run_start, so the step stays on its own rank's timeline
        own = _int(self.run_starts[-1].get("rank"), 0, 0) if self.run_starts else 0
        ranks = _ints(take("rank"), own, own)
        if ranks and min(ranks) < 0:  # not a rank either
            ranks = array("q", [r if r >= 0 else own for r in ranks])
        self.rank.extend(ranks)
        self.step.extend(_ints(take("step")))
        self.start_ns.extend(_ints(take("start_unix_ns")))
        self.step_ms.extend(_floats(take("step_ms")))
        self.data_ms.extend(_floats(take("data_ms")))
        self.host_ms.extend(_floats(take("host_ms")))
        # other_ms is in every step record of a current log, and in none of an older one
        try:
            other = list(map(itemgetter("other_ms"), steps))
            has_other = True
        except KeyError:
            other = list(map(dict.get, steps, repeat("other_ms")))
            has_other = False
        self.between["other_ms"].extend(_sparse_floats(other) if not has_other else _floats(other))
        status = take("status")
        if status.count("ok") + status.count(None) == m:
            self.ok.extend(array("b", [1]) * m)
        else:
            self.ok.extend(array("b", [s is None or s == "ok" for s in status]))
        clocks = take("clock")
        first = clocks[0]
        if clocks.count(first) == m:
            self.clock.extend(array("b", [self._clock_code(first)]) * m)
        else:
            self.clock.extend(array("b", [self._clock_code(c) for c in clocks]))
        self.phases.extend(take("phases_ms"), n0)
        self.groups["memory"].extend(take("memory"), n0)
        # The common case: every step has exactly the 11 fields taken above (and "kind"),
        # and other_ms, so there are no optional groups to look for.
        plain = complete and set(map(len, steps)) == {_PLAIN_FIELDS + has_other}
        if plain:
            gap = array("d", [NAN]) * m
            for f in BETWEEN_FIELDS[1:]:
                self.between[f].extend(gap)
            for f in HOST_FIELDS:
                self.host[f].extend(gap)
            present: Any = ()
        else:
            # the keys of this chunk's steps: a field none of them has is a column of NaN
            present = set(chain.from_iterable(steps))
            gap = array("d", [NAN]) * m
            for f in BETWEEN_FIELDS[1:]:
                self.between[f].extend(_sparse_floats(list(map(dict.get, steps, repeat(f))))
                                       if f in present else gap)
            if "host" not in present:
                for f in HOST_FIELDS:
                    self.host[f].extend(gap)
            else:
                hosts = [h if type(h) is dict else _EMPTY for h in map(dict.get, steps, repeat("host"))]
                for f in HOST_FIELDS:
                    self.host[f].extend(_sparse_floats(list(map(dict.get, hosts, repeat(f)))))
        optional = [("host_phases_ms", self.host_phases), ("phase_retained_bytes", self.retained)] + [
            (key, self.groups[key]) for key, _ in GROUPS if key != "memory"]
        for key, group in optional:
            if plain or key not in present:
                if group.cols:
                    group.extend([None] * m, n0)
            else:
                group.extend(take(key), n0)
        self.n = n0 + m

    def _clock_code(self, c: Any) -> int:
        c = c if isinstance(c, str) else "?"
        try:
            return self.clocks.index(c)
        except ValueError:
            self.clocks.append(c)
            return len(self.clocks) - 1

    # ----------------------------------------------------------------- views

    def phase_names(self) -> list[str]:
        return list(self.phases.cols)

    def ranks(self) -> list[int]:
        """Every rank seen (steps and other records), sorted; malformed ones dropped."""
        seen = set(_uniq(self.rank))
        seen.update(r for r in self.other_ranks if isinstance(r, int) and not isinstance(r, bool))
        seen.discard(-1)
        return sorted(seen)

    def run_id_of(self, src: int) -> Optional[str]:
        if 0 <= src < len(self.run_starts):
            rid = self.run_starts[src].get("run_id")
            return rid if isinstance(rid, str) else None
        return None

    def column_names(self) -> dict[str, tuple[str, str]]:
        """Column name -> (group, key) for every variable column, in DataFrame order:
        phases ``<name>_ms``, host phases ``host_<name>_ms``, ``<name>_retained_bytes``
        (phase_retained_bytes), then memory, counters,
        kernels (``kernel_<field>``) and telemetry fields under their own names. A name
        that would collide with an earlier column gets a ``phase_`` / ``host_phase_`` /
        group prefix instead."""
        taken = set(FIXED_COLUMNS)
        out: dict[str, tuple[str, str]] = {}

        def put(candidates: list[str], group: str, key: str) -> None:
            for name in candidates:
                if name not in taken:
                    break
            else:
                i = 2
                while f"{candidates[-1]}_{i}" in taken:
                    i += 1
                name = f"{candidates[-1]}_{i}"
            taken.add(name)
            out[name] = (group, key)

        for key in self.phases.cols:
            put([f"{key}_ms", f"phase_{key}_ms"], "phases_ms", key)
        for key in self.host_phases.cols:
            put([f"host_{key}_ms", f"host_phase_{key}_ms"], "host_phases_ms", key)
        for key in self.retained.cols:
            put([f"{key}_retained_bytes", f"phase_{key}_retained_bytes"], "phase_retained_bytes", key)
        for group, prefix in GROUPS:
            for key in self.groups[group].cols:
                put([f"{prefix}{key}", f"{group}_{key}"], group, key)
        return out

    def column(self, group: str, key: str) -> array:
        if group == "phases_ms":
            return self.phases.cols[key]
        if group == "host_phases_ms":
            return self.host_phases.cols[key]
        if group == "phase_retained_bytes":
            return self.retained.cols[key]
        return self.groups[group].cols[key]


def _uniq(values: Iterable[int]) -> list[int]:
    np = numpy()
    if np is not None and isinstance(values, array):
        if len(values) == 0:
            return []
        return [int(v) for v in np.unique(np.frombuffer(values, dtype=np.int64))]
    return sorted(set(values))


_NUMPY: Any = False


def numpy() -> Any:
    """numpy when installed (used for speed), else None."""
    global _NUMPY
    if _NUMPY is False:
        try:
            import numpy as np

            _NUMPY = np
        except ImportError:  # pragma: no cover - depends on the environment
            _NUMPY = None
    return _NUMPY


def collect(records: Iterable[dict[str, Any]]) -> StepTable:
    """A :class:`StepTable` of ``records``."""
    return StepTable().add(records)


__all__ = ["StepTable", "IntervalStats", "collect", "GROUPS", "FIXED_COLUMNS", "BETWEEN_FIELDS", "HOST_FIELDS",
           "INTERVAL_KINDS", "numpy", "NAN"]
