"""Compare two runs phase by phase: did the median change beyond noise? And where did
their wall clock go?

For every timing (data wait, the rest of the time between steps ("other", in logs that
record it), each phase, step, iteration = data + other + step - intervals inside the
step) the steps after warmup of both runs (status "ok", all ranks pooled) are compared
with

- the **Mann–Whitney U test** (two-sided, normal approximation with tie and continuity
  corrections): does a step of NEW tend to take longer than a step of BASE? It reports
  the p-value and ``p_slower`` = P(a NEW step is slower than a BASE step) (0.5: no
  difference);
- the **change of the median**, new/base - 1, with a 95% **bootstrap confidence
  interval** (percentile bootstrap of the two medians, 1000 resamples, fixed seed so the
  result is reproducible; runs over 2000 steps are bootstrapped on a random 2000-step
  subsample whose spread is rescaled to the full size, the m-out-of-n bootstrap).

A timing has **regressed** when its median grew by more than ``threshold`` (default 5%)
and by more than ``min_delta_ms`` (default 0.05 ms, so microsecond phases do not fail a
gate on jitter), the U test says p < ``alpha`` (default 0.01), and the whole confidence
interval is above zero. **improved** is the mirror image; a significant change smaller
than the threshold is ``slower`` / ``faster``; anything else is ``same``. Two samples of
one distribution differ by far less than 5% in their medians, so they never regress at
the defaults. Step times are autocorrelated (warmup, GC, thermals), which makes any test
that assumes independent samples over-confident: the threshold, not the p-value, is
what keeps the gate quiet on noise.

``work`` compares the useful work of the steps (docs/useful-work.md) where both runs
recorded it: ``mfu_pct`` and ``tokens_per_s`` (each step's, the same steps after warmup,
all ranks pooled), with the same test and interval. Higher is better here, so the
verdicts are mirrored: a rate **regressed** when its median fell by more than
``threshold`` with p < ``alpha`` and the whole interval below zero (no ``min_delta_ms``:
it is a time), **improved** when it rose as much; ``lower`` / ``higher`` is a significant
change within the threshold. A regressed rate fails the gate like a regressed timing
(``gate`` names them ``mfu_pct`` and ``tokens_per_s``). An MFU drop at an unchanged step
time means each step does less model work per second of the device's peak than before:
new shapes or a new model whose FLOPs per step changed, which the timings alone miss.

``goodput`` compares the runs' wall clock by part (:func:`steptrace.analysis.summary.goodput`: the
training steps' share, data, eval, checkpoint, other, startup, after the last step), as
shares of each run's wall clock and their difference in percentage points; it informs,
it never fails the gate (evaluation and checkpoints are the run's choice, not a
regression of the model).

numpy is required (``pip install 'steptrace[analysis]'``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

from steptrace._table import StepTable
from steptrace._terminal import printable
from steptrace.analysis.summary import DEFAULT_PHASES, DEFAULT_WARMUP, GOODPUT_PARTS, _ms, goodput

DEFAULT_THRESHOLD = 0.05
DEFAULT_ALPHA = 0.01
DEFAULT_MIN_DELTA_MS = 0.05
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_MAX_SAMPLE = 2000
#: Fewer steps than this on either side: no verdict (never a regression).
MIN_STEPS = 8
VERDICTS = ("regressed", "improved", "slower", "faster", "lower", "higher", "same", "too few steps", "added",
            "removed")
#: The per-step work rates compared (a step's ``work`` object), higher is better.
WORK_COMPARED = ("mfu_pct", "tokens_per_s")


def _np() -> Any:
    from steptrace.analysis.run import require

    return require("numpy", "analysis", "steptrace compare")


# --------------------------------------------------------------------------- statistics


def mann_whitney(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Two-sided Mann–Whitney U test of samples ``x`` (base) and ``y`` (new).

    Returns ``(p_value, p_slower)`` where p_slower = P(Y > X) + P(Y = X)/2 = U_y / (n_x n_y).
    The p-value uses the normal approximation with the tie correction of the variance and
    a continuity correction of 0.5 (accurate for the step counts of real runs, n >= 8).
    """
    np = _np()
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("mann_whitney needs two non-empty samples")
    both = np.concatenate([x, y])
    _, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    avg_rank = ends - (counts - 1) / 2.0  # ranks are 1-based: a tie group shares its mean rank
    ranks = avg_rank[inverse.reshape(-1)]
    r_y = float(ranks[n1:].sum())
    u_y = r_y - n2 * (n2 + 1) / 2.0
    n = n1 + n2
    mu = n1 * n2 / 2.0
    ties = float((counts.astype(np.float64) ** 3 - counts).sum())
    var = n1 * n2 / 12.0 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    p_slower = u_y / (n1 * n2)
    if var <= 0:  # every value equal
        return 1.0, p_slower
    diff = u_y - mu
    z = (abs(diff) - 0.5) / math.sqrt(var) if abs(diff) > 0.5 else 0.0
    return min(1.0, math.erfc(z / math.sqrt(2.0))), p_slower


