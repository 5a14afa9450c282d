"""The evidence behind alerts (issue 54, docs/alerts.md "Evidence") as ``steptrace
summary`` and ``steptrace report`` show it.

:func:`evidence_summary` turns the ``alert_update`` records that carry
``details.evidence`` (collected in ``StepTable.evidence``) into the summary's
``"evidence"`` list: per capture the alert it follows (type, step, phase, rank), the
verdict line, the trace's path and size, the baseline's steps and the diff's top rows.
:func:`evidence_blocks` turns that list into text lines and one table per capture, which
the text, rich and HTML renderers lay out each their own way. Log values are checked, not
trusted: a corrupt record gives dashes, never an error.
"""

from __future__ import annotations

from typing import Any, Optional

from steptrace.analysis._column_ops import _is_num

#: Rows kept per diff table (grown, new, vanished) of one capture in the summary.
TOP_ROWS = 5


def _int(v: Any) -> Optional[int]:
    return int(v) if _is_num(v) else None


def _steps(v: Any) -> Optional[list[int]]:
    if isinstance(v, list) and len(v) == 2 and all(_is_num(x) for x in v):
        return [int(v[0]), int(v[1])]
    return None


def _str(v: Any) -> Optional[str]:
    return v if isinstance(v, str) else None


def _rows(v: Any) -> list[dict[str, Any]]:
    return [r for r in v if isinstance(r, dict)][:TOP_ROWS] if isinstance(v, list) else []


def evidence_summary(table: Any) -> list[dict[str, Any]]:
    """The summary's ``"evidence"``: one dict per ``alert_update`` with evidence, in log
    order. ``alert_phase`` is the phase of the alert it follows (matched by rank, type and
    step; None for a request, type ``capture``), ``phase`` the phase of the largest change."""
    alert_phase: dict[tuple[Any, Any, Any], Optional[str]] = {}
    for a in table.alerts:
        key = (_int(a.get("rank", 0)), _str(a.get("type")), _int(a.get("step")))
        alert_phase.setdefault(key, _str(a.get("phase")))
    out = []
    for rec in table.evidence:
        ev = rec["details"]["evidence"]
        if not isinstance(ev, dict):
            continue
        rank, typ, step = _int(rec.get("rank", 0)), _str(rec.get("type")), _int(rec.get("alert_step"))
        diff = ev.get("diff") if isinstance(ev.get("diff"), dict) else {}
        base = ev.get("baseline") if isinstance(ev.get("baseline"), dict) else {}
        out.append({
            "rank": rank,
            "type": typ,
            "alert_step": step,
            "alert_phase": alert_phase.get((rank, typ, step)),
            "phase": _str(rec.get("phase")),
            "steps": _steps(ev.get("steps")),
            "verdict": _str(ev.get("verdict")) or "",
            "trace": _str(ev.get("trace")),
            "trace_bytes": _int(ev.get("trace_bytes")),
            "trace_dropped": _str(ev.get("trace_dropped")),
            "baseline_steps": _steps(base.get("steps")),
            "grew": _rows(diff.get("grew")),
            "new": _rows(diff.get("new")),
            "vanished": _rows(diff.get("vanished")),
            "ops": _rows(ev.get("ops")),  # a capture before any baseline: its own top ops
        })
    return out


def _ms(v: Any, sign: str = "") -> str:
    return f"{sign}{float(v):.2f}" if _is_num(v) else "-"


def _calls(v: Any) -> str:
    return f"{float(v):g}" if _is_num(v) else "-"


def _span(steps: Optional[list[int]]) -> str:
    return "-" if not steps else f"{steps[0]}-{steps[1]}" if steps[0] != steps[1] else str(steps[0])


def _size(n: Optional[int]) -> str:
    if n is None:
        return ""
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.1f} MiB"


def diff_rows(e: dict[str, Any]) -> list[list[str]]:
    """The capture's table: header, then the grown ops (ms/step added, calls per step
    before→after), the new ones (syncs first, as the diff orders them), the vanished ones;
    for a capture without a baseline, its own top ops. Only the header when none."""
    rows = [["change", "phase", "op", "ms/step", "calls/step"]]
    for r in e["grew"]:
        calls = r.get("calls")
        before_after = (f"{_calls(calls[0])}→{_calls(calls[1])}"
                        if isinstance(calls, list) and len(calls) == 2 else "-")
        pct = f" ({float(r['pct']):+.0f}%)" if _is_num(r.get("pct")) else ""
        rows.append(["grew", str(r.get("phase", "-")), str(r.get("op", "-")), _ms(r.get("delta_ms"), "+") + pct,
                     before_after])
    for r in e["new"]:
        rows.append(["new sync" if r.get("sync") is True else "new", str(r.get("phase", "-")), str(r.get("op", "-")),
                     _ms(r.get("ms"), "+"), _calls(r.get("calls"))])
    for r in e["vanished"]:
        rows.append(["vanished", str(r.get("phase", "-")), str(r.get("op", "-")), _ms(r.get("ms"), "-"),
                     _calls(r.get("calls"))])
    for r in e["ops"]:
        self_ms, dev_ms = r.get("self_ms"), r.get("device_ms")
        total = (float(self_ms) if _is_num(self_ms) else 0.0) + (float(dev_ms) if _is_num(dev_ms) else 0.0)
        rows.append(["top", str(r.get("phase", "-")), str(r.get("op", "-")), _ms(total), _calls(r.get("calls"))])
    return rows


def evidence_blocks(summary: dict[str, Any]) -> list[tuple[list[str], list[list[str]]]]:
    """Per capture: its lines (the alert it follows, the verdict, the trace) and its
    table (:func:`diff_rows`). Empty for a summary without evidence."""
    blocks = []
    for e in summary.get("evidence") or ():
        typ = e["type"] or "?"
        what = ("requested capture" if typ == "capture"
                else f"{typ} at step {'-' if e['alert_step'] is None else e['alert_step']}"
                + (f" in {e['alert_phase']}" if e["alert_phase"] else ""))
        head = f"evidence for {what} (rank {'-' if e['rank'] is None else e['rank']}): steps {_span(e['steps'])}"
        if e["baseline_steps"]:
            head += f" against baseline steps {_span(e['baseline_steps'])}"
        lines = [head, f"  verdict: {e['verdict'] or '-'}"]
        if e["trace_dropped"]:
            lines.append(f"  trace: dropped ({e['trace_dropped']})")
        elif e["trace"]:
            size = _size(e["trace_bytes"])
            lines.append(f"  trace: {e['trace']}" + (f" ({size})" if size else ""))
        blocks.append((lines, diff_rows(e)))
    return blocks


__all__ = ["TOP_ROWS", "diff_rows", "evidence_blocks", "evidence_summary"]
