"""``steptrace capture``: evidence now, asked for through a file in the run's log folder
(issue 54, point 3; docs/alerts.md, "Evidence"). No network listener, no signal.

The protocol, one pair of files per rank in the folder of ``rank<R>.jsonl``:

- ``capture-request.rank<R>.json`` ``{"id": "<hex>", "steps": N}``, written by the CLI
  atomically (a temporary file, then rename).
- The profiler (``evidence=True``; the alert thread, so ``detect`` on) looks for it at most
  every 200 ms, on the alert thread's existing wake-up (:meth:`RequestWatch.poll`: one
  ``lstat``; nothing on the training thread, no thread of its own). It renames the file
  away, reads at most :data:`MAX_REQUEST_BYTES` of it, deletes it, and calls
  ``prof.evidence.request_capture(steps=N, request_id=id)`` within ``capture_max`` and
  ``capture_min_interval_s``. Its answer, ``capture-answer.rank<R>.json`` ``{"id",
  "accepted", "reason", "step"}``, says whether the capture was armed and why not. A file
  that is not a request (not a regular file, too big, not JSON, a bad id or step count) is
  deleted and answered ``accepted: false``; the first one per run is logged as a warning.
- The evidence comes as usual, an ``alert_update`` of type ``capture`` whose
  ``details.evidence.request`` is the id; the CLI reads the log's new lines for it.

``run_start`` does not record the ``evidence`` option (a Python option), so a run with it
off is known only by its request staying untaken: the CLI says so at its timeout and
removes the request.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
import time
from typing import Any, Callable, Optional, TextIO

from steptrace._files import write_atomically
from steptrace.errors import SteptraceError
from steptrace.live.records_channel import LogTail

logger = logging.getLogger("steptrace")

MAX_REQUEST_BYTES = 4096  # a request is ~40 bytes; anything larger is not read
POLL_S = 0.2
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_RANK_LOG_RE = re.compile(r"^rank([0-9]{1,9})\.jsonl$")
_ATTEMPT_RE = re.compile(r"^attempt([0-9]{1,9})$")

_REASONS = {
    "busy": "a capture is already in progress",
    "capture_max": "capture_max captures after alerts and requests were already taken in this run",
    "capture_min_interval_s": "at most one capture per capture_min_interval_s",
    "off": "evidence capture is off in this run (it failed earlier, or the profiler is closing)",
}


def request_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"capture-request.rank{rank}.json")


def answer_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"capture-answer.rank{rank}.json")


def _write_atomic(path: str, obj: dict) -> None:
    write_atomically(path, lambda f: json.dump(obj, f))  # a fresh random temporary name, renamed


def parse_request(data: bytes) -> tuple[Optional[str], int, str]:
    """(id, steps, why not) of a request file's bytes; ``why not`` is empty when valid."""
    if len(data) > MAX_REQUEST_BYTES:
        return None, 0, f"over {MAX_REQUEST_BYTES} bytes"
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, 0, "not JSON"
    if not isinstance(obj, dict):
        return None, 0, "not a JSON object"
    rid, steps = obj.get("id"), obj.get("steps")
    if not isinstance(rid, str) or not _ID_RE.match(rid):
        return None, 0, "no valid id (1..64 of A-Z a-z 0-9 _ -)"
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        return rid, 0, f"steps={steps!r} is out of range; allowed: 1..100"
    return rid, steps, ""


# --------------------------------------------------------------------------- the profiler's side


