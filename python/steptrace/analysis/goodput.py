"""The job's goodput across attempts: where every second (and GPU-hour) of a job went.

A job crashes, restarts from its last checkpoint, recomputes the steps it lost, restores
and compiles again. Its attempts share one log root (docs/goodput.md): attempt 0 writes
``ROOT/rank<r>.jsonl``, attempt k >= 1 ``ROOT/attempt<k>/rank<r>.jsonl``; a plain run
folder is a job of one attempt. :func:`job_goodput` reads them all and accounts the job's
wall clock, from the first attempt's process start to the last attempt's last record,
by cause (:data:`CAUSES`), with nothing counted twice: the causes add up to the wall
clock, and x the world size to the GPU-hours.

Rank 0's view is the job's (the lowest rank present where rank 0's log of an attempt is
missing): the other ranks wait for it in every collective. Each attempt's own account
comes from :func:`steptrace.analysis.summary.goodput` (run_end's ``goodput``, or the records of
a torn log); this module splits its training time into productive time, slow steps
(above the job's ideal step time), compiling, host contention, Python's garbage
collections and wasted progress, and
adds the time between attempts (recovery).
"""

from __future__ import annotations

import math
import os
import re
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

from steptrace._table import StepTable, as_object, collect
from steptrace.errors import LogFormatError

#: Every cause, in the order the tables list them. They add up to the job's wall clock.
CAUSES = ("productive", "slow_steps", "wasted_progress", "recovery", "startup", "data", "checkpoint", "restore",
          "eval", "compile", "host_contention", "gc", "other")
#: The causes that are lost time (all but productive).
BADPUT = CAUSES[1:]
#: Badput caused by a restart.
RESTART_CAUSES = ("wasted_progress", "recovery")
#: How the tables name each cause.
LABELS = {"productive": "productive", "slow_steps": "slow steps", "wasted_progress": "wasted progress",
          "recovery": "recovery", "startup": "startup", "data": "data", "checkpoint": "checkpoint save",
          "restore": "checkpoint restore", "eval": "evaluation", "compile": "compile",
          "host_contention": "host contention", "gc": "garbage collection", "other": "other"}
#: The cut-off of the ideal step time: median + this many median absolute deviations.
MAD_CUTOFF = 3.0
IDEAL_METHOD = ("the mean of the steps at or below median + 3 x MAD (median absolute deviation) of the steps' "
                "training time, all attempts, rank 0, the first step of each attempt left out")

_ATTEMPT_RE = re.compile(r"attempt([0-9]{1,9})")
#: An exception a rank got because another rank failed (the collective's transport saw the
#: peer go): gloo's "Connection closed by peer" / "reset by peer", NCCL's aborted
#: communicator, torch's DistBackendError, a collective timeout. Such a rank is not the
#: origin where another rank raised on its own or was killed.
_PEER_ERROR = re.compile(r"closed by peer|reset by peer|remote (worker|process)|DistBackendError|"
                         r"communicator was aborted|collective operation timeout|Broken pipe", re.IGNORECASE)
PathArg = Union[str, "os.PathLike[str]"]


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# --------------------------------------------------------------------------- the attempts


@dataclass(frozen=True)
class Attempt:
    """One attempt of a job: its number and the folder (or single log file) it wrote."""

    number: int
    path: Path


def _has_logs(folder: Path) -> bool:
    # any .jsonl, as the reader takes a folder (the profiler writes rank<N>.jsonl)
    return any(f.suffix == ".jsonl" and f.is_file() for f in folder.iterdir())


def job_attempts(root: PathArg) -> list[Attempt]:
    """The attempts of the job at ``root``, by number: the root itself when it holds
    ``rank<r>.jsonl`` files (any ``.jsonl``: attempt 0), then each ``attempt<k>/`` that
    holds some, by k.
    A plain run folder is a job of one attempt; so is a single log file. Raises
    LogFormatError naming the path when there is no such path or no log in it."""
    p = Path(root)
    if not p.exists():
        raise LogFormatError(f"{p}: no such file or directory")
    if p.is_file():
        return [Attempt(0, p)]
    if not p.is_dir():
        raise LogFormatError(f"{p}: not a folder or a log file")
    out = [Attempt(0, p)] if _has_logs(p) else []
    found = []
    for sub in p.iterdir():
        m = _ATTEMPT_RE.fullmatch(sub.name)
        if m and sub.is_dir() and not sub.is_symlink() and _has_logs(sub):
            found.append(Attempt(int(m.group(1)), sub))
    out += sorted(found, key=lambda a: a.number)
    if not out:
        raise LogFormatError(f"{p}: holds no .jsonl log files and no attempt<k>/ folders with them "
                             "(not a steptrace run or job root)")
    return out


