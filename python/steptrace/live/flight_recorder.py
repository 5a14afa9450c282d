"""PyTorch's flight recorder, read for hang alerts: each rank's last enqueued, started and
completed collective, and, across ranks, the collective where the ranks part.

The flight recorder is torch.distributed's own ring buffer of the collectives a process
launched, on (since torch 2.5) where ``TORCH_FR_BUFFER_SIZE`` (its older name
``TORCH_NCCL_TRACE_BUFFER_SIZE`` still works) is a positive number of entries, set before the first
process group is made. ``steptrace run`` sets it (2000, the value PyTorch recommends)
where the user did not. It is read with ``torch._C._distributed_c10d._dump_fr_trace_json``
(``_dump_nccl_trace_json`` in older releases), whose format PyTorch documents in its
tutorial "Flight Recorder for Debugging Stuck Jobs"
(https://docs.pytorch.org/tutorials/unstable/flight_recorder_tutorial.html, "Flight
Recorder File Formats"): ``pg_status`` gives, per process group, the sequence numbers of
the last enqueued, started and completed collective (-1: not tracked, e.g. started
without ``TORCH_NCCL_ENABLE_TIMING``); ``entries`` the ring's collectives with
``collective_seq_id``, ``profiling_name`` ("nccl:all_reduce"), ``input_sizes``,
``output_sizes``, ``state`` and ``retired``; ``pg_config`` each group's name, description
and ranks. torch 2.9.1 records gloo's collectives too (checked: its JSON dump lists them,
with ``pg_status`` in strings), so the tests use real gloo ranks.

Nothing here runs per step: the hang alert asks for a snapshot once (the alert thread
answers the watchdog), and the cross-rank heartbeat carries a compact one only while its
rank has made no progress for a while (a full dump of 2,000 entries costs about 65 ms of
CPU here: it is taken again only when the groups' status changed).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping, Optional

from steptrace.live._torch_compat import FLIGHT_RECORDER_DUMPS, flight_recorder_dump

#: The environment variables that turn the recorder on (torch 2.9 reads the second, the
#: older name, with a deprecation warning).
ENV_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: What ``steptrace run`` sets (PyTorch's tutorial recommends 2000 entries).
DEFAULT_BUFFER_SIZE = 2000
_DUMPS = FLIGHT_RECORDER_DUMPS


def buffer_size(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """The recorder's buffer size as the environment sets it; None where neither variable
    is set (or is not a number)."""
    for name in ENV_VARS:
        text = environ.get(name)
        if text is not None and text.strip():
            try:
                return int(text)
            except ValueError:
                return None
    return None


def enable(environ: Any = os.environ) -> bool:
    """Turns the recorder on for the processes started from here (``steptrace run``) unless
    the user set either variable (0 included: their choice). True where it set it."""
    if any(name in environ for name in ENV_VARS):
        return False
    environ[ENV_VARS[0]] = str(DEFAULT_BUFFER_SIZE)
    return True


def _dump_function() -> Any:
    return flight_recorder_dump()


def _process_group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:  # noqa: BLE001
        return False


def snapshot(dump: Any = None, environ: Mapping[str, str] = os.environ) -> Optional[dict]:
    """This process's flight recorder state for a hang alert, or None where the process has
    no process group (nothing to say). ``recorder`` is "on" (``groups`` filled), "off"
    (the buffer size is 0 or unset), "unavailable" (this torch has no dump function, or it
    failed) or "empty" (on, no collective recorded yet); ``why`` says what is missing and
    ``summary`` is one line for the alert's message. ``dump`` (bytes, str or dict) stands
    in for the recorder in tests."""
    if dump is None:
        if not _process_group_exists():
            return None
        size = buffer_size(environ)
        if size is None or size <= 0:
            return _off(f"{ENV_VARS[0]} is {'not set' if size is None else size}: the flight recorder is off "
                        f"(steptrace run turns it on; else export {ENV_VARS[0]}={DEFAULT_BUFFER_SIZE} before "
                        f"the process group is made)")
        fn = _dump_function()
        if fn is None:
            return {"recorder": "unavailable", "why": f"this torch has none of {', '.join(_DUMPS)}",
                    "summary": "flight recorder unavailable in this torch"}
        try:
            dump = fn()
        except Exception as exc:  # noqa: BLE001 - a dump that fails is said, not raised
            return {"recorder": "unavailable", "why": f"{fn.__name__} failed: {type(exc).__name__}: {exc}",
                    "summary": "flight recorder dump failed"}
    try:
        parsed = json.loads(dump) if isinstance(dump, (bytes, bytearray, str)) else dump
    except ValueError as exc:
        return {"recorder": "unavailable", "why": f"the dump is not JSON: {exc}",
                "summary": "flight recorder dump unreadable"}
    groups = summarize(parsed)
    if not groups:
        return {"recorder": "empty", "why": "the recorder is on but holds no collective yet "
                                            "(or this backend records none)",
                "version": parsed.get("version"), "groups": [], "summary": "flight recorder: no collective recorded"}
    return {"recorder": "on", "version": parsed.get("version"), "groups": groups, "summary": describe(groups)}


def _off(why: str) -> dict:
    return {"recorder": "off", "why": why, "summary": "flight recorder off"}


def _seq(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _entry(e: Mapping[str, Any]) -> dict:
    return {"seq": _seq(e.get("collective_seq_id")), "op": e.get("profiling_name"),
            "input_sizes": e.get("input_sizes"), "output_sizes": e.get("output_sizes"),
            "dtypes": e.get("input_dtypes"), "state": e.get("state")}


def summarize(dump: Mapping[str, Any]) -> list[dict]:
    """Per process group: its last enqueued, started and completed collective (the entry
    where the ring still holds it, else only its sequence number; None where the group
    tracks none, as ``started`` without timing). Point-to-point entries are left out
    (their sequence numbers are their own)."""
    entries = [e for e in dump.get("entries") or () if not e.get("is_p2p")]
    by_group: dict[str, dict[int, Mapping[str, Any]]] = {}
    desc: dict[str, str] = {}
    for e in entries:
        pg = e.get("process_group") or [str(e.get("pg_id", "")), ""]
        name = str(pg[0])
        by_group.setdefault(name, {})[_seq(e.get("collective_seq_id"))] = e
        if len(pg) > 1 and pg[1]:
            desc[name] = str(pg[1])
    config = dump.get("pg_config") or {}
    groups = []
    for name, status in sorted((dump.get("pg_status") or {}).items(), key=lambda kv: str(kv[0])):
        name = str(name)
        recorded = by_group.get(name, {})
        cfg = config.get(name) or (next(iter(config.values())) if len(config) == 1 else {})  # gloo: keyed ""
        group: dict[str, Any] = {"group": name, "desc": desc.get(name) or cfg.get("desc") or "",
                                 "ranks": cfg.get("ranks")}
        for key, field in (("last_enqueued", "last_enqueued_collective"),
                           ("last_started", "last_started_collective"),
                           ("last_completed", "last_completed_collective")):
            seq = _seq(status.get(field))
            group[key] = None if seq < 0 else _entry(recorded[seq]) if seq in recorded else {"seq": seq}
        enq = group["last_enqueued"]["seq"] if group["last_enqueued"] else 0
        done = group["last_completed"]["seq"] if group["last_completed"] else 0
        # the oldest collective not completed: where this rank waits, if anywhere
        group["pending"] = (_entry(recorded[done + 1]) if done + 1 in recorded else {"seq": done + 1}) \
            if enq > done else None
        if enq <= 0 and not recorded:
            continue  # a group that never ran a collective
        groups.append(group)
    return groups


def _show(entry: Optional[Mapping[str, Any]]) -> str:
    if not entry:
        return "none"
    text = f"#{entry['seq']}"
    if entry.get("op"):
        text += f" {entry['op']}"
    if entry.get("input_sizes") is not None:
        text += f" {json.dumps(entry['input_sizes'], separators=(',', ':'))}"
    return text


def _group_name(g: Mapping[str, Any]) -> str:
    return f"group {g['group']}" + (f" ({g['desc']})" if g.get("desc") else "")


def describe(groups: list[dict]) -> str:
    """One line: per group (the first two with collectives), the last completed collective
    and the one outstanding."""
    parts = []
    for g in groups[:2]:
        text = f"{_group_name(g)}: last completed {_show(g['last_completed'])}"
        if g.get("pending"):
            enq = g["last_enqueued"]["seq"]
            text += f"; {_show(g['pending'])} not completed"
            if enq > g["pending"]["seq"]:
                text += f" (enqueued up to #{enq})"
        else:
            text += ", none outstanding"
        parts.append(text)
    more = f"; {len(groups) - 2} more group(s)" if len(groups) > 2 else ""
    return "flight recorder: " + "; ".join(parts) + more


def compact(snap: Optional[Mapping[str, Any]]) -> Any:
    """A snapshot small enough for a heartbeat: per group [enqueued seq, completed seq,
    pending entry or None, last enqueued entry's op]; a string where the recorder is not
    on (what is missing)."""
    if snap is None:
        return None
    if snap.get("recorder") != "on":
        return f"{snap.get('recorder')}: {snap.get('why', '')}"
    out = {}
    for g in snap["groups"]:
        enq, done = g["last_enqueued"], g["last_completed"]
        pending = g.get("pending")
        out[g["group"]] = [enq["seq"] if enq else 0, done["seq"] if done else 0,
                           [pending.get("op"), pending.get("input_sizes")] if pending else None,
                           enq.get("op") if enq else None]
    return out


_heartbeat_cache: dict = {}  # the last full dump's compact state, by the pg_status it had


def heartbeat_state(environ: Mapping[str, str] = os.environ) -> Any:
    """``compact(snapshot())`` for a stalled rank's heartbeat, once a poll: the group
    status alone (``includeCollectives=False``: about 10 us) each time, the full dump
    (about 65 ms of CPU for 2,000 entries on this 2-core VM) only when that status changed
    since the last one, which in a stall is once."""
    fn = _dump_function()
    size = buffer_size(environ)
    if fn is None or size is None or size <= 0 or not _process_group_exists():
        return compact(snapshot(environ=environ))
    try:
        status = json.loads(fn(includeCollectives=False)).get("pg_status")
    except Exception:  # noqa: BLE001 - said by the full snapshot
        return compact(snapshot(environ=environ))
    key = json.dumps(status, sort_keys=True)
    if _heartbeat_cache.get("key") != key:
        _heartbeat_cache.update(key=key, state=compact(snapshot(environ=environ)))
    return _heartbeat_cache["state"]


def parting(per_rank: Mapping[int, Any]) -> Optional[dict]:
    """Where the ranks part, from their compact snapshots (``{rank: compact(...)}``): the
    first process group in which the ranks' last enqueued collectives differ, the ranks
    behind (they have not called the collective the others wait in) and that collective; or
    the same collective with different operations or sizes (a mismatch); or every rank in
    the same collective, none done. None where nothing parts (or fewer than two ranks sent
    a recorder state). ``message`` says it in one sentence."""
    usable = {r: c for r, c in per_rank.items() if isinstance(c, dict)}
    if len(usable) < 2:
        return None
    names = sorted({g for c in usable.values() for g in c})
    for name in names:
        states = {r: c[name] for r, c in usable.items() if name in c}
        if len(states) < 2:
            continue
        enq = {r: int(s[0]) for r, s in states.items()}
        lo, hi = min(enq.values()), max(enq.values())
        if lo < hi:
            behind = sorted(r for r, e in enq.items() if e == lo)
            ahead = sorted(r for r, e in enq.items() if e > lo)
            op = sizes = None
            for r in ahead:
                s = states[r]
                if int(s[1]) == lo and s[2]:  # its oldest pending collective is #lo+1
                    op, sizes = s[2][0], s[2][1]
                    break
            coll = f"#{lo + 1}" + (f" {op}" if op else "") + (
                f" {json.dumps(sizes, separators=(',', ':'))}" if sizes is not None else "")
            last = states[behind[0]]
            last_text = f"#{lo}" + (f" {last[3]}" if last[3] else "") + (
                ", completed" if int(last[1]) >= lo else ", not completed")
            return {"kind": "behind", "group": name, "seq": lo + 1, "op": op, "input_sizes": sizes,
                    "behind": behind, "waiting": ahead,
                    "message": (f"the ranks part at collective {coll} of group {name}: rank(s) "
                                f"{', '.join(map(str, ahead))} called it, rank(s) {', '.join(map(str, behind))} "
                                f"did not (last: {last_text})")}
        pending = {r: s[2] for r, s in states.items() if s[2]}
        if pending:
            kinds = {json.dumps(p, separators=(",", ":")) for p in pending.values()}
            seq = min(int(s[1]) for s in states.values()) + 1
            if len(kinds) > 1:
                shown = "; ".join(f"rank {r}: {p[0]} {json.dumps(p[1], separators=(',', ':'))}"
                                  for r, p in sorted(pending.items()))
                return {"kind": "mismatch", "group": name, "seq": seq, "ranks": sorted(pending),
                        "message": f"the ranks disagree at collective #{seq} of group {name} ({shown})"}
            if len(pending) == len(states):
                op, sizes = next(iter(pending.values()))
                return {"kind": "stuck", "group": name, "seq": seq, "op": op, "input_sizes": sizes,
                        "ranks": sorted(pending),
                        "message": (f"every rank is in collective #{seq} {op} of group {name} and none "
                                    f"completed it: the collective itself is stuck (network, NCCL, a GPU)")}
    return None


def cross_rank(heartbeats: Mapping[int, Mapping[str, Any]]) -> dict:
    """What the aggregating rank says of the ranks' flight recorders (their heartbeats'
    ``fr``, sent while a rank makes no progress): ``ranks`` (each rank's compact state or
    what is missing) and ``parted`` (:func:`parting`); where no rank's recorder is on,
    ``recorder`` and ``why`` instead."""
    sent = {int(r): hb["fr"] for r, hb in heartbeats.items() if hb.get("fr") is not None}
    if not sent:
        return {"recorder": "not sent", "why": "no rank sent its flight recorder state (ranks send it once "
                                               "they have made no progress for cluster_silent_s / 2)"}
    if not any(isinstance(c, dict) for c in sent.values()):
        return {"recorder": "off", "why": next(iter(sent.values())), "ranks": {str(r): c for r, c in sorted(sent.items())}}
    return {"ranks": {str(r): c for r, c in sorted(sent.items())}, "parted": parting(sent)}
