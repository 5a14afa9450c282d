"""CUPTI in the processes users run: one that imported torch, whose own libcupti (torch 2.15:
CUPTI 13.2 in site-packages/nvidia/cu13/lib) is the copy steptrace shares, and one that did
not (the toolkit's, here CUPTI 13.0). On this machine there is no driver, and CUPTI 13.2's
cuptiGetVersion dies there (SIGSEGV: it recurses while reporting that libcuda.so.1 is
missing); the metrics command died with it. Each command now ends normally, with the reason
when CUPTI cannot be used, never by a signal."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

METRICS = textwrap.dedent("""
    import sys
    from steptrace.cli import main
    sys.argv = ["steptrace", "metrics", "--chip", "GH100", "--mode", "range_profiler", "--json"]
    sys.exit(main())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    # faulthandler on, as under pytest: a crash in steptrace's probe child must not print
    return subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                          timeout=120)


def _torch_cupti() -> str:
    """The libcupti file torch's wheel ships, '' when it ships none."""
    import glob
    import os

    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcupti.so*")))
    return found[0] if found else ""


@pytest.mark.parametrize("imports", ["import torch", ""], ids=["torch imported", "no torch"])
def test_metrics_command_ends_normally_beside_any_cupti(imports):
    p = _run(imports + "\n" + METRICS)
    assert p.returncode >= 0, f"killed by signal {-p.returncode}: {p.stderr[-800:]}"
    report = json.loads(p.stdout)
    assert "Fatal Python error" not in p.stderr, p.stderr[-800:]
    if p.returncode == 0:
        assert report["cupti_version"] > 0 and report["cupti_library"], report
        assert [m for m in report["metrics"] if m["exists"] and m["selected"]], report
    else:  # the one-line reason names the library and why it is not used, on stderr too
        assert p.returncode == 2 and "libcupti" in report["error"], report.get("error")
        assert "\n" not in report["error"]
        assert p.stderr.strip().splitlines() == [f"steptrace: error: {report['error']}"], p.stderr[-800:]


def test_torch_cupti_that_crashes_without_a_driver_is_refused_with_the_reason():
    """Where the libcupti torch loaded cannot even say its version here (13.2 without a
    driver), the command says so instead of dying; where it can, the table is checked."""
    lib = _torch_cupti()
    if not lib:
        pytest.skip("this torch ships no libcupti")
    probe = _run(f"import ctypes; v = ctypes.c_uint32(); ctypes.CDLL({lib!r}).cuptiGetVersion(ctypes.byref(v))")
    p = _run("import torch\n" + METRICS)
    assert p.returncode >= 0, f"killed by signal {-p.returncode}"
    report = json.loads(p.stdout)
    if probe.returncode < 0:  # the vendor library crashes in a bare process: we must not
        assert p.returncode == 2, report.get("error")
        assert "cannot be used" in report["error"] and "cuptiGetVersion died" in report["error"], report["error"]
    else:
        assert p.returncode == 0, report.get("error")


def test_profiler_start_beside_torch_cupti_ends_normally(tmp_path):
    code = textwrap.dedent(f"""
        import torch, steptrace
        with steptrace.Profiler({str(tmp_path)!r}, counters="auto") as prof:
            for _ in range(5):
                with prof.step():
                    with prof.phase("forward"):
                        torch.ones(8) @ torch.ones(8)
    """)
    p = _run(code)
    assert p.returncode == 0, p.stderr[-800:]
    import steptrace

    recs = list(steptrace.read(tmp_path, validate=True))
    start = next(r for r in recs if r["kind"] == "run_start")
    # no GPU here: the CUPTI backends say why they are off, and the run goes on
    for kind in ("kernel_activity", "counters"):
        assert start["backends"][kind]["active"] == [], start["backends"][kind]
        assert start["backends"][kind]["unavailable"], start["backends"][kind]
    assert sum(r["kind"] == "step" for r in recs) == 5
