"""The analysis side: what reads a run's logs after (or while) it is written, without the
compiled core: the reader, ``load()``'s DataFrames (:mod:`steptrace.analysis.run`), the
summary, compare, plot, report, export and goodput, and the detectors replayed over a log
(:mod:`steptrace.analysis.replay`, which does load the core).

``load`` and ``Run`` are loaded on first use: ``import steptrace`` imports the reader from
here and must not pull in the summary with it.
"""

from __future__ import annotations

_LAZY = {"load": "steptrace.analysis.run", "Run": "steptrace.analysis.run"}


def __getattr__(name: str):  # PEP 562
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'steptrace.analysis' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["load", "Run"]
