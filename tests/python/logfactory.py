"""Build steptrace/1 records and log files by hand for the reader, summary and CLI tests.

Every builder returns a record that validates against schema/steptrace-1.schema.json
(test_reader.py proves it); keyword overrides replace or add fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

T0_NS = 1_700_000_000_000_000_000
DEFAULT_PHASES_MS = {"forward": 3.0, "loss": 0.5, "backward": 5.0, "clip": 0.25, "optimizer": 1.25}


def run_start(rank: int = 0, world_size: int = 1, run_id: str = "test-run", **over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "kind": "run_start",
        "schema": "steptrace/1",
        "run_id": run_id,
        "rank": rank,
        "world_size": world_size,
        "host": "testhost",
        "pid": 4242,
        "start_unix_ns": T0_NS,
        "versions": {"steptrace": "0.1.0", "python": "3.11.0", "torch": None, "cuda": None, "cupti": None},
        "device": None,
        "config": {"log_dir": "runs/test"},
        "backends": {
            "timer": {"active": ["host"], "unavailable": {"cuda": "no GPU"}},
            "memory": {"active": ["rss"], "unavailable": {"torch": "torch not imported"}},
        },
    }
    rec.update(over)
    return rec


def step(
    index: int,
    rank: int = 0,
    phases: Optional[Mapping[str, float]] = None,
    data_ms: float = 1.0,
    step_ms: Optional[float] = None,
    status: str = "ok",
    memory: Optional[Mapping[str, int]] = None,
    period_ms: float = 20.0,
    **over: Any,
) -> dict[str, Any]:
    """A step record; step_ms defaults to the sum of the phases, start time to
    ``T0_NS + index * period_ms``."""
    ph = dict(DEFAULT_PHASES_MS if phases is None else phases)
    total = sum(ph.values()) if step_ms is None else step_ms
    rec: dict[str, Any] = {
        "kind": "step",
        "rank": rank,
        "step": index,
        "start_unix_ns": T0_NS + int(index * period_ms * 1e6),
        "clock": "host",
        "status": status,
        "step_ms": total,
        "data_ms": data_ms,
        "host_ms": total,
        "phases_ms": ph,
        "memory": dict({"rss_bytes": 100 * 2**20} if memory is None else memory),
    }
    rec.update(over)
    return rec


def alert(type_: str, at_step: int, rank: int = 0, **over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "kind": "alert",
        "rank": rank,
        "type": type_,
        "step": at_step,
        "value": 30.0,
        "baseline": 10.0,
        "threshold": 1.5,
        "phase": "forward",
        "message": f"{type_} at step {at_step}: forward grew from 10 ms to 30 ms",
    }
    rec.update(over)
    return rec


def run_end(steps: int, rank: int = 0, reason: str = "normal", error_steps: int = 0, **over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "kind": "run_end",
        "rank": rank,
        "reason": reason,
        "end_unix_ns": T0_NS + 10**9,
        "steps": steps,
        "error_steps": error_steps,
        "wall_s": 1.0,
        "summary": {
            "step_ms_mean": 10.0,
            "step_ms_max": 10.0,
            "data_ms_total": float(steps),
            "phases_ms_total": {k: v * steps for k, v in DEFAULT_PHASES_MS.items()},
        },
    }
    rec.update(over)
    return rec


def run_records(n_steps: int = 5, rank: int = 0, world_size: int = 1, end: bool = True) -> list[dict[str, Any]]:
    """A whole valid run: run_start, n_steps default steps, run_end (unless end=False)."""
    recs = [run_start(rank=rank, world_size=world_size)]
    recs += [step(i, rank=rank) for i in range(n_steps)]
    if end:
        recs.append(run_end(n_steps, rank=rank))
    return recs


def lines(records: Iterable[Any]) -> list[str]:
    """The JSON text of each record (one line each, no newline)."""
    return [json.dumps(r) for r in records]


def write_log(path: Path, records: Iterable[Any], tail: str = "") -> Path:
    """Write records as JSON Lines (each ending in a newline), then ``tail`` verbatim
    (e.g. a truncated last line without its newline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(line + "\n" for line in lines(records)) + tail
    path.write_text(text, encoding="utf-8")
    return path
