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
    "steptrace_rank_split_seconds", "steptrace_time_seconds_total", "steptrace_runq_wait_seconds_total",
    "steptrace_comm_busbw_bytes_per_second", "steptrace_comm_algbw_bytes_per_second",
    "steptrace_tokens_per_second", "steptrace_samples_per_second", "steptrace_model_tflops_per_second",
    "steptrace_mfu_ratio", "steptrace_tokens_total", "steptrace_samples_total",
    "steptrace_badput_seconds_total", "steptrace_job_goodput_ratio",
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


def test_job_dashboard_has_the_goodput_panels():
    panels = {p["title"]: p for p in dashboards()["steptrace-job.json"]["panels"]}
    by_kind = panels["Where the wall clock goes (seconds per second, by kind)"]
    [target] = by_kind["targets"]
    assert target["expr"].startswith("sum by (kind) (rate(steptrace_time_seconds_total{")
    assert by_kind["options"]["stacking"]["mode"] == "normal"
    share = panels["Goodput: training share of the wall clock"]
    assert share["fieldConfig"]["defaults"]["unit"] == "percentunit"
    training, runq = (t["expr"] for t in share["targets"])
    assert 'kind="step"' in training and "steptrace_time_seconds_total" in training
    assert "steptrace_runq_wait_seconds_total" in runq
    for expr in (target["expr"], training, runq):
        assert 'job="$job", rank=~"$rank"' in expr  # the dashboard's selection applies


def test_job_dashboard_has_the_collective_bandwidth_panel():
    panels = {p["title"]: p for p in dashboards()["steptrace-job.json"]["panels"]}
    bw = panels["Collective bandwidth per rank (bus / algorithm)"]
    assert bw["fieldConfig"]["defaults"]["unit"] == "Bps"  # bytes per second, shown as kB/s .. GB/s
    exprs_ = [t["expr"] for t in bw["targets"]]
    assert [e.split("{")[0] for e in exprs_] == ["steptrace_comm_busbw_bytes_per_second",
                                                 "steptrace_comm_algbw_bytes_per_second"]
    assert all('job="$job", rank=~"$rank"' in e for e in exprs_)
    assert [t["legendFormat"] for t in bw["targets"]] == ["bus r{{rank}}", "alg r{{rank}}"]


def test_job_dashboard_has_mfu_per_rank_beside_tensor_cores_and_power_and_tokens_per_s():
    panels = {p["title"]: p for p in dashboards()["steptrace-job.json"]["panels"]}
    mfu = panels["MFU per rank, beside tensor-core activity and power"]
    names = [re.findall(r"\bsteptrace_[a-z_]+", t["expr"]) for t in mfu["targets"]]
    assert names == [["steptrace_mfu_ratio"], ["steptrace_tensor_active_ratio"], ["steptrace_gpu_power_watts"]]
    assert all(t["legendFormat"].startswith("r{{rank}}") for t in mfu["targets"])  # one line per rank
    assert mfu["fieldConfig"]["defaults"]["unit"] == "percentunit"
    [power_axis] = mfu["fieldConfig"]["overrides"]
    assert power_axis["matcher"]["options"] == "C" and {"id": "unit", "value": "watt"} in power_axis["properties"]
    tokens = panels["Throughput: tokens/s and samples/s"]
    joined = " ".join(t["expr"] for t in tokens["targets"])
    assert "rate(steptrace_tokens_total" in joined and "steptrace_tokens_per_second" in joined
    for panel in (mfu, tokens):
        for t in panel["targets"]:
            assert 'job="$job", rank=~"$rank"' in t["expr"]
    # side by side on one row
    assert mfu["gridPos"]["y"] == tokens["gridPos"]["y"] and mfu["gridPos"]["w"] + tokens["gridPos"]["w"] == 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Twenty minutes of one rank's wall clock, backfilled (promtool tsdb create-blocks-from
# openmetrics) so that the goodput panels have values to check: seconds per second by kind,
# and the training thread's run-queue wait.
BACKFILL_RATES = {"step": 0.6, "data": 0.1, "eval": 0.2, "checkpoint": 0.05, "other": 0.05}
BACKFILL_RUNQ = 0.1
BACKFILL_MFU = {"0": 0.42, "1": 0.31}
BACKFILL_TOKENS_PER_S = 5000.0


