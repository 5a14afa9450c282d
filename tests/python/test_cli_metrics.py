"""`steptrace metrics --chip X` in a subprocess: the metric set per chip checked with
CUPTI's host API (no GPU needed). Skipped only where libcupti cannot be loaded."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from support import logfactory as lf

CI_CHIPS = ("GA100", "GH100", "AD102", "GB100", "GB202")


def run_metrics(*args: str) -> Any:
    """The installed console script with the installed package: `metrics` needs the compiled
    core, which the source tree's python/ (first on PYTHONPATH in lf.cli_env) lacks."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([lf.steptrace_script(), "metrics", *args], capture_output=True, text=True,
                          env=env, timeout=120, stdin=subprocess.DEVNULL)


def _report(chip: str, *extra: str) -> dict:
    proc = run_metrics("--chip", chip, "--json", *extra)
    report = json.loads(proc.stdout)
    if report["error"].startswith(("libcupti could not be loaded", "built without CUPTI headers")):
        pytest.skip(f"CUPTI host API unavailable: {report['error']}")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return report


@pytest.mark.parametrize("chip", CI_CHIPS)
@pytest.mark.parametrize("mode", ("pm_sampling", "range_profiler"))
def test_every_chip_set_exists_and_is_one_pass(chip: str, mode: str) -> None:
    r = _report(chip, "--mode", mode)
    assert r["chip"] == chip and r["mode"] == mode and r["error"] == ""
    assert r["passes"] == 1
    selected = [m for m in r["metrics"] if m["selected"]]
    assert all(m["exists"] for m in selected)
    counters = [m["counter"] for m in selected]
    assert len(counters) == len(set(counters))
    assert {"tensor_active_pct", "dram_throughput_pct", "sm_occupancy_pct"} <= set(counters)
    assert r["cupti_version"] > 0 and r["cupti_library"]


def test_auto_mode_is_pm_sampling_and_text_output() -> None:
    assert _report("GH100")["mode"] == "pm_sampling"
    proc = run_metrics("--chip", "GH100")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("chip GH100 (table GH100): pm_sampling, trigger gpu_time_interval, 1 pass")
    assert any(ln.startswith("+ tensor_active_pct") and "exists" in ln for ln in lines)
    # sm__throughput does not fit one pass with the rest on GH100: listed, not selected
    assert any("sm__throughput" in ln and not ln.startswith("+") and "passes" in ln for ln in lines)


@pytest.mark.parametrize("chip", ["H100", "gh100", "GX999"])
def test_bad_chip_is_one_line_error_naming_it_and_the_supported_ones(chip: str) -> None:
    proc = run_metrics("--chip", chip)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("steptrace: error: ")
    assert f'"{chip}"' in lines[0]
    for c in CI_CHIPS:
        assert c in lines[0]


@pytest.mark.parametrize("chip", ["x" * 10_000, "GH100; rm", ""])
def test_a_chip_that_is_not_a_name_is_refused_in_one_short_line(chip: str) -> None:
    proc = run_metrics("--chip", chip)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("steptrace: error: --chip ") and len(lines[0]) < 200
    assert "letters and digits" in lines[0]


def test_old_chip_says_why() -> None:
    proc = run_metrics("--chip", "TU102")
    assert proc.returncode == 2 and "older than" in proc.stderr


def test_help_lists_metrics() -> None:
    proc = lf.run_cli("--help")
    assert proc.returncode == 0 and "metrics" in proc.stdout
