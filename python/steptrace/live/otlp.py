"""OTLP metrics export: the run's metrics pushed over OTLP/HTTP (protobuf) to an
OpenTelemetry collector, for teams whose pipeline is OpenTelemetry rather than Prometheus
scrapes.

    with steptrace.Profiler("runs/exp1", metrics_otlp="http://collector:4318/v1/metrics"):
        ...

How records reach it: a daemon thread (``steptrace-otlp``) takes what the writer thread
already wrote from the core's record channel, as dicts (steptrace.live.records_channel), and feeds the
OpenTelemetry SDK's instruments; the SDK's periodic reader exports them on its own thread.
The training thread does nothing for it, and neither does the C++ writer: calling into
Python from the writer thread would need the GIL, which the training thread holds, so a
slow collector could stall steps through it. Export failures are logged once; the log
file keeps everything. Needs the ``otlp`` extra (``pip install steptrace[otlp]``).

The metrics (OpenTelemetry names; a collector's Prometheus exporter turns them into the
``steptrace_*`` names of the Prometheus endpoint) carry the resource attributes
``service.name`` (steptrace), ``job``, ``run_id``, ``rank``, ``host`` and
``service.instance.id`` (``run_id/rank``); see docs/observability.md.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from typing import Any, Mapping, Optional

from steptrace import _core
from steptrace._options import PYTHON_OPTIONS
from steptrace.live.records_channel import follow_records
from steptrace.errors import ConfigError

logger = logging.getLogger("steptrace")

# Its options and their defaults, from the option table (include/steptrace/config_options.def).
OTLP_OPTIONS: dict = {k: v for k, v in PYTHON_OPTIONS.items() if k.startswith("metrics_otlp")}
_INTERVAL_RANGE = (0.1, 3600.0)
# The instruments are the rows of the metrics table (csrc/sinks/metrics.def) that name an
# OTLP instrument: its name, kind, unit, description and (histograms) the Prometheus
# family's buckets. The bounds are the Prometheus sink's too.
OTLP_METRICS: tuple = tuple(row for row in _core.metric_table() if row["otlp"])
DURATION_BUCKETS = next(row["buckets"] for row in OTLP_METRICS if row["name"] == "steptrace_step_duration_seconds")
_MAX_PHASES = _core.MAX_PHASES  # the core's phase table (kMaxPhases): bounded attribute values
_MAX_ALERT_TYPES = _core.METRIC_MAX_ALERT_TYPES
_MAX_CLUSTER_ROWS = _core.METRIC_MAX_CLUSTER_ROWS  # the stragglers first, then by score
_EXPORT_TIMEOUT_S = 5.0
_MEMORY_KINDS = ("allocated", "reserved", "peak", "rss", "heap", "device_used")


def check_otlp_options(options: Mapping[str, Any]) -> None:
    """Raises ConfigError naming a bad value and what is allowed (before any file exists)."""
    url = options["metrics_otlp"]
    lo, hi = _INTERVAL_RANGE
    interval = options["metrics_otlp_interval_s"]
    if not lo <= interval <= hi:
        raise ConfigError(f"option metrics_otlp_interval_s={interval!r} is out of range; allowed: {lo:g}..{hi:g}")
    if not url:
        return
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"option metrics_otlp={url!r} is not an OTLP/HTTP URL; allowed: "
                          "'' (off) or http(s)://host:port/v1/metrics")
    try:
        _ = parts.port  # a port that is not a number raises
    except ValueError as exc:
        raise ConfigError(f"option metrics_otlp={url!r}: {exc}") from None
    try:
        import opentelemetry.exporter.otlp.proto.http.metric_exporter  # noqa: F401, PLC0415
        import opentelemetry.sdk.metrics  # noqa: F401, PLC0415
    except ImportError as exc:
        raise ConfigError(f"option metrics_otlp={url!r} needs the OpenTelemetry SDK and its OTLP/HTTP exporter "
                          f"({exc.name} is missing): pip install 'steptrace[otlp]'") from None


def _cluster_rows(record: Mapping[str, Any]) -> list[dict]:
    rows = [r for r in record.get("ranks") or [] if isinstance(r, dict) and isinstance(r.get("rank"), int)]
    if len(rows) > _MAX_CLUSTER_ROWS:
        stragglers = set(record.get("stragglers") or [])
        rows.sort(key=lambda r: (r["rank"] not in stragglers, -(r.get("straggler_pct") or -1e300)))
        rows = rows[:_MAX_CLUSTER_ROWS]
    return rows


class OtlpExporter:
    """One daemon thread following the records of ``core`` (in process, not its log file)
    into OpenTelemetry instruments,
    exported every ``metrics_otlp_interval_s`` to ``metrics_otlp`` by the SDK's periodic
    reader. :meth:`stop` (after the core closed) reads the rest, exports once more and
    shuts the SDK down (at most the export timeout)."""

    def __init__(self, core: Any, options: Mapping[str, Any], *, exporter: Any = None,
                 poll_s: Optional[float] = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter  # noqa: PLC0415
        from opentelemetry.sdk.metrics import MeterProvider  # noqa: PLC0415
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader  # noqa: PLC0415
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View  # noqa: PLC0415
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415

        self._core = core
        config = core.config
        self._log = follow_records(core)
        self._pending: list = self._log.take()  # run_start first: the run's identity
        start = self._run_start()
        self.run_id = str(start.get("run_id") or config.run_id)
        self.rank = int(start.get("rank", config.rank))
        self.host = str(start.get("host") or "")
        self.job = str(config.job)
        interval_s = float(options["metrics_otlp_interval_s"])
        self._poll_s = poll_s if poll_s is not None else min(1.0, interval_s)
        resource = Resource.create({
            "service.name": "steptrace", "service.instance.id": f"{self.run_id}/{self.rank}",
            "job": self.job, "run_id": self.run_id, "rank": self.rank, "host": self.host, "host.name": self.host,
        })
        inner = exporter if exporter is not None else OTLPMetricExporter(
            endpoint=options["metrics_otlp"], timeout=_EXPORT_TIMEOUT_S)
        self.url = options["metrics_otlp"]
        self._exporter = _reporting_exporter(inner, self.url)
        self._reader = PeriodicExportingMetricReader(self._exporter, export_interval_millis=interval_s * 1000.0,
                                                     export_timeout_millis=_EXPORT_TIMEOUT_S * 1000.0)
        views = [View(instrument_name=row["otlp"]["name"],
                      aggregation=ExplicitBucketHistogramAggregation(row["buckets"]))
                 for row in OTLP_METRICS if row["buckets"]]
        self._provider = MeterProvider(resource=resource, metric_readers=[self._reader], views=views)
        self._rows: list[dict] = []  # the last cluster record's, for the observable gauges
        self._make_instruments(self._provider.get_meter("steptrace"))
        self._phases: set[str] = set()
        self._alert_types: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one reader of the log at a time (the thread, then stop())
        self._thread = threading.Thread(target=self._run, name="steptrace-otlp", daemon=True)

    def _make_instruments(self, m: Any) -> None:
        """One instrument per OTLP row of the metrics table, as the attribute named after it
        (steptrace.step.duration: self.step_duration). The observable gauges are observed
        at each export from the last cluster record only: a rank that left the listed rows
        stops being exported instead of repeating a stale value."""
        observe = {"steptrace.rank.straggler_score": self._observe_scores, "steptrace.rank.split": self._observe_split}
        for row in OTLP_METRICS:
            o = row["otlp"]
            name, kind, kw = o["name"], o["instrument"], {"unit": o["unit"], "description": o["description"]}
            if kind == "observable_gauge":
                instrument = m.create_observable_gauge(name, callbacks=[observe[name]], **kw)
            else:
                instrument = getattr(m, f"create_{kind}")(name, **kw)
            setattr(self, name.removeprefix("steptrace.").replace(".", "_"), instrument)

    def _observe_scores(self, options: Any) -> list:
        from opentelemetry.metrics import Observation  # noqa: PLC0415

        return [Observation(row["straggler_pct"] / 100.0, _subject(row))
                for row in self._rows if isinstance(row.get("straggler_pct"), (int, float))]

    def _observe_split(self, options: Any) -> list:
        from opentelemetry.metrics import Observation  # noqa: PLC0415

        return [Observation(row[f"{part}_ms"] / 1e3, {**_subject(row), "part": part})
                for row in self._rows for part in ("compute", "comm", "wait", "data")
                if isinstance(row.get(f"{part}_ms"), (int, float))]

    def _run_start(self) -> dict:
        return self._pending[0] if self._pending else {}

    def start(self) -> "OtlpExporter":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Reads what the log has left (run_end included), exports it and shuts down."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 3 * self._poll_s))
        self.poll_once()
        try:
            self._provider.shutdown(timeout_millis=_EXPORT_TIMEOUT_S * 1000.0)  # the final export
        except Exception as exc:  # noqa: BLE001 - never fail the user's close
            logger.warning("steptrace: OTLP export to %s: shutdown failed: %s", self.url, exc)

    @property
    def failures(self) -> int:
        return self._exporter.failures

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - the thread must survive a bad record
                logger.warning("steptrace: OTLP exporter: %s", exc)

    def poll_once(self) -> None:
        with self._lock:
            records, self._pending = self._pending + self._log.take(), []
            for rec in records:  # dicts, decoded by the core's record channel
                self._record(rec)

    def _record(self, rec: dict) -> None:
        kind = rec.get("kind")
        if kind == "step":
            self._step(rec)
        elif kind == "alert":
            t = str(rec.get("type", "other"))
            if t not in self._alert_types and len(self._alert_types) >= _MAX_ALERT_TYPES:
                t = "other"
            self._alert_types.add(t)
            self.alerts.add(1, {"type": t})
        elif kind == "cluster":
            self._cluster(rec)

    def _step(self, rec: dict) -> None:
        self.steps.add(1)
        if rec.get("status", "ok") != "ok":
            self.error_steps.add(1)
        self.step_duration.record(float(rec.get("step_ms", 0.0)) / 1e3)
        for name, ms in (rec.get("phases_ms") or {}).items():
            if name in self._phases or len(self._phases) < _MAX_PHASES:
                self._phases.add(name)
                self.phase_duration.record(float(ms) / 1e3, {"phase": name})
        self.data_wait.add(max(0.0, float(rec.get("data_ms", 0.0))) / 1e3)
        inside = _ms(rec, "interval_in_step_ms")
        parts = {"step": _ms(rec, "host_ms") - inside, "data": _ms(rec, "data_ms"), "eval": _ms(rec, "eval_ms"),
                 "checkpoint": _ms(rec, "checkpoint_ms"), "other": _ms(rec, "other_ms")}
        for part, ms in parts.items():
            self.time.add(max(0.0, ms) / 1e3, {"kind": part})
        runq = (rec.get("host") or {}).get("runq_ms")
        if isinstance(runq, (int, float)) and runq > 0:
            self.runq_wait.add(runq / 1e3)
        memory = rec.get("memory") or {}
        for k in _MEMORY_KINDS:
            v = memory.get(f"{k}_bytes")
            if isinstance(v, (int, float)) and v >= 0:
                self.memory.set(v, {"kind": k})
        hw = rec.get("hw")
        if hw:
            if isinstance(hw.get("power_w"), (int, float)):
                self.gpu_power.set(hw["power_w"])
            if isinstance(hw.get("energy_j"), (int, float)) and hw["energy_j"] > 0:
                self.gpu_energy.add(hw["energy_j"])
            if isinstance(hw.get("max_temp_c"), (int, float)):
                self.gpu_temperature.set(hw["max_temp_c"])
            if isinstance(hw.get("sm_clock_mhz"), (int, float)):
                self.gpu_sm_clock.set(hw["sm_clock_mhz"] * 1e6)

    def _cluster(self, rec: dict) -> None:
        self._rows = _cluster_rows(rec)  # one assignment: the export thread reads either list


def _ms(rec: Mapping[str, Any], key: str) -> float:
    v = rec.get(key, 0.0)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _subject(row: Mapping[str, Any]) -> dict:
    # Not `rank` / `host`: those are the resource's (the aggregating process).
    return {"subject_rank": row["rank"], "subject_host": str(row.get("host") or "")}


def _reporting_exporter(inner: Any, url: str) -> Any:
    """``inner`` (an OTLP metric exporter) that counts failed exports and says the first
    one once, as the C++ sinks do."""
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult  # noqa: PLC0415

    class ReportingExporter(MetricExporter):
        def __init__(self) -> None:
            super().__init__(preferred_temporality=getattr(inner, "_preferred_temporality", None),
                             preferred_aggregation=getattr(inner, "_preferred_aggregation", None))
            self.failures = 0

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            try:
                result = inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
                why = "the collector did not accept it"
            except Exception as exc:  # noqa: BLE001 - counted and said, never raised
                result, why = MetricExportResult.FAILURE, str(exc)
            if result != MetricExportResult.SUCCESS:
                self.failures += 1
                if self.failures == 1:
                    logger.warning("steptrace: OTLP metrics export to %s failed (%s); retrying at each "
                                   "interval, the log file has everything", url, why)
            return result

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return inner.force_flush(timeout_millis=timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return ReportingExporter()
