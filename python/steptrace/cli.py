"""The ``steptrace`` command line.

``steptrace summary PATH [--json] [--skip-bad]`` prints a run's per-phase table. Each
subcommand is an ``_add_<name>(subparsers)`` function that registers its parser and sets
``func`` to a ``_cmd_<name>(args) -> int``; add new ones to ``_COMMANDS``.

Exit status: 0 on success, 2 for a usage error or a log that cannot be read (one line
``steptrace: error: ...`` on stderr, never a traceback). Reader warnings (a truncated
last line, skipped lines) are printed as ``steptrace: warning: ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, Callable, Optional, Sequence, TextIO

from steptrace.errors import SteptraceError

EXIT_OK = 0
EXIT_ERROR = 2


def _print_warning(message: Any, category: type, filename: str, lineno: int,
                   file: Optional[TextIO] = None, line: Optional[str] = None) -> None:
    # one line, without the source location of the warnings.warn call: users care about
    # the log file and line, which the message already names
    print(f"steptrace: warning: {_one_line(str(message))}", file=sys.stderr)


def _one_line(text: str) -> str:
    return " ".join(text.split())


# --------------------------------------------------------------------------- summary


def _add_summary(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "summary",
        help="per-phase p50/p95/max, shares, memory, alerts of a run",
        description="Summarize a steptrace run: a rank<N>.jsonl file or a run folder.",
    )
    p.add_argument("path", metavar="PATH", help="a .jsonl log file or a run folder")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--skip-bad", action="store_true", help="skip corrupt lines with a warning instead of failing")
    p.set_defaults(func=_cmd_summary)


def _cmd_summary(args: argparse.Namespace) -> int:
    from steptrace.reader import read
    from steptrace.summary import format_summary, summarize

    summary = summarize(read(args.path, skip_bad=args.skip_bad), source=args.path)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return EXIT_OK


# --------------------------------------------------------------------------- main

_COMMANDS: list[Callable[[Any], None]] = [_add_summary]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="steptrace", description="Read and analyse steptrace step logs.")
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
        from steptrace.reader import ReaderWarning

        warnings.simplefilter("always", ReaderWarning)
        warnings.showwarning = _print_warning
        try:
            return args.func(args)
        except BrokenPipeError:
            # `steptrace summary x | head`: the reader went away; not an error worth a message
            _silence_stdout()
            return EXIT_OK
        except (SteptraceError, OSError) as exc:
            print(f"steptrace: error: {_one_line(str(exc))}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            return 130


def _silence_stdout() -> None:
    # Python flushes stdout at exit; point it at devnull so that flush cannot raise again.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
