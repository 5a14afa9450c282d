"""steptrace: per-step profiling of PyTorch training loops.

``import steptrace`` is cheap: the compiled core (``steptrace._core``) is loaded the first
time the profiler is used, so the reader and the CLI work without it.
"""

from steptrace._lazy import lazy_attributes
from steptrace.errors import (
    ConfigError,
    LogFormatError,
    SteptraceError,
    UnknownOptionError,
    UsageError,
    UsageWarning,
)
from steptrace.analysis.reader import read, validate_record



def _source_version() -> str:
    # The one place the version is set: project(steptrace VERSION x.y.z) in CMakeLists.txt.
    # The wheel's metadata (pyproject.toml reads it there), _core.version(), run_start's
    # versions.steptrace and steptraceConfigVersion.cmake all come from it
    # (tests/python/test_version.py checks that they agree).
    import re
    from pathlib import Path

    try:
        text = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    except OSError:
        return "0+unknown"
    m = re.search(r"project\(steptrace VERSION ([0-9.]+)", text)
    return m.group(1) if m else "0+unknown"


try:
    from importlib.metadata import version as _version

    __version__ = _version("steptrace")
except Exception:  # running from a source tree without an install
    __version__ = _source_version()
SCHEMA = "steptrace/1"

_LAZY = {"Profiler": "steptrace.live.profiler", "load": "steptrace.analysis.run", "Run": "steptrace.analysis.run",
         "detect": "steptrace.analysis.replay"}


__getattr__ = lazy_attributes("steptrace", _LAZY, globals())  # load the extension only when the profiler is used


__all__ = [
    "Profiler",
    "detect",
    "load",
    "Run",
    "read",
    "validate_record",
    "SCHEMA",
    "SteptraceError",
    "ConfigError",
    "UnknownOptionError",
    "UsageError",
    "UsageWarning",
    "LogFormatError",
]
