"""The ``steptrace`` command line.

::

    steptrace summary RUN [--json] [--plain]           per-phase p50/p95/p99/max, wall clock, memory, alerts
    steptrace compare BASE NEW [--threshold PCT] ...   which phases (and MFU, tokens/s) regressed (a CI gate)
    steptrace plot RUN -o out.png [--rank R]           step time by phase, memory, counters
    steptrace export RUN --format chrome|csv -o FILE   Perfetto / chrome://tracing timeline, or CSV
    steptrace report RUN -o report.html                one self-contained HTML report
    steptrace metrics --chip GH100 [--json]            the CUPTI counter set for a chip (no GPU needed)
    steptrace cluster RUN [--fail-on-straggler]        per-rank table, the straggler named (exit 1)
    steptrace goodput JOB_ROOT [--gpu-hour-cost X]     the job's goodput across attempts, GPU-hours per cause
    steptrace run [--log-dir DIR] train.py [ARGS]      profile an unmodified script (steptrace.live.launcher)
    steptrace capture RUN_OR_PID [--steps N]           evidence of the next N steps now (steptrace.live.capture_request)

RUN is a ``rank<N>.jsonl`` file or a run folder (every rank). Every command takes
``--skip-bad`` (skip records that are not steptrace records with a warning; torn lines
are always skipped) and ``--no-progress``. Each subcommand
is an ``_add_<name>(subparsers)`` function that registers its parser and sets ``func``
to a ``_cmd_<name>(args) -> int``; add new ones to ``_COMMANDS``.

Exit status: 0 on success; 1 from ``compare`` when a phase or work rate regressed (and from
``cluster --fail-on-straggler`` when a straggler was found, from ``capture`` when refused or
timed out); 2 for a usage
error or a log that cannot be read (one line ``steptrace: error: ...`` on stderr, never a
traceback). Reader warnings (a truncated last line, skipped lines) are printed as
``steptrace: warning: ...``. On a terminal, a long read shows a progress bar on stderr
and ``summary``/``compare`` print rich tables; in a pipe or a file the output is plain
text and nothing else is drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any, Callable, Optional, Sequence, TextIO

from steptrace.errors import SteptraceError

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_FOUND = 1  # cluster --fail-on-straggler found one
EXIT_ERROR = 2
_showwarning = warnings.showwarning
_printed: set = set()  # reader warnings printed by this command (a file read twice warns once)


def _print_warning(message: Any, category: type, filename: str, lineno: int,
                   file: Optional[TextIO] = None, line: Optional[str] = None) -> None:
    # one line, without the source location of the warnings.warn call: users care about
    # the log file and line, which the message already names
    from steptrace._progress import clear_active
    from steptrace.analysis.reader import ReaderWarning

    clear_active()
    if not issubclass(category, ReaderWarning):  # a library's warning: Python's usual format
        _showwarning(message, category, filename, lineno, file, line)
        return
    text = _one_line(str(message))
    if text in _printed:
        return
    _printed.add(text)
    print(f"steptrace: warning: {text}", file=sys.stderr)


def _one_line(text: str) -> str:
    from steptrace._terminal import printable

    # messages name files and may quote a log: nothing in them reaches the terminal raw
    return printable(" ".join(text.split()), one_line=True)


def _json_safe(obj: Any) -> Any:
    """Non-finite floats become null, so the output is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _print_json(obj: Any) -> None:
    print(json.dumps(_json_safe(obj), indent=2, allow_nan=False))


def _rich_console() -> Any:
    """A rich Console for stdout when stdout is a terminal and rich is installed, else None."""
    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(file=sys.stdout, highlight=False)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-bad", action="store_true",
                   help="skip records that are not steptrace records with a warning instead of failing "
                        "(torn lines are always skipped)")
    p.add_argument("--no-progress", action="store_true", help="never draw a progress bar (drawn only on a terminal)")


def _progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "no_progress", False)


def _step_range(text: str) -> Any:
    from steptrace.analysis.export import StepRange

    try:
        return StepRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _percent(text: str) -> float:
    t = text.strip().rstrip("%")
    try:
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage (e.g. 5 or 5%)") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: the threshold must be a percentage >= 0")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def _positive_int(text: str) -> int:
    v = _nonneg_int(text)
    if v < 2:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 2")
    return v


