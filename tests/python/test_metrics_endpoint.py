"""The Prometheus endpoint of a real CPU training loop, scraped by a real Prometheus
server (Debian's ``prometheus``), queried back through its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

import steptrace
from support.training import batches, train

PROMETHEUS = shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _poll(what: str, fn, timeout_s: float = 90.0, every_s: float = 0.25):
    """fn() until it returns something truthy; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except OSError as e:  # not listening yet, or mid-restart
            last_error = e
        time.sleep(every_s)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what} (last error: {last_error})")


def test_endpoint_serves_the_run_without_prometheus(tmp_path):
    with steptrace.Profiler(tmp_path / "run", metrics_port=0, run_id="plain-scrape", job="pytest") as prof:
        train(prof, batches(12))
        prof.flush()
        port = prof.metrics_port
        assert port > 0
        text = _get(f"http://127.0.0.1:{port}/metrics").decode()
    assert f'steptrace_steps_total{{job="pytest",run_id="plain-scrape",rank="0",host="{socket.gethostname()}"}} 12' in text
    for phase in ("forward", "loss", "backward", "clip", "optimizer"):
        assert f'steptrace_phase_duration_seconds_count{{job="pytest",run_id="plain-scrape",rank="0",host="{socket.gethostname()}",phase="{phase}"}} 12' in text
    start = json.loads(open(prof.log_path).readline())
    assert start["metrics"] == {"host": "127.0.0.1", "port": port, "path": "/metrics"}
    assert start["config"]["metrics_port"] == 0 and start["config"]["job"] == "pytest"


def test_endpoint_says_what_the_cross_rank_exchange_told_the_rank_of_its_peers(tmp_path):
    # steptrace_peers_in_interval: absent without an exchange; what the exchange's thread
    # sets (other ranks in an evaluation or checkpoint) once there is one
    with steptrace.Profiler(tmp_path / "run", metrics_port=0, run_id="peers", job="pytest") as prof:
        url = f"http://127.0.0.1:{prof.metrics_port}/metrics"
        assert "steptrace_peers_in_interval" not in _get(url).decode()
        prof._core.set_peers_in_interval(2, 3.0)  # as ClusterExchange does
        text = _get(url).decode()
    assert f'steptrace_peers_in_interval{{job="pytest",run_id="peers",rank="0",host="{socket.gethostname()}"}} 2' in text


def test_metrics_port_is_off_by_default_and_validated(tmp_path):
    with steptrace.Profiler(tmp_path / "run") as prof:
        assert prof.metrics_port == -1
    with pytest.raises(steptrace.ConfigError, match="metrics_port"):
        steptrace.Profiler(tmp_path / "bad", metrics_port=70000)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on `port`, from the kernel's tables."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # TCP_LISTEN
                raw = bytes.fromhex(addr)
                if width == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four host-order 32-bit words
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_the_endpoint_listens_on_loopback_unless_told_otherwise(tmp_path):
    # the issue: it listened on every interface (0.0.0.0), with no way to choose
    with steptrace.Profiler(tmp_path / "default", metrics_port=0) as prof:
        assert _listening_addresses(prof.metrics_port) == {"127.0.0.1"}
    start = json.loads(open(prof.log_path).readline())
    assert start["metrics"]["host"] == "127.0.0.1" and start["config"]["metrics_host"] == "127.0.0.1"
    with steptrace.Profiler(tmp_path / "all", metrics_port=0, metrics_host="0.0.0.0") as prof:
        assert _listening_addresses(prof.metrics_port) == {"0.0.0.0"}
        assert _get(f"http://127.0.0.1:{prof.metrics_port}/metrics").startswith(b"# HELP")
    assert json.loads(open(prof.log_path).readline())["metrics"]["host"] == "0.0.0.0"


