"""The package's two sides (docs/architecture.md): ``import steptrace`` loads neither the
compiled core nor the live side, and the analysis side (reader, summary CLI) works with
the core unimportable; the public names resolve to their sub-packages on first use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support import logfactory as lf


def _python(code: str) -> subprocess.CompletedProcess:
    # a fresh interpreter: this one has long imported everything
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_steptrace_loads_no_core_no_live_side_and_no_torch():
    proc = _python("import sys, json, steptrace; print(json.dumps(sorted(sys.modules)))")
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    ours = {m for m in loaded if m.startswith("steptrace")}
    assert ours == {"steptrace", "steptrace._lazy", "steptrace._progress", "steptrace.errors",
                    "steptrace.analysis", "steptrace.analysis.reader"}, ours
    assert not loaded & {"torch", "numpy", "pandas"}


def test_the_reader_and_the_summary_work_without_the_compiled_core(tmp_path: Path):
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(4))
    code = ("import sys; sys.modules['steptrace._core'] = None  # import steptrace._core -> ImportError\n"
            "import steptrace\n"
            f"assert sum(r['kind'] == 'step' for r in steptrace.read({str(path)!r})) == 4\n"
            "from steptrace.cli import main\n"
            f"rc = main(['summary', {str(path)!r}, '--json'])\n"
            "sys.exit(rc)\n")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 4


def test_public_names_come_from_the_sub_packages():
    import steptrace
    import steptrace.analysis

    assert steptrace.Profiler.__module__ == "steptrace.live.profiler"
    assert steptrace.load.__module__ == steptrace.Run.__module__ == "steptrace.analysis.run"
    assert steptrace.analysis.load is steptrace.load and steptrace.analysis.Run is steptrace.Run
    assert steptrace.detect.__module__ == "steptrace.analysis.replay"
    assert steptrace.read.__module__ == "steptrace.analysis.reader"
    assert set(steptrace.__all__) >= {"Profiler", "detect", "load", "Run", "read", "validate_record", "SCHEMA"}
