"""Plots of a run: the step time stacked by phase, memory, counters.

:func:`plot_run` draws, one panel under the other, sharing the step axis:

1. the iteration time of each step stacked by phase (data wait at the bottom, then the
   rest of the time between steps, "other (between steps)", then the phases, then
   "no phase": step time no phase covers), with the trailing median of the
   iteration time (the detector's window, default 100 steps) and the regression line at
   ``regression_threshold`` (1.5) x that median, alerts marked where they fired, and
   error steps as red crosses;
2. with useful work in the steps (docs/useful-work.md): MFU (%, left axis; TFLOP/s
   where there is no MFU) and tokens/s (right axis; samples/s where there are no
   tokens) of each step, under the step time they divide, with the GPU's power (W) on a
   third axis where NVML read it;
3. memory over the steps (each field the log has, per rank);
4. with NVML readings in the steps (``hw``): the GPU's power (W, left axis: each step's
   average, its lowest reading, and the power limit) against the step time (ms, right
   axis) over the run;
5. hardware counters (%), kernel times (ms) and telemetry (W, C), each only when the log
   has them.

With several ranks the stack shows one rank (``rank=``, default the lowest) and the
other ranks' iteration times are thin grey lines. Runs longer than :data:`MAX_POINTS`
steps are drawn as bins of consecutive steps (means, plus the per-bin maximum of the
iteration time so that spikes stay visible).

matplotlib is an optional dependency: ``pip install 'steptrace[plot]'``.
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any, Optional

from steptrace._table import as_object
from steptrace.analysis.run import Run, load, require
from steptrace.analysis.summary import HwSeries

MAX_POINTS = 3000
DEFAULT_WINDOW = 100
DEFAULT_REGRESSION = 1.5
_PHASE_COLORS = {
    "data": "#9e9e9e",
    "forward": "#1f77b4",
    "loss": "#ff7f0e",
    "backward": "#2ca02c",
    "clip": "#d62728",
    "optimizer": "#9467bd",
}
_EXTRA_COLORS = ["#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a"]
_ALERT_MARKERS = ["v", "D", "s", "^", "P", "X", "*", "o"]


def _figure_class() -> Any:
    require("matplotlib", "plot", "steptrace plot")
    # A bare Figure renders with Agg whatever the configured backend: no pyplot state,
    # no display needed.
    from matplotlib.figure import Figure

    return Figure


def _bins(n: int, max_points: int) -> int:
    return max(1, -(-n // max_points))  # ceil


def _binned(np: Any, values: Any, k: int, how: str = "mean") -> Any:
    """Means (or maxima) of consecutive groups of ``k`` values; NaN for an all-NaN group."""
    if k == 1:
        return values
    n = len(values) // k * k
    reduce = np.nanmean if how == "mean" else np.nanmax
    with warnings.catch_warnings():  # "Mean of empty slice" / "All-NaN slice": NaN is the answer
        warnings.simplefilter("ignore", RuntimeWarning)
        out = reduce(values[:n].reshape(-1, k), axis=1)
        if n < len(values):
            out = np.append(out, reduce(values[n:]))
    return out


def _scale_bytes(peak: float) -> tuple[float, str]:
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak >= 2 * div:
            return float(div), unit
    return 1.0, "B"


def plot_run(run: Any, output: "Optional[str | os.PathLike[str]]" = None, *, rank: Optional[int] = None,
             steps: Any = None, width: float = 12.0, dpi: int = 110, title: Optional[str] = None) -> Any:
    """Draw the panels of ``run`` (a path or :class:`~steptrace.analysis.Run`); save to
    ``output`` (the format follows its extension: .png, .svg, .pdf) when given. Returns
    the matplotlib Figure. ``steps`` is a :class:`steptrace.analysis.export.StepRange` (or
    "START:STOP") limiting the steps drawn."""
    Figure = _figure_class()
    np = require("numpy", "plot", "steptrace plot")
    run = load(run) if not isinstance(run, Run) else run
    df = run.steps
    if isinstance(steps, str) or steps is None:
        from steptrace.analysis.export import StepRange

        steps = StepRange.parse(steps)
    if not steps.everything:
        lo = -(2**62) if steps.start is None else steps.start
        hi = 2**62 if steps.stop is None else steps.stop
        df = df[(df["step"] >= lo) & (df["step"] < hi)]
    ranks = sorted(int(r) for r in df["rank"].unique()) if len(df) else []
    if rank is None:
        rank = ranks[0] if ranks else 0
    elif ranks and rank not in ranks:
        from steptrace.errors import UsageError

        raise UsageError(f"rank {rank} is not in this log (ranks: {', '.join(map(str, ranks))})")
    mine = df[df["rank"] == rank].sort_values("step", kind="stable")
    cfg = run.config
    window = cfg.get("window") if isinstance(cfg.get("window"), int) else DEFAULT_WINDOW
    factor = cfg.get("regression_threshold")
    factor = float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else DEFAULT_REGRESSION

    groups = [c for c in ("counters", "kernels", "telemetry") if _group_columns(run, c)]
    mem_cols = [name for name, group, key in run.variable_columns() if group == "memory"
                and key != "device_total_bytes" and name in df and df[name].notna().any()]
    power = _power_series(run, rank, mine["step"].to_numpy(), np)
    work = _work_series(mine, np)
    n_panels = 1 + (1 if work else 0) + (1 if power is not None else 0) + (1 if mem_cols else 0) + len(groups)
    heights = [3.0] + [1.6] * (n_panels - 1)
    fig = Figure(figsize=(width, sum(heights) + 1.0), dpi=dpi, layout="constrained")
    axes = fig.subplots(n_panels, 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]

    x_all = mine["step"].to_numpy()
    k = _bins(len(mine), MAX_POINTS)
    x = _binned(np, x_all.astype(np.float64), k)
    ax = axes[0]
    ok = (mine["status"] == "ok").to_numpy()
    phase_cols = run.phase_columns
    layers, labels, colors = [], [], []
    covered = np.zeros(len(mine))
    data = np.nan_to_num(mine["data_ms"].to_numpy(dtype=np.float64))
    layers.append(data)
    labels.append("data")
    colors.append(_PHASE_COLORS["data"])
    between = np.nan_to_num(mine["other_ms"].to_numpy(dtype=np.float64))
    if between.any():
        layers.append(between)
        labels.append("other (between steps)")
        colors.append("#c7c7c7")
    extra = iter(_EXTRA_COLORS * 4)
    for phase, col in phase_cols.items():
        v = np.nan_to_num(mine[col].to_numpy(dtype=np.float64))
        layers.append(v)
        covered = covered + v
        labels.append(phase)
        colors.append(_PHASE_COLORS.get(phase) or next(extra))
    step_ms = np.nan_to_num(mine["step_ms"].to_numpy(dtype=np.float64))
    other = np.clip(step_ms - covered, 0.0, None)
    if other.any():
        layers.append(other)
        labels.append("no phase")
        colors.append("#dddddd")
    iteration = mine["iteration_ms"].to_numpy(dtype=np.float64)
    if len(mine):
        # error steps are drawn as crosses, not stacked (their phases stopped part-way)
        stack = [_binned(np, np.where(ok, layer, np.nan), k) for layer in layers]
        stack = [np.nan_to_num(s) for s in stack]
        ax.stackplot(x, *stack, labels=labels, colors=colors, linewidth=0, alpha=0.9)
        series = mine["iteration_ms"].where(mine["status"] == "ok")
        median = series.rolling(window, min_periods=min(10, window)).median().shift(1).to_numpy()
        ax.plot(x, _binned(np, median, k), color="black", linewidth=1.2,
                label=f"trailing median ({window} steps)")
        ax.plot(x, _binned(np, median * factor, k), color="black", linewidth=1.0, linestyle="--",
                label=f"{factor:g} x median")
        if k > 1:
            ax.plot(x, _binned(np, np.where(ok, iteration, np.nan), k, "max"), color="#555555", linewidth=0.6,
                    label=f"max per {k} steps")
        if (~ok).any():
            ax.scatter(x_all[~ok], np.nan_to_num(iteration[~ok]), marker="x", color="red", zorder=5,
                       label="error step")
        for other_rank in ranks:
            if other_rank == rank:
                continue
            o = df[df["rank"] == other_rank].sort_values("step", kind="stable")
            ko = _bins(len(o), MAX_POINTS)
            ax.plot(_binned(np, o["step"].to_numpy(dtype=np.float64), ko),
                    _binned(np, o["iteration_ms"].to_numpy(dtype=np.float64), ko), color="grey",
                    linewidth=0.5, alpha=0.6, label="other ranks" if other_rank == [r for r in ranks if r != rank][0] else None)
        top = np.nanpercentile(iteration[ok], 99.5) if ok.any() else 1.0
        med_max = np.nanmax(median * factor) if np.isfinite(median).any() else 0.0
        ax.set_ylim(0, max(top, med_max) * 1.15 or 1.0)
    else:
        ax.text(0.5, 0.5, "no steps", transform=ax.transAxes, ha="center", va="center")
    _mark_alerts(ax, run, rank, steps)
    ax.set_ylabel("iteration ms")
    what = f"rank {rank} of {len(ranks)}" if len(ranks) > 1 else f"rank {rank}"
    ax.set_title(title or f"{_run_name(run)}: iteration time by phase ({what})", loc="left", fontsize=11)
    _legend(ax)
    ax.grid(True, alpha=0.3)

    panel = 1
    if work:
        _work_panel(axes[panel], np, x, k, work, ok, power)
        panel += 1
    if power is not None:
        _power_panel(axes[panel], np, x, k, power, mine["step_ms"].to_numpy(dtype=np.float64), ok)
        panel += 1
    if mem_cols:
        ax = axes[panel]
        panel += 1
        peak = float(np.nanmax(df[mem_cols].to_numpy(dtype=np.float64)))
        div, unit = _scale_bytes(peak)
        for col in mem_cols:
            for r in ranks:
                o = df[df["rank"] == r].sort_values("step", kind="stable")
                ko = _bins(len(o), MAX_POINTS)
                y = o[col].to_numpy(dtype=np.float64) / div
                label = col[:-6] if col.endswith("_bytes") else col
                ax.plot(_binned(np, o["step"].to_numpy(dtype=np.float64), ko), _binned(np, y, ko), linewidth=1.0,
                        label=label if len(ranks) == 1 else f"{label} rank {r}")
        ax.set_ylabel(f"memory {unit}")
        _legend(ax)
        ax.grid(True, alpha=0.3)
    units = {"counters": "%", "kernels": "ms", "telemetry": ""}
    for group in groups:
        ax = axes[panel]
        panel += 1
        for col in _group_columns(run, group):
            y = mine[col].to_numpy(dtype=np.float64)
            ax.plot(x, _binned(np, y, k), linewidth=1.0, label=col)
        ax.set_ylabel(f"{group} {units[group]}".strip())
        _legend(ax)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    if output is not None:
        fig.savefig(os.fspath(output), dpi=dpi)
    return fig


def hw_of(run: Run) -> Optional[HwSeries]:
    """The steps' NVML readings (``hw``) of ``run``, from its step table; None for a log
    without any."""
    series = run.table.hw
    return series if len(series) else None


def _power_series(run: Run, rank: int, steps: Any, np: Any) -> Optional[dict[str, Any]]:
    """Power (W) of ``rank``'s steps, aligned with ``steps``: None without readings."""
    hw = hw_of(run)
    if hw is None or not len(steps):
        return None
    at = {s: i for i, (r, s) in enumerate(zip(hw.rank, hw.step)) if r == rank}
    if not at:
        return None
    idx = [at.get(int(s), -1) for s in steps]

    def col(field: str) -> Any:
        v = np.asarray(hw.values[field] + [np.nan], dtype=np.float64)  # index -1: no reading
        return v[idx]

    limits = [v for v in col("power_limit_w") if v == v]
    if not limits:
        for rs in run.run_starts:
            t = as_object(rs.get("backends")).get("telemetry")
            if isinstance(t, dict) and isinstance(t.get("power_limit_w"), (int, float)) and rs.get("rank", 0) == rank:
                limits.append(float(t["power_limit_w"]))
    return {"power_w": col("power_w"), "min_power_w": col("min_power_w"), "max_temp_c": col("max_temp_c"),
            "power_limit_w": max(limits) if limits else None}


