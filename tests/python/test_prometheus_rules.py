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


def test_every_paging_rule_has_a_test_and_utilization_pages_nothing():
    rules = (RULES / "steptrace.rules.yml").read_text()
    tests = (RULES / "steptrace.rules.test.yml").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines() if line.strip().startswith("- alert:")]
    assert len(alerts) == 8
    for name in alerts:
        assert f"alertname: {name}\n" in tests, f"{name} has no firing test"
    # utilization is only recorded: no alert rule reads it
    for block in rules.split("- alert:")[1:]:
        assert "GPU_UTIL" not in block