@pytest.mark.parametrize("host", ["localhost", "0.0.0.0:9400", "", "127.0.0.1 ", "fe80::1%eth0", "1.2.3"])
def test_metrics_host_must_be_an_ip_address_and_nothing_is_written_first(tmp_path, host):
    with pytest.raises(steptrace.ConfigError) as e:
        steptrace.Profiler(tmp_path / "bad", metrics_port=0, metrics_host=host)
    message = str(e.value)
    assert f"metrics_host={json.dumps(host)}" in message and "IPv4 or IPv6 address" in message
    assert not (tmp_path / "bad" / "rank0.jsonl").exists()


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus (apt-get install prometheus)")
def test_a_real_prometheus_scrapes_a_training_loop(tmp_path):
    steps = 40
    run_id = f"prom-{int(time.time())}"
    with steptrace.Profiler(tmp_path / "run", metrics_port=0, run_id=run_id) as prof:
        train(prof, batches(steps))
        prof.flush()
        port = prof.metrics_port
        assert port > 0
        web_port = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: steptrace-under-test\n    honor_labels: true\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
        )
        log = open(tmp_path / "prometheus.log", "wb")
        server = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web_port}"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{web_port}"
            _poll("Prometheus to be ready", lambda: server.poll() is None and _get(f"{base}/-/ready"), 60)

            def query(expr: str):
                url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                body = json.loads(_get(url))
                assert body["status"] == "success", body
                return body["data"]["result"]

            def steps_total():
                assert server.poll() is None, (tmp_path / "prometheus.log").read_text()
                result = query(f'steptrace_steps_total{{run_id="{run_id}"}}')
                return result if result and result[0]["value"][1] == str(steps) else None

            result = _poll(f"Prometheus to scrape steptrace_steps_total == {steps}", steps_total, 90)
            assert len(result) == 1
            labels = result[0]["metric"]
            assert labels["job"] == "steptrace"  # the default job label, kept by honor_labels
            assert labels["rank"] == "0" and labels["host"] == socket.gethostname()
            assert labels["instance"] == f"127.0.0.1:{port}"
            # the histograms and the per-phase split arrive in the same scrape
            count = query(f'steptrace_step_duration_seconds_count{{run_id="{run_id}"}}')
            assert count[0]["value"][1] == str(steps)
            phases = query(f'steptrace_phase_duration_seconds_count{{run_id="{run_id}"}}')
            assert sorted(r["metric"]["phase"] for r in phases) == sorted(
                ["forward", "loss", "backward", "clip", "optimizer"])
            p50 = query(f'histogram_quantile(0.5, steptrace_step_duration_seconds_bucket{{run_id="{run_id}"}})')
            assert float(p50[0]["value"][1]) > 0
            up = query(f'up{{instance="127.0.0.1:{port}"}}')
            assert up[0]["value"][1] == "1"
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            log.close()


def _start(argv: list, log_path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def test_textfile_mode_leaves_the_final_metrics(tmp_path):
    path = tmp_path / "steptrace.prom"
    with steptrace.Profiler(tmp_path / "run", metrics_textfile=str(path), run_id="textfile") as prof:
        train(prof, batches(9))
        assert prof.metrics_port == -1
    text = path.read_text()
    assert f'steptrace_steps_total{{job="steptrace",run_id="textfile",rank="0",host="{socket.gethostname()}"}} 9' in text
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


PUSHGATEWAY = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")


@pytest.mark.skipif(PUSHGATEWAY is None, reason="needs Debian's prometheus-pushgateway")
def test_a_short_job_pushes_to_a_real_pushgateway_at_close(tmp_path):
    port = _free_port()
    server = _start([PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}",
                     f"--persistence.file={tmp_path / 'pushgateway.data'}"], tmp_path / "pushgateway.log")
    try:
        base = f"http://127.0.0.1:{port}"
        _poll("the Pushgateway to be ready", lambda: server.poll() is None and _get(f"{base}/-/ready"), 60)
        with steptrace.Profiler(tmp_path / "run", metrics_pushgateway=base, run_id="short/job", job="batch") as prof:
            train(prof, batches(6))
        text = _get(f"{base}/metrics").decode()
        lines = [l for l in text.splitlines() if l.startswith("steptrace_steps_total{")]
        assert len(lines) == 1, text
        assert 'job="batch"' in lines[0] and 'run_id="short/job"' in lines[0] and 'rank="0"' in lines[0]
        assert lines[0].endswith(" 6")
    finally:
        _stop(server)