_WORK_AXES = (("mfu_pct", "MFU %", "#2ca02c"), ("tflops_per_s", "TFLOP/s", "#2ca02c"),
              ("tokens_per_s", "tokens/s", "#9467bd"), ("samples_per_s", "samples/s", "#9467bd"))


def _work_series(mine: Any, np: Any) -> dict[str, Any]:
    """The useful-work rates of the steps drawn, by column, that at least one step has."""
    out = {}
    for col, _label, _color in _WORK_AXES:
        if col in mine and mine[col].notna().any():
            out[col] = mine[col].to_numpy(dtype=np.float64)
    return out


def _work_panel(ax: Any, np: Any, x: Any, k: int, work: dict[str, Any], ok: Any,
                power: Optional[dict[str, Any]]) -> None:
    """MFU (else TFLOP/s) on the left axis, tokens/s (else samples/s) on the right, and the
    GPU's power on a third axis where NVML read it."""
    left = next(((c, lab, col) for c, lab, col in _WORK_AXES[:2] if c in work), None)
    right = next(((c, lab, col) for c, lab, col in _WORK_AXES[2:] if c in work), None)
    handles: list[Any] = []
    names: list[str] = []

    def draw(target: Any, spec: tuple[str, str, str]) -> None:
        c, label, color = spec
        target.plot(x, _binned(np, np.where(ok, work[c], np.nan), k), color=color, linewidth=1.1, label=label)
        target.set_ylabel(label)
        target.set_ylim(bottom=0)
        h, n = target.get_legend_handles_labels()
        handles.extend(h)
        names.extend(n)

    main = left or right
    assert main is not None  # _work_series found at least one rate
    draw(ax, main)
    if left and right:
        draw(ax.twinx(), right)
    if power is not None and np.isfinite(power["power_w"]).any():
        ax3 = ax.twinx()
        ax3.spines["right"].set_position(("axes", 1.12))
        ax3.plot(x, _binned(np, power["power_w"], k), color="#e6550d", linewidth=0.8, alpha=0.7, label="power W")
        ax3.set_ylabel("power W")
        ax3.set_ylim(bottom=0)
        h, n = ax3.get_legend_handles_labels()
        handles.extend(h)
        names.extend(n)
    what = "MFU" if "mfu_pct" in work else ("TFLOP/s" if "tflops_per_s" in work else "throughput")
    ax.set_title(f"useful work: {what} per step" + (" and tokens/s" if "tokens_per_s" in work and left else ""),
                 loc="left", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.22, 1.0), fontsize=8, frameon=False)


