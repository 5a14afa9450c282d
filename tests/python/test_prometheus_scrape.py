"""End to end with a real Prometheus: a running training loop serves /metrics, Debian's
prometheus scrapes it every second with the shipped rules loaded, and every expression of
the rules and the dashboards is accepted; those that need only what a CPU run has return
data (the DCGM ones and those needing a fault are checked for validity only). The loop's
GPU figures come from the stand-in NVML library of the C++ tests, and its cross-rank view
from one synthetic cluster record written as rank 0's exchange writes it."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Needs a GPU, a DCGM exporter, DDP, or an alert episode to be open: validity only.
VALIDITY_ONLY = re.compile(r"DCGM_|tensor_active|dram_throughput|sm_occupancy|comm_|compute_seconds|error_steps|in_flight|"
                           r"gpu_util|throttled")

LOOP = textwrap.dedent("""
    import sys, time, torch
    import steptrace
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    with steptrace.Profiler(sys.argv[1], metrics_port=0, job="scrape-test", peak_tflops=0.001) as prof:
        i = 0
        while not (prof.step_index > 200 and __import__("os").path.exists(sys.argv[2])):
            with prof.step():
                # useful work: 32 samples of 64 tokens, a forward and backward of 6 x 32 x 64 x 64 FLOPs
                prof.add_work(samples=32, tokens=32 * 64, flops=6 * 32 * 64 * 64)
                with prof.phase("forward"):
                    loss = model(x).square().mean()
                    if i in (120, 121, 122):
                        time.sleep(0.3)  # a stretch of slow steps: an alert for alerts_total
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    opt.step(); opt.zero_grad()
            if i == 60:  # rank 0's cross-rank view, as steptrace.cluster writes it
                import json
                row = dict(steps=20, step_ms=10.0, step_p95_ms=11.0, data_ms=0.5, compute_ms=6.0, comm_ms=1.0,
                           wait_ms=1.0, own_ms=6.5)
                prof._core.write_record(json.dumps(dict(
                    kind="cluster", step=i, window=3, world_size=2, ranks_reporting=2, stragglers=[],
                    ranks=[dict(row, rank=0, host="a", straggler_pct=-1.0), dict(row, rank=1, host="b", straggler_pct=1.0)])))
            i += 1
            time.sleep(0.005)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())  # the API's own error object
        except ValueError:
            return {}  # "Service Unavailable" (plain text) while Prometheus starts up
    except (urllib.error.URLError, OSError):
        return {}  # not listening yet


