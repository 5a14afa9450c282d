"""One version, set in one place (project(steptrace VERSION ...) in CMakeLists.txt), and the
same everywhere it is shown: the package metadata and steptrace.__version__, the extension's
_core.version(), `steptrace --version`, run_start's versions.steptrace, and the C++
package's steptraceConfigVersion.cmake."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest

import steptrace
from steptrace import _core
from steptrace.cli import main

ROOT = Path(__file__).resolve().parents[2]


def source_version() -> str:
    m = re.search(r"project\(steptrace VERSION ([0-9]+\.[0-9]+\.[0-9]+)[ )\n]",
                  (ROOT / "CMakeLists.txt").read_text())
    assert m, "CMakeLists.txt must set project(steptrace VERSION X.Y.Z)"
    return m.group(1)


def test_no_second_version_literal():
    # pyproject.toml reads the version from CMakeLists.txt, and the package has no literal
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "input = \"CMakeLists.txt\"" in pyproject
    assert not re.search(r"^version\s*=", pyproject, re.M)
    init = (ROOT / "python" / "steptrace" / "__init__.py").read_text()
    assert source_version() not in init


def test_python_metadata_and_extension_agree():
    v = source_version()
    assert steptrace.__version__ == v
    assert dist_version("steptrace") == v
    assert _core.version() == v


def test_cli_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"steptrace {source_version()}"


def test_run_start_versions(tmp_path, records_of):
    with steptrace.Profiler(tmp_path) as prof:
        for _ in range(2):
            with prof.step():
                with prof.phase("forward"):
                    pass
    records = records_of(prof.log_path)
    assert records[0]["kind"] == "run_start"
    assert records[0]["versions"]["steptrace"] == source_version()


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_cmake_package_config_version(tmp_path):
    # Configure only (a few seconds, nothing is compiled): steptraceConfigVersion.cmake is
    # written at configure time, then loaded the way find_package(steptrace X.Y) loads it.
    build = tmp_path / "build"
    subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), "-DSTEPTRACE_BUILD_TESTS=OFF",
         "-DSTEPTRACE_BUILD_BENCHMARKS=OFF", "-DSTEPTRACE_BUILD_EXAMPLES=OFF",
         "-DSTEPTRACE_WITH_TORCH=OFF", "-DSTEPTRACE_WITH_CUPTI=OFF",
         f"-DPython3_EXECUTABLE={sys.executable}"],
        check=True, capture_output=True, text=True)
    config_version = build / "steptraceConfigVersion.cmake"
    assert config_version.is_file()
    v = source_version()
    major, minor, _ = v.split(".")
    probe = tmp_path / "probe.cmake"
    probe.write_text(
        f'set(PACKAGE_FIND_VERSION "{major}.{minor}")\n'
        f'set(PACKAGE_FIND_VERSION_MAJOR "{major}")\nset(PACKAGE_FIND_VERSION_MINOR "{minor}")\n'
        f'set(PACKAGE_FIND_VERSION_PATCH "0")\nset(PACKAGE_FIND_VERSION_COUNT 2)\n'
        'set(CMAKE_SIZEOF_VOID_P 8)\n'
        f'include("{config_version.as_posix()}")\n'
        'message("version=${PACKAGE_VERSION} compatible=${PACKAGE_VERSION_COMPATIBLE}")\n')
    out = subprocess.run(["cmake", "-P", str(probe)], check=True, capture_output=True, text=True)
    assert f"version={v} compatible=TRUE" in out.stderr
