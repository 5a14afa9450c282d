"""Export a run as a Chrome trace-event timeline (Perfetto, chrome://tracing) or as CSV.

**Chrome trace** (the JSON Object Format of the Trace Event Format): one process per rank
(``pid`` = rank, named ``rank N (host)`` by ``process_name`` metadata), with the lanes

- tid 1 ``steps``: an ``X`` (complete) event per step, named ``step``, with the step's
  phases nested inside it as ``X`` events named after the phase;
- tid 2 ``data wait``: an ``X`` event ``data`` before each step, as long as its data_ms;
- tid 3 ``host``: the host time of each phase, when the clock was ``cuda``.

Alerts are instant events (``ph: "i"``) on the steps lane; memory (MiB) and hardware
counters are counter events (``ph: "C"``). ``ts`` and ``dur`` are microseconds from the
earliest run_start of the export (``otherData.origin_unix_ns`` gives that instant). The
log stores how long each phase took, not when it started: the phases of a step are laid
end to end from the step's start in the order they were recorded (nested phases are cut
at the step's end), so their lengths are exact and their offsets approximate.

**CSV**: one row per step and rank with the columns of ``steptrace.load(...).steps``;
an empty cell is a value the step does not have.

Both stream: memory stays bounded by the size of one chunk of steps (CSV collects the
columns first, about 100 MB per million steps).
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import IO, Any, Iterable, Optional

from steptrace._files import write_atomically
from steptrace._table import BETWEEN_FIELDS, HOST_FIELDS
from steptrace.analysis.reader import Paths, log_files, read

STEP_TID, DATA_TID, HOST_TID = 1, 2, 3
_LANES = {STEP_TID: "steps", DATA_TID: "data wait", HOST_TID: "host"}
FORMATS = ("chrome", "csv")


class StepRange:
    """A half-open range of step indices ``[start, stop)``; None ends are open."""

    def __init__(self, start: Optional[int] = None, stop: Optional[int] = None) -> None:
        self.start, self.stop = start, stop

    @classmethod
    def parse(cls, text: Optional[str]) -> "StepRange":
        """``"100:200"``, ``"100:"``, ``":50"`` or a single step ``"7"``."""
        if text is None or text == "":
            return cls()
        try:
            if ":" in text:
                a, b = text.split(":", 1)
                return cls(int(a) if a.strip() else None, int(b) if b.strip() else None)
            i = int(text)
            return cls(i, i + 1)
        except ValueError:
            raise ValueError(f"bad step range {text!r}: use START:STOP, START:, :STOP or one step") from None

    def __contains__(self, step: Any) -> bool:
        if not isinstance(step, int):
            return self.start is None and self.stop is None
        return (self.start is None or step >= self.start) and (self.stop is None or step < self.stop)

    @property
    def everything(self) -> bool:
        return self.start is None and self.stop is None


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _us(ms: Any) -> Optional[float]:
    """A duration in ms as finite, non-negative microseconds (None for anything else: a
    corrupt 1e308 ms would write ``inf``, which is not JSON)."""
    v = _num(ms)
    if v is None or v < 0:
        return None
    v *= 1000.0
    return v if math.isfinite(v) else None


def _scalar(v: Any) -> Any:
    """``v`` when it is a JSON scalar, else None (alert arguments of a corrupt log may be
    lists nested a thousand deep, which json.dumps cannot write)."""
    return v if v is None or isinstance(v, (str, int, bool)) or _num(v) is not None else None


def _headers(path: Paths, skip_bad: bool) -> list[dict[str, Any]]:
    """The run_start of each file, read before streaming (one line per file)."""
    out = []
    for f in log_files(path):
        it = read(f, skip_bad=skip_bad)
        try:
            out.append(next(it))
        finally:
            it.close()
    return out


# --------------------------------------------------------------------------- chrome


class _ChromeWriter:
    def __init__(self, fh: IO[str], origin_ns: int) -> None:
        self.fh = fh
        self.origin = origin_ns
        self.first = True
        self.names: dict[str, str] = {}
        self.count = 0

    def q(self, s: str) -> str:
        v = self.names.get(s)
        if v is None:
            v = self.names[s] = json.dumps(s)
        return v

    def raw(self, text: str) -> None:
        self.fh.write(text if self.first else ",\n" + text)
        self.first = False
        self.count += 1

    def meta(self, name: str, pid: int, tid: Optional[int], args: dict[str, Any]) -> None:
        # ts/tid are not needed on metadata, but some older viewers expect them
        ev: dict[str, Any] = {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": 0 if tid is None else tid,
                              "args": args}
        self.raw(json.dumps(ev))

    def us(self, ns: int) -> float:
        return (ns - self.origin) / 1000.0

    def complete(self, name: str, cat: str, ts: float, dur: float, pid: int, tid: int, args: str) -> None:
        self.raw(f'{{"name":{self.q(name)},"cat":"{cat}","ph":"X","ts":{ts:.3f},"dur":{max(dur, 0.0):.3f},'
                 f'"pid":{pid},"tid":{tid},"args":{args}}}')

    def counter(self, name: str, ts: float, pid: int, values: dict[str, float]) -> None:
        args = ",".join(f"{self.q(k)}:{v:.6g}" for k, v in values.items())
        self.raw(f'{{"name":{self.q(name)},"ph":"C","ts":{ts:.3f},"pid":{pid},"args":{{{args}}}}}')

    def instant(self, name: str, ts: float, pid: int, tid: int, args: dict[str, Any]) -> None:
        self.raw(json.dumps({"name": name, "cat": "alert", "ph": "i", "s": "p", "ts": round(ts, 3),
                             "pid": pid, "tid": tid, "args": args}))


def export_chrome(path: Paths, out: IO[str], *, steps: Optional[StepRange] = None, skip_bad: bool = False,
                  progress: bool = False) -> int:
    """Write the Chrome trace of ``path`` to the text stream ``out``; returns the event count."""
    rng = steps or StepRange()
    headers = _headers(path, skip_bad)
    starts = [h["start_unix_ns"] for h in headers if isinstance(h.get("start_unix_ns"), int)]
    origin = min(starts) if starts else 0
    w = _ChromeWriter(out, origin)
    out.write('{"traceEvents":[\n')
    named: set[int] = set()
    lanes_named: set[tuple[int, int]] = set()

    def lane(pid: int, tid: int) -> None:
        if (pid, tid) not in lanes_named:
            lanes_named.add((pid, tid))
            w.meta("thread_name", pid, tid, {"name": _LANES[tid]})
            w.meta("thread_sort_index", pid, tid, {"sort_index": tid})

    file_rank = 0  # the rank of the file being read (its run_start's)

    def process(rec: dict[str, Any]) -> int:
        pid = rec.get("rank", file_rank)
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else file_rank
        if pid not in named:
            named.add(pid)
            host = rec.get("host")
            label = f"rank {pid}" + (f" ({host})" if isinstance(host, str) and host else "")
            w.meta("process_name", pid, None, {"name": label})
            w.meta("process_sort_index", pid, None, {"sort_index": pid})
        return pid

    step_start: dict[tuple[int, int], float] = {}  # (rank, step) -> ts, for the alerts
    last_ts: dict[int, float] = {}
    for rec in read(path, skip_bad=skip_bad, progress=progress):
        kind = rec.get("kind")
        if kind == "step":
            st = rec.get("step")
            st = st if not isinstance(st, bool) else None  # JSON true is no step index
            if st not in rng:
                continue
            t0 = rec.get("start_unix_ns")
            dur = _us(rec.get("step_ms"))
            if not isinstance(t0, int) or dur is None:
                continue
            pid = process(rec)
            lane(pid, STEP_TID)
            ts = w.us(t0)
            status = rec.get("status", "ok")
            status = status if isinstance(status, str) else "?"
            args = f'{{"step":{st if isinstance(st, int) else "null"},"status":{w.q(status)}}}'
            w.complete("step", "step", ts, dur, pid, STEP_TID, args)
            step_args = f'{{"step":{st if isinstance(st, int) else "null"}}}'
            end = ts + dur
            cur = ts
            pm = rec.get("phases_ms")
            if isinstance(pm, dict):
                for name, v in pm.items():
                    d = _us(v)
                    if d is None or cur >= end:
                        continue
                    d_us = min(d, end - cur)
                    w.complete(str(name), "phase", cur, d_us, pid, STEP_TID, step_args)
                    cur += d_us
            data = _us(rec.get("data_ms"))
            if data and math.isfinite(ts - data):
                lane(pid, DATA_TID)
                w.complete("data", "data", ts - data, data, pid, DATA_TID, step_args)
            hp = rec.get("host_phases_ms")
            if isinstance(hp, dict) and hp:
                lane(pid, HOST_TID)
                cur = ts
                for name, v in hp.items():
                    d = _us(v)
                    if d is None or not math.isfinite(cur + d):
                        continue
                    w.complete(str(name), "host", cur, d, pid, HOST_TID, step_args)
                    cur += d
            mem = rec.get("memory")
            if isinstance(mem, dict):
                vals = {k[:-6] + "_MiB": x / 2**20 for k, x in mem.items()
                        if k.endswith("_bytes") and k != "device_total_bytes" and _num(x) is not None}
                if vals:
                    w.counter("memory", ts, pid, vals)
            for group in ("counters", "telemetry"):
                g = rec.get(group)
                if isinstance(g, dict):
                    vals = {k: float(x) for k, x in g.items() if _num(x) is not None}
                    if vals:
                        w.counter(group, ts, pid, vals)
            if isinstance(st, int):
                step_start[(pid, st)] = ts
                if len(step_start) > 100_000:  # bounded: alerts come soon after their step
                    for key in list(step_start)[:50_000]:
                        del step_start[key]
            last_ts[pid] = ts
        elif kind == "run_start":
            r = rec.get("rank")
            file_rank = r if isinstance(r, int) and not isinstance(r, bool) else 0
            process(rec)
        elif kind == "alert":
            st = rec.get("step")
            if not rng.everything and st not in rng:
                continue
            pid = process(rec)
            lane(pid, STEP_TID)
            if isinstance(rec.get("unix_ns"), int):
                ts = w.us(rec["unix_ns"])
            else:
                ts = step_start.get((pid, st), last_ts.get(pid, 0.0)) if isinstance(st, int) else last_ts.get(pid, 0.0)
            args = {k: _scalar(rec.get(k)) for k in ("type", "step", "phase", "value", "baseline", "threshold",
                                                      "message")}
            w.instant(f"alert: {rec.get('type', '?')}", ts, pid, STEP_TID, args)
    other = {"steptrace_export": "chrome", "origin_unix_ns": origin,
             "run_ids": sorted({h.get("run_id") for h in headers if isinstance(h.get("run_id"), str)})}
    out.write('\n],"displayTimeUnit":"ms","otherData":' + json.dumps(other) + "}\n")
    return w.count


# --------------------------------------------------------------------------- csv

_CSV_CHUNK = 65536


def export_csv(path: Paths, out: IO[str], *, steps: Optional[StepRange] = None, skip_bad: bool = False,
               progress: bool = False) -> int:
    """Write one CSV row per step and rank to ``out``; returns the number of rows."""
    from steptrace.analysis.run import is_int_field, load_table

    rng = steps or StepRange()
    run = load_table(path, skip_bad=skip_bad, progress=progress)
    t = run.table
    run_ids = [t.run_id_of(i) or "" for i in range(len(t.run_starts))]
    variable = run.variable_columns()
    header = ["run_id", "rank", "step", "start_unix_ns", "clock", "status", "step_ms", "data_ms", "host_ms",
              "iteration_ms", *BETWEEN_FIELDS, *HOST_FIELDS] + [name for name, _, _ in variable]
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)

    def floats(a: Iterable[float]) -> list[Any]:
        return ["" if v != v else v for v in a]

    def ints(a: Iterable[float]) -> list[Any]:
        return ["" if v != v else int(v) for v in a]

    rows = 0
    for lo in range(0, t.n, _CSV_CHUNK):
        hi = min(lo + _CSV_CHUNK, t.n)
        step_ms = t.step_ms[lo:hi]
        data_ms = t.data_ms[lo:hi]
        between = [t.between[f][lo:hi] for f in BETWEEN_FIELDS]
        other_ms, in_step_ms = between[0], between[3]
        cols: list[list[Any]] = [
            [run_ids[s] if s >= 0 else "" for s in t.src[lo:hi]],
            list(t.rank[lo:hi]),
            list(t.step[lo:hi]),
            ["" if v < 0 else v for v in t.start_ns[lo:hi]],
            [t.clocks[c] for c in t.clock[lo:hi]],
            ["ok" if o else "error" for o in t.ok[lo:hi]],
            floats(step_ms),
            floats(data_ms),
            floats(t.host_ms[lo:hi]),
            # the iteration as steptrace.load() computes it: data + other + step - inside the step
            floats(round((d if d == d else 0.0) + (o if o == o else 0.0) + s - (i if i == i else 0.0), 6)
                   for d, o, s, i in zip(data_ms, other_ms, step_ms, in_step_ms)),
            *(floats(col) for col in between),
            *(floats(t.host[f][lo:hi]) for f in HOST_FIELDS),
        ]
        for _, group, key in variable:
            a = t.column(group, key)[lo:hi]
            cols.append(ints(a) if is_int_field(group, key) else floats(a))
        chunk = list(zip(*cols))
        if not rng.everything:
            chunk = [r for r in chunk if r[2] in rng]
        writer.writerows(chunk)
        rows += len(chunk)
    return rows


def export(path: Paths, fmt: str, output: "str | os.PathLike[str]", **kwargs: Any) -> int:
    """Export ``path`` as ``fmt`` ("chrome" or "csv") to the file ``output`` ("-": stdout).

    Writes to a new temporary file next to ``output`` (a random name, created exclusively:
    a planted name is never opened) and renames it, so a failed export leaves no
    half-written file behind. Returns the number of events / rows written.
    """
    import sys

    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: use {' or '.join(FORMATS)}")
    fn = export_chrome if fmt == "chrome" else export_csv
    if os.fspath(output) == "-":
        return fn(path, sys.stdout, **kwargs)
    return write_atomically(os.fspath(output), lambda fh: fn(path, fh, **kwargs), newline="")


__all__ = ["export", "export_chrome", "export_csv", "StepRange", "FORMATS"]