class RequestWatch:
    """Polled by the alert thread (``_deliver_alerts``) on each wake-up; looks at the
    request file at most every :data:`POLL_S`. Never raises: a failure is logged once."""

    def __init__(self, evidence: Any, core: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._evidence = evidence
        self._core = core
        self._log_dir = os.path.dirname(core.log_path)
        self._rank = int(core.config.rank)
        self._path = request_path(self._log_dir, self._rank)
        self._clock = clock
        self._last = -float("inf")
        self._warned = False

    def poll(self) -> None:
        now = self._clock()
        if now - self._last < POLL_S:
            return
        self._last = now
        try:
            st = os.lstat(self._path)
        except OSError:
            return  # no request (the usual case)
        try:
            self._take(st)
        except Exception as exc:  # noqa: BLE001 - a file in the log folder never stops the alert thread
            self._warn(f"{type(exc).__name__}: {exc}")

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("steptrace: ignored a capture request in %s: %s (further ones are ignored "
                           "without a warning; see docs/alerts.md#evidence)", self._path, why)

    def _take(self, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            os.unlink(self._path)  # a link, a FIFO, a folder...: removed, never opened
            return self._refuse(None, "not a regular file")
        taken = f"{self._path}.taken"
        os.replace(self._path, taken)  # a request written from now on is the next one
        try:
            fd = os.open(taken, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
                data = f.read(MAX_REQUEST_BYTES + 1) if regular else b""
        finally:
            os.unlink(taken)
        if not regular:
            return self._refuse(None, "not a regular file")
        rid, steps, why = parse_request(data)
        if why:
            return self._refuse(rid, why)
        ok = self._evidence.request_capture("request", steps=steps, request_id=rid)
        why = self._evidence.last_skipped
        self._answer(rid, ok, "" if ok else f"{why}: {_REASONS.get(why, why)}")

    def _refuse(self, rid: Optional[str], why: str) -> None:
        self._warn(why)
        self._answer(rid, False, f"unreadable request: {why}")

    def _answer(self, rid: Optional[str], accepted: bool, reason: str) -> None:
        step = int(self._core.step_index) if accepted else None
        _write_atomic(answer_path(self._log_dir, self._rank),
                      {"id": rid, "accepted": accepted, "reason": reason, "step": step})


# --------------------------------------------------------------------------- the CLI's side


class CaptureError(SteptraceError):
    """A bad target or option (exit 2): nothing was written."""


def _rank_logs(folder: str) -> dict[int, str]:
    out = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        m = _RANK_LOG_RE.match(name)
        if m and os.path.isfile(os.path.join(folder, name)):
            out[int(m.group(1))] = os.path.join(folder, name)
    return out


def _log_dir_of_pid(pid: int) -> tuple[str, list[int]]:
    fd_dir = f"/proc/{pid}/fd"
    if not os.path.isdir("/proc/self/fd"):
        raise CaptureError(f"{pid}: finding a process's log needs Linux's /proc; pass the run's log folder")
    if not os.path.exists(f"/proc/{pid}"):
        raise CaptureError(f"{pid}: no such process (nor a folder of that name); pass a run folder or a live PID")
    try:
        fds = os.listdir(fd_dir)
    except PermissionError:
        raise CaptureError(f"{pid}: cannot read {fd_dir} (another user's process?); pass the run's log folder")
    found: dict[str, list[int]] = {}
    for fd in fds:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        m = _RANK_LOG_RE.match(os.path.basename(target))
        if m and os.path.isabs(target):
            found.setdefault(os.path.dirname(target), []).append(int(m.group(1)))
    if not found:
        raise CaptureError(f"{pid}: the process has no steptrace log (rank<N>.jsonl) open; is it a steptrace "
                           "run? Pass the run's log folder")
    if len(found) > 1:
        raise CaptureError(f"{pid}: the process writes logs in several folders ({', '.join(sorted(found))}); "
                           "pass one of them")
    folder, ranks = next(iter(found.items()))
    return folder, sorted(set(ranks))


def resolve_target(target: str) -> tuple[str, list[int]]:
    """(log folder, ranks) of a run folder or a PID. A folder with ``attempt<k>/``
    sub-folders (a restarted job, docs/goodput.md) means its latest attempt."""
    if not os.path.isdir(target):
        if target.isdigit():
            return _log_dir_of_pid(int(target))
        raise CaptureError(f"{target}: no such folder; allowed: a run's log folder (holding rank<N>.jsonl) "
                           "or the PID of a running steptrace process")
    folder, best = target, (-1 if not _rank_logs(target) else 0)
    for name in os.listdir(target):
        m = _ATTEMPT_RE.match(name)
        sub = os.path.join(target, name)
        if m and int(m.group(1)) > best and _rank_logs(sub):
            folder, best = sub, int(m.group(1))
    ranks = sorted(_rank_logs(folder))
    if not ranks:
        raise CaptureError(f"{target}: not a steptrace run (no rank<N>.jsonl in it)")
    return folder, ranks


def _first_record(path: str) -> dict:
    with open(path, "rb") as f:
        line = f.readline(1 << 20)
    try:
        rec = json.loads(line)
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or rec.get("kind") != "run_start":
        raise CaptureError(f"{path}: not a steptrace log (its first line is not a run_start record)")
    return rec


def _last_kind(path: str) -> Optional[str]:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line
        return rec.get("kind") if isinstance(rec, dict) else None
    return None


def check_live(log_dir: str, rank: int) -> str:
    """The rank's log path, after checking its run can take a request."""
    path = os.path.join(log_dir, f"rank{rank}.jsonl")
    start = _first_record(path)
    if start.get("config", {}).get("detect") is False:
        raise CaptureError(f"{path}: the run has detect=False, and requests are read by the alert thread, "
                           "which runs only with detect on (and the run needs evidence=True)")
    if _last_kind(path) == "run_end":
        raise CaptureError(f"{path}: the run has ended (run_end is its last record); nothing can take a request")
    return path


def _find_evidence(lines: list[bytes], rid: str) -> Optional[dict]:
    for line in lines:
        if rid.encode() not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        ev = rec.get("details", {}).get("evidence") if isinstance(rec, dict) else None
        if rec.get("kind") == "alert_update" and isinstance(ev, dict) and ev.get("request") == rid:
            return rec
    return None


def _read_answer(path: str, rid: str) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read(MAX_REQUEST_BYTES))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) and obj.get("id") == rid else None


def capture(target: str, steps: int, rank: Optional[int], timeout_s: float, out: TextIO,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """``steptrace capture``: 0 when every asked rank's evidence came, 1 when refused or
    timed out; raises CaptureError (nothing written) for a bad target or option."""
    if not 1 <= steps <= 100:
        raise CaptureError(f"--steps {steps} is out of range; allowed: 1..100")
    if not timeout_s > 0:
        raise CaptureError(f"--timeout {timeout_s:g} must be > 0 (seconds)")
    log_dir, ranks = resolve_target(target)
    if rank is not None:
        if rank not in ranks:
            raise CaptureError(f"--rank {rank}: no rank{rank}.jsonl in {log_dir} (ranks there: "
                               f"{', '.join(map(str, ranks))})")
        ranks = [rank]
    logs = {r: check_live(log_dir, r) for r in ranks}
    rid = secrets.token_hex(8)
    # the lines written from now on, at most 16 MiB a poll
    tails = {r: LogTail(logs[r], offset=os.path.getsize(logs[r]), max_read=16 << 20) for r in ranks}
    for r in ranks:
        _write_atomic(request_path(log_dir, r), {"id": rid, "steps": steps})
    print(f"requested {steps} step{'s' if steps != 1 else ''} of evidence from rank{'s' if len(ranks) > 1 else ''} "
          f"{', '.join(map(str, ranks))} in {log_dir} (request {rid}); waiting up to {timeout_s:g} s", file=out,
          flush=True)
    waiting, failed, answered = set(ranks), False, set()
    start = next_note = clock()
    while waiting:
        for r in sorted(waiting):
            if r not in answered:
                ans = _read_answer(answer_path(log_dir, r), rid)
                if ans is not None:
                    answered.add(r)
                    if not ans.get("accepted"):
                        print(f"rank {r}: refused: {ans.get('reason')}", file=out, flush=True)
                        waiting.discard(r)
                        failed = True
                        continue
                    print(f"rank {r}: capture armed before step {ans.get('step')}", file=out, flush=True)
            rec = _find_evidence(tails[r].new_lines(), rid)
            if rec is not None:
                ev = rec["details"]["evidence"]
                trace = os.path.join(log_dir, ev["trace"]) if ev.get("trace") else \
                    f"none ({ev.get('trace_dropped', 'not written')})"
                first, last = ev.get("steps", [None, None])
                print(f"rank {r}: evidence of steps {first}-{last}\n  verdict: {ev.get('verdict')}\n"
                      f"  trace: {trace}", file=out, flush=True)
                waiting.discard(r)
        if not waiting:
            break
        now = clock()
        if now - start >= timeout_s:
            for r in sorted(waiting):
                if r in answered:
                    why = "the capture was armed but no evidence came: the loop may not have run the steps yet"
                else:
                    try:
                        os.unlink(request_path(log_dir, r))  # not taken: no capture later, by surprise
                    except OSError:
                        pass
                    why = ("the request was not taken (removed now): the run needs evidence=True and detect on "
                           "(run_start does not record evidence), or its process is stopped")
                print(f"rank {r}: no evidence within {timeout_s:g} s: {why}", file=out, flush=True)
            return 1
        if now >= next_note + 10:
            next_note = now
            print(f"waiting for rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, sorted(waiting)))} "
                  f"({now - start:.0f} s)", file=out, flush=True)
        sleep(POLL_S)
    return 1 if failed else 0