def _backfill(tmp: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/setup.sh installs it (Debian package prometheus)"
    labels = 'job="j",run_id="r",rank="0",host="h"'
    end = int(time.time())
    start = end - 1200
    lines = ["# TYPE steptrace_time_seconds counter"]
    for t in range(start, end, 15):
        for kind, rate in BACKFILL_RATES.items():
            lines.append(f'steptrace_time_seconds_total{{{labels},kind="{kind}"}} {(t - start) * rate} {t}')
    lines.append("# TYPE steptrace_runq_wait_seconds counter")
    lines += [f"steptrace_runq_wait_seconds_total{{{labels}}} {(t - start) * BACKFILL_RUNQ} {t}"
              for t in range(start, end, 15)]
    # two ranks' MFU and tokens (the MFU panel and the job's tokens/s)
    lines.append("# TYPE steptrace_mfu_ratio gauge")
    for rank, ratio in BACKFILL_MFU.items():
        lines += [f'steptrace_mfu_ratio{{job="j",run_id="r",rank="{rank}",host="h"}} {ratio} {t}'
                  for t in range(start, end, 15)]
    lines.append("# TYPE steptrace_tokens counter")
    for rank in BACKFILL_MFU:
        lines += [f'steptrace_tokens_total{{job="j",run_id="r",rank="{rank}",host="h"}} '
                  f'{(t - start) * BACKFILL_TOKENS_PER_S} {t}' for t in range(start, end, 15)]
    (tmp / "backfill.om").write_text("\n".join(lines) + "\n# EOF\n")
    proc = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(tmp / "backfill.om"),
                           str(tmp / "data")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    exe = shutil.which("prometheus")
    assert exe, "prometheus is missing: scripts/setup.sh installs it (Debian package prometheus)"
    tmp = tmp_path_factory.mktemp("prom")
    (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
    _backfill(tmp)
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


def test_goodput_panels_show_the_time_by_kind_and_the_training_share(prometheus):
    panels = {p["title"]: p for p in dashboards()["steptrace-job.json"]["panels"]}
    values = {"$job": "j", "$rank": "0|1"}

    def query(expr: str) -> list[dict]:
        for k, v in values.items():
            expr = expr.replace(k, v)
        answer = _query(prometheus, expr)
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        return answer["data"]["result"]

    [by_kind] = panels["Where the wall clock goes (seconds per second, by kind)"]["targets"]
    got = {r["metric"]["kind"]: float(r["value"][1]) for r in query(by_kind["expr"])}
    assert set(got) == set(BACKFILL_RATES)
    # rate() extrapolates the same way for every kind: the proportions are exact
    total = sum(got.values())
    for kind, rate in BACKFILL_RATES.items():
        assert got[kind] / total == pytest.approx(rate / sum(BACKFILL_RATES.values()), rel=1e-6), kind
    training, runq = panels["Goodput: training share of the wall clock"]["targets"]
    [share] = query(training["expr"])
    assert float(share["value"][1]) == pytest.approx(0.6, rel=1e-6)
    [wait] = query(runq["expr"])
    assert float(wait["value"][1]) == pytest.approx(BACKFILL_RUNQ, rel=1e-6)


def test_mfu_panel_shows_each_ranks_mfu_and_the_jobs_tokens_per_s(prometheus):
    panels = {p["title"]: p for p in dashboards()["steptrace-job.json"]["panels"]}

    def query(expr: str) -> list[dict]:
        expr = expr.replace("$job", "j").replace("$rank", "0|1")
        answer = _query(prometheus, expr)
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        return answer["data"]["result"]

    mfu = panels["MFU per rank, beside tensor-core activity and power"]["targets"][0]
    got = {r["metric"]["rank"]: float(r["value"][1]) for r in query(mfu["expr"])}
    assert got == {k: pytest.approx(v) for k, v in BACKFILL_MFU.items()}
    job_tokens = panels["Throughput: tokens/s and samples/s"]["targets"][0]
    # the selected ranks' rates summed: two ranks over one, in one query (one evaluation
    # time; rate() extrapolates each rank's counter alike), is exactly 2
    both, one = job_tokens["expr"].replace("$rank", "0|1"), job_tokens["expr"].replace("$rank", "0")
    [ratio] = query(f"({both}) / ({one})")
    assert float(ratio["value"][1]) == pytest.approx(2.0, rel=1e-9)
    [rate] = query(one)
    assert float(rate["value"][1]) == pytest.approx(BACKFILL_TOKENS_PER_S, rel=0.2)
