"""Render a :func:`steptrace.analysis.summary.summarize` dict: the aligned text of
:func:`format_summary` (``steptrace summary``), the rich tables of :func:`render_rich`
(a terminal), and the rows, lines and cell formats both are built from (also used by
the HTML report and ``steptrace compare``). Pure functions of the dict: nothing here
reads a log or computes a statistic.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from steptrace.analysis._column_ops import _is_num
from steptrace._table import INTERVAL_KINDS
from steptrace._terminal import printable
from steptrace.analysis.evidence_view import evidence_blocks
from steptrace.analysis.summary import GOODPUT_PARTS, WORK_RATES


def _num(v: Optional[float], fmt: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{unit}"


def _energy(j: Optional[float]) -> str:
    """Joules, as kJ / MJ / kWh beyond a few thousand."""
    if j is None:
        return "-"
    if abs(j) >= 3.6e6:
        return f"{j / 3.6e6:.2f} kWh"
    if abs(j) >= 1e4:
        return f"{j / 1e3:.1f} kJ"
    return f"{j:.3g} J" if abs(j) < 10 else f"{j:.1f} J"


def hw_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The GPU hardware table (header first; empty when the log has no NVML readings)."""
    hw = summary.get("hw")
    if not hw:
        return []
    power = _num(hw.get("mean_power_w"), ".0f", " W")
    if hw.get("power_pct_of_limit") is not None:
        power += f" ({hw['power_pct_of_limit']:.0f}% of {hw['power_limit_w']:.0f} W)"
    rows = [["gpu (" + str(hw.get("source") or "nvml") + ")", "value"],
            ["power mean", power],
            ["power min", _num(hw.get("min_power_w"), ".0f", " W")],
            ["energy per step", _energy(hw.get("energy_per_step_j"))],
            ["energy per 1000 steps", _energy(hw.get("energy_j_per_1000_steps"))],
            ["energy total", _energy(hw.get("energy_j"))],
            ["temperature max", _num(hw.get("max_temp_c"), ".0f", " C")]]
    if hw.get("mean_sm_clock_mhz") is not None:
        rows.append(["sm clock mean", _num(hw.get("mean_sm_clock_mhz"), ".0f", " MHz")])
    reasons = hw.get("throttle_reasons") or {}
    rows.append(["throttle", ", ".join(f"{r} ({n} steps)" for r, n in reasons.items()) if reasons else "none"])
    return rows


_WORK_LABELS = {"samples_per_s": "samples/s", "tokens_per_s": "tokens/s", "tflops_per_s": "TFLOP/s",
                "mfu_pct": "MFU"}


def rate_text(v: Optional[float]) -> str:
    """A rate with the digits that matter: ``13,194``, ``412.3``, ``0.00243``."""
    if v is None or v != v:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def work_value_text(field: str, v: Optional[float]) -> str:
    """A work rate as the tables show it (MFU in %)."""
    if v is None:
        return "-"
    return f"{v:.1f}%" if field == "mfu_pct" and abs(v) >= 0.1 else (
        f"{v:.3g}%" if field == "mfu_pct" else rate_text(v))


def work_trend_text(trend: Optional[dict[str, Any]]) -> str:
    """``flat``, ``falling -8.1% over 900 steps`` or ``-``."""
    if not trend or trend.get("trend") in (None, "unknown"):
        return "-"
    if trend["trend"] == "flat":
        return "flat"
    pct = trend.get("change_pct") or 0.0
    return f"{trend['trend']} {pct:+.1f}% over {trend.get('steps', 0)} steps"


