"""Alert episodes of the cross-rank rules: one tracker serves every rule (the window rules
and ``rank_silent``), so an episode opens, folds repeats and resolves the same way for all.

A (kind, subject rank) pair opens an episode after ``needed`` hits in a row that also
span at least ``min_ns`` of the windows' own time, where their times are known: one ``alert``
record. Later hits fold into it (``repeats``); the first miss closes it with a
``resolved`` record (``first_step`` .. ``step``), and :meth:`EpisodeTracker.close_all`
resolves what is still open at the end of the run. A subject rank below 0 is the whole
job (``comm_heavy``): its records carry no ``subject_rank``.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional


class _Episode:
    __slots__ = ("streak", "streak_start_ns", "fired", "first_step", "repeats")

    def __init__(self) -> None:
        self.streak = 0
        self.streak_start_ns: Optional[int] = None  # when the streak's first window began
        self.fired = False
        self.first_step = 0
        self.repeats = 0


class EpisodeTracker:
    """The open and past episodes of one aggregating rank (``rank``: the rank whose log
    gets the records), and how many alerts each kind raised (:attr:`alert_counts`)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._episodes: dict[tuple[str, int], _Episode] = {}
        self.alert_counts: dict[str, int] = {}

    def __len__(self) -> int:
        """The (kind, rank) pairs that ever hit (state is kept only for those)."""
        return len(self._episodes)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return iter(self._episodes)

    def update(self, kind: str, r: int, hit: bool, step: int, needed: int, unix_ns: Optional[int],
               make: Callable[[], dict], resolved_text: str,
               span: tuple[Optional[int], Optional[int]] = (None, None), min_ns: int = 0) -> list[dict]:
        """One observation of rule ``kind`` for subject rank ``r``: the ``alert`` record
        (body from ``make()``, called only then) when this hit opens an episode, the
        ``resolved`` record when this miss closes one, else nothing. ``span``: when the
        observed window began and ended (ns; None: unknown, then ``needed`` alone counts)."""
        ep = self._episodes.get((kind, r))
        if ep is None:  # state only for (kind, rank) that ever hit: not 3 per rank of the job
            if not hit:
                return []
            ep = self._episodes[(kind, r)] = _Episode()
        if not hit:
            ep.streak = 0
            if ep.fired:
                ep.fired = False
                return [self._resolved(kind, r, step, ep, resolved_text)]
            return []
        ep.streak += 1
        if ep.streak == 1:
            ep.streak_start_ns = span[0]
        if ep.fired:
            ep.repeats += 1
            return []
        if ep.streak < needed:
            return []
        if ep.streak_start_ns is not None and span[1] is not None and span[1] - ep.streak_start_ns < min_ns:
            return []  # not for long enough yet
        ep.fired, ep.first_step, ep.repeats = True, step, 0
        self.alert_counts[kind] = self.alert_counts.get(kind, 0) + 1
        body = make()
        alert = {"kind": "alert", "rank": self.rank, "type": kind, "step": step, **body}
        if r >= 0:
            alert["subject_rank"] = r
        if unix_ns is not None:
            alert["unix_ns"] = unix_ns
        return [alert]

    def close_all(self, step: int, text: str) -> list[dict]:
        """Resolves every episode still open, in (kind, rank) order."""
        out = []
        for (kind, r), ep in sorted(self._episodes.items()):
            if ep.fired:
                out.append(self._resolved(kind, r, step, ep, text))
                ep.fired = False
        return out

    def _resolved(self, kind: str, r: int, step: int, ep: _Episode, text: str) -> dict:
        rec = {"kind": "resolved", "rank": self.rank, "type": kind, "step": step,
               "first_step": ep.first_step, "repeats": ep.repeats, "message": text}
        if r >= 0:
            rec["subject_rank"] = r
        return rec
