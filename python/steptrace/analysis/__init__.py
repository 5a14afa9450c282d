"""The analysis side: what reads a run's logs after (or while) it is written, without the
compiled core: the reader, ``load()``'s DataFrames (:mod:`steptrace.analysis.run`), the
summary, compare, plot, report, export and goodput, and the detectors replayed over a log
(:mod:`steptrace.analysis.replay`, which does load the core).

``load`` and ``Run`` are loaded on first use: ``import steptrace`` imports the reader from
here and must not pull in the summary with it.
"""

from __future__ import annotations

from steptrace._lazy import lazy_attributes

_LAZY = {"load": "steptrace.analysis.run", "Run": "steptrace.analysis.run"}
__getattr__ = lazy_attributes("steptrace.analysis", _LAZY, globals())

__all__ = ["load", "Run"]