def _float_at_least(text: str, low: float, inclusive: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not ((v >= low if inclusive else v > low) and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number {'>=' if inclusive else '>'} {low:g}")
    return v


def _nonneg_float(text: str) -> float:
    return _float_at_least(text, 0.0, inclusive=True)


def _positive_float(text: str) -> float:
    return _float_at_least(text, 0.0, inclusive=False)


# --------------------------------------------------------------------------- summary


def _add_summary(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "summary",
        help="per-phase p50/p95/p99/max, shares, memory, counters, alerts of a run",
        description="Summarize a steptrace run: a rank<N>.jsonl file or a run folder.",
    )
    p.add_argument("path", metavar="PATH", help="a .jsonl log file or a run folder")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--plain", action="store_true", help="plain text even on a terminal")
    _common(p)
    p.set_defaults(func=_cmd_summary)


def _cmd_summary(args: argparse.Namespace) -> int:
    from steptrace.analysis.summary import format_summary, render_rich, summarize_job

    summary = summarize_job(args.path, skip_bad=args.skip_bad, progress=_progress(args))
    if args.json:
        _print_json(summary)
        return EXIT_OK
    console = None if args.plain else _rich_console()
    if console is not None:
        render_rich(summary, console)
    else:
        print(format_summary(summary))
    return EXIT_OK


# --------------------------------------------------------------------------- compare


def _add_compare(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from steptrace.analysis.compare import DEFAULT_ALPHA, DEFAULT_MIN_DELTA_MS, DEFAULT_THRESHOLD

    p = sub.add_parser(
        "compare",
        help="which phases got slower or faster between two runs (exit 1 on a regression)",
        description=(
            "Compare the per-phase step times of two runs: the change of the median with a bootstrap "
            "95%% confidence interval, and a two-sided Mann-Whitney U test. A phase regressed when its "
            "median grew by more than --threshold and --min-delta-ms, with p < --alpha and the whole "
            "interval above zero. Where both runs recorded useful work, MFU and tokens/s are compared "
            "the same way, and a fall beyond --threshold is a regression too. Exit status 1 when a "
            "(gated) timing or work rate regressed, 0 when none did, 2 on errors: use it as a CI gate "
            "between two model versions."
        ),
    )
    p.add_argument("base", metavar="BASE", help="the reference run (file or folder)")
    p.add_argument("new", metavar="NEW", help="the run to check (file or folder)")
    p.add_argument("--threshold", type=_percent, default=100 * DEFAULT_THRESHOLD, metavar="PCT",
                   help=f"regression threshold in percent of the median (default {100 * DEFAULT_THRESHOLD:g})")
    p.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                   help=f"significance level of the rank test (default {DEFAULT_ALPHA:g})")
    p.add_argument("--min-delta-ms", type=float, default=DEFAULT_MIN_DELTA_MS, metavar="MS",
                   help=f"ignore median changes smaller than this (default {DEFAULT_MIN_DELTA_MS:g} ms)")
    p.add_argument("--warmup", type=_nonneg_int, default=None, metavar="N",
                   help="skip the first N steps of each run (default: the run's warmup_steps, else 10)")
    p.add_argument("--gate", metavar="NAMES", default=None,
                   help="comma-separated timings and work rates whose regression fails the command "
                        "(default: all; e.g. iteration,backward,mfu_pct,tokens_per_s)")
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    p.add_argument("--plain", action="store_true", help="plain text even on a terminal")
    _common(p)
    p.set_defaults(func=_cmd_compare)


def _cmd_compare(args: argparse.Namespace) -> int:
    from steptrace.analysis.run import load_table
    from steptrace.analysis.compare import compare_tables, format_compare

    if not 0 < args.alpha < 1:
        raise _Usage(f"--alpha must be between 0 and 1, got {args.alpha:g}")
    if not (math.isfinite(args.min_delta_ms) and args.min_delta_ms >= 0):
        raise _Usage(f"--min-delta-ms must be >= 0, got {args.min_delta_ms:g}")
    gate = None
    if args.gate is not None:
        gate = [g.strip() for g in args.gate.split(",") if g.strip()]
        if not gate:
            raise _Usage("--gate needs at least one timing name")
    from steptrace.analysis.run import require

    require("numpy", "analysis", "steptrace compare")
    base = load_table(args.base, skip_bad=args.skip_bad, progress=_progress(args))
    new = load_table(args.new, skip_bad=args.skip_bad, progress=_progress(args))
    result = compare_tables(base.table, new.table, threshold=args.threshold / 100.0, alpha=args.alpha,
                            min_delta_ms=args.min_delta_ms, warmup=args.warmup, gate=gate,
                            base_name=args.base, new_name=args.new)
    if gate is not None:
        known = [*result["phases"], *result["work"]]
        unknown = [g for g in gate if g not in known]
        if unknown:
            raise _Usage(f"--gate names {', '.join(unknown)}, not a timing or work rate of these runs "
                         f"(have: {', '.join(known)})")
    if args.json:
        _print_json(result)
    else:
        console = None if args.plain else _rich_console()
        if console is not None:
            _render_compare_rich(result, console)
        else:
            print(format_compare(result))
    return EXIT_OK if result["ok"] else EXIT_REGRESSION


def _render_compare_rich(result: dict[str, Any], console: Any) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from steptrace.analysis.compare import compare_footer, compare_header, compare_rows, goodput_line, goodput_rows, work_rows

    from steptrace._terminal import printable

    def text(line: str, style: str = "") -> Any:  # log text (phase names): no markup, inert controls
        return Text(printable(line, one_line=True), style=style)

    console.print(text(compare_header(result), style="bold"))
    rows = compare_rows(result)
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for i, h in enumerate(rows[0]):
        t.add_column(h, justify="left" if i in (0, 6) else "right")
    styles = {"regressed": "bold red", "improved": "bold green", "slower": "yellow", "faster": "green"}
    for r, (name, info) in zip(rows[1:], result["phases"].items()):
        t.add_row(*(text(c) for c in r[:-1]), Text(r[-1], style=styles.get(info["verdict"], "")))
    console.print(t)
    work = work_rows(result)
    if work:
        styles.update(lower="yellow", higher="green")
        w = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for i, h in enumerate(work[0]):
            w.add_column(h, justify="left" if i in (0, 6) else "right")
        for r, info in zip(work[1:], result["work"].values()):
            w.add_row(*r[:-1], Text(r[-1], style=styles.get(info["verdict"], "")))
        console.print(w)
    wall = goodput_rows(result)
    if wall:
        g = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for i, h in enumerate(wall[0]):
            g.add_column(h, justify="left" if i == 0 else "right")
        for r in wall[1:]:
            g.add_row(*r)
        console.print(g)
        console.print(goodput_line(result))
    console.print(text(compare_footer(result), style="bold red" if result["regressed"] else "green"))


# --------------------------------------------------------------------------- plot


def _add_plot(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "plot",
        help="plot step time by phase, trailing median, alerts, memory and counters",
        description="Plot a run: step time stacked by phase with the trailing median and the regression "
                    "line, alerts, memory and counters over the steps. Needs matplotlib.",
    )
    p.add_argument("path", metavar="RUN", help="a .jsonl log file or a run folder")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the image to write (.png, .svg or .pdf)")
    p.add_argument("--rank", type=_nonneg_int, default=None, help="the rank whose phases are stacked (default: lowest)")
    p.add_argument("--steps", type=_step_range, default=None, metavar="START:STOP", help="only these steps")
    _common(p)
    p.set_defaults(func=_cmd_plot)


def _cmd_plot(args: argparse.Namespace) -> int:
    from steptrace.analysis.run import load, require

    require("matplotlib", "plot", "steptrace plot")
    _check_output(args.output, (".png", ".svg", ".pdf"))
    run = load(args.path, skip_bad=args.skip_bad, progress=_progress(args))
    from steptrace.analysis.plot import plot_run

    plot_run(run, args.output, rank=args.rank, steps=args.steps)
    print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


# --------------------------------------------------------------------------- export


def _add_export(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "export",
        help="export a run as a Chrome trace (Perfetto) or as CSV",
        description="Export a run: --format chrome writes a trace-event JSON timeline of the steps and "
                    "phases, one process per rank (open it in ui.perfetto.dev or chrome://tracing); "
                    "--format csv writes one row per step and rank.",
    )
    p.add_argument("path", metavar="RUN", help="a .jsonl log file or a run folder")
    p.add_argument("--format", required=True, choices=("chrome", "csv"), help="chrome (trace-event JSON) or csv")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write ('-' for stdout)")
    p.add_argument("--steps", type=_step_range, default=None, metavar="START:STOP", help="only these steps")
    _common(p)
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from steptrace.analysis.export import export

    if args.output != "-":
        _check_output(args.output, None)
    n = export(args.path, args.format, args.output, steps=args.steps, skip_bad=args.skip_bad,
               progress=_progress(args))
    what = "events" if args.format == "chrome" else "rows"
    if args.output != "-":
        print(f"wrote {args.output} ({n} {what})", file=sys.stderr)
    return EXIT_OK


# --------------------------------------------------------------------------- report


def _add_report(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "report",
        help="write one self-contained HTML report (summary, plots, alerts)",
        description="Write a self-contained HTML report of a run: the summary table, the plots (embedded), "
                    "the alerts and the run's details. It needs no network to open. Needs matplotlib.",
    )
    p.add_argument("path", metavar="RUN", help="a .jsonl log file or a run folder")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    p.add_argument("--rank", type=_nonneg_int, default=None, help="the rank whose phases are plotted")
    p.add_argument("--title", default=None, help="the report's title (default: the path)")
    _common(p)
    p.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from steptrace.analysis.run import load, require

    require("matplotlib", "plot", "steptrace report")
    _check_output(args.output, None)
    run = load(args.path, skip_bad=args.skip_bad, progress=_progress(args))
    from steptrace.analysis.report import write_report

    write_report(run, args.output, rank=args.rank, title=args.title)
    print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


# --------------------------------------------------------------------------- metrics


def _add_cluster(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "cluster",
        help="compare the ranks of a run: per-rank table, the straggler named",
        description="Read every rank's log of a run folder, align the ranks by step in windows, and "
                    "name the rank that holds the others up (the rules of the live cross-rank view).",
        epilog="Exit status: 0 ok, 1 a straggler was found and --fail-on-straggler was given, 2 error.",
    )
    p.add_argument("path", metavar="RUN_DIR", help="a run folder (rank<N>.jsonl files), or a job root: each "
                                                   "attempt on its own")
    p.add_argument("--interval", type=_positive_int, default=None,
                   help="steps per window (default: the run's cluster_interval, else 50)")
    p.add_argument("--straggler-pct", type=_positive_float, default=None,
                   help="own work above the other ranks' median by more than this %% (default 10)")
    p.add_argument("--straggler-min-s", type=_nonneg_float, default=None,
                   help="an alert needs the straggler for this many seconds of the run (default 30; 0: the "
                        "windows alone, for short runs)")
    p.add_argument("--fail-on-straggler", action="store_true", help="exit 1 when a straggler is found (CI)")
    p.add_argument("--json", action="store_true", help="print the windows, alerts and table as JSON")
    _common(p)
    p.set_defaults(func=_cmd_cluster)


def _cmd_cluster(args: argparse.Namespace) -> int:
    from steptrace.cluster import analyze_records, format_cluster, stragglers_found
    from steptrace.analysis.reader import read

    options = {}
    if args.interval is not None:
        options["cluster_interval"] = args.interval
    if args.straggler_pct is not None:
        options["straggler_pct"] = args.straggler_pct
    if args.straggler_min_s is not None:
        options["straggler_min_s"] = args.straggler_min_s
    from steptrace.analysis.goodput import job_attempts

    # a job root: the ranks of each attempt are compared among themselves, attempt by attempt
    attempts = job_attempts(args.path) if os.path.isdir(args.path) else []
    if len(attempts) > 1:
        results = [(a, analyze_records(read(a.path, skip_bad=args.skip_bad, progress=_progress(args)), options))
                   for a in attempts]
        if args.json:
            _print_json({"attempts": [{"attempt": a.number, "path": os.fspath(a.path), **r} for a, r in results]})
        else:
            print("\n\n".join(f"attempt {a.number} ({os.fspath(a.path)})\n" + format_cluster(r, source=os.fspath(a.path))
                              for a, r in results))
        found = any(stragglers_found(r) for _, r in results)
    else:
        result = analyze_records(read(args.path, skip_bad=args.skip_bad, progress=_progress(args)), options)
        if args.json:
            _print_json(result)
        else:
            print(format_cluster(result, source=args.path))
        found = stragglers_found(result)
    return EXIT_FOUND if args.fail_on_straggler and found else EXIT_OK


def _add_goodput(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "goodput",
        help="the job's goodput across its attempts: seconds and GPU-hours lost per cause",
        description="Account the wall clock of a job across its attempts (restarts): productive time, slow "
                    "steps above the ideal step time, wasted progress, recovery, startup, data, checkpoint "
                    "save and restore, evaluation, compile, host contention, other; in seconds, GPU-hours "
                    "(x ranks) and, with a price, money (docs/goodput.md).",
    )
    p.add_argument("path", metavar="JOB_ROOT",
                   help="a job root (rank<N>.jsonl and attempt<k>/ folders), a run folder or a .jsonl log")
    p.add_argument("--gpu-hour-cost", type=_nonneg_float, default=None, metavar="X",
                   help="the price of one GPU-hour (default: run_start's config gpu_hour_cost, else none)")
    p.add_argument("--json", action="store_true", help="print the account as one JSON object")
    _common(p)
    p.set_defaults(func=_cmd_goodput)


def _cmd_goodput(args: argparse.Namespace) -> int:
    from steptrace.analysis.goodput import format_job, job_goodput

    job = job_goodput(args.path, args.gpu_hour_cost, skip_bad=args.skip_bad, progress=_progress(args))
    if args.json:
        _print_json(job)
    else:
        print(format_job(job))  # its cells (a run_end's error text) are made printable there
    return EXIT_OK


def _add_metrics(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "metrics",
        help="the CUPTI hardware-counter set steptrace uses on a chip, its passes, each metric checked",
        description="Print the metric set steptrace asks CUPTI for on a GPU chip (silicon name, e.g. GH100 "
                    "for H100/H200, GA100 for A100), whether each metric exists and how many passes the "
                    "set needs, using CUPTI's profiler host API: no GPU is needed, only libcupti.",
    )
    p.add_argument("--chip", required=True, help="the chip name, as cuptiDeviceGetChipName reports it")
    p.add_argument("--mode", default="auto", choices=("auto", "pm_sampling", "range_profiler"),
                   help="the profiler mode (default: PM sampling where available)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=_cmd_metrics)


def _cupti_dirs() -> list[str]:
    """The lib folders of the CUDA wheels' CUPTI (torch's), found without importing torch, in
    each layout they ship: nvidia/cu13/lib (the CUDA 13 wheels), nvidia/cu12/lib,
    nvidia/cuda_cupti/lib (before them)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [os.path.join(loc, layout, "lib") for loc in spec.submodule_search_locations
            for layout in ("cu13", "cu12", "cuda_cupti")
            if os.path.isfile(os.path.join(loc, layout, "lib", "libcupti.so.13"))
            or os.path.isfile(os.path.join(loc, layout, "lib", "libcupti.so.12"))]


def _cmd_metrics(args: argparse.Namespace) -> int:
    from steptrace import _core

    if not (0 < len(args.chip) <= 32 and args.chip.isascii() and args.chip.isalnum()):
        shown = args.chip if len(args.chip) <= 40 else args.chip[:40] + "..."
        raise _Usage(f"--chip {shown!r} is not a chip name: allowed are up to 32 letters and digits "
                     f"(the silicon name, e.g. GH100, GA100, AD102)")
    try:
        report = _core.check_metric_set(args.chip, args.mode, _cupti_dirs())
    except ValueError as exc:  # unknown chip or mode
        raise _Usage(str(exc)) from None
    if args.json:
        _print_json(report)
        if report["error"]:
            _error(report["error"])  # the one error line of every failing command, as without --json
            return EXIT_ERROR
        return EXIT_OK
    head = f"chip {report['chip']} (table {report['family']}): {report['mode']}"
    if report["trigger"]:
        head += f", trigger {report['trigger']}"
    passes = report["passes"]
    head += f", {passes} pass{'es' if passes != 1 else ''}" if passes >= 0 else ", passes not computed"
    print(head)
    if report["cupti_library"]:
        print(f"CUPTI {report['cupti_version']} from {report['cupti_library']}")
    width = max((len(m["counter"]) for m in report["metrics"]), default=0)
    for m in report["metrics"]:
        mark = "+" if m["selected"] else " "
        exists = "exists" if m["exists"] else "missing" if not m["note"] == "not checked" else "unchecked"
        line = f"{mark} {m['counter']:<{width}}  {exists:<9} {m['name']}"
        if m["note"] and not m["selected"] and m["note"] != "not checked":
            line += f"  ({m['note']})"
        print(line)
    if report["error"]:
        _error(report["error"])
        return EXIT_ERROR
    return EXIT_OK


# --------------------------------------------------------------------------- main


class _Usage(SteptraceError):
    """A bad combination of arguments found after parsing (exit 2, one line)."""


def _check_output(path: str, suffixes: Optional[tuple[str, ...]]) -> None:
    """Fail before reading a big log when the output cannot be written."""
    if suffixes is not None and os.path.splitext(path)[1].lower() not in suffixes:
        raise _Usage(f"{path}: the output must end in {', '.join(suffixes)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _Usage(f"{path}: no such directory {folder}")
    if os.path.isdir(path):
        raise _Usage(f"{path}: is a directory")


def _add_run(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from steptrace.live.launcher import add_arguments

    p = sub.add_parser(
        "run", help="profile an unmodified training script",
        description="Run a training script as __main__ with steptrace: steps end at optimizer steps, phases "
                    "come from module, autograd, grad-clip and optimizer hooks (docs/auto-instrumentation.md). "
                    "The exit status is the script's.")
    add_arguments(p)
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from steptrace.live.launcher import run

    return run(args)


def _add_capture(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "capture", help="evidence of a running run's next steps, now",
        description="Ask a running profiler (evidence=True) for a torch.profiler capture of its next steps, "
                    "through a request file in its log folder, and wait for the evidence record "
                    "(docs/alerts.md#evidence). Exit 0 when it came, 1 when refused or timed out.")
    p.add_argument("target", metavar="RUN_OR_PID", help="the run's log folder, or the PID of the training process")
    p.add_argument("--steps", type=int, default=3, help="steps to capture, 1..100 (default 3)")
    p.add_argument("--rank", type=int, default=None, help="only this rank (default: every rank in the folder)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the evidence (default 60)")
    p.set_defaults(func=_cmd_capture)


def _cmd_capture(args: argparse.Namespace) -> int:
    from steptrace.live.capture_request import capture

    return capture(args.target, args.steps, args.rank, args.timeout, sys.stdout)


_COMMANDS: list[Callable[[Any], None]] = [_add_summary, _add_compare, _add_plot, _add_export, _add_report,
                                          _add_cluster, _add_goodput, _add_metrics, _add_run, _add_capture]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="steptrace",
        description="Read and analyse steptrace step logs.",
        epilog="Exit status: 0 ok, 1 compare found a regression, 2 error.",
    )
    from steptrace import __version__

    parser.add_argument("--version", action="version", version=f"steptrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``) and return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    if getattr(args, "func", None) is None:
        parser.print_usage(sys.stderr)
        print("steptrace: error: a command is required (try: steptrace summary PATH)", file=sys.stderr)
        return EXIT_ERROR
    with warnings.catch_warnings():
        from steptrace.analysis.reader import ReaderWarning

        warnings.simplefilter("always", ReaderWarning)
        warnings.showwarning = _print_warning
        _printed.clear()
        try:
            return args.func(args)
        except BrokenPipeError:
            # `steptrace summary x | head`: the reader went away; not an error worth a message
            _silence_stdout()
            return EXIT_OK
        except (SteptraceError, OSError) as exc:
            _error(str(exc) if not isinstance(exc, OSError) or not exc.filename else
                   f"{exc.filename}: {exc.strerror or exc}")
            return EXIT_ERROR
        except KeyboardInterrupt:
            from steptrace._progress import clear_active

            clear_active()
            return 130


def _error(message: str) -> None:
    from steptrace._progress import clear_active

    clear_active()
    print(f"steptrace: error: {_one_line(message)}", file=sys.stderr)


def _silence_stdout() -> None:
    # Python flushes stdout at exit; point it at devnull so that flush cannot raise again.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
