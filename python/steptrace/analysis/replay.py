"""Offline detection: steptrace's record detectors over steps read back from a log, or
made up by hand.

The same C++ detectors as in a live run (step_regression, stall, memory_growth and the
device diagnoses; not the hang watchdog, which needs a step that is still running), so
``detect(run_dir)`` with no options gives the run's own alerts, and
``detect(run_dir, min_excess_ms=5)`` shows what a different setting would have raised:
the way to tune the rules on a real run. Tests drive it with synthetic timelines.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Union

from steptrace.errors import LogFormatError

_MEMORY_FIELDS = ("allocated_bytes", "reserved_bytes", "peak_bytes", "rss_bytes", "heap_bytes",
                  "device_used_bytes", "device_total_bytes")

Source = Union[str, "os.PathLike[str]", Iterable[dict]]


def _number(rec: dict, key: str, where: str, default: Any = None) -> Any:
    value = rec.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LogFormatError(f"{where}: {key}={value!r} must be a number")
    return value


def _replay_step(rec: dict, where: str, previous_rss: Any) -> Any:
    """The step record as the detectors' named ReplayStep (steptrace/replay.hpp)."""
    from steptrace import _core

    step = rec.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise LogFormatError(f"{where}: step={step!r} must be an integer >= 0")
    phases = rec.get("phases_ms") or {}
    if not isinstance(phases, dict):
        raise LogFormatError(f"{where}: phases_ms must be an object of phase name -> ms")
    memory = rec.get("memory") or {}
    if not isinstance(memory, dict):
        raise LogFormatError(f"{where}: memory must be an object of byte counts")
    s = _core.ReplayStep()
    for key in _MEMORY_FIELDS:
        v = memory.get(key, -1)
        if isinstance(v, bool) or not isinstance(v, int):
            raise LogFormatError(f"{where}: memory.{key}={v!r} must be an integer")
        setattr(s, key, v)
    s.step = step
    s.start_unix_ns = int(_number(rec, "start_unix_ns", where, 0))
    s.data_ms = float(_number(rec, "data_ms", where, 0.0))
    s.step_ms = float(_number(rec, "step_ms", where))
    s.failed = rec.get("status") == "error"
    # an evidence capture ran in the step: the detectors skip it, as they did live
    s.profiled = rec.get("profiled") is True
    s.phases_ms = [(str(k), float(_number(phases, k, f"{where}: phases_ms"))) for k in phases]
    # a live run re-reads RSS at most every 10 ms and repeats it in between
    s.rss_fresh = memory.get("rss_bytes") != previous_rss
    s.other_ms = float(_number(rec, "other_ms", where, 0.0))
    s.interval_in_step_ms = float(_number(rec, "interval_in_step_ms", where, 0.0))
    s.runq_ms, s.runq_span_ms, s.steal_ms = _host(rec, where)
    s.data_start_ms = float(_number(rec, "data_start_ms", where, 0.0))
    s.compile_ms = float(_number(rec, "compile_ms", where, 0.0))
    s.tokens, s.samples = _work(rec, where)
    s.gc_ms, s.gc_gen2_ms, s.gc_between_ms, s.gc_between_gen2_ms, gc_count = _gc(rec, where)
    s.gc_count = int(gc_count)
    return s


def _work(rec: dict, where: str) -> tuple[float, float]:
    """The step's work: (tokens, samples), -1 for a figure it lacks."""
    work = rec.get("work")
    if not isinstance(work, dict):
        return -1.0, -1.0
    at = f"{where}: work"
    return float(_number(work, "tokens", at, -1.0)), float(_number(work, "samples", at, -1.0))


def _gc(rec: dict, where: str) -> tuple[float, float, float, float, float]:
    """The step's Python collections: (ms, gen2_ms, between_ms, between_gen2_ms, count), 0 where absent."""
    gc = rec.get("gc")
    if not isinstance(gc, dict):
        return 0.0, 0.0, 0.0, 0.0, 0.0
    at = f"{where}: gc"
    return tuple(float(_number(gc, f, at, 0.0))  # type: ignore[return-value]
                 for f in ("ms", "gen2_ms", "between_ms", "between_gen2_ms", "count"))


def _host(rec: dict, where: str) -> tuple[float, float, float]:
    """The step's host reading: (runq_ms, runq_span_ms, steal_ms), -1 for a figure it lacks."""
    host = rec.get("host")
    if not isinstance(host, dict) or "runq_ms" not in host:
        return -1.0, 0.0, -1.0
    at = f"{where}: host"
    return (float(_number(host, "runq_ms", at)), float(_number(host, "runq_span_ms", at, 0.0)),
            float(_number(host, "steal_ms", at, -1.0)))


def detect(source: Source, **options: Any) -> list[dict[str, Any]]:
    """Runs the detectors over ``source`` and returns their records (``alert``,
    ``alert_update`` and ``resolved`` dicts, in order, per rank).

    ``source`` is a log file, a run folder (each rank on its own), or an iterable of step
    records (dicts with ``step``, ``step_ms`` and optionally ``data_ms``, ``phases_ms``,
    ``memory``, ``status``, ``profiled``, ``rank``; other kinds are skipped; a step marked
    ``"profiled": true``, slowed by an evidence capture, is not judged, as in a live run).
    Options are the Profiler's detection options (``window``, ``regression_threshold``, ``min_excess_ms``,
    ...); for a log they default to the run's own configuration from its run_start.
    Raises ConfigError / UnknownOptionError for bad options, LogFormatError for a record
    that is not a step record the detectors can read.
    """
    from steptrace import _core
    from steptrace.live.profiler import _CORE_OPTIONS, build_config
    from steptrace.analysis.reader import read

    if isinstance(source, (str, os.PathLike)):
        records: Iterable[dict] = read(source)
        where_prefix = os.fspath(source)
    else:
        records = source
        where_prefix = "record"
    run_config: dict[str, Any] = {}
    by_rank: dict[int, list[Any]] = {}
    last_rss: dict[int, Any] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise LogFormatError(f"{where_prefix} {i}: expected a dict record, got {type(rec).__name__}")
        kind = rec.get("kind", "step")
        if kind == "run_start" and not run_config:
            run_config = {k: v for k, v in (rec.get("config") or {}).items() if k in _CORE_OPTIONS}
        if kind != "step":
            continue
        rank = rec.get("rank", 0)
        rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else 0
        t = _replay_step(rec, f"{where_prefix} {i} (step {rec.get('step')!r})", last_rss.get(rank))
        last_rss[rank] = (rec.get("memory") or {}).get("rss_bytes")
        by_rank.setdefault(rank, []).append(t)
    for key in ("rank", "world_size", "run_id", "overwrite"):
        run_config.pop(key, None)
    config, _ = build_config("replay", {**run_config, **options})
    out: list[dict[str, Any]] = []
    for rank in sorted(by_rank):
        config.rank = rank
        try:
            found = _core.replay_detectors(config, by_rank[rank])
        except Exception as exc:  # steps out of order: the record is what is wrong
            raise LogFormatError(f"{where_prefix}: rank {rank}: {exc}") from None
        out.extend(found)  # the detectors' records, as dicts
    return out
