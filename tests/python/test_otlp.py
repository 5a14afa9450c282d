"""OTLP metrics export: a real CPU training loop exports to a local OTLP/HTTP receiver
(http.server on loopback, started here) that decodes each ExportMetricsServiceRequest with
opentelemetry-proto's classes; metric names, values and resource attributes must arrive.
Bad options raise before any file is written; a dead collector never fails the run."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from pathlib import Path

import pytest

import steptrace
from steptrace import ConfigError

pytest.importorskip("opentelemetry.sdk.metrics", reason="the otlp extra: pip install 'steptrace[otlp]'")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.metric_exporter")
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest  # noqa: E402


class Receiver:
    """An OTLP/HTTP metrics endpoint: keeps every decoded request."""

    def __init__(self) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportMetricsServiceRequest()
                req.ParseFromString(body)
                with outer.lock:
                    outer.requests.append((self.path, self.headers.get("Content-Type"), req))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def last_points(self) -> tuple[dict, dict]:
        """The resource attributes and {metric name: [data points]} of the last request."""
        with self.lock:
            _, _, req = self.requests[-1]
        [rm] = req.resource_metrics
        attrs = {a.key: _value(a.value) for a in rm.resource.attributes}
        metrics: dict = {}
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                which = m.WhichOneof("data")
                metrics[m.name] = (m.unit, which, list(getattr(m, which).data_points))
        return attrs, metrics


def _value(v):
    return getattr(v, v.WhichOneof("value"))


def _attrs(point) -> dict:
    return {a.key: _value(a.value) for a in point.attributes}


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def _train(path: Path, steps: int, **options) -> steptrace.Profiler:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    with steptrace.Profiler(path, job="otlp-test", **options) as prof:
        for _ in range(steps):
            with prof.step():
                with prof.phase("forward"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
        # a cross-rank view as rank 0's exchange writes it (cluster.py -> write_record)
        prof._core.write_record(json.dumps({
            "kind": "cluster", "step": steps - 1, "window": 0, "world_size": 2, "ranks_reporting": 2,
            "stragglers": [1], "ranks": [
                {"rank": 0, "host": "a", "steps": 20, "step_ms": 10.0, "compute_ms": 6.0, "comm_ms": 1.0, "wait_ms": 3.0,
                 "data_ms": 0.5, "own_ms": 6.5, "straggler_pct": -23.1},
                {"rank": 1, "host": "b", "steps": 20, "step_ms": 10.0, "compute_ms": 8.0, "comm_ms": None, "wait_ms": 0.0,
                 "data_ms": 0.5, "own_ms": 8.5, "straggler_pct": 30.77}]}))
    return prof


def test_a_training_loop_exports_its_metrics_with_its_identity(tmp_path, receiver):
    steps = 40
    _train(tmp_path / "run", steps, metrics_otlp=receiver.url, metrics_otlp_interval_s=0.2)
    records = list(steptrace.read(tmp_path / "run" / "rank0.jsonl", validate=True))
    start, end = records[0], records[-1]
    assert end["kind"] == "run_end"
    assert receiver.requests, "nothing reached the receiver"
    path, content_type, _ = receiver.requests[-1]
    assert (path, content_type) == ("/v1/metrics", "application/x-protobuf")
    attrs, metrics = receiver.last_points()  # the final export, at close: cumulative totals
    assert attrs["service.name"] == "steptrace"
    assert attrs["job"] == "otlp-test"
    assert attrs["run_id"] == start["run_id"]
    assert attrs["rank"] == 0
    assert attrs["host"] == start["host"] and attrs["host"]

    unit, kind, [pt] = metrics["steptrace.steps"]
    assert (unit, kind, pt.as_int or pt.as_double) == ("{step}", "sum", steps)
    unit, kind, [hist] = metrics["steptrace.step.duration"]
    assert (unit, kind, hist.count) == ("s", "histogram", steps)
    step_s = sum(r["step_ms"] for r in records if r["kind"] == "step") / 1e3
    assert hist.sum == pytest.approx(step_s, rel=1e-6)
    assert list(hist.explicit_bounds) == list(steptrace.live.otlp.DURATION_BUCKETS)
    phases = {_attrs(p)["phase"]: p for p in metrics["steptrace.phase.duration"][2]}
    assert set(phases) == {"forward", "backward", "optimizer"}
    assert all(p.count == steps for p in phases.values())
    # the wall clock by kind, as the records account it
    by_kind = {_attrs(p)["kind"]: p.as_double for p in metrics["steptrace.time"][2]}
    step_records = [r for r in records if r["kind"] == "step"]
    assert by_kind["step"] == pytest.approx(sum(r["host_ms"] for r in step_records) / 1e3, rel=1e-6)
    assert by_kind["other"] == pytest.approx(sum(r["other_ms"] for r in step_records) / 1e3, rel=1e-6, abs=1e-9)
    [rss] = [p for p in metrics["steptrace.memory"][2] if _attrs(p)["kind"] == "rss"]
    assert rss.as_int > 1 << 20 or rss.as_double > 1 << 20
    # the cross-rank rows, by the rank they describe
    scores = {_attrs(p)["subject_rank"]: p.as_double for p in metrics["steptrace.rank.straggler_score"][2]}
    assert scores == pytest.approx({0: -0.231, 1: 0.3077})
    split = {(_attrs(p)["subject_rank"], _attrs(p)["part"]): p.as_double for p in metrics["steptrace.rank.split"][2]}
    assert split[(1, "compute")] == pytest.approx(0.008) and split[(0, "wait")] == pytest.approx(0.003)
    assert (1, "comm") not in split  # null in the record: not exported
    # the NVML figures are absent on a machine without NVML, not zeros
    assert not [name for name in metrics if name.startswith("steptrace.gpu.")]


def test_exports_run_while_training_not_only_at_close(tmp_path, receiver):
    import time

    with steptrace.Profiler(tmp_path / "run", metrics_otlp=receiver.url, metrics_otlp_interval_s=0.1,
                            flush_interval_ms=20) as prof:
        deadline = time.monotonic() + 30
        seen = 0
        while time.monotonic() < deadline:
            with prof.step():
                with prof.phase("forward"):
                    time.sleep(0.002)
            if receiver.requests:
                _, metrics = receiver.last_points()
                if "steptrace.steps" in metrics:
                    seen = metrics["steptrace.steps"][2][0].as_int
                    if seen > 0:
                        break
        assert seen > 0, "no export with steps arrived while the run was going"
        assert not prof.closed


def test_a_dead_collector_is_said_once_and_the_run_completes(tmp_path, caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with caplog.at_level("WARNING", logger="steptrace"):
        _train(tmp_path / "run", 10, metrics_otlp=f"http://127.0.0.1:{port}/v1/metrics",
               metrics_otlp_interval_s=0.1)
    records = list(steptrace.read(tmp_path / "run" / "rank0.jsonl"))
    assert records[-1]["kind"] == "run_end" and records[-1]["steps"] == 10
    said = [r.getMessage() for r in caplog.records if "OTLP metrics export" in r.getMessage()]
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0]


@pytest.mark.parametrize("options, needle", [
    ({"metrics_otlp": "collector:4318"}, "metrics_otlp='collector:4318' is not an OTLP/HTTP URL"),
    ({"metrics_otlp": "grpc://c:4317"}, "is not an OTLP/HTTP URL"),
    ({"metrics_otlp": "http://c:port/v1/metrics"}, "metrics_otlp='http://c:port/v1/metrics'"),
    ({"metrics_otlp": 4318}, "must be a str"),
    ({"metrics_otlp_interval_s": 0.0}, "metrics_otlp_interval_s=0.0 is out of range"),
])
def test_bad_otlp_options_raise_before_any_file(tmp_path, options, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("?", r"\?")):
        steptrace.Profiler(tmp_path / "run", **options)
    assert not (tmp_path / "run").exists()


def test_without_the_sdk_the_option_names_the_extra_before_any_file(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.metrics", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'steptrace\[otlp\]'"):
        steptrace.Profiler(tmp_path / "run", metrics_otlp="http://127.0.0.1:4318/v1/metrics")
    assert not (tmp_path / "run").exists()
