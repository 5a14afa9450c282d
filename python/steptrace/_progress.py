"""A one-line progress bar on stderr for long reads, drawn only on a terminal.

``Progress(total_bytes, label)`` draws nothing until the read has taken
:data:`DELAY_S` seconds (so small logs print nothing at all), then redraws at most ten
times a second, and erases itself when closed. When stderr is not a TTY (a pipe, a file,
CI) it never writes anything. ``STEPTRACE_PROGRESS_DELAY_S`` overrides the delay (the
tests set it to 0 to see the bar on small files).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

#: Seconds a read must take before the bar appears.
DELAY_S = 0.5
#: Seconds between redraws.
INTERVAL_S = 0.1
_WIDTH = 28

_active: Optional["Progress"] = None


def _delay() -> float:
    try:
        return max(0.0, float(os.environ.get("STEPTRACE_PROGRESS_DELAY_S", DELAY_S)))
    except ValueError:
        return DELAY_S


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}" if n >= 10 * 2**20 else f"{n / 2**20:.1f}"


class Progress:
    """Progress of reading ``total`` bytes, shown as ``label [#####-----] 45% 130/290 MiB 2.1 s``."""

    def __init__(self, total: int, label: str = "reading", stream: Optional[TextIO] = None,
                 force: bool = False) -> None:
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        try:
            tty = self.stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        self.enabled = bool(force or tty)
        self.start = time.monotonic()
        self.delay = _delay()
        self.next_draw = self.start + self.delay
        self.drawn = False
        self.done = 0

    def update(self, done: int) -> None:
        """``done`` bytes of ``total`` have been read (cheap when nothing is drawn)."""
        self.done = done
        if not self.enabled:
            return
        now = time.monotonic()
        if now < self.next_draw:
            return
        self.next_draw = now + INTERVAL_S
        self._draw(now)

    def _draw(self, now: float) -> None:
        global _active
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        fill = int(round(frac * _WIDTH))
        bar = "#" * fill + "-" * (_WIDTH - fill)
        text = (f"{self.label} [{bar}] {frac * 100:3.0f}%  {_mib(self.done)}/{_mib(self.total)} MiB"
                f"  {now - self.start:.1f} s")
        try:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False
            return
        self.drawn = True
        _active = self

    def clear(self) -> None:
        """Erase the bar (before a warning is printed, or at the end)."""
        global _active
        if self.drawn:
            try:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self.drawn = False
            # the next update redraws it
            self.next_draw = 0.0
        if _active is self:
            _active = None

    def close(self) -> None:
        self.clear()
        self.enabled = False


def clear_active() -> None:
    """Erase whatever bar is on screen (the CLI calls this before printing a warning)."""
    if _active is not None:
        _active.clear()


__all__ = ["Progress", "clear_active", "DELAY_S"]