def median_change_ci(x: Sequence[float], y: Sequence[float], level: float = 0.95,
                     resamples: int = BOOTSTRAP_RESAMPLES, max_sample: int = BOOTSTRAP_MAX_SAMPLE,
                     seed: int = 0) -> tuple[float, float]:
    """Bootstrap confidence interval of ``median(y) / median(x) - 1`` (see the module doc)."""
    np = _np()
    rng = np.random.default_rng(seed)
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)

    def boot_medians(v: Any) -> Any:
        n = len(v)
        full = float(np.median(v))
        if n > max_sample:
            sub = rng.choice(v, size=max_sample, replace=False)
            scale = math.sqrt(max_sample / n)
        else:
            sub, scale = v, 1.0
        m = len(sub)
        idx = rng.integers(0, m, size=(resamples, m))
        meds = np.median(sub[idx], axis=1)
        return full + (meds - float(np.median(sub))) * scale

    mx, my = boot_medians(x), boot_medians(y)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = my / mx - 1.0
    ratio = ratio[np.isfinite(ratio)]
    if len(ratio) == 0:
        return (math.nan, math.nan)
    tail = (1.0 - level) / 2.0 * 100.0
    lo, hi = np.percentile(ratio, [tail, 100.0 - tail])
    return float(lo), float(hi)


# --------------------------------------------------------------------------- samples


def _warmup(table: StepTable) -> int:
    for rs in table.run_starts:
        cfg = rs.get("config")
        w = cfg.get("warmup_steps") if isinstance(cfg, dict) else None
        if isinstance(w, int) and not isinstance(w, bool) and w >= 0:
            return w
    return DEFAULT_WARMUP


def _col(a: Any, dtype: Any) -> Any:
    np = _np()
    return np.frombuffer(a, dtype=dtype).copy() if len(a) else np.zeros(0, dtype=dtype)


def _kept(table: StepTable, warmup: Optional[int]) -> Any:
    """The steps compared: ok, timed, ``step >= warmup`` (all of them when that would
    leave fewer than :data:`MIN_STEPS`)."""
    np = _np()
    w = _warmup(table) if warmup is None else warmup
    ok = _col(table.ok, np.int8) != 0
    keep = ok & ~np.isnan(_col(table.step_ms, np.float64))
    after = keep & (_col(table.step, np.int64) >= w)
    return after if int(after.sum()) >= MIN_STEPS else keep


def work_samples(table: StepTable, warmup: Optional[int] = None) -> dict[str, Any]:
    """The per-step work rates compared (:data:`WORK_COMPARED`) of the steps
    :func:`samples` compares, NaN (a step without the figure) dropped; a rate no step
    has is left out."""
    np = _np()
    cols = table.groups["work"].cols
    keep = _kept(table, warmup)
    out = {}
    for field in WORK_COMPARED:
        if field in cols:
            v = _col(cols[field], np.float64)[keep]
            out[field] = v[~np.isnan(v)]
    return out


