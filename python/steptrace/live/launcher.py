"""``steptrace run``: profile an unmodified training script.

    steptrace run [--log-dir DIR] train.py [args...]
    steptrace run --nproc-per-node 2 train.py [args...]         # through torch.distributed.run
    steptrace run --torchrun="--nnodes 2 --node-rank 0 ..." train.py [args...]

The script runs in this process as ``__main__`` (runpy, ``sys.argv`` = the script and its
arguments) with a :class:`steptrace.Profiler` created before it starts and
:class:`steptrace.live.autophase.GlobalPhaseHooks` installed: a step ends when an optimizer
step returns, the next one begins at the next training forward (or backward, or
optimizer step), and its phases come from the outermost module calls, autograd, grad
clipping and the optimizer. Between steps, a DataLoader's fetch is data, forwards with
gradients disabled are evaluation, checkpoint saves (torch.save, DCP, safetensors)
are checkpoints and their loads (torch.load, DCP, safetensors, and the load_state_dict
that applies one) are restores, before the first step too: the watch is in place before
the script's first line (:mod:`steptrace.live.intervals`); the rest is other host work. The script's exit status and exceptions are its own; the log
is closed (``run_end``) on every way out.

With ``--nproc-per-node N`` or ``--torchrun ARGS`` the launcher re-executes itself under
``python -m torch.distributed.run ARGS -m steptrace.live.launcher ...``, so that every rank
runs the launcher and writes its own ``rank<N>.jsonl`` into the same folder.

The launcher turns PyTorch's flight recorder on (``TORCH_FR_BUFFER_SIZE=2000``) unless
``TORCH_FR_BUFFER_SIZE`` or ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set already (0 turns it
off): hang alerts then carry each rank's last collectives (:mod:`steptrace.live.flight_recorder`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import Optional, Sequence

EXIT_USAGE = 2
DEFAULT_LOG_DIR = "runs/steptrace"


from steptrace.errors import SteptraceError


class LaunchError(SteptraceError):
    """A bad argument found before anything ran or was written (exit 2, one line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The launcher's options (shared by ``steptrace run`` and ``python -m steptrace.live.launcher``)."""
    p.add_argument("--log-dir", default=DEFAULT_LOG_DIR,
                   help=f"folder for rank<N>.jsonl (default {DEFAULT_LOG_DIR}; an existing log is replaced)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="run N ranks through torch.distributed.run (each one profiled)")
    p.add_argument("--torchrun", default=None, metavar="ARGS",
                   help="arguments for torch.distributed.run, one string after = (e.g. --torchrun=\"--standalone --nnodes 1\")")
    p.add_argument("--discover-steps", type=int, default=2, metavar="N",
                   help="optimizer steps during which every module call is watched to find the top-level "
                        "modules, which alone are hooked afterwards (default 2; 0: watch every call throughout)")
    p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="a Profiler option (repeatable; the value is read as JSON, else as a string)")
    p.add_argument("script", help="the training script (a .py file)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def _options(pairs: Sequence[str]) -> dict:
    import json

    out = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise LaunchError(f"--option {pair!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(text)
        except ValueError:
            out[key] = text
    return out


def check(args: argparse.Namespace) -> dict:
    """Every argument checked before anything runs or is written; the Profiler options."""
    script = args.script
    if not os.path.isfile(script):
        raise LaunchError(f"{script}: no such script" if not os.path.exists(script) else f"{script}: not a file")
    if not os.access(script, os.R_OK):
        raise LaunchError(f"{script}: cannot be read")
    log_dir = args.log_dir
    existing = os.path.abspath(log_dir)
    while not os.path.exists(existing):  # the folder, or the first ancestor that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise LaunchError(f"--log-dir {log_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LaunchError(f"--log-dir {log_dir}: {existing} is not writable")
    if args.discover_steps < 0:
        raise LaunchError(f"--discover-steps {args.discover_steps}: must be 0 or more")
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")
    options = {"overwrite": True, **_options(args.option)}
    from steptrace.live.profiler import build_config

    build_config(log_dir, options)  # bad options fail here (ConfigError), before any file
    return options


def _torchrun_command(args: argparse.Namespace) -> list[str]:
    extra = shlex.split(args.torchrun) if args.torchrun else []
    if args.nproc_per_node is not None:
        extra += ["--nproc-per-node", str(args.nproc_per_node)]
    inner = ["--log-dir", args.log_dir, "--discover-steps", str(args.discover_steps)]
    for pair in args.option:
        inner += ["--option", pair]
    return [sys.executable, "-m", "torch.distributed.run", *extra, "-m", "steptrace.live.launcher", *inner,
            args.script, *args.args]


def run(args: argparse.Namespace) -> int:
    """Checks the arguments (LaunchError, ConfigError), then runs the script (or torchrun)
    and returns its exit status: 1 after printing the traceback of an exception it raised,
    as ``python train.py`` would."""
    options = check(args)
    from steptrace.live.flight_recorder import enable as enable_flight_recorder

    # PyTorch's flight recorder (TORCH_FR_BUFFER_SIZE) for the hang alerts' collectives,
    # unless the user set it: read when the first process group is made, in this process
    # or in the ranks torchrun starts (they inherit the environment)
    enable_flight_recorder()
    if args.nproc_per_node is not None or args.torchrun is not None:
        return subprocess.call(_torchrun_command(args))
    try:
        return run_script(args.script, list(args.args), args.log_dir, options, discover_steps=args.discover_steps)
    except (KeyboardInterrupt, LaunchError):
        raise
    except Exception as exc:
        _print_script_traceback(exc, args.script)
        return 1


def _print_script_traceback(exc: BaseException, script: str) -> None:
    """The traceback from the script's frames on (runpy's and ours left out)."""
    import traceback

    tb, path = exc.__traceback__, os.path.abspath(script)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != path:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb if tb is not None else exc.__traceback__, file=sys.stderr)


def run_script(script: str, argv: list[str], log_dir: str, options: dict, *, discover_steps: int = 2) -> int:
    """Runs ``script`` as ``__main__`` under a profiler with global phase hooks. Returns its
    exit status (from SystemExit, else 0); an exception from it propagates after the log
    is closed with run_end reason ``exception``."""
    import runpy

    import torch  # noqa: F401  (the hooks live in torch; the script imports it anyway)

    from steptrace.live.autophase import GlobalPhaseHooks
    from steptrace.live.intervals import IntervalWatch
    from steptrace.live.profiler import Profiler

    try:
        prof = Profiler(log_dir, **options)
    except SteptraceError as exc:  # e.g. a log_dir that cannot be created: nothing ran yet
        raise LaunchError(f"--log-dir {log_dir}: {exc}") from None
    # checkpoints, the DataLoader's fetches and evaluation forwards between steps
    intervals = IntervalWatch(prof._core, data=True)
    work = None
    if prof._count_work:
        from steptrace.live.work import TopLevelWork

        work = TopLevelWork(prof._core)  # samples, tokens and FLOPs of the models' training forwards
    hooks = GlobalPhaseHooks(prof._core, steps=True, discover_steps=discover_steps,
                             intervals=intervals, work=work)
    saved_argv = sys.argv
    sys.argv = [script, *argv]
    script_dir = os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, script_dir)  # its imports resolve as under `python train.py`
    status, reason, error = 0, "normal", ""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        status = code if isinstance(code, int) else (0 if code is None else 1)
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)  # what the interpreter prints for sys.exit("message")
        if status != 0:
            reason, error = "exit", f"SystemExit: {code}"
    except KeyboardInterrupt:
        reason, error = "signal", "KeyboardInterrupt"
        raise
    except BaseException as exc:
        reason, error = "exception", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        hooks.end_open_step(failed=reason != "normal")
        hooks.remove()
        intervals.remove()
        prof.close(reason, error)
        sys.argv = saved_argv
        if script_dir in sys.path:
            sys.path.remove(script_dir)
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m steptrace.live.launcher`` (what each torchrun rank runs)."""
    parser = argparse.ArgumentParser(prog="steptrace run", description="Profile an unmodified training script.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except SteptraceError as exc:  # a bad argument or option: before anything ran or was written
        print(f"steptrace: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
