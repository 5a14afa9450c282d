"""The Profiler's options: checked and split between the core's ``_core.Config`` and the
options Python handles itself, before anything touches the disk. The option table is
include/steptrace/config_options.def (via the generated :mod:`steptrace._options`).
"""

from __future__ import annotations

import os
from typing import Any

from steptrace import _core
from steptrace._options import PYTHON_OPTIONS
from steptrace.cluster import check_cluster_options
from steptrace.errors import ConfigError, UnknownOptionError
from steptrace.live.evidence_capture import check_evidence_options
from steptrace.live.otlp import check_otlp_options

# Options handled here rather than by the core (None: any callable or None), from the
# option table (include/steptrace/config_options.def, via the generated steptrace._options).
_PYTHON_OPTIONS: dict = dict(PYTHON_OPTIONS)
_CORE_OPTIONS = sorted(
    name for name in dir(_core.Config) if not name.startswith("_") and name not in ("validate", "log_dir")
)
ALLOWED_OPTIONS = sorted([*_CORE_OPTIONS, *_PYTHON_OPTIONS])


def _check_type(key: str, value: Any, default: Any) -> None:
    if default is None:  # a callback
        ok, expected = value is None or callable(value), "callable or None"
    elif isinstance(default, bool):
        ok, expected = isinstance(value, bool), "a bool"
    elif isinstance(default, int):
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an int"
    elif isinstance(default, float):
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, str):
        ok, expected = isinstance(value, str), "a str"
    else:  # list of phase names
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        expected = "a list of str"
    if not ok:
        raise ConfigError(f"option {key}={value!r} must be {expected}, got {type(value).__name__}")


def build_config(log_dir: "str | os.PathLike[str]", options: dict) -> tuple[Any, dict]:
    """The validated core config and the Python-side options; raises before touching disk."""
    if not isinstance(log_dir, (str, os.PathLike)):
        raise ConfigError(f"log_dir={log_dir!r} must be a path (str or os.PathLike), got {type(log_dir).__name__}")
    config = _core.Config()
    config.log_dir = os.fspath(log_dir)
    python_options = dict(_PYTHON_OPTIONS)
    for key, value in options.items():
        if key in _PYTHON_OPTIONS:
            _check_type(key, value, _PYTHON_OPTIONS[key])
            python_options[key] = value
            continue
        if key not in _CORE_OPTIONS:
            raise UnknownOptionError(f"unknown option {key!r}; allowed: {', '.join(ALLOWED_OPTIONS)}")
        _check_type(key, value, getattr(config, key))
        setattr(config, key, list(value) if isinstance(value, tuple) else value)
    grace = python_options["sigterm_grace_s"]
    if not 0 <= grace <= 3600:
        raise ConfigError(f"option sigterm_grace_s={grace!r} is out of range; allowed: 0..3600 (seconds)")
    check_cluster_options(python_options)
    check_otlp_options(python_options)
    check_evidence_options(python_options)
    config.validate()
    return config, python_options
