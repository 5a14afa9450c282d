"""Log text on a terminal: a log is input that anyone who can write in its folder (or
make a rank publish a phase name, an alert message, a host name) controls, and the CLI
prints it. Control characters in it would drive the terminal (ESC sequences: cursor
moves, a cleared screen, retitled windows, OSC 8 links, text hidden from the user), and a
lone surrogate cannot be encoded at all (a traceback instead of the output)."""

from __future__ import annotations

import re

# C0 controls (but tab and newline, which the caller may keep), DEL, C1 controls (0x9b is a
# CSI on terminals that take 8-bit controls), the Unicode bidirectional overrides and
# isolates (text shown in another order than it reads), line and paragraph separators,
# and lone surrogates.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")
_UNSAFE_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                              "\ud800-\udfff]")


def _escaped(m: "re.Match[str]") -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, one_line: bool = False) -> str:
    """``text`` with every character that could drive a terminal shown as an escape
    (``\\x1b``, ``\\u202e``): visible, inert. Tabs and newlines are kept unless
    ``one_line`` (a table cell, a name)."""
    pattern = _UNSAFE_ONE_LINE if one_line else _UNSAFE
    return pattern.sub(_escaped, text) if pattern.search(text) else text


__all__ = ["printable"]