def _power_panel(ax: Any, np: Any, x: Any, k: int, power: dict[str, Any], step_ms: Any, ok: Any) -> None:
    """Power (W, left axis) against step time (ms, right axis) over the steps."""
    ax.plot(x, _binned(np, power["power_w"], k), color="#e6550d", linewidth=1.2, label="power W (step mean)")
    low = power["min_power_w"]
    if np.isfinite(low).any():
        ax.plot(x, _binned(np, low, k), color="#fdae6b", linewidth=0.8, label="power W (step min)")
    limit = power["power_limit_w"]
    if limit:
        ax.axhline(limit, color="#e6550d", linestyle=":", linewidth=1.0, label=f"power limit {limit:.0f} W")
    top = np.nanmax(power["power_w"]) if np.isfinite(power["power_w"]).any() else 0.0
    ax.set_ylim(0, max(top, limit or 0.0) * 1.1 or 1.0)
    ax.set_ylabel("power W")
    temp = power["max_temp_c"]
    hot = f", max {np.nanmax(temp):.0f} C" if np.isfinite(temp).any() else ""
    ax.set_title(f"GPU power and step time{hot}", loc="left", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(x, _binned(np, np.where(ok, step_ms, np.nan), k), color="#1f77b4", linewidth=0.8, alpha=0.8,
             label="step ms")
    ax2.set_ylabel("step ms")
    ax2.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, loc="upper left", bbox_to_anchor=(1.04, 1.0), fontsize=8, frameon=False)


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def _group_columns(run: Run, group: str) -> list[str]:
    df = run.steps
    return [name for name, g, _ in run.variable_columns() if g == group and df[name].notna().any()]


