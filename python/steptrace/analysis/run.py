"""Logs as pandas DataFrames: ``steptrace.load(path).steps`` / ``.alerts``.

``load()`` reads a log file, a run folder (all ranks) or a list of either, through the
same streaming reader as :func:`steptrace.read`, into compact columns, and builds the
DataFrames from them on first use. A million steps load in seconds.

``Run.steps`` has one row per step and rank, in file order (rank by rank, step by step):

- ``run_id`` (categorical), ``rank``, ``step``, ``start_unix_ns``, ``clock`` and
  ``status`` (categoricals), ``step_ms``, ``data_ms`` (the wrapped loader's wait),
  ``host_ms``, and ``iteration_ms`` = data_ms + other_ms + step_ms -
  interval_in_step_ms (the training iteration the slow-step rules judge; NaN
  other_ms / interval_in_step_ms count as 0);
- the time between steps by kind: ``other_ms`` (the rest of the gap before the step),
  ``eval_ms``, ``checkpoint_ms`` (intervals that ended since the previous step),
  ``interval_in_step_ms`` (the part of them inside the step), and the run-queue wait
  ``runq_ms`` over ``runq_span_ms`` (on the steps where it was read), with the thread's
  ``on_cpu_ms`` and the hypervisor's ``steal_ms`` in that span: always there, NaN
  where a step does not have the field (older logs have none of them; eval_ms,
  checkpoint_ms and interval_in_step_ms are written only when > 0);
- one ``<phase>_ms`` column per phase (``forward_ms``, ...), ``host_<phase>_ms`` for
  the host times of the phases when the clock is ``cuda``, and ``<phase>_retained_bytes``
  on the steps where the memory-growth detector attributed a rise to the phases;
- memory fields under their own names (``rss_bytes``, ``allocated_bytes``, ...),
  counters (``tensor_active_pct``, ...), kernels as ``kernel_<field>``
  (``kernel_nccl_ms``, ``kernel_count``, ...) and telemetry (``power_w``, ``temp_c``,
  ``sm_clock_mhz``), when the log has them;
- useful work (docs/useful-work.md) under its own names: ``samples``, ``tokens``,
  ``flops``, ``samples_per_s``, ``tokens_per_s``, ``tflops_per_s``, ``mfu_pct``,
  ``j_per_sample``, ``j_per_token``, on the steps that counted them.

A value a step does not have is NaN; byte and count columns without a gap are int64. A
phase whose column name would collide with a fixed column gets a ``phase_`` prefix
(``Run.phase_columns`` maps every phase to its column). ``Run.alerts`` has one row per
alert record (``run_id``, ``rank``, ``step``, ``type``, ``phase``, ``value``,
``baseline``, ``threshold``, ``message``, ``unix_ns``, and ``resolved_step`` when a
``resolved`` record closed that episode).

pandas is an optional dependency: ``pip install 'steptrace[analysis]'``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from steptrace._table import BETWEEN_FIELDS, HOST_FIELDS, StepTable, _int, collect
from steptrace.errors import SteptraceError
from steptrace.analysis.reader import Paths, read
from steptrace.analysis.summary import DEFAULT_PHASES

#: The alert DataFrame's columns, in order.
ALERT_COLUMNS = ("run_id", "rank", "step", "type", "phase", "value", "baseline", "threshold",
                 "message", "unix_ns", "resolved_step")
_INT_SUFFIXES = ("_bytes", "_count")


def is_int_field(group: str, key: str) -> bool:
    """Whether a step field holds whole numbers (bytes, counts)."""
    return key.endswith(_INT_SUFFIXES) or (group == "kernels" and key == "count")


class MissingDependencyError(SteptraceError, ImportError):
    """An optional dependency (pandas, numpy, matplotlib) is not installed."""


def require(module: str, extra: str, what: str) -> Any:
    """Import ``module`` or raise :class:`MissingDependencyError` saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependencyError(
            f"{what} needs {module.split('.')[0]}, which is not installed: pip install 'steptrace[{extra}]'"
        ) from None


