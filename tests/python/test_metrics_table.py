"""The metrics exist once: csrc/sinks/metrics.def.

Fails when a real scrape renders a family the table lacks (or with another type, HELP or
labels), when the renderer leaves a row of the table unused, when the OTLP export's
instruments differ from the table's OTLP rows, or when a dashboard queries a name the table
lacks.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest

import steptrace
from steptrace import _core
from support.training import batches, train

ROOT = Path(__file__).resolve().parents[2]
TABLE = _core.metric_table()
BY_NAME = {row["name"]: row for row in TABLE}
BASE_LABELS = {"job", "run_id", "rank", "host"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _load_dashboard_builder():
    spec = importlib.util.spec_from_file_location("build_dashboards", ROOT / "grafana" / "build_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _family(sample_name: str) -> str:
    """The family a sample belongs to (a histogram's _bucket / _sum / _count: the histogram)."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = sample_name.removesuffix(suffix)
        if base != sample_name and BY_NAME.get(base, {}).get("type") == "histogram":
            return base
    return sample_name


def test_table_rows_are_well_formed():
    assert len(TABLE) >= 50
    names = [row["name"] for row in TABLE]
    assert len(names) == len(set(names))
    for row in TABLE:
        assert re.fullmatch(r"steptrace_[a-z0-9_]+", row["name"]), row
        assert row["type"] in ("counter", "gauge", "histogram"), row
        assert row["help"] and "\n" not in row["help"], row
        assert not (set(row["labels"]) & BASE_LABELS), row
        # histograms and only they have buckets, increasing
        assert bool(row["buckets"]) == (row["type"] == "histogram"), row
        assert list(row["buckets"]) == sorted(set(row["buckets"])), row
        if row["type"] == "counter":
            assert row["name"].endswith("_total"), row


def test_the_dashboard_builder_reads_the_same_table():
    builder = _load_dashboard_builder()
    assert list(builder.metric_families().values()) == [row["name"] for row in TABLE]


def test_every_row_is_rendered_by_the_registry():
    # The renderer names families only through the table (Metric::<id>), and uses every row.
    render = (ROOT / "csrc" / "sinks" / "metrics_render.cpp").read_text(encoding="utf-8")
    assert '"steptrace_' not in render
    used = set(re.findall(r"Metric::(\w+)", render))
    assert used == {row["name"].removeprefix("steptrace_") for row in TABLE}


def _parse_scrape(text: str) -> tuple[dict, dict, dict]:
    helps, types, labels = {}, {}, {}
    for line in text.splitlines():
        if m := re.fullmatch(r"# HELP (\S+) (.*)", line):
            helps[m[1]] = m[2]
        elif m := re.fullmatch(r"# TYPE (\S+) (\S+)", line):
            types[m[1]] = m[2]
        elif line and not line.startswith("#"):
            m = re.fullmatch(r"(\w+)\{(.*)\} \S+", line)
            assert m, line
            keys = set(re.findall(r'(\w+)="(?:[^"\\]|\\.)*"', m[2]))
            labels.setdefault(_family(m[1]), set()).update(keys)
    return helps, types, labels


@pytest.fixture(scope="module")
def scrape(tmp_path_factory) -> str:
    """The endpoint of a CPU training loop with an alert, sized collectives and a cluster
    record, so that most families are present."""
    tmp = tmp_path_factory.mktemp("metrics-table")
    host = socket.gethostname()
    with steptrace.Profiler(tmp / "run", metrics_port=0, run_id="table", job="table", cluster="off") as prof:
        train(prof, batches(6))
        core = prof._core
        with prof.step():
            core.collective_end(core.collective_begin(), True, 4_000_000, 6_000_000)
        core.set_peers_in_interval(1, 2.0)
        core.write_record(json.dumps({"kind": "alert", "type": "step_regression", "step": 3, "message": "test"}))
        row = {"steps": 20, "step_ms": 10.0, "step_p95_ms": 11.0, "compute_ms": 6.0, "comm_ms": 1.0,
               "wait_ms": 0.0, "data_ms": 0.5, "own_ms": 6.5, "straggler_pct": 0.0}
        core.write_record(json.dumps({"kind": "cluster", "step": 19, "window": 0, "world_size": 2,
                                      "ranks_reporting": 2, "stragglers": [],
                                      "ranks": [{**row, "rank": 0, "host": host, "busbw_gbps": 12.5},
                                                {**row, "rank": 1, "host": "node-b"}]}))
        prof.flush()
        with urllib.request.urlopen(f"http://127.0.0.1:{prof.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()


def test_every_scraped_family_is_a_row_of_the_table(scrape):
    helps, types, labels = _parse_scrape(scrape)
    assert set(types) == set(helps) == set(labels)
    assert set(types) <= set(BY_NAME), set(types) - set(BY_NAME)
    for name, t in types.items():
        row = BY_NAME[name]
        assert t == row["type"], name
        # the text format escapes backslash and newline in HELP; the table has neither
        assert helps[name] == row["help"], name
        assert labels[name] - {"le"} == BASE_LABELS | set(row["labels"]), name
    # the loop above reached the families of steps, phases, time, alerts, communication
    # and the cross-rank view
    for name in ("steptrace_steps_total", "steptrace_phase_duration_seconds", "steptrace_time_seconds_total",
                 "steptrace_alerts_total", "steptrace_comm_busbw_bytes_per_second",
                 "steptrace_peers_in_interval", "steptrace_rank_split_seconds", "steptrace_cluster_stragglers"):
        assert name in types, name
    # and the histograms' buckets are the table's
    les = {float(v) for v in re.findall(r'steptrace_step_duration_seconds_bucket\{[^}]*le="([^"+]+)"', scrape)}
    assert sorted(les) == list(BY_NAME["steptrace_step_duration_seconds"]["buckets"])


class _Meter:
    """Records the instruments the OTLP export creates."""

    def __init__(self) -> None:
        self.created: list[tuple] = []

    def __getattr__(self, attr: str):
        kind = attr.removeprefix("create_")

        def create(name, callbacks=None, unit="", description=""):
            self.created.append((name, kind, unit, description))
            return object()
        return create


def test_otlp_instruments_are_the_tables_otlp_rows():
    pytest.importorskip("opentelemetry.sdk.metrics")
    from steptrace.live import otlp  # noqa: PLC0415

    meter = _Meter()
    exporter = object.__new__(otlp.OtlpExporter)  # only its instruments, no thread nor SDK
    exporter._make_instruments(meter)
    rows = [row for row in TABLE if row["otlp"]]
    assert meter.created == [(r["otlp"]["name"], r["otlp"]["instrument"], r["otlp"]["unit"], r["otlp"]["description"])
                             for r in rows]
    # the fifteen instruments the export has always had, each beside its Prometheus family
    assert {r["otlp"]["name"]: r["name"] for r in rows} == {
        "steptrace.steps": "steptrace_steps_total", "steptrace.error_steps": "steptrace_error_steps_total",
        "steptrace.step.duration": "steptrace_step_duration_seconds",
        "steptrace.phase.duration": "steptrace_phase_duration_seconds",
        "steptrace.data_wait": "steptrace_data_wait_seconds_total", "steptrace.time": "steptrace_time_seconds_total",
        "steptrace.runq_wait": "steptrace_runq_wait_seconds_total", "steptrace.memory": "steptrace_memory_bytes",
        "steptrace.alerts": "steptrace_alerts_total", "steptrace.gpu.power": "steptrace_gpu_power_watts",
        "steptrace.gpu.energy": "steptrace_gpu_energy_joules_total",
        "steptrace.gpu.temperature": "steptrace_gpu_temperature_celsius",
        "steptrace.gpu.sm_clock": "steptrace_gpu_sm_clock_hertz",
        "steptrace.rank.straggler_score": "steptrace_rank_straggler_score",
        "steptrace.rank.split": "steptrace_rank_split_seconds",
    }
    # the record intake uses them by attribute
    for attr in ("steps", "error_steps", "step_duration", "phase_duration", "data_wait", "time", "runq_wait",
                 "memory", "alerts", "gpu_power", "gpu_energy", "gpu_temperature", "gpu_sm_clock"):
        assert hasattr(exporter, attr), attr
    assert otlp.DURATION_BUCKETS == BY_NAME["steptrace_step_duration_seconds"]["buckets"]
    assert (otlp._MAX_CLUSTER_ROWS, otlp._MAX_ALERT_TYPES) == (_core.METRIC_MAX_CLUSTER_ROWS,
                                                                _core.METRIC_MAX_ALERT_TYPES)


def test_dashboards_query_only_the_tables_names():
    builder = _load_dashboard_builder()
    # no metric name typed in the builder's code (its docstrings and comments aside)
    tree = ast.parse((ROOT / "grafana" / "build_dashboards.py").read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node)}
    typed = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and id(node) not in docstrings and re.search(r"steptrace_[a-z]", node.value)]
    assert not typed, typed
    seen = set()
    for name in ("steptrace-overview.json", "steptrace-job.json", "steptrace-profiling.json"):
        dash = json.loads((ROOT / "grafana" / name).read_text(encoding="utf-8"))
        queries = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        queries += [v["query"]["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
        for q in queries:
            seen.update(_family(n) for n in re.findall(r"\bsteptrace_[a-z0-9_]+", q))
    assert seen and seen <= set(BY_NAME), seen - set(BY_NAME)
    assert builder.M.steps_total == "steptrace_steps_total"
