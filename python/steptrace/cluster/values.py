"""What another rank put in the store, read as untrusted input: each value parsed alone
and type-checked against the fields the aggregator reads, into a new dict that holds only
those fields. A rank that publishes something else (a torn or corrupt value, two objects
in one value, another steptrace version's fields) is that rank's problem alone: the
caller leaves it out and says so once; the other ranks' values are never touched by it.

Each parser raises :class:`BadValue` with a short reason of our own wording (never the
value's text: it goes to a log line and a terminal)."""

from __future__ import annotations

import math
from typing import Any, Optional

from steptrace.cluster.stats import WORK_KEYS
from steptrace.analysis.reader import _loads  # orjson where installed: ~0.5 us a heartbeat

#: Larger than any value a rank publishes (a heartbeat ~200 bytes, a summary ~1 KB, a
#: stalled rank's flight-recorder state a few KB): longer is not parsed at all.
MAX_VALUE_BYTES = 1 << 20
#: Host and phase names longer than this are not names (they go into alert messages).
_MAX_NAME = 1024
_MAX_INT = 1 << 63


class BadValue(ValueError):
    """A rank's store value this version cannot use; ``str()`` says why."""


def _parse(value: Any) -> dict:
    raw = bytes(value)
    if len(raw) > MAX_VALUE_BYTES:
        raise BadValue(f"{len(raw)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        obj = _loads(raw)
    except (ValueError, RecursionError) as exc:  # orjson.JSONDecodeError is a ValueError
        # the decoder's own words name a position, never the text (e.g. "Extra data: line 1 column 9")
        raise BadValue(f"not one JSON object ({str(exc).splitlines()[0][:120]})") from None
    if type(obj) is not dict:
        raise BadValue(f"a JSON {type(obj).__name__}, not an object")
    return obj


def _number(obj: dict, key: str) -> float:
    """A finite number (a bool is not one)."""
    v = obj.get(key)
    if type(v) is float:
        if math.isfinite(v):
            return v
    elif type(v) is int and -_MAX_INT < v < _MAX_INT:
        return float(v)
    raise BadValue(_wrong(obj, key, "a finite number"))


def _optional_number(obj: dict, key: str) -> Optional[float]:
    return None if obj.get(key) is None else _number(obj, key)


def _integer(obj: dict, key: str, lo: int = 0) -> int:
    v = obj.get(key)
    if type(v) is int and lo <= v < _MAX_INT:
        return v
    raise BadValue(_wrong(obj, key, f"an integer >= {lo}"))


def _name(obj: dict, key: str, default: Optional[str] = None) -> str:
    v = obj.get(key, default)
    if type(v) is str and len(v) <= _MAX_NAME:
        return v
    raise BadValue(_wrong(obj, key, f"a string of at most {_MAX_NAME} characters"))


def _wrong(obj: dict, key: str, expected: str) -> str:
    if key not in obj:
        return f"no field {key!r}"
    return f"field {key!r} is a {type(obj[key]).__name__}, not {expected}"


def parse_heartbeat(value: Any) -> dict:
    """A rank's heartbeat (exchange.py ``_publish_heartbeat``: short keys) as the fields
    the aggregator reads: t, p (its clock's readings, s), s (step), ph (phase), c (in a
    collective), i (interval, optional), w (last window published), m (median step, s),
    fr (flight recorder state, optional)."""
    hb = _parse(value)
    c = hb.get("c")
    if type(c) not in (int, bool) or c not in (0, 1):
        raise BadValue(_wrong(hb, "c", "0 or 1"))
    fr = hb.get("fr")
    if fr is not None and not _flight_recorder_ok(fr):
        raise BadValue("field 'fr' is not a flight recorder state")
    return {"t": _number(hb, "t"), "p": _number(hb, "p"), "s": _integer(hb, "s"), "ph": _name(hb, "ph"),
            "c": bool(c), "i": _name(hb, "i", ""), "w": _integer(hb, "w", lo=-1),
            "m": max(0.0, _number(hb, "m")), "fr": fr}


def _flight_recorder_ok(fr: Any) -> bool:
    """flight_recorder.compact()'s shape: a string (why the recorder is off), or per group
    [enqueued seq, completed seq, [op, sizes] or None, op or None] (what parting() reads)."""
    if type(fr) is str:
        return len(fr) <= 4 * _MAX_NAME
    if type(fr) is not dict:
        return False
    for state in fr.values():
        if type(state) is not list or len(state) != 4:
            return False
        enq, done, pending, op = state
        if type(enq) is not int or type(done) is not int or not (op is None or type(op) is str):
            return False
        if pending is not None and (type(pending) is not list or len(pending) != 2
                                    or not (pending[0] is None or type(pending[0]) is str)):
            return False
    return True


#: A window summary's numbers (stats.window_summary), required and optional.
_SUMMARY_NUMBERS = ("step_ms", "step_p95_ms", "data_ms", "compute_ms", "own_ms")
_SUMMARY_OPTIONAL = ("comm_ms", "exposed_ms", "runq_ms", "gc_ms", "busbw_gbps", *WORK_KEYS)


def parse_summary(value: Any, rank: int) -> dict:
    """A rank's window summary (stats.window_summary), the fields the rules read; its
    ``rank`` must be the slot's."""
    s = _parse(value)
    if _integer(s, "rank") != rank:
        raise BadValue(f"a summary for rank {s['rank']} in rank {rank}'s key")
    out: dict[str, Any] = {"rank": rank, "host": _name(s, "host", ""), "window": _integer(s, "window"),
                           "first_step": _integer(s, "first_step"), "last_step": _integer(s, "last_step"),
                           "steps": _integer(s, "steps", lo=1)}
    for key in _SUMMARY_NUMBERS:
        out[key] = _number(s, key)
    for key in _SUMMARY_OPTIONAL:
        if key in s:
            out[key] = _optional_number(s, key)
    method = s.get("method")
    if not (method is None or (type(method) is str and len(method) <= _MAX_NAME)):
        raise BadValue(_wrong(s, "method", "a string or null"))
    out["method"] = method
    phases = s.get("phases_ms")
    if type(phases) is not dict:
        raise BadValue(_wrong(s, "phases_ms", "an object"))
    if any(len(n) > _MAX_NAME for n in phases):
        raise BadValue(f"a phase name of more than {_MAX_NAME} characters")
    out["phases_ms"] = {n: _number(phases, n) for n in phases}
    if "start_unix_ns" in s or "end_unix_ns" in s:
        out["start_unix_ns"], out["end_unix_ns"] = _integer(s, "start_unix_ns"), _integer(s, "end_unix_ns")
    if "memory_bytes" in s:
        out["memory_bytes"] = _integer(s, "memory_bytes")
    hw = s.get("hw")
    if hw is not None:
        if type(hw) is not dict:
            raise BadValue(_wrong(s, "hw", "an object"))
        if any(len(k) > _MAX_NAME for k in hw):
            raise BadValue(f"an hw field name of more than {_MAX_NAME} characters")
        out["hw"] = {k: _optional_number(hw, k) for k in hw}
    return out


def parse_busy(value: Any) -> list[int]:
    """The aggregator's list of the ranks in an evaluation or checkpoint."""
    raw = bytes(value)
    try:
        busy = _loads(raw) if len(raw) <= MAX_VALUE_BYTES else None
    except (ValueError, RecursionError):
        busy = None
    if type(busy) is not list or not all(type(r) is int for r in busy):
        raise BadValue("the list of busy ranks is not a list of integers")
    return busy