def samples(table: StepTable, warmup: Optional[int] = None) -> dict[str, Any]:
    """The per-timing samples compared: ok steps with ``step >= warmup`` (all of them
    when that would leave fewer than :data:`MIN_STEPS`), NaN dropped."""
    np = _np()
    col = _col
    keep = _kept(table, warmup)
    step_ms = col(table.step_ms, np.float64)
    data = col(table.data_ms, np.float64)
    data = np.where(np.isnan(data), 0.0, data)
    out: dict[str, Any] = {"data": data[keep]}
    other = col(table.between["other_ms"], np.float64)
    kept_other = other[keep]
    kept_other = kept_other[~np.isnan(kept_other)]
    if len(kept_other):  # only logs that account the time between steps have it
        out["other"] = kept_other
    names = table.phase_names()
    for name in [p for p in DEFAULT_PHASES if p in names] + [p for p in names if p not in DEFAULT_PHASES]:
        v = col(table.phases.cols[name], np.float64)[keep]
        out[name] = v[~np.isnan(v)]
    out["step"] = step_ms[keep]
    inside = col(table.between["interval_in_step_ms"], np.float64)
    out["iteration"] = (data + np.nan_to_num(other, nan=0.0) + step_ms - np.nan_to_num(inside, nan=0.0))[keep]
    return out


# --------------------------------------------------------------------------- compare


def _verdict(change: float, delta: float, p: float, ci: tuple[float, float], threshold: float,
             alpha: float, min_delta_ms: float) -> str:
    significant = p < alpha
    if significant and change > threshold and delta > min_delta_ms and ci[0] > 0:
        return "regressed"
    if significant and change < -threshold and -delta > min_delta_ms and ci[1] < 0:
        return "improved"
    if significant and change > 0 and ci[0] > 0:
        return "slower"
    if significant and change < 0 and ci[1] < 0:
        return "faster"
    return "same"


def _compare_row(xb: Any, xn: Any, threshold: float, alpha: float, min_delta: float, unit: str = "_ms",
                 higher_is_better: bool = False) -> dict[str, Any]:
    """One compared quantity: medians (``base_p50<unit>``, ``new_p50<unit>``), change %,
    the bootstrap interval, the U test and the verdict. With ``higher_is_better`` (a rate)
    the verdicts are mirrored: a significant fall beyond the threshold regressed, a
    significant change within it is ``lower`` / ``higher``."""
    np = _np()
    row: dict[str, Any] = {
        "n_base": 0 if xb is None else int(len(xb)),
        "n_new": 0 if xn is None else int(len(xn)),
        f"base_p50{unit}": None, f"new_p50{unit}": None, f"delta{unit}": None, "change_pct": None,
        "ci_low_pct": None, "ci_high_pct": None, "p_value": None,
        "p_higher" if higher_is_better else "p_slower": None,
    }
    if (xb is None or len(xb) == 0) and (xn is None or len(xn) == 0):
        row["verdict"] = "too few steps"
    elif xb is None or len(xb) == 0:
        row["verdict"] = "added"
    elif xn is None or len(xn) == 0:
        row["verdict"] = "removed"
    else:
        mb, mn = float(np.median(xb)), float(np.median(xn))
        row[f"base_p50{unit}"], row[f"new_p50{unit}"], row[f"delta{unit}"] = mb, mn, mn - mb
        change = (mn / mb - 1.0) if mb > 0 else (0.0 if mn == mb else math.inf)
        row["change_pct"] = 100.0 * change if math.isfinite(change) else None
        if len(xb) < MIN_STEPS or len(xn) < MIN_STEPS:
            row["verdict"] = "too few steps"
        else:
            p, p_up = mann_whitney(xb, xn)
            ci = median_change_ci(xb, xn) if mb > 0 else (math.nan, math.nan)
            row["p_value"] = p
            row["p_higher" if higher_is_better else "p_slower"] = p_up
            if math.isfinite(ci[0]):
                row["ci_low_pct"], row["ci_high_pct"] = 100.0 * ci[0], 100.0 * ci[1]
            if higher_is_better:  # a fall is the regression: the same rules on the mirror image
                verdict = _verdict(-change, -(mn - mb), p, (-ci[1], -ci[0]), threshold, alpha, min_delta)
                row["verdict"] = {"slower": "lower", "faster": "higher"}.get(verdict, verdict)
            else:
                row["verdict"] = _verdict(change, mn - mb, p, ci, threshold, alpha, min_delta)
    return row


