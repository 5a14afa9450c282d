"""One self-contained HTML report of a run: summary, plots, alerts, run details.

The file needs nothing but itself: styles are inline, the plots are PNGs embedded as
``data:`` URIs, and a Content-Security-Policy (``default-src 'none'``) forbids every
network request, so it opens the same offline, from an e-mail, or from a CI artifact.
A few lines of inline script mark the page ``data-rendered="ok"`` once every plot has
decoded (``broken:N`` otherwise), which the tests read back from headless Chromium.

Needs matplotlib for the plots (``pip install 'steptrace[plot]'``).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import os
from typing import Any, Optional

from steptrace._files import write_atomically
from steptrace._table import as_object
from steptrace.analysis.run import Run, load, require
from steptrace.errors import SteptraceError
from steptrace.analysis.summary import (
    _ms,
    _pct,
    _energy,
    alert_rows,
    counter_rows,
    headline,
    hw_rows,
    hw_summary,
    memory_rows,
    rate_text,
    work_lines,
    work_rows,
    work_value_text,
)

#: At most this many alerts are listed one by one (all are counted in the summary).
MAX_ALERT_ROWS = 500

_CSS = """
:root { --fg:#1d232a; --muted:#5f6b76; --line:#d9dee3; --bg:#ffffff; --accent:#1f77b4; --bad:#c62828; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Liberation Sans", sans-serif;
       color: var(--fg); background: var(--bg); margin: 0; padding: 24px 32px 48px; max-width: 1400px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
.sub { color: var(--muted); margin: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0 4px; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px; min-width: 130px; }
.card .v { font-size: 20px; font-weight: 600; }
.card .k { color: var(--muted); font-size: 12px; }
.card.bad .v { color: var(--bad); }
table { border-collapse: collapse; margin: 4px 0; }
th, td { padding: 4px 12px 4px 0; text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
th { color: var(--muted); font-weight: 600; border-bottom: 1px solid var(--line); }
td:first-child, th:first-child, td.l, th.l { text-align: left; }
td.msg { text-align: left; white-space: normal; max-width: 720px; }
tr.total td { border-top: 1px solid var(--line); font-weight: 600; }
.bar { display: inline-block; height: 10px; background: var(--accent); border-radius: 2px; vertical-align: middle; }
.barcell { text-align: left; width: 160px; }
img.plot { max-width: 100%; height: auto; border: 1px solid var(--line); border-radius: 4px; }
.alert-type { color: var(--bad); font-weight: 600; }
.none { color: #2e7d32; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 4px 0; }
dt { color: var(--muted); } dd { margin: 0; }
code { font: 12px ui-monospace, "DejaVu Sans Mono", monospace; }
footer { margin-top: 36px; color: var(--muted); font-size: 12px; }
"""

_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var broken = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); }).length;
  document.documentElement.setAttribute("data-rendered", broken ? "broken:" + broken : "ok");
});
"""


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _table(rows: list[list[str]], left: tuple[int, ...] = (0,), msg_col: Optional[int] = None,
           cls: Optional[dict[int, str]] = None) -> str:
    head = "".join(f'<th class="{"l" if i in left or i == msg_col else ""}">{_e(h)}</th>'
                   for i, h in enumerate(rows[0]))
    body = []
    for r in rows[1:]:
        cells = []
        for i, c in enumerate(r):
            klass = "msg" if i == msg_col else ("l" if i in left else "")
            if cls and i in cls:
                klass += " " + cls[i]
            cells.append(f'<td class="{klass.strip()}">{_e(c)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _phase_table(summary: dict[str, Any]) -> str:
    rows = ['<tr><th>phase</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th><th>max ms</th>'
            '<th>mean ms</th><th>share</th><th class="l"></th></tr>']

    def row(label: str, st: dict[str, Any], total: bool = False) -> None:
        share = st.get("share_pct") or 0.0
        bar = "" if total else f'<span class="bar" style="width:{max(0.0, min(share, 100.0)) * 1.6:.0f}px"></span>'
        rows.append(
            f'<tr class="{"total" if total else ""}"><td>{_e(label)}</td><td>{_ms(st["p50_ms"])}</td>'
            f'<td>{_ms(st["p95_ms"])}</td><td>{_ms(st.get("p99_ms"))}</td><td>{_ms(st["max_ms"])}</td>'
            f'<td>{_ms(st.get("mean_ms"))}</td><td>{_pct(st["share_pct"])}</td><td class="barcell">{bar}</td></tr>'
        )

    row("data", summary["data"])
    if summary.get("other"):
        row("other", summary["other"])
    for phase, st in summary.get("phases", {}).items():
        row(phase, st)
    row("step", summary["step"], total=True)
    row("iteration", summary["iteration"])
    return "<table>" + "".join(rows) + "</table>"


def _card(value: str, key: str, bad: bool = False) -> str:
    return f'<div class="card{" bad" if bad else ""}"><div class="v">{_e(value)}</div><div class="k">{_e(key)}</div></div>'


def _run_details(run: Run) -> str:
    parts = []
    for rs in run.run_starts[:16]:
        dev = as_object(rs.get("device"))
        dev_text = "none (CPU)" if not dev else f"{dev.get('name')}" + (
            f", {dev['memory_total_bytes'] / 2**30:.1f} GiB" if isinstance(dev.get("memory_total_bytes"), int) else "")
        versions = ", ".join(f"{k} {v}" for k, v in as_object(rs.get("versions")).items() if v)
        backends = []
        for kind, b in as_object(rs.get("backends")).items():
            if not isinstance(b, dict):
                continue
            active = b.get("active")
            active = ", ".join(map(str, active)) if isinstance(active, list) and active else "none"
            off = "; ".join(f"{k}: {v}" for k, v in as_object(b.get("unavailable")).items())
            backends.append(f"<b>{_e(kind)}</b>: {_e(active)}" + (f" <span class='sub'>(not used: {_e(off)})</span>"
                                                                    if off else ""))
        started = rs.get("start_unix_ns")
        when = (_dt.datetime.fromtimestamp(started / 1e9, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
                if isinstance(started, int) else "-")
        parts.append(
            f"<h3>rank {_e(rs.get('rank'))} of {_e(rs.get('world_size'))}</h3><dl>"
            f"<dt>run id</dt><dd><code>{_e(rs.get('run_id'))}</code></dd>"
            f"<dt>host / pid</dt><dd>{_e(rs.get('host'))} / {_e(rs.get('pid'))}</dd>"
            f"<dt>started</dt><dd>{_e(when)}</dd>"
            f"<dt>device</dt><dd>{_e(dev_text)}</dd>"
            f"<dt>versions</dt><dd>{_e(versions)}</dd>"
            f"<dt>backends</dt><dd>{'<br>'.join(backends) or '-'}</dd>"
            f"<dt>config</dt><dd><code>{_e(json.dumps(rs.get('config'), sort_keys=True))}</code></dd></dl>"
        )
    if len(run.run_starts) > 16:
        parts.append(f"<p class='sub'>... and {len(run.run_starts) - 16} more ranks</p>")
    return "".join(parts)


def _alert_list(run: Run) -> str:
    alerts = run.table.alerts
    if not alerts:
        return ""
    rows = [["rank", "step", "type", "phase", "value", "baseline", "threshold", "message"]]
    for a in alerts[:MAX_ALERT_ROWS]:
        def num(v: Any) -> str:
            return f"{v:.4g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"

        rows.append([str(a.get("rank", "")), str(a.get("step", "")), str(a.get("type", "")), str(a.get("phase") or "-"),
                     num(a.get("value")), num(a.get("baseline")), num(a.get("threshold")), str(a.get("message", ""))])
    more = (f"<p class='sub'>{len(alerts) - MAX_ALERT_ROWS} more alerts not listed.</p>"
            if len(alerts) > MAX_ALERT_ROWS else "")
    return "<h3>Every alert</h3>" + _table(rows, left=(2, 3), msg_col=7, cls={2: "alert-type"}) + more


def _evidence_list(summary: dict[str, Any]) -> str:
    """Each capture's evidence (issue 54): the alert it follows, the verdict, the trace's
    path (relative to the run folder) and the diff's top rows; empty without evidence."""
    from steptrace.analysis.evidence_view import evidence_blocks

    parts = []
    for lines, rows in evidence_blocks(summary):
        parts.append(f"<h3>{_e(lines[0])}</h3>" + "".join(f"<p>{_e(line.strip())}</p>" for line in lines[1:])
                     + (_table(rows, left=(0, 1, 2)) if len(rows) > 1 else ""))
    if not parts:
        return ""
    return ("".join(parts) + "<p class='sub'>Evidence: torch.profiler captures of the steps after an alert, "
            "diffed against a baseline capture; ms/step is the time per step an op added (or lost); open "
            "the trace in Perfetto (docs/alerts.md, Evidence).</p>")


def _ranks_section(run: Run) -> str:
    """Per-rank table (the cross-rank view over the run) and the step-time heat map."""
    from steptrace.analysis.plot import rank_heatmap_png

    png = base64.b64encode(rank_heatmap_png(run)).decode("ascii")
    rows = [["rank", "host", "steps", "p50 ms", "p95 ms", "compute ms", "comm ms", "wait ms", "data ms",
             "straggler"]]
    try:
        per_rank = run.per_rank
    except SteptraceError:
        per_rank = None
    if per_rank is not None and len(per_rank):
        for r, row in per_rank.iterrows():
            def ms(key: str) -> str:
                v = row.get(key)
                return "-" if v is None or v != v else f"{v:.2f}"
            pct = row.get("straggler_pct")
            rows.append([str(r), str(row.get("host") or "?"), str(int(row["steps"])), ms("step_ms"), ms("step_p95_ms"),
                         ms("compute_ms"), ms("comm_ms"), ms("wait_ms"), ms("data_ms"),
                         "-" if pct is None or pct != pct else f"{pct:+.1f}%"])
    table = _table(rows, left=(0, 1)) if len(rows) > 1 else ""
    return ("<h2>Ranks</h2>" + table
            + "<p class='sub'>straggler: own work (compute + data, waiting excluded) against the median of "
              "the other ranks (see <code>steptrace cluster</code>).</p>"
            + '<img class="plot" alt="step time by rank and step" '
              f'src="data:image/png;base64,{png}">')


def _hw_section(hw: dict[str, Any], rows: list[list[str]]) -> str:
    """GPU hardware (NVML): cards for power, energy and temperature, then the table."""
    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    pct = hw.get("power_pct_of_limit")
    reasons = hw.get("throttle_reasons") or {}
    cards = [
        _card(num(hw.get("mean_power_w"), ".0f") + " W", "mean power" + (f" ({pct:.0f}% of limit)" if pct else "")),
        _card(num(hw.get("min_power_w"), ".0f") + " W", "lowest power"),
        _card(_energy(hw.get("energy_per_step_j")), "energy per step"),
        _card(_energy(hw.get("energy_j")), "energy in all"),
        _card(num(hw.get("max_temp_c"), ".0f") + " C", "hottest"),
        _card(", ".join(reasons) if reasons else "none", "throttling", bad=bool(reasons)),
    ]
    return ("<h2>GPU hardware</h2>" + f'<div class="cards">{"".join(cards)}</div>' + _table(rows, left=(0, 1))
            + "<p class='sub'>NVML readings over each step (<code>hw</code> in the step records): power is the "
              "mean of the steps' averages, energy per step their mean, energy in all the counter's rise over the "
              "run (run_end), all ranks' GPUs together; the timeline's power panel shows power against step "
              "time.</p>")


def _work_section(summary: dict[str, Any]) -> str:
    """Useful work: the rates' medians and trends, the peak, energy per token."""
    rows = work_rows(summary)
    lines = work_lines(summary)
    return ("<h2>Useful work</h2>" + (_table(rows, left=(0, len(rows[0]) - 1)) if rows else "")
            + "".join(f"<p>{_e(line)}</p>" for line in lines)
            + "<p class='sub'>Each step's samples, tokens and model FLOPs per second of its training iteration "
              "(<code>work</code> in the step records); MFU is its FLOP/s over the device's peak; p50 over the "
              "steps with status ok, all ranks pooled; trend: the least-squares line over the steps after "
              "warmup (flat when it moves less than 5% of the median). The timeline's work panel shows them "
              "beside the step time and the GPU's power.</p>")


def _waste_section(job: dict[str, Any]) -> str:
    """The job's goodput across attempts (docs/goodput.md): the sentence, then the tables
    per cause and, with several attempts, per attempt."""
    from steptrace.analysis.goodput import attempt_rows, cause_rows, header_lines

    lines = header_lines(job)
    per_attempt = _table(attempt_rows(job), left=(0, 2, 8), msg_col=8) if len(job["attempts"]) > 1 else ""
    return ("<h2>Waste report</h2>" + f"<p><b>{_e(lines[0])}</b></p>"
            + "".join(f"<p>{_e(line)}</p>" for line in lines[1:]) + _table(cause_rows(job)) + per_attempt
            + "<p class='sub'>Where the job's wall clock went, across its attempts, as rank 0 saw it: seconds, "
              "GPU-hours (x ranks) and their share; slow steps are the steps' time above the ideal step time, "
              "wasted progress the steps a failed attempt lost, recovery the gap before the next attempt "
              "(<code>steptrace goodput</code>, docs/goodput.md).</p>")


def _job_waste(run: Run, summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The waste report: the job's across its attempts where the run is a job root with
    several, else the run's own (the summary's)."""
    from steptrace.analysis.goodput import job_attempts, job_goodput

    source = run.source
    if source and os.path.isdir(source) and len(job_attempts(source)) > 1:
        return job_goodput(source)
    return summary.get("waste")


def render_report(run: Any, *, title: Optional[str] = None, rank: Optional[int] = None) -> str:
    """The report of ``run`` (a path or :class:`~steptrace.analysis.Run`) as an HTML string."""
    require("matplotlib", "plot", "steptrace report")
    from steptrace import __version__
    from steptrace.analysis.plot import hw_of, png_bytes

    run = load(run) if not isinstance(run, Run) else run
    summary = run.summary()
    hw = hw_summary(hw_of(run), run.run_ends, run.run_starts)
    if hw is not None:
        summary["hw"] = hw
    name = title or summary.get("source") or summary.get("run_id") or "run"
    png = base64.b64encode(png_bytes(run, rank=rank, dpi=100)).decode("ascii")

    cards = []
    cards.append(_card(str(summary.get("steps", 0)), "steps" + (f" x {len(summary['ranks'])} ranks"
                                                              if len(summary.get("ranks") or []) > 1 else "")))
    rate = summary.get("steps_per_s")
    cards.append(_card(f"{rate:.1f}" if rate is not None else "-", "steps / s"))
    it = summary.get("iteration") or {}
    cards.append(_card(_ms(it.get("p50_ms")) + " ms" if it else "-", "median iteration"))
    data = summary.get("data") or {}
    cards.append(_card(_pct(data.get("share_pct")) if data else "-", "waiting for data",
                       bad=bool(data) and (data.get("share_pct") or 0) > 20))
    good = summary.get("goodput") or {}
    if good:
        cards.append(_card(_pct(good.get("training_pct")), "of the wall clock training"))
    waste = _job_waste(run, summary)
    if waste and waste.get("goodput_ratio") is not None:
        ratio = waste["goodput_ratio"]
        cards.append(_card(_pct(100 * ratio), "goodput (productive)", bad=ratio < 0.5))
    work = summary.get("work") or {}
    if "mfu_pct" in work:
        cards.append(_card(work_value_text("mfu_pct", work["mfu_pct"]["p50"]), "median MFU"))
    if "tokens_per_s" in work:
        cards.append(_card(rate_text(work["tokens_per_s"].get("job_p50", work["tokens_per_s"]["p50"])),
                           "tokens / s" + (" (job)" if "job_p50" in work["tokens_per_s"] else "")))
    n_alerts = sum(a["count"] for a in (summary.get("alerts") or {}).values())
    cards.append(_card(str(n_alerts), "alerts", bad=n_alerts > 0))
    cards.append(_card(str(summary.get("error_steps", 0)), "error steps", bad=summary.get("error_steps", 0) > 0))
    cards.append(_card(str(summary.get("end_reason")).split(" (")[0], "end of run",
                       bad=summary.get("end_reason") != "normal"))

    sections = []
    if summary.get("iteration"):
        sections.append("<h2>Step time by phase</h2>" + _phase_table(summary)
                        + "<p class='sub'>share: the phase's fraction of the total iteration time "
                          "(data wait + other time between steps + step); percentiles over the steps with status ok, all ranks pooled.</p>")
    else:
        sections.append("<h2>Step time by phase</h2><p>No completed steps recorded.</p>")
    sections.append('<h2>Timeline</h2><img class="plot" alt="step time stacked by phase, memory and counters '
                    f'over the steps" src="data:image/png;base64,{png}">')
    if waste:
        sections.append(_waste_section(waste))
    if len(run.ranks) > 1:
        sections.append(_ranks_section(run))
    if work:
        sections.append(_work_section(summary))
    if summary.get("memory"):
        sections.append("<h2>Memory</h2>" + _table(memory_rows(summary), left=(0, 4))
                        + "<p class='sub'>start, peak and end: the largest across ranks; trend: the "
                          "least-squares slope over the steps after the first "
                          f"{_e(summary.get('warmup_steps'))} (flat when it moves less than 1% of the peak).</p>")
    if summary.get("hw"):
        sections.append(_hw_section(summary["hw"], hw_rows(summary)))
    counters = counter_rows(summary)
    if counters:
        sections.append("<h2>Counters</h2>" + _table(counters))
    if summary.get("alerts"):
        sections.append("<h2>Alerts</h2>" + _table(alert_rows(summary), left=(0,), msg_col=3, cls={0: "alert-type"})
                        + _alert_list(run) + _evidence_list(summary))
    else:  # a requested capture has evidence without an alert
        sections.append('<h2>Alerts</h2><p class="none">No alerts.</p>' + _evidence_list(summary))
    sections.append("<h2>Run</h2>" + _run_details(run))

    generated = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    csp = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>steptrace report: {_e(name)}</title><style>{_CSS}</style></head>\n<body>"
        f"<h1>steptrace report: {_e(name)}</h1><p class=\"sub\">{_e(headline(summary))}</p>"
        f"<div class=\"cards\">{''.join(cards)}</div>"
        + "\n".join(sections)
        + f"<footer>Generated by steptrace {_e(__version__)} on {generated}.</footer>"
        f"<script>{_SCRIPT}</script></body></html>\n"
    )


def write_report(run: Any, output: "str | os.PathLike[str]", **kwargs: Any) -> str:
    """Write the report of ``run`` to ``output``; returns the path written."""
    text = render_report(run, **kwargs)
    target = os.fspath(output)
    write_atomically(target, lambda fh: fh.write(text))  # a new temporary, then a rename
    return target


__all__ = ["render_report", "write_report", "MAX_ALERT_ROWS"]