def work_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The useful-work table (header first; empty without work): each rate's median, the
    job's (the ranks' medians summed) where there are several ranks, and its trend."""
    w = summary.get("work") or {}
    fields = [f for f in WORK_RATES if f in w]
    if not fields:
        return []
    multi = any("job_p50" in w[f] for f in fields)
    head = ["work (per rank)" if multi else "work", "p50"] + (["job"] if multi else []) + ["trend"]
    rows = [head]
    for f in fields:
        e = w[f]
        row = [_WORK_LABELS[f], work_value_text(f, e.get("p50"))]
        if multi:
            row.append(rate_text(e["job_p50"]) if "job_p50" in e else "-")
        rows.append(row + [work_trend_text(e.get("trend"))])
    return rows


def work_lines(summary: dict[str, Any]) -> list[str]:
    """The lines under the work table: the peak MFU divides by (or why there is no MFU),
    the run's MFU and its energy per token (run_end)."""
    w = summary.get("work")
    if not w:
        return []
    out = []
    peak, run = w.get("peak") or {}, w.get("run") or {}
    if _is_num(peak.get("peak_tflops")):
        what = ", ".join(str(peak[k]) for k in ("mfu_dtype", "chip") if isinstance(peak.get(k), str))
        assumed = " (dtype assumed)" if peak.get("mfu_dtype_assumed") is True else ""
        out.append(f"MFU against a peak of {peak['peak_tflops']:g} TFLOP/s" + (f" ({what})" if what else "") + assumed)
    elif isinstance(peak.get("mfu_unavailable"), str):
        out.append(f"no MFU: {peak['mfu_unavailable']}")
    if _is_num(run.get("mfu_pct")):
        out.append(f"MFU over the whole run (run_end): {work_value_text('mfu_pct', run['mfu_pct'])}")
    if _is_num(run.get("j_per_token")):
        line = f"energy per token: {run['j_per_token']:.3g} J"
        if _is_num(run.get("tokens_per_kwh")):
            kwh = float(run["tokens_per_kwh"])
            line += f", {kwh / 1e6:,.1f} M tokens/kWh" if kwh >= 1e6 else f", {rate_text(kwh)} tokens/kWh"
        out.append(line + f" ({_energy(run.get('energy_j'))} in all)")
    return out


def top_kernel_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The top kernels by device time (header first; empty when none were recorded)."""
    top = summary.get("top_kernels") or []
    if not top:
        return []
    rows = [["kernel", "work", "total ms", "calls", "share"]]
    for k in top:
        name = k["name"] if len(k["name"]) <= 80 else k["name"][:77] + "..."
        rows.append([name, str(k["work"]), _ms(k["total_ms"]), str(k["count"]), _pct(k["share_pct"])])
    return rows


def device_lines(summary: dict[str, Any]) -> list[str]:
    """One line per device backend, shown when one of them collected anything."""
    backends = summary.get("device_backends") or {}
    if not any(not v.startswith("unavailable") for v in backends.values()):
        return []
    labels = {"kernel_activity": "kernel activity", "counters": "counters"}
    return [f"{labels[k]}: {v}" for k, v in backends.items()]


# --------------------------------------------------------------------------- text


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}%"


def _bytes(v: Optional[int]) -> str:
    if v is None:
        return "-"
    x = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return str(v)  # pragma: no cover


def _table(rows: list[list[str]], gap: str = "   ", left: Sequence[int] = (0,)) -> list[str]:
    """Align a table: the columns in ``left`` (default the first) to the left, the others
    to the right. Cells come from the log (phase, kernel and host names): control
    characters in them are shown as escapes, never sent to the terminal."""
    rows = [[printable(c, one_line=True) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append(gap.join(cells).rstrip())
    return out


def trend_text(trend: Optional[dict[str, Any]]) -> str:
    """``flat``, ``rising +1.0 MiB/step``, ``falling -12 KiB/step`` or ``-``."""
    if not trend or trend.get("trend") in (None, "unknown"):
        return "-"
    label = trend["trend"]
    if label == "flat":
        return "flat"
    slope = trend.get("bytes_per_step") or 0.0
    sign = "+" if slope >= 0 else "-"
    return f"{label} {sign}{_bytes(abs(slope))}/step"


def _field_label(field: str) -> str:
    for suffix in ("_bytes", "_pct", "_ms", "_w", "_c", "_mhz"):
        if field.endswith(suffix):
            return field[: -len(suffix)]
    return field


def _unit_value(field: str, v: float) -> str:
    if field.endswith("_pct"):
        return f"{v:.1f}%"
    if field.endswith("_ms"):
        return f"{v:.3f} ms"
    if field.endswith("_w"):
        return f"{v:.0f} W"
    if field.endswith("_c"):
        return f"{v:.1f} C"
    if field.endswith("_mhz"):
        return f"{v:.0f} MHz"
    return f"{v:.3g}"


def headline(summary: dict[str, Any]) -> str:
    """The first line of the summary: run, steps, errors, rate, clock, end reason."""
    name = summary.get("source") or summary.get("run_id") or "?"
    ranks = summary.get("ranks") or []
    errors = summary.get("error_steps", 0)
    head = f"job {name}, {summary['attempts']} attempts: " if summary.get("attempts", 1) > 1 else f"run {name}: "
    if len(ranks) > 1:
        head += f"{len(ranks)} ranks, "
    head += f"{summary.get('steps', 0)} steps ({errors} error{'' if errors == 1 else 's'})"
    rate = summary.get("steps_per_s")
    head += f", {rate:.1f} steps/s" if rate is not None else ", - steps/s"
    head += f", clock {summary.get('clock') or '-'}, ended {summary.get('end_reason')}"
    return head


def phase_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The per-phase table (header first): p50/p95/p99/max in ms and share of the iteration."""
    rows = [["phase", "p50 ms", "p95 ms", "p99 ms", "max ms", "share"]]

    def row(label: str, st: dict[str, Any]) -> None:
        rows.append([label, _ms(st["p50_ms"]), _ms(st["p95_ms"]), _ms(st.get("p99_ms")), _ms(st["max_ms"]),
                     _pct(st["share_pct"])])

    row("data", summary["data"])
    if summary.get("other"):
        row("other", summary["other"])
    for phase, st in summary.get("phases", {}).items():
        row(phase, st)
    row("step", summary["step"])
    row("iteration", summary["iteration"])
    return rows