def _run_name(run: Run) -> str:
    ids = run.run_ids
    if run.source:
        return os.path.basename(os.path.normpath(run.source)) or run.source
    return ids[0] if ids else "run"


def _mark_alerts(ax: Any, run: Run, rank: int, steps: Any) -> None:
    alerts = run.alerts
    if not len(alerts):
        return
    mine = alerts[alerts["rank"] == rank]
    if not steps.everything:
        lo = -(2**62) if steps.start is None else steps.start
        hi = 2**62 if steps.stop is None else steps.stop
        mine = mine[(mine["step"] >= lo) & (mine["step"] < hi)]
    if not len(mine):
        return
    top = ax.get_ylim()[1]
    for i, (typ, grp) in enumerate(mine.groupby("type", observed=True)):
        xs = grp["step"].to_numpy(dtype=float)
        for xv in xs:
            ax.axvline(xv, color="red", alpha=0.25, linewidth=0.8)
        ax.scatter(xs, [top * 0.96] * len(xs), marker=_ALERT_MARKERS[i % len(_ALERT_MARKERS)], color="red",
                   zorder=6, clip_on=False, label=f"alert: {typ}")


def png_bytes(run: Any, **kwargs: Any) -> bytes:
    """The plot as PNG bytes (for the HTML report)."""
    fig = plot_run(run, **kwargs)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=kwargs.get("dpi", 110))
    return buf.getvalue()


