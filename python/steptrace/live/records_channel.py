"""The records a profiler writes, followed in the same process as Python values.

The background threads that follow a run (the cross-rank exchange, the OTLP export) take
the records from the core's record channel (``core.records(kinds)``, a
``steptrace._core.RecordChannel``): each record arrives as a dict decoded in C++, of the
kinds asked for only (filtered in C++ before decoding), without reading the log file back
and without parsing JSON text in Python. The channel keeps at most 65,536 records for a
taker that falls behind (the oldest are lost first); the writer thread never waits for it.

    channel = follow_records(core, kinds=("step",))
    for rec in channel.take():      # the records written since the previous take()
        rec["step"], rec["phases_ms"]

A stand-in core without a channel (tests that write a log by hand, a finished run) is
followed through its log file instead (:class:`LogTail`).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional


def follow_records(core: Any, kinds: Optional[Iterable[str]] = None) -> Any:
    """A channel of the records ``core`` writes from now on (run_start first, where its kind
    is taken): an object whose ``take()`` returns the records written since the previous
    call, as dicts, in the log's order; ``kinds`` (e.g. ``("step",)``): only those."""
    wanted = list(kinds) if kinds is not None else None
    records = getattr(core, "records", None)
    return records(wanted) if records is not None else LogTail(core.log_path, wanted)


class LogTail:
    """The records a log file gained since the last call, as dicts (a finished run's log, or
    a stand-in core's): the whole lines only, an incomplete last line waits for the next
    read; lines that are not a JSON object are skipped."""

    def __init__(self, path: str, kinds: Optional[Iterable[str]] = None, *, offset: int = 0,
                 max_read: int = -1) -> None:
        # offset: where the first read starts (the file's size: only lines written from now);
        # max_read: at most this many bytes per call (-1: all the file gained)
        self.path = path
        self.kinds = frozenset(kinds) if kinds is not None else None
        self._offset = offset
        self._max_read = max_read
        self._partial = b""

    def new_lines(self) -> list[bytes]:
        """The whole lines (bytes, no newline) the file gained since the previous call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(self._max_read)
        except OSError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the next read
        return lines

    def take(self) -> list[dict]:
        out = []
        for line in self.new_lines():
            try:
                rec = json.loads(line)  # a log file on disk, as steptrace.analysis.reader reads one
            except ValueError:
                continue
            if isinstance(rec, dict) and (self.kinds is None or rec.get("kind") in self.kinds):
                out.append(rec)
        return out