def compare_tables(base: StepTable, new: StepTable, *, threshold: float = DEFAULT_THRESHOLD,
                   alpha: float = DEFAULT_ALPHA, min_delta_ms: float = DEFAULT_MIN_DELTA_MS,
                   warmup: Optional[int] = None, gate: Optional[Iterable[str]] = None,
                   base_name: Optional[str] = None, new_name: Optional[str] = None) -> dict[str, Any]:
    """Compare two collected runs; returns a JSON-ready dict (see :func:`compare`)."""
    np = _np()
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    sb, sn = samples(base, warmup), samples(new, warmup)
    between = [k for k in ("data", "other") if k in sb or k in sn]  # the time before the step first
    order = between + [k for k in sb if k not in between and k not in ("step", "iteration")]
    order += [k for k in sn if k not in sb and k not in between and k not in ("step", "iteration")]
    order += ["step", "iteration"]
    gate_set = None if gate is None else set(gate)
    rows: dict[str, dict[str, Any]] = {}
    for name in order:
        rows[name] = _compare_row(sb.get(name), sn.get(name), threshold, alpha, min_delta_ms)
        rows[name]["gated"] = gate_set is None or name in gate_set
    wb, wn = work_samples(base, warmup), work_samples(new, warmup)
    work: dict[str, dict[str, Any]] = {}
    for name in WORK_COMPARED:
        if name in wb or name in wn:
            work[name] = _compare_row(wb.get(name), wn.get(name), threshold, alpha, 0.0, unit="",
                                      higher_is_better=True)
            work[name]["gated"] = gate_set is None or name in gate_set
    regressed = [k for k, r in (*rows.items(), *work.items()) if r["verdict"] == "regressed" and r["gated"]]
    improved = [k for k, r in (*rows.items(), *work.items()) if r["verdict"] == "improved"]
    return {
        "goodput": compare_goodput(goodput(base), goodput(new)),
        "base": base_name,
        "new": new_name,
        "test": "Mann-Whitney U (two-sided, normal approximation) + bootstrap 95% CI of the median change",
        "threshold_pct": 100.0 * threshold,
        "alpha": alpha,
        "min_delta_ms": min_delta_ms,
        "warmup_steps": {"base": _warmup(base) if warmup is None else warmup,
                         "new": _warmup(new) if warmup is None else warmup},
        "phases": rows,
        "work": work,
        "regressed": regressed,
        "improved": improved,
        "ok": not regressed,
    }


def compare(base: Any, new: Any, **kwargs: Any) -> dict[str, Any]:
    """Compare two runs: paths (file, run folder) or :class:`steptrace.analysis.Run`s.

    Keyword arguments: ``threshold`` (fraction, default 0.05), ``alpha`` (0.01),
    ``min_delta_ms`` (0.05), ``warmup`` (steps to skip; default: the run's
    ``warmup_steps``), ``gate`` (the timings that count as a regression; default all),
    and ``skip_bad`` for reading. The result has one entry per timing under ``"phases"``
    (medians, change %, CI, p-value, verdict), the lists ``regressed`` and ``improved``,
    and ``ok`` (no gated timing regressed).
    """
    from steptrace.analysis.run import Run, load_table

    skip_bad = kwargs.pop("skip_bad", False)
    progress = kwargs.pop("progress", False)
    tables = []
    names = []
    for run in (base, new):
        if isinstance(run, Run):
            tables.append(run.table)
            names.append(run.source)
        elif isinstance(run, StepTable):
            tables.append(run)
            names.append(None)
        else:
            r = load_table(run, skip_bad=skip_bad, progress=progress)
            tables.append(r.table)
            names.append(r.source)
    kwargs.setdefault("base_name", names[0])
    kwargs.setdefault("new_name", names[1])
    return compare_tables(tables[0], tables[1], **kwargs)


