"""The text of ``steptrace cluster RUN_DIR``: the per-rank table and the verdict."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from steptrace._terminal import printable
from steptrace.cluster.options import HW_POWER_KEY, HW_TEMP_KEY
from steptrace.cluster.stats import WORK_KEYS

_WORK_HEADS = {"mfu_pct": "MFU", "tokens_per_s": "tokens/s"}


def _fmt(v: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _share(part: Optional[float], whole: Optional[float]) -> str:
    return "-" if part is None or not whole else f"{100.0 * part / whole:.0f}%"


def _work_cell(key: str, v: Optional[float]) -> str:
    if v is None:
        return "-"
    if key == "mfu_pct":
        return f"{v:.1f}%"
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def stragglers_found(result: Mapping[str, Any]) -> list[int]:
    """Ranks a straggler alert named in an :func:`analyze_records` result."""
    return sorted({a["subject_rank"] for a in result["alerts"]
                   if a["kind"] == "alert" and a["type"] == "straggler"})


def verdict_line(v: Mapping[str, Any]) -> str:
    """The whole run's straggler verdict of :func:`analyze_records` as one line: the rank,
    its excess, what it cost the others, and apart from that whether the alert's floor was
    met."""
    wait = (f"the others waited {v['others_wait_pct']:.0f}% of each step ({v['others_wait_ms']:.1f} ms)"
            if v.get("others_wait_pct") is not None
            else f"the others spent {v['others_wait_ms']:.1f} ms more than it in a later phase, waiting for it")
    excess = "" if v.get("excess_pct") is None else f"{v['excess_pct']:+.0f}% own work, "
    own = ("" if v.get("others_own_ms") is None
           else f"compute + data {v['own_ms']:.1f} ms vs the others' {v['others_own_ms']:.1f} ms, ")
    low = "; lower confidence: communication was not timed" if v.get("confidence") == "low" else ""
    return (f"rank {v['straggler']} is the straggler (host {v.get('host') or '?'}): {excess}{own}slower in "
            f"{v['phase']}; {wait}; named in {v['windows_named']} of {v['windows']} windows{low}; {v['floor']}")


def format_cluster(result: Mapping[str, Any], source: str = "") -> str:
    """The per-rank table and the verdict of :func:`analyze_records`, as text."""
    table = result["table"]
    lines = []
    if table is None:
        return printable(f"{source or 'run'}: no completed steps", one_line=True)
    lines.append(f"cluster view of {source or 'run'}: {len(table['ranks'])} rank(s), "
                 f"windows of {result['interval']} steps, communication timed by: "
                 f"{table['method'] or 'nothing (comm_timing off, or collectives steptrace does not see)'}")
    head = ["rank", "host", "steps", "p50 ms", "p95 ms", "compute", "comm", "wait", "data",
            "straggler", "memory"]
    # the GPU's power and temperature (NVML), where any rank has them: hot_gpu compares these
    with_hw = any(row.get("hw") for row in table["ranks"])
    if with_hw:
        head += ["power", "temp"]
    # useful work (docs/useful-work.md), where any rank counted it: each rank's median
    work = [k for k in WORK_KEYS if any(row.get(k) is not None for row in table["ranks"])]
    head += [_WORK_HEADS[k] for k in work]
    rows = [head]
    for row in table["ranks"]:
        mem = row.get("memory_bytes")
        rows.append([str(row["rank"]), printable(str(row.get("host") or "?"), one_line=True), str(row["steps"]), _fmt(row["step_ms"], ".2f"),
                     _fmt(row["step_p95_ms"], ".2f"), _share(row["compute_ms"], row["step_ms"]),
                     _share(row["comm_ms"], row["step_ms"]), _share(row["wait_ms"], row["step_ms"]),
                     _share(row["data_ms"], row["step_ms"]), _fmt(row["straggler_pct"], "+.1f", "%"),
                     "-" if not mem else f"{mem / 2**20:.0f} MiB"])
        if with_hw:
            hw = row.get("hw") or {}
            rows[-1] += [_fmt(hw.get(HW_POWER_KEY), ".0f", " W"), _fmt(hw.get(HW_TEMP_KEY), ".0f", " C")]
        rows[-1] += [_work_cell(k, row.get(k)) for k in work]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i not in (1,) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    lines.append("(compute / comm / wait / data: shares of the median step; straggler: own work, "
                 "compute + data, against the median of the other ranks"
                 + ("; MFU, tokens/s: the rank's median step" if work else "") + ")")
    windows = len(result["windows"])
    found = stragglers_found(result)
    for r in found:
        alerts = [a for a in result["alerts"] if a["kind"] == "alert" and a["type"] == "straggler"
                  and a["subject_rank"] == r]
        hit = sum(1 for w in result["windows"] if r in w["stragglers"])
        a = alerts[0]
        lines.append(f"STRAGGLER: rank {r} (host {a['details']['host'] or '?'}): own work "
                     f"{a['details'].get('excess_pct', 0):.0f}% above the other ranks' median at its first "
                     f"alert (step {a['step']}); a straggler in {hit} of {windows} windows; slower in {a['phase']}")
        lines.append(f"  {a['message']}")
    for a in result["alerts"]:
        if a["kind"] == "alert" and a["type"] != "straggler":
            lines.append(f"{a['type'].upper()} at step {a['step']}: {a['message']}")
    hang = result.get("hang")
    if hang and hang.get("parted"):  # from the ranks' hang alerts (PyTorch's flight recorder)
        lines.append(f"HANG: {hang['parted']['message']} (each rank's last hang alert, flight recorder)")
    verdict = result.get("verdict")
    if verdict and verdict.get("straggler") is not None:
        lines.append(verdict_line(verdict))
    elif not found and len(table["ranks"]) >= 2 and not table["method"]:
        # step times alone: every rank waits for the slowest at each collective, so they agree
        lines.append(f"no verdict: communication was not timed, so a straggler hidden by the others' waiting "
                     f"cannot be told apart (step times alone, {windows} windows compared; see "
                     f"docs/distributed.md#communication-timing)")
    elif not found and len(table["ranks"]) >= 2:
        slowest = table.get("slowest_rank")
        lines.append(f"no straggler: the slowest rank ({slowest}) is {table.get('slowest_excess_pct', 0):+.1f}% "
                     f"against the other ranks' median over the run"
                     + (f" (the others waited {verdict['slowest_others_wait_ms']:.1f} ms of each step)"
                        if verdict and verdict.get("slowest_others_wait_ms") is not None else "")
                     + f", in {windows} windows compared")
    elif len(table["ranks"]) < 2:
        lines.append("one rank only: nothing to compare across ranks")
    # host names, phases and alert messages come from the logs: one line each, inert
    return "\n".join(printable(line, one_line=True) for line in lines)