# The stand-in NVML library of the C++ tests, compiled by test_nvml.py's fixture.


def _samples(text: str, name: str) -> dict:
    """{label string: value} of one metric in the text format."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def test_hardware_figures_and_the_cross_rank_view_on_the_endpoint(tmp_path, monkeypatch, fake_nvml):
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "xid")
    host = socket.gethostname()
    base = f'job="hw",run_id="hw-scrape",rank="0",host="{host}"'
    xid_seen = []
    with steptrace.Profiler(tmp_path / "run", metrics_port=0, run_id="hw-scrape", job="hw", nvml_interval_ms=2,
                            on_alert=lambda r: xid_seen.append(r) if r["type"] == "hardware_error" else None) as prof:
        net = train(prof, batches(30))
        _poll("the fake's XID 79", lambda: xid_seen, timeout_s=30)
        train(prof, batches(10), net)
        # rank 0's cross-rank view, as the exchange writes it (steptrace.cluster -> write_record)
        prof._core.write_record(json.dumps({
            "kind": "cluster", "step": 39, "window": 1, "world_size": 2, "ranks_reporting": 2, "stragglers": [1],
            "ranks": [{"rank": 0, "host": host, "steps": 20, "step_ms": 10.0, "step_p95_ms": 11.0, "compute_ms": 6.0,
                       "comm_ms": 1.0, "wait_ms": 3.0, "data_ms": 0.5, "own_ms": 6.5, "straggler_pct": -23.5},
                      {"rank": 1, "host": "node-b", "steps": 20, "step_ms": 10.0, "step_p95_ms": 12.0, "compute_ms": 8.0,
                       "comm_ms": 1.0, "wait_ms": 0.0, "data_ms": 0.5, "own_ms": 8.5, "straggler_pct": 30.8}]}))
        prof.flush()
        text = _get(f"http://127.0.0.1:{prof.metrics_port}/metrics").decode()
    records = list(steptrace.read(tmp_path / "run" / "rank0.jsonl", validate=True))
    last_hw = [r["hw"] for r in records if r["kind"] == "step" and "hw" in r][-1]
    assert _samples(text, "steptrace_gpu_power_watts") == {base: pytest.approx(last_hw["power_w"], abs=0.06)}
    assert 640 <= last_hw["power_w"] <= 660  # the fake's steady 650 W
    assert _samples(text, "steptrace_gpu_power_limit_watts") == {base: 700}
    assert _samples(text, "steptrace_gpu_temperature_celsius") == {base: last_hw["max_temp_c"]}
    assert _samples(text, "steptrace_gpu_sm_clock_hertz") == {base: pytest.approx(last_hw["sm_clock_mhz"] * 1e6, rel=1e-3)}
    assert last_hw["util_pct"] == 98  # the fake's utilization
    assert _samples(text, "steptrace_gpu_utilization_ratio") == {base: pytest.approx(0.98)}
    energy = sum(r["hw"]["energy_j"] for r in records if r["kind"] == "step" and "hw" in r)
    [got] = _samples(text, "steptrace_gpu_energy_joules_total").values()
    assert got == pytest.approx(energy, rel=1e-3, abs=1e-2) and got > 0
    errors = _samples(text, "steptrace_gpu_hardware_errors_total")  # the fake's XID, then its ECC rise
    assert errors[base + ',kind="xid"'] == 1 and set(errors) <= {base + ',kind="xid"', base + ',kind="ecc_uncorrected"'}
    assert _samples(text, "steptrace_gpu_last_xid") == {base: 79}
    assert _samples(text, "steptrace_rank_straggler_score") == {
        f'job="hw",run_id="hw-scrape",rank="0",host="{host}"': -0.235,
        'job="hw",run_id="hw-scrape",rank="1",host="node-b"': 0.308}
    split = _samples(text, "steptrace_rank_split_seconds")
    assert split['job="hw",run_id="hw-scrape",rank="1",host="node-b",part="compute"'] == 0.008
    assert _samples(text, "steptrace_cluster_stragglers") == {base: 1}
    assert records[-1]["sinks"] == [
        {"name": "jsonl", "status": "ok", "slow_calls": 0, "max_call_ms": records[-1]["sinks"][0]["max_call_ms"]},
        {"name": "prometheus", "status": "ok", "slow_calls": 0, "max_call_ms": records[-1]["sinks"][1]["max_call_ms"]}]


def test_collective_bandwidth_on_the_endpoint(tmp_path):
    # Collectives timed through the core's own calls (what steptrace.live.comm makes for each
    # torch.distributed collective), with the sizes it gives: payload S and S x bus factor.
    host = socket.gethostname()
    base = f'job="bw",run_id="bw-scrape",rank="0",host="{host}"'
    with steptrace.Profiler(tmp_path / "run", metrics_port=0, run_id="bw-scrape", job="bw", cluster="off") as prof:
        core = prof._core
        for i in range(6):
            with prof.step():
                token = core.collective_begin()
                time.sleep(0.002)  # the collective's duration (only its length matters here)
                core.collective_end(token, True, 4_000_000 * (i + 1), 6_000_000 * (i + 1))
        with prof.step():  # a step without sized collectives keeps the last sized step's figures
            core.collective_end(core.collective_begin(), True)
        # rank 0's cross-rank view lists each rank's bus bandwidth (window median)
        row = {"steps": 20, "step_ms": 10.0, "step_p95_ms": 11.0, "compute_ms": 6.0, "comm_ms": 1.0, "wait_ms": 0.0,
               "data_ms": 0.5, "own_ms": 6.5, "straggler_pct": 0.0}
        core.write_record(json.dumps({"kind": "cluster", "step": 19, "window": 0, "world_size": 2,
                                      "ranks_reporting": 2, "stragglers": [],
                                      "ranks": [{**row, "rank": 0, "host": host, "busbw_gbps": 12.5},
                                                {**row, "rank": 1, "host": "node-b"}]}))
        prof.flush()
        text = _get(f"http://127.0.0.1:{prof.metrics_port}/metrics").decode()
    steps = [r for r in steptrace.read(tmp_path / "run" / "rank0.jsonl", validate=True) if r["kind"] == "step"]
    last_sized = [s["comm"] for s in steps if "busbw_gbps" in s["comm"]][-1]
    assert "busbw_gbps" not in steps[-1]["comm"] and last_sized["bytes"] == 24_000_000
    # GB/s in the record (6 significant digits), bytes per second on the endpoint
    assert _samples(text, "steptrace_comm_algbw_bytes_per_second") == {
        base: pytest.approx(last_sized["algbw_gbps"] * 1e9, rel=1e-5)}
    assert _samples(text, "steptrace_comm_busbw_bytes_per_second") == {
        base: pytest.approx(last_sized["busbw_gbps"] * 1e9, rel=1e-5)}
    assert _samples(text, "steptrace_comm_bytes_total") == {base: sum(4_000_000 * (i + 1) for i in range(6))}
    assert "# TYPE steptrace_comm_busbw_bytes_per_second gauge" in text
    assert _samples(text, "steptrace_rank_busbw_bytes_per_second") == {base: 12.5e9}  # rank 1 has none: absent


def test_no_sized_collectives_no_bandwidth_series(tmp_path):
    with steptrace.Profiler(tmp_path / "run", metrics_port=0, cluster="off") as prof:
        train(prof, batches(3))
        prof.flush()
        text = _get(f"http://127.0.0.1:{prof.metrics_port}/metrics").decode()
    assert "steptrace_comm_" not in text and "busbw" not in text