#: The parts of the wall clock as compare lists them: training first.
_GOODPUT_ORDER = ("steps_s", "data_s", "eval_s", "checkpoint_s", "other_s", "startup_s", "after_last_step_s")


def compare_goodput(base: Optional[dict[str, Any]], new: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Each part of the wall clock as a share of each run's (``base_pct``, ``new_pct``) and
    the change in percentage points (``delta_pts``), ``training`` first; with each run's
    ``wall_s``, ``training_pct`` and ``from``. None when neither run has goodput (older
    logs); a run without it has None for its side."""
    if base is None and new is None:
        return None

    def share(g: Optional[dict[str, Any]], part: str) -> Optional[float]:
        if g is None:
            return None
        if part == "steps":
            return g.get("training_pct")
        return (g.get("parts_pct") or {}).get(part)

    parts: dict[str, dict[str, Any]] = {}
    for key in _GOODPUT_ORDER:
        part = key[:-2]
        b, n = share(base, part), share(new, part)
        b_s = None if base is None else base.get(key)
        n_s = None if new is None else new.get(key)
        parts["training" if part == "steps" else part] = {
            "base_pct": b, "new_pct": n, "delta_pts": None if b is None or n is None else n - b,
            "base_s": b_s, "new_s": n_s}
    return {
        "base": None if base is None else {k: base.get(k) for k in ("wall_s", "training_pct", "from", "source")},
        "new": None if new is None else {k: new.get(k) for k in ("wall_s", "training_pct", "from", "source")},
        "parts": parts,
    }


# --------------------------------------------------------------------------- text


def _signed_pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def _p(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return "<1e-6" if v < 1e-6 else (f"{v:.2g}" if v < 0.01 else f"{v:.2f}")


def compare_rows(result: dict[str, Any]) -> list[list[str]]:
    """The comparison as table rows (header first), shared by the text and rich views."""
    rows = [["phase", "base p50 ms", "new p50 ms", "change", "95% CI", "p-value", "verdict"]]
    for name, r in result["phases"].items():
        ci = "-" if r["ci_low_pct"] is None else f"[{r['ci_low_pct']:+.1f}%, {r['ci_high_pct']:+.1f}%]"
        verdict = r["verdict"].upper() if r["verdict"] in ("regressed", "improved") else r["verdict"]
        if r["verdict"] == "regressed" and not r["gated"]:
            verdict += " (not gated)"
        rows.append([name, _ms(r["base_p50_ms"]), _ms(r["new_p50_ms"]), _signed_pct(r["change_pct"]), ci,
                     _p(r["p_value"]), verdict])
    return rows


_WORK_LABELS = {"mfu_pct": "MFU", "tokens_per_s": "tokens/s"}


def work_rows(result: dict[str, Any]) -> list[list[str]]:
    """The compared work rates as table rows (header first; empty when neither run
    recorded useful work)."""
    from steptrace.analysis.summary import work_value_text

    work = result.get("work") or {}
    if not work:
        return []
    rows = [["work", "base p50", "new p50", "change", "95% CI", "p-value", "verdict"]]
    for name, r in work.items():
        ci = "-" if r["ci_low_pct"] is None else f"[{r['ci_low_pct']:+.1f}%, {r['ci_high_pct']:+.1f}%]"
        verdict = r["verdict"].upper() if r["verdict"] in ("regressed", "improved") else r["verdict"]
        if r["verdict"] == "regressed" and not r["gated"]:
            verdict += " (not gated)"
        rows.append([_WORK_LABELS.get(name, name), work_value_text(name, r["base_p50"]),
                     work_value_text(name, r["new_p50"]), _signed_pct(r["change_pct"]), ci, _p(r["p_value"]),
                     verdict])
    return rows


def _row_of(result: dict[str, Any], name: str) -> dict[str, Any]:
    return result["phases"].get(name) or (result.get("work") or {})[name]


def _label(name: str) -> str:
    return _WORK_LABELS.get(name, name)


def compare_header(result: dict[str, Any]) -> str:
    return (f"compare {result.get('base') or 'BASE'} -> {result.get('new') or 'NEW'}: median change per phase; "
            f"regression = more than {result['threshold_pct']:g}% and {result['min_delta_ms']:g} ms slower "
            f"with Mann-Whitney p < {result['alpha']:g}")


def compare_footer(result: dict[str, Any]) -> str:
    reg = result["regressed"]
    if reg:
        parts = ", ".join(f"{_label(k)} ({_row_of(result, k)['change_pct']:+.1f}%)" for k in reg)
        slower = [k for k in reg if k in result["phases"]]
        lower = [k for k in reg if k not in result["phases"]]
        what = []
        if slower:
            what.append(f"{len(slower)} phase{'s' if len(slower) != 1 else ''} slower")
        if lower:
            what.append(f"{' and '.join(_label(k) for k in lower)} lower")
        return f"REGRESSION: {', '.join(what)} beyond {result['threshold_pct']:g}%: {parts}"
    imp = result["improved"]
    if imp:
        parts = ", ".join(f"{_label(k)} ({_row_of(result, k)['change_pct']:+.1f}%)" for k in imp)
        return f"no regression; improved: {parts}"
    return "no regression"


_GOODPUT_LABELS = {"training": "training (steps)", "data": "data", "eval": "eval", "checkpoint": "checkpoint",
                   "other": "other", "startup": "startup", "after_last_step": "after last step"}


def _share(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}%"


def goodput_rows(result: dict[str, Any]) -> list[list[str]]:
    """Where the two runs' wall clock went, as shares of each run's (header first; empty
    when neither run has goodput)."""
    g = result.get("goodput")
    if not g:
        return []
    rows = [["wall clock share", "base", "new", "change"]]
    for part in ("training", "data", "eval", "checkpoint", "other", "startup", "after_last_step"):
        p = g["parts"][part]
        delta = "-" if p["delta_pts"] is None else f"{p['delta_pts'] + 0.0:+.1f} pts".replace("-0.0", "+0.0")
        rows.append([_GOODPUT_LABELS[part], _share(p["base_pct"]), _share(p["new_pct"]), delta])

    def wall(side: Optional[dict[str, Any]]) -> str:
        return "-" if not side or side.get("wall_s") is None else f"{side['wall_s']:.1f} s"

    rows.append(["wall clock", wall(g["base"]), wall(g["new"]), ""])
    return rows


def goodput_line(result: dict[str, Any]) -> str:
    """One line on the training share: ``training share 83.7% -> 78.2% (-5.5 points)``."""
    g = result.get("goodput")
    if not g:
        return ""
    p = g["parts"]["training"]
    if p["delta_pts"] is None:
        side = "base" if p["base_pct"] is None else "new"
        return f"training share of the wall clock: {_share(p['base_pct'])} -> {_share(p['new_pct'])} " \
               f"({side} has no goodput: an older log)"
    return (f"training share of the wall clock: {_share(p['base_pct'])} -> {_share(p['new_pct'])} "
            f"({p['delta_pts']:+.1f} points)".replace("-0.0", "+0.0"))


def format_compare(result: dict[str, Any]) -> str:
    """Render a :func:`compare` result as plain aligned text (no trailing newline)."""
    from steptrace.analysis.summary import _table as align

    rows = compare_rows(result)
    lines = [compare_header(result)] + align(rows)
    work = work_rows(result)
    if work:
        lines += [""] + align(work)
    wall = goodput_rows(result)
    if wall:
        lines += [""] + align(wall) + [goodput_line(result)]
    lines += ["", compare_footer(result)]
    # phase names come from the logs: one line each, control characters inert
    return "\n".join(printable(line, one_line=True) for line in lines)


__all__ = [
    "compare",
    "compare_tables",
    "compare_goodput",
    "format_compare",
    "mann_whitney",
    "median_change_ci",
    "samples",
    "work_samples",
    "work_rows",
    "WORK_COMPARED",
    "DEFAULT_THRESHOLD",
    "DEFAULT_ALPHA",
    "DEFAULT_MIN_DELTA_MS",
]