def rank_heatmap_png(run: Any, *, width: float = 12.0, dpi: int = 100, max_columns: int = 400) -> bytes:
    """A heat map of step time by rank (rows) and step (columns; consecutive steps averaged
    into at most ``max_columns`` bins), as PNG bytes: a straggler is a hot row, a cluster-
    wide slowdown a hot column. With host-timed communication it shows each rank's own
    work (the step minus the time blocked in collectives), since waiting evens out the
    step times."""
    Figure = _figure_class()
    np = require("numpy", "plot", "steptrace report")
    df = run.steps
    df = df[df["status"] == "ok"] if "status" in df else df
    label = "step ms"
    if "comm_exposed_ms" in df and df["comm_exposed_ms"].notna().any():
        # DDP makes every rank's step as long as the slowest one's: own work shows who it is
        df = df.assign(own_ms=df["host_ms"] - df["comm_exposed_ms"].fillna(0.0))
        label = "own work ms"
    grid = df.pivot_table(index="rank", columns="step", values="own_ms" if label != "step ms" else "step_ms",
                          aggfunc="mean")
    values = grid.to_numpy(dtype=float, copy=True)
    values[values < 0] = np.nan  # no time is negative: a corrupt -1e308 would overflow the colour scale
    bins = max(1, -(-values.shape[1] // max_columns))
    if bins > 1:  # average runs of `bins` steps, padding the last with NaN
        pad = (-values.shape[1]) % bins
        values = np.pad(values, ((0, 0), (0, pad)), constant_values=np.nan)
        values = np.nanmean(values.reshape(values.shape[0], -1, bins), axis=2)
    fig = Figure(figsize=(width, 1.2 + 0.3 * len(grid.index)), dpi=dpi, layout="constrained")
    ax = fig.add_subplot()
    first, last = int(grid.columns.min()), int(grid.columns.max())
    image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="magma",
                      extent=(first - 0.5, last + 0.5, len(grid.index) - 0.5, -0.5))
    ax.set_yticks(range(len(grid.index)), [str(r) for r in grid.index])
    ax.set_ylabel("rank")
    ax.set_xlabel("step")
    fig.colorbar(image, ax=ax, label=label)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


__all__ = ["plot_run", "png_bytes", "rank_heatmap_png", "hw_of", "MAX_POINTS"]
