"""steptrace: per-step profiling of PyTorch training loops.

``import steptrace`` is cheap: the compiled core (``steptrace._core``) is loaded the first
time the profiler is used, so the reader and the CLI work without it.
"""

from steptrace.errors import (
    ConfigError,
    LogFormatError,
    SteptraceError,
    UnknownOptionError,
    UsageError,
    UsageWarning,
)
from steptrace.reader import read, validate_record

try:
    from importlib.metadata import version as _version

    __version__ = _version("steptrace")
except Exception:  # running from a source tree without an install
    __version__ = "0.1.0"
SCHEMA = "steptrace/1"

_LAZY = {"Profiler": "steptrace.profiler", "load": "steptrace.analysis", "Run": "steptrace.analysis",
         "detect": "steptrace.replay"}


def __getattr__(name: str):  # PEP 562: load the extension only when the profiler is used
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'steptrace' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
