"""Writing an output file (a report, an export) whole or not at all, in a folder others
may write in too: the temporary file is created anew under a random name (O_EXCL, no
link followed), never opened through a name someone planted (``out.html.tmp-<pid>`` ->
a victim's file was truncated and overwritten), then renamed over the target (a rename
replaces a link at the target, never what it points to)."""

from __future__ import annotations

import os
import secrets
from typing import IO, Any, Callable, Optional, TypeVar

T = TypeVar("T")

_TRIES = 16


def _create_temporary(target: str) -> tuple[int, str]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(_TRIES):
        tmp = f"{target}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp  # the umask applies, as for open(target, "w")
        except FileExistsError:
            continue  # a name taken (planted, or a rare collision): another one
    raise FileExistsError(f"could not create a temporary file next to {target} ({_TRIES} names taken)")


def write_atomically(target: str, write: Callable[[IO[Any]], T], *, newline: Optional[str] = None) -> T:
    """Calls ``write`` with a text file (UTF-8) that becomes ``target`` once ``write``
    returns; on any failure nothing is left behind and ``target`` is unchanged."""
    fd, tmp = _create_temporary(target)
    try:
        with open(fd, "w", encoding="utf-8", newline=newline) as fh:
            result = write(fh)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return result


__all__ = ["write_atomically"]