def _wait(what: str, check, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _expressions() -> list[tuple[str, str]]:
    import yaml  # noqa: PLC0415 (PyYAML comes with the test dependencies)

    out = []
    rules = yaml.safe_load((ROOT / "prometheus" / "steptrace.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            kind = "record" if "record" in rule else "alert"
            out.append((f"rule {rule.get('record') or rule.get('alert')}", rule["expr"] if kind == "record"
                        else "VALIDITY:" + rule["expr"]))
    for path in sorted((ROOT / "grafana").glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']}", target["expr"]))
    return out


# The stand-in NVML library of the C++ tests, compiled by test_nvml.py's fixture.


@pytest.fixture(scope="module")
def scraped(tmp_path_factory, fake_nvml):
    exe = shutil.which("prometheus")
    assert exe, "prometheus is missing: scripts/setup.sh installs it (Debian package prometheus)"
    tmp = tmp_path_factory.mktemp("scrape")
    stop = tmp / "stop"
    env = dict(os.environ, STEPTRACE_NVML_LIBRARY=str(fake_nvml), STEPTRACE_FAKE_NVML_SCENARIO="steady")
    loop = subprocess.Popen([sys.executable, "-c", LOOP, str(tmp / "run"), str(stop)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log = tmp / "run" / "rank0.jsonl"

    def port():
        if loop.poll() is not None:
            pytest.fail("training loop died: " + loop.stderr.read()[-2000:])
        if not log.exists():
            return None
        first = log.read_text().split("\n", 1)[0]
        return json.loads(first).get("metrics", {}).get("port") if first.endswith("}") else None

    metrics_port = _wait("the endpoint's port in run_start", port)
    # the shipped rules, evaluated every second instead of every 30 s
    rules = (ROOT / "prometheus" / "steptrace.rules.yml").read_text().replace("interval: 30s", "interval: 1s")
    (tmp / "rules.yml").write_text(rules)
    (tmp / "prometheus.yml").write_text(textwrap.dedent(f"""
        global: {{scrape_interval: 1s, evaluation_interval: 1s}}
        rule_files: [{tmp / 'rules.yml'}]
        scrape_configs:
          - job_name: steptrace
            honor_labels: true  # keep the training job's own job label
            static_configs: [{{targets: ["127.0.0.1:{metrics_port}"]}}]
    """))
    prom_port = _free_port()
    prom = subprocess.Popen([exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{prom_port}"
    try:
        def steps_seen():
            r = _get(base + "/api/v1/query?" + urllib.parse.urlencode(
                {"query": 'count_over_time(steptrace_steps_total{job="scrape-test"}[1m])'}))
            res = r.get("data", {}).get("result", []) if r.get("status") == "success" else []
            return bool(res) and float(res[0]["value"][1]) >= 5  # five scrapes: rates have points
        _wait("five scrapes of the running loop", steps_seen)
        _wait("an alert from the slow stretch", lambda: _query_has_data(
            base, 'steptrace_alerts_total{job="scrape-test"}'))
        # the group's last recording rule (it reads an earlier one): every rule before it has run
        _wait("the recording rules", lambda: _query_has_data(base, "steptrace:training_steps_per_second:job"))
        yield base
    finally:
        stop.write_text("")
        loop.wait(timeout=60)
        prom.terminate()
        prom.wait(timeout=30)
    assert loop.returncode == 0, loop.stderr[-2000:] if isinstance(loop.stderr, str) else ""


def _query(base: str, expr: str) -> dict:
    return _get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def _query_has_data(base: str, expr: str) -> bool:
    r = _query(base, expr)
    return r.get("status") == "success" and bool(r["data"]["result"])


def test_the_scraped_run_has_its_steps(scraped):
    r = _query(scraped, 'steptrace_steps_total{job="scrape-test"}')
    [series] = r["data"]["result"]
    assert series["metric"]["rank"] == "0" and series["metric"]["run_id"]
    assert float(series["value"][1]) > 5


def test_the_scraped_run_has_its_useful_work(scraped):
    def one(expr: str) -> float:
        [series] = _query(scraped, expr)["data"]["result"]
        return float(series["value"][1])

    sel = '{job="scrape-test"}'
    # one scrape holds both counters: every written step counted its 2048 tokens and 32 samples
    assert one(f"steptrace_tokens_total{sel} / steptrace_steps_total{sel}") == 2048
    assert one(f"steptrace_samples_total{sel} / steptrace_steps_total{sel}") == 32
    # the last step's rates: tokens/s = 64 x samples/s; MFU = its FLOP/s over the 1 GFLOP/s peak
    assert one(f"steptrace_tokens_per_second{sel} / steptrace_samples_per_second{sel}") == pytest.approx(64)
    mfu = one(f"steptrace_mfu_ratio{sel}")
    tflops = one(f"steptrace_model_tflops_per_second{sel}")
    assert 0 < mfu and mfu == pytest.approx(tflops / 0.001)


def test_every_rule_and_dashboard_expression_is_valid_and_returns_data(scraped):
    values = {"$job": "scrape-test", "$rank": "0", "$__range": "5m", "${datasource}": ""}
    run_id = _query(scraped, 'steptrace_steps_total{job="scrape-test"}')["data"]["result"][0]["metric"]["run_id"]
    values["$run_id"] = run_id
    empty = []
    for where, expr in _expressions():
        validity_only = expr.startswith("VALIDITY:") or bool(VALIDITY_ONLY.search(expr))
        expr = expr.removeprefix("VALIDITY:")
        for k, v in values.items():
            expr = expr.replace(k, v)
        r = _query(scraped, expr)
        assert r["status"] == "success", f"{where}: {expr}: {r.get('error')}"
        if not validity_only and not r["data"]["result"]:
            empty.append(f"{where}: {expr}")
    assert not empty, "returned no data from the scraped run:\n" + "\n".join(empty)