class Run:
    """The records of one or more logs, with the steps and alerts as DataFrames."""

    def __init__(self, table: StepTable, source: Optional[str] = None,
                 reread: Optional[Any] = None) -> None:
        self.table = table
        self.source = source
        self._reread = reread  # the records again (the cross-rank view needs whole records)
        self._per_rank: Any = None
        self._steps: Any = None
        self._alerts: Any = None
        self._columns = table.column_names()

    # ------------------------------------------------------------------ records

    @property
    def run_starts(self) -> list[dict[str, Any]]:
        """The run_start record of each file read, in order."""
        return self.table.run_starts

    @property
    def run_ends(self) -> list[dict[str, Any]]:
        return self.table.run_ends

    @property
    def clusters(self) -> list[dict[str, Any]]:
        return self.table.clusters

    @property
    def run_ids(self) -> list[str]:
        """Distinct run ids, in reading order."""
        ids = (rs.get("run_id") for rs in self.table.run_starts)
        return list(dict.fromkeys(i for i in ids if isinstance(i, str)))

    @property
    def ranks(self) -> list[int]:
        return self.table.ranks()

    @property
    def phases(self) -> list[str]:
        """Phase names, the five default phases first (in their order), then the others
        in the order they first appear."""
        names = self.table.phase_names()
        return [p for p in DEFAULT_PHASES if p in names] + [p for p in names if p not in DEFAULT_PHASES]

    @property
    def phase_columns(self) -> dict[str, str]:
        """Phase name -> its column in :attr:`steps`."""
        by_key = {key: col for col, (group, key) in self._columns.items() if group == "phases_ms"}
        return {p: by_key[p] for p in self.phases}

    @property
    def config(self) -> dict[str, Any]:
        """The profiler configuration of the first run_start (window, thresholds, ...)."""
        for rs in self.table.run_starts:
            if isinstance(rs.get("config"), dict):
                return rs["config"]
        return {}

    def summary(self) -> dict[str, Any]:
        """The :func:`steptrace.analysis.summary.summarize` dict of these records."""
        from steptrace.analysis.summary import summarize_table

        return summarize_table(self.table, source=self.source)

    def __len__(self) -> int:
        return self.table.n

    def __repr__(self) -> str:
        ids = self.run_ids
        name = ids[0] if len(ids) == 1 else f"{len(ids)} runs"
        return (f"<steptrace.Run {name}: {self.table.n} steps, {len(self.ranks)} rank(s), "
                f"{len(self.phases)} phases, {len(self.table.alerts)} alerts>")

    # ------------------------------------------------------------------ frames

    @property
    def steps(self) -> Any:
        """One row per step and rank (see the module docstring for the columns)."""
        if self._steps is None:
            self._steps = self._build_steps()
        return self._steps

    @property
    def alerts(self) -> Any:
        """One row per alert record, with ``resolved_step`` where the episode ended."""
        if self._alerts is None:
            self._alerts = self._build_alerts()
        return self._alerts

    @property
    def per_rank(self) -> Any:
        """One row per rank, indexed by rank: the table of ``steptrace cluster`` (step
        p50/p95, compute, comm, wait, data and own work in ms, ``straggler_pct`` against the
        median of the other ranks, memory), over the whole run."""
        if self._per_rank is None:
            pd = require("pandas", "analysis", "Run.per_rank")
            if self._reread is None:
                raise SteptraceError("Run.per_rank needs a Run loaded from files (steptrace.load(run_dir))")
            from steptrace.cluster import analyze_records

            table = analyze_records(self._reread())["table"]
            rows = [{k: v for k, v in row.items() if k != "hw"} for row in (table or {}).get("ranks", [])]
            self._per_rank = pd.DataFrame(rows).set_index("rank") if rows else pd.DataFrame()
        return self._per_rank

    def _run_id_codes(self, src: Any, np: Any) -> tuple[Any, list[str]]:
        ids = [self.table.run_id_of(i) or "" for i in range(len(self.table.run_starts))]
        cats = list(dict.fromkeys(ids))
        code_of = np.array([cats.index(i) for i in ids] + [-1], dtype=np.int64)  # src -1 -> -1
        return code_of[src], cats

    def _build_steps(self) -> Any:
        pd = require("pandas", "analysis", "steptrace.load().steps")
        np = require("numpy", "analysis", "steptrace.load().steps")
        t = self.table

        def arr(a: Any, dtype: Any) -> Any:
            # a copy: the DataFrame must not share the growable array's buffer
            if not len(a):
                return np.zeros(0, dtype=dtype)
            src_dtype = {"d": np.float64, "q": np.int64, "b": np.int8}[a.typecode]
            return np.frombuffer(a, dtype=src_dtype).astype(dtype, copy=True)

        src = arr(t.src, np.int64)
        codes, cats = self._run_id_codes(src, np)
        cols: dict[str, Any] = {
            "run_id": pd.Categorical.from_codes(codes, categories=cats or [""]),
            "rank": arr(t.rank, np.int64),
            "step": arr(t.step, np.int64),
            "start_unix_ns": arr(t.start_ns, np.int64),
            "clock": pd.Categorical.from_codes(arr(t.clock, np.int64), categories=t.clocks or ["host"]),
            "status": pd.Categorical.from_codes(1 - arr(t.ok, np.int64), categories=["ok", "error"]),
        }
        step_ms = arr(t.step_ms, np.float64)
        data_ms = arr(t.data_ms, np.float64)
        cols["step_ms"] = step_ms
        cols["data_ms"] = data_ms
        cols["host_ms"] = arr(t.host_ms, np.float64)
        between = {f: arr(t.between[f], np.float64) for f in BETWEEN_FIELDS}
        cols["iteration_ms"] = (np.nan_to_num(data_ms, nan=0.0) + np.nan_to_num(between["other_ms"], nan=0.0)
                                + step_ms - np.nan_to_num(between["interval_in_step_ms"], nan=0.0))
        cols.update(between)
        for f in HOST_FIELDS:
            cols[f] = arr(t.host[f], np.float64)
        for name, group, key in self.variable_columns():
            values = arr(t.column(group, key), np.float64)
            if is_int_field(group, key):
                # int64 only when every value is a whole number it holds (a corrupt 1e300 is not)
                if len(values) and np.isfinite(values).all() and (np.abs(values) < 2.0**63).all() \
                        and (values == np.floor(values)).all():
                    values = values.astype(np.int64)
            cols[name] = values
        return pd.DataFrame(cols)

    def variable_columns(self) -> list[tuple[str, str, str]]:
        """(column, record group, key) of the per-phase, memory, counter, kernel and
        telemetry columns of :attr:`steps`, in their DataFrame order (phases as
        :attr:`phases` orders them, then the groups in that order)."""
        items = sorted(self._columns.items(), key=lambda kv: self._column_rank(kv[1]))
        return [(name, group, key) for name, (group, key) in items]

    def _column_rank(self, gk: tuple[str, str]) -> tuple[int, int]:
        group, key = gk
        order = {"phases_ms": 0, "host_phases_ms": 1, "phase_retained_bytes": 2, "memory": 3, "counters": 4,
                 "kernels": 5, "telemetry": 6, "comm": 7, "meta": 8, "work": 9}
        if group in ("phases_ms", "host_phases_ms", "phase_retained_bytes"):
            phases = self.phases
            return (order[group], phases.index(key) if key in phases else len(phases))
        return (order.get(group, 9), 0)

    def _build_alerts(self) -> Any:
        pd = require("pandas", "analysis", "steptrace.load().alerts")
        t = self.table
        # an episode (first_step .. step) closes every alert of its type and rank in it
        episodes: dict[tuple[Any, Any], list[tuple[int, int]]] = {}

        def text(v: Any) -> Optional[str]:  # a corrupt log may hold a list where a name goes
            return v if isinstance(v, str) else None

        def key(rec: dict[str, Any]) -> tuple[Any, Any]:
            rank = rec.get("rank", 0)
            return (rank if isinstance(rank, int) else None, text(rec.get("type")))

        for r in t.resolved:
            end, first = r.get("step"), r.get("first_step")
            if isinstance(end, int):
                start = first if isinstance(first, int) else -1
                episodes.setdefault(key(r), []).append((start, end))
        for spans in episodes.values():
            spans.sort(key=lambda se: se[1])

        def resolved_step(a: dict[str, Any]) -> Any:
            st = a.get("step")
            if not isinstance(st, int):
                return None
            for start, end in episodes.get(key(a), ()):
                if end >= st and start <= st:
                    return end
            return None

        rows = []
        for a, src in zip(t.alerts, t.alert_src):
            rid = t.run_id_of(src) or ""
            rows.append({
                "run_id": rid,
                "rank": a.get("rank", 0),
                "step": a.get("step"),
                "type": text(a.get("type")),
                "phase": text(a.get("phase")),
                "value": a.get("value"),
                "baseline": a.get("baseline"),
                "threshold": a.get("threshold"),
                "message": text(a.get("message")),
                "unix_ns": a.get("unix_ns"),
                "resolved_step": resolved_step(a),
            })
        df = pd.DataFrame(rows, columns=list(ALERT_COLUMNS))
        for col in ("value", "baseline", "threshold"):
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
        for col in ("rank", "step", "unix_ns", "resolved_step"):
            # whole numbers within int64 only: orjson reads 1e30 (or 10**30) as a float
            df[col] = pd.array([None if (v := _int(x, None, None)) is None else v for x in df[col]], dtype="Int64")
        df["run_id"] = df["run_id"].astype("category")
        df["type"] = df["type"].astype("category")
        return df


def load(path: Union[Paths, "Run"], *, skip_bad: bool = False, validate: bool = False,
         progress: bool = False) -> Run:
    """Read a log file, a run folder (all ranks), or a list of either into a :class:`Run`.

    ``run.steps`` and ``run.alerts`` are pandas DataFrames (``pip install
    'steptrace[analysis]'``); ``skip_bad``, ``validate`` and ``progress`` are those of
    :func:`steptrace.read`. Raises :class:`steptrace.LogFormatError` for a log that cannot
    be read and :class:`MissingDependencyError` when pandas is not installed.
    """
    if isinstance(path, Run):
        return path
    require("pandas", "analysis", "steptrace.load()")
    return load_table(path, skip_bad=skip_bad, validate=validate, progress=progress)


def load_table(path: Paths, *, skip_bad: bool = False, validate: bool = False,
               progress: bool = False) -> Run:
    """:func:`load` without the pandas check (the DataFrames are built on first use)."""
    source = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    table = collect(read(path, skip_bad=skip_bad, validate=validate, progress=progress))
    return Run(table, source=source, reread=lambda: read(path, skip_bad=skip_bad))


__all__ = ["load", "load_table", "Run", "MissingDependencyError", "require", "ALERT_COLUMNS"]
