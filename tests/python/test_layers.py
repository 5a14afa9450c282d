"""The build's layer check (scripts/check_layers.py, run by the steptrace_layers target):
the tree follows the layers, and an include that runs the wrong way fails it by name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent.parent
_SCRIPT = _ROOT / "scripts" / "check_layers.py"


def _check(csrc: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(_SCRIPT), str(csrc)], capture_output=True, text=True,
                          timeout=60)


def test_the_tree_follows_the_layers():
    proc = _check(_ROOT / "csrc")
    assert proc.returncode == 0, proc.stderr


def test_core_including_a_sink_fails_the_check(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(_ROOT / "csrc", csrc)
    victim = csrc / "core" / "detect" / "slow_step_detector.cpp"  # a folder inside core/
    victim.write_text('#include "../../sinks/prometheus_sink.hpp"\n' + victim.read_text())
    backend = csrc / "backends" / "host" / "host_clock.cpp"
    backend.write_text('#include "core/step_record.hpp"\n' + backend.read_text())
    proc = _check(csrc)
    assert proc.returncode == 1
    assert "core/detect/slow_step_detector.cpp:1: core/ includes sinks/" in proc.stderr, proc.stderr
    assert "backends/host/host_clock.cpp:1: backends/ includes core/" in proc.stderr, proc.stderr
    assert "2 include(s) against the layers" in proc.stderr