_GOODPUT_LABELS = {"startup_s": "startup", "steps_s": "steps (training)", "data_s": "data",
                   "eval_s": "eval", "checkpoint_s": "checkpoint", "restore_s": "restore", "other_s": "other",
                   "after_last_step_s": "after last step"}
_ORIGIN_TEXT = {"process_start": "from process start", "profiler_start": "from profiler start",
                "mixed": "from process or profiler start"}


def _duration(ms: float) -> str:
    """Milliseconds as ``12.5 ms`` below a second, else ``3.21 s``."""
    return f"{ms:.2f} ms" if abs(ms) < 1000 else f"{ms / 1e3:.2f} s"


def _seconds(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 10 else f"{v:.3f}"


def goodput_rows(summary: dict[str, Any]) -> list[list[str]]:
    """The "where the wall clock went" table (header first; empty without goodput): each
    part in seconds and as a share of the wall clock, and for eval, checkpoint and other
    the intervals recorded (how many, the longest)."""
    g = summary.get("goodput")
    if not g:
        return []
    intervals = summary.get("intervals") or {}
    origin = _ORIGIN_TEXT.get(g.get("from"), "")
    ranks = g.get("ranks") or 1
    head = "wall clock" + (f" ({ranks} ranks, summed)" if ranks > 1 else "")
    rows = [[head, "seconds", "share", "intervals"]]
    pct = g.get("parts_pct") or {}
    keys = list(GOODPUT_PARTS)
    if g.get("restore_s"):  # newer logs that restored a checkpoint
        keys.insert(keys.index("checkpoint_s") + 1, "restore_s")
    for key in keys:
        name = key[:-2]
        iv = intervals.get(name) if name in INTERVAL_KINDS else None
        note = f"{iv['count']}, longest {_duration(1e3 * iv['max_s'])}" if iv else ""
        rows.append([_GOODPUT_LABELS[key], _seconds(g.get(key)), _pct(pct.get(name)), note])
    rows.append([f"total ({origin})" if origin else "total", _seconds(g.get("wall_s")),
                 _pct(100.0) if g.get("wall_s") else "-", ""])
    return rows


def _share_and_alerts(summary: dict[str, Any], part: dict[str, Any], of: str, alert: str) -> tuple[str, str]:
    """A wall-clock line's tails: ", <share_pct>% of <of>" and "; <n> <alert> alerts"
    (each empty where the summary has none)."""
    share = f", {part['share_pct']:.1f}% of {of}" if part.get("share_pct") is not None else ""
    n = (summary.get("alerts") or {}).get(alert, {}).get("count")
    alerts = f"; {n} {alert} alert{'s' if n != 1 else ''}" if n else ""
    return share, alerts


def goodput_lines(summary: dict[str, Any]) -> list[str]:
    """The lines under the wall-clock table: the training share, the run-queue wait and
    Python's garbage collections."""
    out = []
    g = summary.get("goodput")
    if g:
        src = " (computed from the step records: no run_end)" if g.get("source") == "steps" else (
            " (some ranks computed from their step records: no run_end)" if g.get("source") == "mixed" else "")
        out.append(f"training share (goodput): {_pct(g.get('training_pct'))} of the wall clock{src}")
    rq = summary.get("runq")
    if rq:
        share, alerts = _share_and_alerts(summary, rq, "the time it was read over", "host_contention")
        out.append(f"run-queue wait (runnable, waiting for a CPU): {_duration(rq['total_ms'])}{share}{alerts}")
        if rq.get("steal_ms"):
            out.append(f"CPU time the hypervisor took (steal): {_duration(rq['steal_ms'])}")
    gc = summary.get("gc")
    if gc:
        share, alerts = _share_and_alerts(summary, gc, "the training iterations", "gc_pause")
        young = gc["total_ms"] - gc["gen2_total_ms"]
        out.append(f"garbage collection (Python): {_duration(gc['total_ms'])} in {gc['count']} collection"
                   f"{'s' if gc['count'] != 1 else ''}{share} (generation 2: {_duration(gc['gen2_total_ms'])}, "
                   f"generations 0-1: {_duration(young)}; in steps {_duration(gc['ms'])}, between steps "
                   f"{_duration(gc['between_ms'])}){alerts}")
    return out


def waste_parts(summary: dict[str, Any]) -> list[Any]:
    """The waste report of the summary (docs/goodput.md): its lines (the sentence, the
    goodput, the ideal step time), then (rows, left-aligned columns) for the table per
    cause and, with several attempts, per attempt; empty without a report."""
    job = summary.get("waste")
    if not job:
        return []
    from steptrace.analysis.goodput import attempt_rows, cause_rows, header_lines

    out: list[Any] = [header_lines(job), (cause_rows(job), (0,))]
    if len(job["attempts"]) > 1:
        out.append((attempt_rows(job), (0, 2, 8)))
    return out


def memory_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = [["memory", "start", "peak", "end", "trend"]]
    trends = summary.get("memory_trend") or {}
    for field, v in (summary.get("memory") or {}).items():
        rows.append([_field_label(field), _bytes(v["start"]), _bytes(v["peak"]), _bytes(v["end"]),
                     trend_text(trends.get(field))])
    return rows


def counter_rows(summary: dict[str, Any]) -> list[list[str]]:
    """Mean of each counter, kernel and telemetry field (header first; empty when none)."""
    rows: list[list[str]] = []
    for group in ("counters", "kernels", "telemetry"):
        for field, v in (summary.get(group) or {}).items():
            label = f"kernel {_field_label(field)}" if group == "kernels" else _field_label(field)
            rows.append([label, _unit_value(field, v) if group != "kernels" or field != "count" else f"{v:.1f}"])
    return [["counter", "mean"]] + rows if rows else []


def alert_rows(summary: dict[str, Any]) -> list[list[str]]:
    alerts = summary.get("alerts") or {}
    first = summary.get("alert_first") or {}
    rows = [["alert", "count", "first step", "first message"]]
    order = sorted(alerts.items(), key=lambda kv: (kv[1].get("first_step") is None, kv[1].get("first_step") or 0))
    for typ, a in order:
        fs = a.get("first_step")
        msg = (first.get(typ) or {}).get("message") or ""
        rows.append([typ, str(a["count"]), "-" if fs is None else str(fs), msg])
    return rows


def format_summary(summary: dict[str, Any]) -> str:
    """Render a :func:`summarize` dict as a plain aligned text table (no trailing newline)."""
    lines = [headline(summary)]
    if summary.get("iteration"):
        lines += _table(phase_rows(summary))
    else:
        lines.append("no completed steps recorded")

    wall = goodput_rows(summary)
    extra = goodput_lines(summary)
    if wall or extra:
        lines.append("")
    if wall:
        lines += _table(wall, left=(0, 3))
    lines += extra
    waste = waste_parts(summary)
    if waste:
        lines.append("")
        lines += waste[0]
        for k, (rows, left) in enumerate(waste[1:]):
            lines += [""] * (k > 0) + _table(rows, left=left)

    if summary.get("memory"):
        lines.append("")
        lines += _table(memory_rows(summary), left=(0, 4))

    counters = counter_rows(summary)
    if counters:
        lines.append("")
        lines += _table(counters)
    work = work_rows(summary)
    work_extra = work_lines(summary)
    if work or work_extra:
        lines.append("")
    if work:
        lines += _table(work, left=(0, len(work[0]) - 1))
    lines += work_extra
    hw = hw_rows(summary)
    if hw:
        lines.append("")
        lines += _table(hw, left=(0, 1))
    top = top_kernel_rows(summary)
    if top:
        lines.append("")
        lines += _table(top, left=(0, 1))
    device = device_lines(summary)
    if device:
        lines.append("")
        lines += device

    lines.append("")
    if summary.get("alerts"):
        rows = alert_rows(summary)
        # the message column is free text: left-aligned, last, never padded
        body = _table([r[:3] for r in rows])
        lines += [f"{b}   {r[3]}".rstrip() for b, r in zip(body, rows)]
    else:
        lines.append("alerts: none")
    for ev_lines, rows in evidence_blocks(summary):
        lines += [""] + ev_lines
        if len(rows) > 1:
            lines += ["  " + line for line in _table(rows, left=(0, 1, 2))]
    # every line may hold log text (an alert's message, a device name): one line each
    return "\n".join(printable(line, one_line=True) for line in lines)


def render_rich(summary: dict[str, Any], console: Any) -> None:
    """Print a :func:`summarize` dict on a ``rich.console.Console`` as tables."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    def text(line: str, style: str = "") -> Any:
        # log text as a Text: rich reads no markup in it ("[link=...]" would become an OSC 8
        # link), and its control characters are shown as escapes
        return Text(printable(line, one_line=True), style=style)

    console.print(text(headline(summary), style="bold"))

    def table(rows: list[list[str]], left: Sequence[int] = (0,), first_style: Optional[str] = None) -> Any:
        t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for i, h in enumerate(rows[0]):
            t.add_column(text(h), justify="left" if i in left else "right", style=first_style if i == 0 else None,
                         overflow="fold")
        for r in rows[1:]:
            t.add_row(*(text(c) for c in r))
        return t

    if summary.get("iteration"):
        console.print(table(phase_rows(summary), first_style="cyan"))
    else:
        console.print("no completed steps recorded")
    wall = goodput_rows(summary)
    if wall:
        console.print(table(wall, left=(0, 3)))
    for line in goodput_lines(summary):
        console.print(text(line))
    waste = waste_parts(summary)
    if waste:
        for line in waste[0]:
            console.print(text(line))
        for rows, left in waste[1:]:
            console.print(table(rows, left=left))
    if summary.get("memory"):
        console.print(table(memory_rows(summary), left=(0, 4)))
    counters = counter_rows(summary)
    if counters:
        console.print(table(counters))
    work = work_rows(summary)
    if work:
        console.print(table(work, left=(0, len(work[0]) - 1)))
    for line in work_lines(summary):
        console.print(text(line))
    hw = hw_rows(summary)
    if hw:
        console.print(table(hw, left=(0, 1)))
    top = top_kernel_rows(summary)
    if top:
        console.print(table(top, left=(0, 1)))
    for line in device_lines(summary):
        console.print(text(line))
    if summary.get("alerts"):
        console.print(table(alert_rows(summary), left=(0, 3), first_style="red"))
    else:
        console.print("alerts: none", style="green")
    for ev_lines, rows in evidence_blocks(summary):
        console.print(text(ev_lines[0], style="bold"))
        for line in ev_lines[1:]:
            console.print(text(line))
        if len(rows) > 1:
            console.print(table(rows, left=(0, 1, 2)))
