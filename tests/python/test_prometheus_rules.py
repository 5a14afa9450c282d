"""The shipped alert rules, checked and unit-tested by Debian's real promtool (installed by
scripts/setup.sh): each paging rule fires on its fault and not on its look-alike."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

RULES = Path(__file__).resolve().parents[2] / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: scripts/setup.sh installs it (Debian package prometheus)"
    return subprocess.run([exe, *args], cwd=RULES, capture_output=True, text=True, timeout=120)


def test_rules_are_valid():
    proc = promtool("check", "rules", "steptrace.rules.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_rules_unit_tests_pass():
    proc = promtool("test", "rules", "steptrace.rules.test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _alert_rules() -> list[dict]:
    import yaml  # noqa: PLC0415 (PyYAML comes with the test dependencies)

    groups = yaml.safe_load((RULES / "steptrace.rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


PAGES = {"SteptraceGpuXidError", "SteptraceGpuEccUncorrectable", "SteptraceNvlinkCrcErrors", "SteptraceStall",
         "SteptraceNoProgress", "SteptraceGpuTemperatureRising", "SteptraceGpuPowerDrop",
         "SteptraceThroughputDecline"}
TICKETS = {"SteptraceHostContention", "SteptraceGcPause", "SteptraceSlowCheckpoint", "SteptraceLongInterval"}


def test_every_alert_rule_has_a_test_and_utilization_pages_nothing():
    rules = _alert_rules()
    tests = (RULES / "steptrace.rules.test.yml").read_text()
    assert {r["alert"] for r in rules} == PAGES | TICKETS
    for rule in rules:
        assert f"alertname: {rule['alert']}\n" in tests, f"{rule['alert']} has no firing test"
        # utilization is only recorded: no alert rule reads it
        assert "GPU_UTIL" not in rule["expr"]


def test_only_training_faults_and_hardware_page():
    """The paging policy: host contention, GC pauses, slow checkpoints and anything about evaluation or
    checkpoints are tickets; a paging rule never fires on them (promtool checks the cases:
    steptrace.rules.test.yml)."""
    for rule in _alert_rules():
        severity = rule["labels"]["severity"]
        assert severity == ("page" if rule["alert"] in PAGES else "ticket"), rule["alert"]
        if severity != "page":
            continue
        expr = rule["expr"]
        for word in ("host_contention", "gc_pause", "slow_checkpoint", "runq", "goodput",
                     "steptrace_time_seconds_total"):
            assert word not in expr, f"{rule['alert']} reads {word}"
        # an open evaluation / checkpoint interval (here or on the rank waited for) may only
        # excuse a rule, never fire it
        for excuse in ("interval_in_flight", "peers_in_interval"):
            if excuse in expr:
                assert expr.index("unless") < expr.index(excuse), rule["alert"]
    # the throughput page judges training work: its recorded series leaves evaluation,
    # checkpoints and CPU waits out
    import yaml  # noqa: PLC0415

    groups = yaml.safe_load((RULES / "steptrace.rules.yml").read_text())["groups"]
    recorded = {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}
    decline = next(r for r in _alert_rules() if r["alert"] == "SteptraceThroughputDecline")
    assert "steptrace:training_steps_per_second:job" in decline["expr"]
    assert 'kind=~"step|data|other"' in recorded["steptrace:training_seconds:rate5m"]
    assert "steptrace_runq_wait_seconds_total" in recorded["steptrace:training_seconds:rate5m"]
    assert "steptrace:goodput_ratio_5m:job" in recorded
