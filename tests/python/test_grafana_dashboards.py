"""The Grafana dashboards: generated from one description and up to date, in a triage
hierarchy with working links, DCGM names for the hardware, and every query accepted by a
real Prometheus server (Debian's, started here)."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"
NAMES = ("steptrace-overview.json", "steptrace-job.json", "steptrace-profiling.json")
# The metric names the endpoint exports (docs/prometheus-grafana.md, "Prometheus metrics") and the recording
# rules of prometheus/steptrace.rules.yml.
STEPTRACE_METRICS = {
    "steptrace_step_duration_seconds_bucket", "steptrace_step_duration_seconds_sum",
    "steptrace_step_duration_seconds_count", "steptrace_phase_duration_seconds_bucket",
    "steptrace_phase_duration_seconds_sum", "steptrace_steps_total", "steptrace_error_steps_total",
    "steptrace_data_wait_seconds_total", "steptrace_step_median_seconds", "steptrace_step_in_flight_seconds",
    "steptrace_memory_bytes", "steptrace_alerts_total", "steptrace_tensor_active_ratio",
    "steptrace_dram_throughput_ratio", "steptrace_sm_occupancy_ratio", "steptrace_compute_seconds_total",
    "steptrace_comm_seconds_total", "steptrace_comm_exposed_seconds_total",
    "steptrace_gpu_power_watts", "steptrace_gpu_power_limit_watts", "steptrace_gpu_temperature_celsius",
    "steptrace_gpu_energy_joules_total", "steptrace_gpu_throttled_steps_total", "steptrace_rank_straggler_score",
    "steptrace_rank_split_seconds",
}


def dashboards() -> dict[str, dict]:
    return {name: json.loads((GRAFANA / name).read_text()) for name in NAMES}


def exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboards_are_generated_and_up_to_date():
    proc = subprocess.run([sys.executable, str(GRAFANA / "build_dashboards.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_triage_hierarchy_links_overview_to_job_to_profiling():
    d = dashboards()
    uids = {dash["uid"] for dash in d.values()}
    assert uids == {"steptrace-overview", "steptrace-job", "steptrace-profiling"}
    overview, job = d["steptrace-overview.json"], d["steptrace-job.json"]
    # overview's job panels open the job dashboard with that job selected
    links = [link["url"] for p in overview["panels"] for link in p["fieldConfig"]["defaults"]["links"]]
    assert links and all(u.startswith("/d/steptrace-job/") and "var-job=${__field.labels.job}" in u for u in links)
    assert {v["name"] for v in job["templating"]["list"]} >= {"job", "rank"}
    job_links = [link["url"] for p in job["panels"] for link in p["fieldConfig"]["defaults"]["links"]]
    assert any(u.startswith("/d/steptrace-profiling/") and "var-run_id=" in u for u in job_links)
    # the profiling dashboard links to the run's HTML report and Perfetto trace
    text = " ".join(p.get("options", {}).get("content", "") for p in d["steptrace-profiling.json"]["panels"])
    assert "report.html" in text and "trace.json" in text and "perfetto" in text.lower()
    # every dashboard-level link points to a dashboard that exists
    for dash in d.values():
        for link in dash["links"]:
            assert link["url"].removeprefix("/d/") in uids


def test_hardware_panels_use_dcgm_names_and_steptrace_names_exist():
    every = [e for dash in dashboards().values() for e in exprs(dash)]
    joined = " ".join(every)
    for name in ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_UTIL",
                 "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_SM_OCCUPANCY"):
        assert name in joined, name
    used = set(re.findall(r"\bsteptrace_[a-z_]+", joined))
    assert used <= STEPTRACE_METRICS, used - STEPTRACE_METRICS
    assert "steptrace:step_duration_seconds:p95_5m" in joined  # a recording rule of the rules file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    exe = shutil.which("prometheus")
    assert exe, "prometheus is missing: scripts/setup.sh installs it (Debian package prometheus)"
    tmp = tmp_path_factory.mktemp("prom")
    (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
    port = _free_port()
    proc = subprocess.Popen([exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # poll readiness: it answers once its storage is open
        try:
            with urllib.request.urlopen(base + "/-/ready", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "prometheus did not become ready in 60 s"
        time.sleep(0.1)
    yield base
    proc.terminate()
    proc.wait(timeout=30)


def _query(base: str, expr: str) -> dict:
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def test_every_query_is_valid_promql(prometheus):
    values = {"$job": "j", "$rank": "0|1", "$run_id": "r", "$__range": "1h", "${datasource}": ""}
    for name, dash in dashboards().items():
        for expr in exprs(dash):
            concrete = expr
            for k, v in values.items():
                concrete = concrete.replace(k, v)
            answer = _query(prometheus, concrete)
            assert answer["status"] == "success", f"{name}: {expr}: {answer.get('error')}"
