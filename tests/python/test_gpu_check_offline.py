"""The device check (tests/gpu/run.sh) as the GPU machine runs it, here: offline (no package
index, no apt-get: a stand-in on PATH records any call and fails), with the interpreter given
in PYTHON, building steptrace from the tree with the bundled fmt and nlohmann/json headers
(CMAKE_DISABLE_FIND_PACKAGE_*), into a scratch prefix. Without a GPU every script is one
`SKIP  <script>  no GPU` row and the run exits 0; its results land in the output folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["check_cuda_timing.py", "check_streams.py", "check_graphs.py", "check_nvml_devices.py",
           "check_cupti.py", "check_nvml.py", "check_work.py"]


@pytest.fixture
def no_network_bin(tmp_path):
    """A folder for the front of PATH whose apt-get, apt and sudo record that they were
    called and fail."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "forbidden-calls"
    for name in ("apt-get", "apt", "sudo"):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {calls}\nexit 1\n")
        tool.chmod(0o755)
    return bin_dir, calls


def test_device_check_runs_offline_and_skips_without_a_gpu(tmp_path, no_network_bin):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run tests/gpu/run.sh itself")
    bin_dir, calls = no_network_bin
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, PATH=f"{bin_dir}:{os.environ['PATH']}",
               STEPTRACE_GPU_PREFIX=str(tmp_path / "prefix"), STEPTRACE_GPU_BUILD_CAP_S="900",
               # any download attempt goes nowhere
               PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_NO_INDEX="1", PYTHONPATH="")
    t0 = time.monotonic()
    p = subprocess.run(["bash", str(ROOT / "tests/gpu/run.sh"), str(out)], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=1200)
    took = time.monotonic() - t0
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert not calls.exists(), calls.read_text()

    build = (out / "build.log").read_text()
    assert "using the bundled fmt 9.1.0" in build, build[-2000:]
    assert "using the bundled nlohmann/json 3.11.2" in build, build[-2000:]
    # the steptrace checked is the one just built into the scratch prefix, not the venv's
    assert str(tmp_path / "prefix" / "site" / "steptrace") in p.stdout

    summary = (out / "summary.txt").read_text().splitlines()
    rows = [line for line in summary if re.match(r"^(PASS|FAIL|SKIP|INFO)  ", line)]
    assert rows == [f"SKIP  {s}  no GPU (torch.cuda.is_available() is False)" for s in SCRIPTS], summary
    assert summary[-1].startswith("device check: ") and summary[-1].endswith("exit 0"), summary
    for name in ("run.log", "env.txt"):
        assert (out / name).stat().st_size > 0
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert size < 8 << 20, f"{size} bytes to copy back"
    print(f"dry run of tests/gpu/run.sh: {took:.0f} s, {size} bytes of results")


def test_device_check_says_how_to_call_it(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "tests/gpu/run.sh")], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "usage: bash tests/gpu/run.sh OUT_DIR" in p.stderr
    p = subprocess.run(["bash", str(ROOT / "tests/gpu/run.sh"), str(tmp_path / "o")], capture_output=True,
                       text=True, timeout=30, env=dict(os.environ, PYTHON="/nonexistent/python3"))
    assert p.returncode == 2 and "PYTHON=/nonexistent/python3: not found" in p.stderr
