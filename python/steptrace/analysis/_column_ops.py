"""Column operations behind :mod:`steptrace.analysis.summary`: the same statistics on ``array``/list
columns in pure Python and on numpy arrays (fast on a million steps), with the same
results, and the per-timing statistics (count, mean, p50/p95/p99, max, share) built on them."""

from __future__ import annotations

import math
from array import array
from typing import Any, Optional, Sequence

from steptrace._table import numpy


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, interpolated linearly
    between the two nearest ranks (numpy's default "linear" method)."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("percentile of no values")
    h = (n - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo])


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# --------------------------------------------------------------------------- column ops


class _PyOps:
    """Column operations on ``array``/list columns in pure Python (no numpy installed)."""

    @staticmethod
    def col(a: Any) -> Any:
        return a

    @staticmethod
    def timed(ok: Any, step_ms: Any) -> list[int]:
        return [i for i, (o, s) in enumerate(zip(ok, step_ms)) if o and s == s]

    @staticmethod
    def take(col: Any, idx: Sequence[int]) -> list[float]:
        return [col[i] for i in idx]

    @staticmethod
    def nonnan(v: Sequence[float]) -> list[float]:
        return [x for x in v if x == x]

    @staticmethod
    def present(v: Sequence[float]) -> list[int]:
        return [i for i, x in enumerate(v) if x == x]

    @staticmethod
    def present_ns(v: Sequence[int]) -> list[int]:
        return [i for i, x in enumerate(v) if x >= 0]

    @staticmethod
    def nan_to_zero(v: Sequence[float]) -> list[float]:
        return [x if x == x else 0.0 for x in v]

    @staticmethod
    def add(a: Sequence[float], b: Sequence[float]) -> list[float]:
        return [x + y for x, y in zip(a, b)]

    @staticmethod
    def sort(v: Sequence[float]) -> list[float]:
        return sorted(v)

    @staticmethod
    def total(v: Sequence[float]) -> float:
        return math.fsum(v)

    @staticmethod
    def ranks_rows(rank: Any, ranks: Sequence[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {r: [] for r in ranks}
        for i, r in enumerate(rank):
            if r in out:
                out[r].append(i)
        return out

    @staticmethod
    def slope(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
        n = len(x)
        if n < 3:
            return None
        mx, my = math.fsum(x) / n, math.fsum(y) / n
        sxx = math.fsum((a - mx) ** 2 for a in x)
        if sxx <= 0:
            return None
        return math.fsum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx


class _NpOps:
    """The same operations with numpy (fast on a million steps)."""

    def __init__(self, np: Any) -> None:
        self.np = np

    def col(self, a: Any) -> Any:
        np = self.np
        if isinstance(a, array):
            dtype = {"d": np.float64, "q": np.int64, "b": np.int8}[a.typecode]
            return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype=dtype)
        return np.asarray(a)

    def timed(self, ok: Any, step_ms: Any) -> Any:
        return self.np.flatnonzero((ok != 0) & ~self.np.isnan(step_ms))

    @staticmethod
    def take(col: Any, idx: Any) -> Any:
        return col[idx]

    def nonnan(self, v: Any) -> Any:
        return v[~self.np.isnan(v)]

    def present(self, v: Any) -> Any:
        return self.np.flatnonzero(~self.np.isnan(v))

    def present_ns(self, v: Any) -> Any:
        return self.np.flatnonzero(v >= 0)

    def nan_to_zero(self, v: Any) -> Any:
        return self.np.where(self.np.isnan(v), 0.0, v)

    @staticmethod
    def add(a: Any, b: Any) -> Any:
        return a + b

    def sort(self, v: Any) -> Any:
        return self.np.sort(v)

    @staticmethod
    def total(v: Any) -> float:
        # exactly rounded, like the pure-Python path: both give the same numbers
        return math.fsum(v.tolist()) if len(v) else 0.0

    def ranks_rows(self, rank: Any, ranks: Sequence[int]) -> dict[int, Any]:
        np = self.np
        if len(ranks) == 1:
            return {ranks[0]: np.flatnonzero(rank == ranks[0])}
        order = np.argsort(rank, kind="stable")
        sorted_r = rank[order]
        out = {}
        for r in ranks:
            lo, hi = np.searchsorted(sorted_r, [r, r + 1])
            out[r] = np.sort(order[lo:hi])
        return out

    def slope(self, x: Any, y: Any) -> Optional[float]:
        np = self.np
        if len(x) < 3:
            return None
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        with np.errstate(all="ignore"):  # a corrupt 1e300 overflows: no trend, not a warning
            dx = x - x.mean()
            sxx = float(dx @ dx)
            if not 0 < sxx < math.inf:
                return None
            slope = float(dx @ (y - y.mean())) / sxx
        return slope if math.isfinite(slope) else None


def _ops() -> Any:
    np = numpy()
    return _NpOps(np) if np is not None else _PyOps()


def _stats(values: Any, ops: Any, iteration_total: float) -> dict[str, Any]:
    """count, mean, p50/p95/p99, max and share of the iteration of one timing."""
    s = ops.sort(values)
    n = len(s)
    total = ops.total(s)
    return {
        "count": n,
        "mean_ms": total / n,
        "p50_ms": float(percentile(s, 50)),
        "p95_ms": float(percentile(s, 95)),
        "p99_ms": float(percentile(s, 99)),
        "max_ms": float(s[-1]),
        # share of the mean iteration = sum over steps / sum of iterations; a step
        # without this phase counts as 0 for it
        "share_pct": 100.0 * total / iteration_total if iteration_total > 0 else None,
    }