# --------------------------------------------------------------------------- per-step extras


class StepExtras:
    """What the job account needs from the step records beyond a :class:`StepTable`'s
    columns, one value per step row in the same order (``tee`` them while the table
    collects): ``progress`` (-1 where absent), ``compile_ms`` and ``restore_ms`` (0 where
    absent); and per rank the end (unix ns) of its latest checkpoint save interval."""

    def __init__(self) -> None:
        self.progress = array("q")
        self.compile_ms = array("d")
        self.restore_ms = array("d")
        self.save_end_ns: dict[int, int] = {}

    def tee(self, records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        progress, compile_ms, restore_ms = self.progress.append, self.compile_ms.append, self.restore_ms.append
        for rec in records:
            kind = rec.get("kind")
            if kind == "step":
                p = rec.get("progress")
                progress(int(p) if _is_num(p) and 0 <= p < 2**62 and float(p).is_integer() else -1)
                c = rec.get("compile_ms")
                compile_ms(float(c) if _is_num(c) and c > 0 else 0.0)
                r = rec.get("restore_ms")
                restore_ms(float(r) if _is_num(r) and r > 0 else 0.0)
            elif kind == "interval" and rec.get("interval") == "checkpoint":
                start, ms, rank = rec.get("start_unix_ns"), rec.get("duration_ms"), rec.get("rank", 0)
                if isinstance(start, int) and _is_num(ms) and 0 <= ms < 1e12 and isinstance(rank, int):
                    end = start + round(ms * 1e6)
                    if end > self.save_end_ns.get(rank, -1):
                        self.save_end_ns[rank] = end
            yield rec


def read_attempt(path: PathArg, *, skip_bad: bool = False, progress: bool = False) -> tuple[StepTable, StepExtras]:
    """The records of one attempt (a run folder or a log file) as a table and its extras."""
    from steptrace.analysis.reader import read

    extras = StepExtras()
    table = collect(extras.tee(read(path, skip_bad=skip_bad, progress=progress)))
    return table, extras


# --------------------------------------------------------------------------- the ideal step time


def _median(sorted_v: Sequence[float]) -> float:
    n = len(sorted_v)
    mid = n // 2
    return sorted_v[mid] if n % 2 else 0.5 * (sorted_v[mid - 1] + sorted_v[mid])


def ideal_step_time(times_ms: Sequence[float]) -> Optional[dict[str, Any]]:
    """The ideal step time of ``times_ms`` as Google's ml-goodput-measurement finds it
    (``compute_ideal_step_time``): the mean of the times at or below median + 3 x MAD,
    the median absolute deviation, unscaled. Unlike it, steps under 1 s are kept (it
    drops them; a step here may take a millisecond). None without a positive time."""
    v = sorted(t for t in times_ms if t == t and t > 0)
    if not v:
        return None
    med = _median(v)
    mad = _median(sorted(abs(t - med) for t in v))
    cut = med + MAD_CUTOFF * mad
    kept = [t for t in v if t <= cut]
    return {"ms": math.fsum(kept) / len(kept), "median_ms": med, "mad_ms": mad, "cutoff_ms": cut,
            "steps": len(kept), "of_steps": len(v), "method": IDEAL_METHOD}


# --------------------------------------------------------------------------- one attempt


@dataclass
class _View:
    """One attempt as rank 0 (or the lowest rank) saw it, before the split of its steps."""

    number: int
    path: str
    rank: int
    ranks: list[int]
    world_size: int
    g: dict[str, Any]  # summary.goodput's account of the view rank
    start_ns: int  # process start (else the profiler's)
    start_from: str
    end_ns: int
    failed: bool
    end_reasons: dict[str, str]
    origin: Optional[dict[str, Any]]
    # the view rank's steps, in time order: training ms, compile ms, run-queue ms, Python's collections in
    # the step (ms), start, progress, save end
    t_ms: list[float]
    compile_ms: list[float]
    runq_ms: list[float]
    gc_ms: list[float]
    step_start: list[int]
    progress: list[int]
    save_end_ns: Optional[int]
    cost: Optional[float]


def _start_of(rs: dict[str, Any]) -> tuple[Optional[int], str]:
    p = rs.get("process_start_unix_ns")
    if isinstance(p, int) and not isinstance(p, bool) and p > 0:
        return p, "process_start"
    s = rs.get("start_unix_ns")
    return (s, "profiler_start") if isinstance(s, int) and not isinstance(s, bool) and s > 0 else (None, "")


def _origin(table: StepTable, ranks: list[int], ends: dict[int, dict[str, Any]],
            last_ns: dict[int, int]) -> Optional[dict[str, Any]]:
    """The rank where a failed attempt's disruption began, as far as the records show it."""
    def earliest(cands: list[int]) -> int:
        return min(cands, key=lambda r: (last_ns.get(r, 1 << 62), r))

    def error(r: int) -> str:
        err = ends.get(r, {}).get("error")
        return err if isinstance(err, str) else ""

    def raised_why(r: int) -> str:
        return f"its run_end says it ended on an exception: {error(r)}"[:300] if error(r) else \
            "its run_end says it ended on an exception"

    raised = [r for r in ranks if ends.get(r, {}).get("reason") == "exception"]
    own = [r for r in raised if not _PEER_ERROR.search(error(r))]
    if own:
        return {"rank": earliest(own), "why": raised_why(earliest(own))}
    torn = [r for r in ranks if r not in ends and r in last_ns]
    if torn:
        r = earliest(torn)
        later = [o for o in ranks if o != r and last_ns.get(o, -1) > last_ns[r]]
        if later or len(ranks) == 1:
            went_on = (max(last_ns[o] for o in later) - last_ns[r]) / 1e9 if later else 0.0
            why = "its log ends without run_end (killed or crashed)"
            if later:
                why += f" while rank {max(later, key=lambda o: last_ns[o])} went on for {went_on:.2f} s"
            return {"rank": r, "why": why}
    for a in table.alerts:
        subject = as_object(a.get("details")).get("subject_rank", a.get("subject_rank"))
        if a.get("type") == "rank_silent" and isinstance(subject, int) and not isinstance(subject, bool):
            return {"rank": subject, "why": f"rank {a.get('rank', 0)}'s rank_silent alert names it"}
    for a in table.alerts:
        details = as_object(a.get("details"))
        if a.get("type") == "hang" and isinstance(a.get("rank"), int) and not details.get("collectives_in_flight"):
            return {"rank": a["rank"], "why": "its own hang alert (no collective in flight: not waiting for a peer)"}
    if raised:  # every exception was a peer's failure seen in a collective: the first of them
        r = earliest(raised)
        return {"rank": r, "why": raised_why(r) + " (a peer's failure, seen by this rank first)"}
    stopped = [r for r in ranks if ends.get(r, {}).get("reason") in ("signal", "exit")]
    if stopped:
        r = earliest(stopped)
        return {"rank": r, "why": f"the first rank to end, on {ends[r]['reason']} (its run_end)"}
    return None


def _view(number: int, path: str, table: StepTable, extras: Optional[StepExtras]) -> _View:
    from steptrace.analysis.summary import _ops, goodput

    ops = _ops()
    ranks = table.ranks()
    if not ranks:
        raise LogFormatError(f"{path}: no records")
    restore = ops.col(extras.restore_ms) if extras is not None and len(extras.restore_ms) == table.n else None
    g_all = goodput(table, ops=ops, restore=restore)
    by_rank = (g_all or {}).get("by_rank", {})
    starts = {rs.get("rank", 0): rs for rs in table.run_starts if isinstance(rs.get("rank", 0), int)}
    candidates = sorted(r for r in starts if str(r) in by_rank)
    if not candidates:
        raise LogFormatError(f"{path}: no rank's records account for its wall clock (a log written before "
                             "steptrace accounted the time between steps): no waste report")
    view = 0 if 0 in candidates else candidates[0]
    g = by_rank[str(view)]
    start, start_from = _start_of(starts[view])
    if start is None or start > g["start_unix_ns"]:
        start, start_from = g["start_unix_ns"], g["from"]
    ends: dict[int, dict[str, Any]] = {}
    for e in table.run_ends:
        r = e.get("rank", 0)
        if isinstance(r, int) and not isinstance(r, bool):
            ends[r] = e
    reasons = {str(r): (ends[r].get("reason") if isinstance(ends[r].get("reason"), str) else "unknown")
               if r in ends else "missing" for r in ranks}
    failed = any(v != "normal" for v in reasons.values())
    last_ns = {int(r): int(v["end_unix_ns"]) for r, v in by_rank.items()}
    origin = _origin(table, ranks, ends, last_ns) if failed else None
    world = max([ws for rs in table.run_starts if isinstance(ws := rs.get("world_size"), int) and ws > 0]
                + [len(ranks)])

    rows = [int(i) for i in ops.ranks_rows(ops.col(table.rank), [view])[view]] if table.n else []
    rows.sort(key=lambda i: table.start_ns[i])

    def v(col: Any, i: int) -> float:
        x = float(col[i])
        return x if x == x else 0.0

    t_ms, comp, runq, gcs, st, prog = [], [], [], [], [], []
    gc_col = table.groups["gc"].cols.get("ms")
    for i in rows:
        t = max(0.0, v(table.host_ms, i) - v(table.between["interval_in_step_ms"], i))
        c = min(t, extras.compile_ms[i]) if extras is not None else 0.0
        t_ms.append(t)
        comp.append(c)
        # the step's Python collections before its run-queue wait (a collection slowed by a busy
        # host is still the collection, as the gc_pause rule has it; csrc/core/badput.cpp agrees)
        gcs.append(max(0.0, min(t - c, v(gc_col, i) if gc_col is not None else 0.0)))
        runq.append(min(t - c - gcs[-1], v(table.host["runq_ms"], i)))
        st.append(int(table.start_ns[i]))
        prog.append(int(extras.progress[i]) if extras is not None else -1)
    # the job's last save: by whichever rank saved (DDP saves on rank 0 alone, FSDP on all)
    save_end = max(extras.save_end_ns.values(), default=None) if extras is not None else None
    if save_end is None:  # no checkpoint interval records: a step that lists a save follows it
        saved = [table.start_ns[i] for i in range(table.n) if v(table.between["checkpoint_ms"], i) > 0]
        save_end = max(saved) if saved else None
    cost = None
    for rs in table.run_starts:
        c = as_object(rs.get("config")).get("gpu_hour_cost")
        if _is_num(c) and c > 0:
            cost = float(c)
            break
    return _View(number, path, view, ranks, world, g, start, start_from, int(g["end_unix_ns"]), failed, reasons,
                 origin, t_ms, comp, runq, gcs, st, prog, save_end, cost)


# --------------------------------------------------------------------------- the job


def _wasted_rows(view: _View, nxt: Optional[_View]) -> tuple[set[int], str]:
    """The steps of a failed attempt whose work was lost, and how they were found."""
    if nxt is not None and any(p >= 0 for p in view.progress):
        resumed = [p for p in nxt.progress if p >= 0]
        if resumed:
            p0 = resumed[0]
            return ({i for i, p in enumerate(view.progress) if p >= p0},
                    f"the steps at progress >= {p0}, where attempt {nxt.number} resumed")
    if view.save_end_ns is None:
        return set(range(len(view.t_ms))), "every step: no checkpoint was saved"
    return ({i for i, s in enumerate(view.step_start) if s >= view.save_end_ns},
            "the steps after the last checkpoint save")


def _gpu_hours(seconds: dict[str, float], world: int) -> dict[str, float]:
    return {k: s * world / 3600.0 for k, s in seconds.items()}


def account(attempts: Sequence[tuple[int, str, StepTable, Optional[StepExtras]]], *, root: Optional[str] = None,
            gpu_hour_cost: Optional[float] = None) -> dict[str, Any]:
    """The job account of attempts already read: ``(number, path, table, extras)`` each,
    in order. See :func:`job_goodput` for the result."""
    views = [_view(n, p, t, x) for n, p, t, x in attempts]
    # the ideal step time: every attempt's steps (rank 0), each attempt's first left out
    pool = [t - c - q - g for vw in views
            for t, c, q, g in list(zip(vw.t_ms, vw.compile_ms, vw.runq_ms, vw.gc_ms))[1:]]
    ideal = ideal_step_time(pool)
    ideal_ms = ideal["ms"] if ideal is not None else math.inf

    out_attempts = []
    totals = dict.fromkeys(CAUSES, 0.0)
    hours = dict.fromkeys(CAUSES, 0.0)
    prev_end: Optional[int] = None
    for k, vw in enumerate(views):
        nxt = views[k + 1] if k + 1 < len(views) else None
        g = vw.g
        sec = dict.fromkeys(CAUSES, 0.0)
        wasted, wasted_how = _wasted_rows(vw, nxt) if vw.failed else (set(), "")
        warmup = 0.0
        for i, (t, c, q, gt) in enumerate(zip(vw.t_ms, vw.compile_ms, vw.runq_ms, vw.gc_ms)):
            if i in wasted:
                sec["wasted_progress"] += t / 1e3
                continue
            sec["compile"] += c / 1e3
            sec["host_contention"] += q / 1e3
            sec["gc"] += gt / 1e3
            excess = max(0.0, t - c - q - gt - ideal_ms) / 1e3
            if i == 0:
                warmup = excess  # the first step's warm-up: getting started, as the ideal leaves it out
            else:
                sec["slow_steps"] += excess
        start = vw.start_ns if prev_end is None else max(vw.start_ns, prev_end)
        overlap = max(0, start - vw.start_ns) / 1e9  # began before the previous attempt ended
        window = max(0.0, (vw.end_ns - start) / 1e9)
        sec["startup"] = max(0.0, g["startup_s"] + (g["start_unix_ns"] - vw.start_ns) / 1e9 + warmup - overlap)
        for cause, key in (("data", "data_s"), ("checkpoint", "checkpoint_s"), ("restore", "restore_s"),
                           ("eval", "eval_s")):
            sec[cause] = g.get(key, 0.0)
        split = sum(sec[c] for c in ("slow_steps", "wasted_progress", "compile", "host_contention", "gc")) + warmup
        sec["productive"] = max(0.0, g["steps_s"] - split)
        sec["other"] = window - math.fsum(sec[c] for c in CAUSES if c not in ("other", "recovery"))
        if -1e-9 < sec["other"] < 0:
            sec["other"] = 0.0
        if nxt is not None:  # from this attempt's last record to the next one's process start
            sec["recovery"] = max(0.0, (nxt.start_ns - vw.end_ns) / 1e9)
        prev_end = vw.end_ns
        gh = _gpu_hours(sec, vw.world_size)
        for c in CAUSES:
            totals[c] += sec[c]
            hours[c] += gh[c]
        entry: dict[str, Any] = {
            "attempt": vw.number, "path": vw.path, "view_rank": vw.rank, "ranks": vw.ranks,
            "world_size": vw.world_size, "failed": vw.failed, "end_reasons": vw.end_reasons,
            "start_unix_ns": vw.start_ns, "start_from": vw.start_from, "end_unix_ns": vw.end_ns,
            "wall_s": window, "steps": len(vw.t_ms), "wasted_steps": len(wasted),
            "seconds": sec, "gpu_hours": gh,
            "gpu_hours_total": math.fsum(gh.values()),
        }
        if vw.failed:
            entry["wasted_how"] = wasted_how
            entry["origin"] = vw.origin
        first_progress = next((p for p in vw.progress if p >= 0), None)
        if first_progress is not None:
            entry["first_progress"] = first_progress
        out_attempts.append(entry)

    wall = max(0.0, (views[-1].end_ns - views[0].start_ns) / 1e9)
    total_hours = math.fsum(hours.values())
    lost_hours = math.fsum(hours[c] for c in BADPUT)
    cost = gpu_hour_cost
    cost_from = "argument" if cost is not None else None
    if cost is None:
        cost = next((vw.cost for vw in views if vw.cost is not None), None)
        cost_from = "run_start config gpu_hour_cost" if cost is not None else None
    out: dict[str, Any] = {
        "root": root,
        "attempts": out_attempts,
        "failed_attempts": sum(1 for a in out_attempts if a["failed"]),
        "world_size": max(vw.world_size for vw in views),
        "wall_s": wall,
        "seconds": totals,
        "gpu_hours": hours,
        "gpu_hours_total": total_hours,
        "lost_gpu_hours": lost_hours,
        "share_pct": {c: (100.0 * hours[c] / total_hours if total_hours > 0 else 0.0) for c in CAUSES},
        "goodput_ratio": totals["productive"] / wall if wall > 0 else None,
        "ideal_step": ideal,
        "gpu_hour_cost": cost,
        "cost": None,
    }
    if cost is not None and cost > 0:
        out["cost"] = {"per_gpu_hour": cost, "from": cost_from, "total": cost * total_hours,
                       "lost": cost * lost_hours, "by_cause": {c: cost * hours[c] for c in CAUSES}}
    return out


def load_job(root: PathArg, *, skip_bad: bool = False,
             progress: bool = False) -> list[tuple[int, str, StepTable, StepExtras]]:
    """Read every attempt of the job at ``root`` (:func:`job_attempts`)."""
    return [(a.number, os.fspath(a.path), *read_attempt(a.path, skip_bad=skip_bad, progress=progress))
            for a in job_attempts(root)]


def job_goodput(root: PathArg, gpu_hour_cost: Optional[float] = None, *, skip_bad: bool = False,
                progress: bool = False) -> dict[str, Any]:
    """The goodput of the job at ``root`` (a job root, a run folder or a log file) across
    its attempts, as a JSON-ready dict:

    - ``seconds``, ``gpu_hours`` (seconds x world size / 3600) and ``share_pct`` per cause
      (:data:`CAUSES`), in total; they add up to ``wall_s`` (and ``gpu_hours_total``);
      ``lost_gpu_hours`` all but productive; ``goodput_ratio`` productive / wall;
    - ``attempts``: each attempt's ``seconds`` and ``gpu_hours`` (``recovery`` is the gap
      after it), ``wall_s``, ``failed``, ``end_reasons`` per rank, ``view_rank``,
      ``wasted_steps`` and ``wasted_how``, and for a failed attempt ``origin`` (the rank
      where the disruption began and why, or None where the records do not show it);
    - ``ideal_step``: the ideal step time (:func:`ideal_step_time`) and how it was found;
    - ``gpu_hour_cost`` (the argument, else run_start's ``config.gpu_hour_cost`` when
      > 0) and ``cost`` (``total``, ``lost``, ``by_cause``) when there is one.

    Raises LogFormatError for a path without logs, or logs that cannot be read.
    """
    if gpu_hour_cost is not None and not (_is_num(gpu_hour_cost) and gpu_hour_cost >= 0):
        raise ValueError(f"gpu_hour_cost must be a number >= 0, got {gpu_hour_cost!r}")
    return account(load_job(root, skip_bad=skip_bad, progress=progress), root=os.fspath(root),
                   gpu_hour_cost=gpu_hour_cost)


# --------------------------------------------------------------------------- text


def hours_text(h: float) -> str:
    """GPU-hours with the digits that matter: ``212.0``, ``3.41``, ``0.000123``."""
    if h >= 100:
        return f"{h:.1f}"
    if h >= 1:
        return f"{h:.2f}"
    return "0" if h == 0 else f"{h:.3g}"


def money_text(v: float) -> str:
    """An amount of money: two decimals, more digits below one unit (``0.00123``)."""
    return f"{v:.2f}" if v == 0 or abs(v) >= 0.995 else f"{v:.3g}"


def _seconds(s: float) -> str:
    return f"{s:.1f}" if abs(s) >= 100 else f"{s:.3f}"


def cause_rows(job: dict[str, Any]) -> list[list[str]]:
    """The table per cause (header first): seconds, GPU-hours, share of the GPU-hours
    (and the cost, when there is a price)."""
    cost = job.get("cost")
    head = ["cause", "seconds", "GPU-hours", "share"] + (["cost"] if cost else [])
    rows = [head]
    for c in CAUSES:
        row = [LABELS[c], _seconds(job["seconds"][c]), hours_text(job["gpu_hours"][c]), f"{job['share_pct'][c]:.1f}%"]
        rows.append(row + ([money_text(cost["by_cause"][c])] if cost else []))
    total = ["total", _seconds(job["wall_s"]), hours_text(job["gpu_hours_total"]), "100.0%"]
    rows.append(total + ([money_text(cost["total"])] if cost else []))
    return rows


def attempt_rows(job: dict[str, Any]) -> list[list[str]]:
    """The table per attempt (header first)."""
    rows = [["attempt", "ranks", "ended", "wall s", "productive s", "wasted s", "recovery s", "GPU-hours", "origin"]]
    for a in job["attempts"]:
        reasons = sorted(set(a["end_reasons"].values()))
        ended = "normal" if not a["failed"] else "failed (" + ", ".join(reasons) + ")"
        origin = a.get("origin")
        rows.append([str(a["attempt"]), str(a["world_size"]), ended, _seconds(a["wall_s"]),
                     _seconds(a["seconds"]["productive"]), _seconds(a["seconds"]["wasted_progress"]),
                     _seconds(a["seconds"]["recovery"]), hours_text(a["gpu_hours_total"]),
                     f"rank {origin['rank']}: {origin['why']}" if origin else ("-" if not a["failed"] else "not shown")])
    return rows


def sentence(job: dict[str, Any]) -> str:
    """One sentence: the GPU-hours lost (and their price), by share of the loss."""
    lost = job["lost_gpu_hours"]
    head = f"this job lost {hours_text(lost)} GPU-hours"
    cost = job.get("cost")
    if cost:
        head += f" (= {money_text(cost['lost'])} at {money_text(cost['per_gpu_hour'])} per GPU-hour)"
    if lost <= 0:
        return head + f" of {hours_text(job['gpu_hours_total'])}"
    parts = [("restarts (wasted progress + recovery)", sum(job["gpu_hours"][c] for c in RESTART_CAUSES))]
    parts += [(LABELS[c], job["gpu_hours"][c]) for c in BADPUT if c not in RESTART_CAUSES]
    shares = sorted(((100.0 * h / lost, name) for name, h in parts if h > 0), reverse=True)
    listed = [f"{pct:.0f}% {name}" for pct, name in shares if pct >= 0.5]
    return head + (": " + ", ".join(listed) if listed else "")


def header_lines(job: dict[str, Any]) -> list[str]:
    """The lines above the tables: the sentence, the goodput, the ideal step time."""
    ideal = job.get("ideal_step")
    ratio = job.get("goodput_ratio")
    ranks = job["world_size"]
    lines = [sentence(job),
             f"goodput (productive share of the wall clock): {100 * ratio:.1f}% of {_seconds(job['wall_s'])} s"
             + (f" x {ranks} ranks" if ranks > 1 else "") if ratio is not None else "goodput: -"]
    lines.append(f"ideal step time {ideal['ms']:.3f} ms: the mean of {ideal['steps']} of {ideal['of_steps']} steps at "
                 f"or below median {ideal['median_ms']:.3f} + 3 x MAD {ideal['mad_ms']:.3f} ms" if ideal else
                 "ideal step time: - (no steps after the first of an attempt)")
    return lines


def format_job(job: dict[str, Any]) -> str:
    """The waste report as plain text: the sentence, the table per cause, per attempt."""
    from steptrace.analysis.summary import _table

    lines = header_lines(job) + [""]
    lines += _table(cause_rows(job))
    lines.append("")
    lines += _table(attempt_rows(job), left=(0, 2, 8))
    return "\n".join(lines)


__all__ = ["CAUSES", "BADPUT", "Attempt", "StepExtras", "job_attempts", "job_goodput", "ideal_step_time",
           "account", "load_job", "read_attempt", "cause_rows", "attempt_rows", "sentence", "format_job"]
