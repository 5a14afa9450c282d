"""Live: the exchange through torch.distributed's store. Every rank publishes its window
summaries and heartbeats from a background thread; the aggregating rank reads them and
writes the ``cluster`` records and the alerts into its own log."""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
import time
from typing import Any, Callable, Mapping, Optional

from steptrace.live import flight_recorder
from steptrace.cluster.rules import ClusterAnalyzer
from steptrace.cluster.stats import _median, window_summary
from steptrace.cluster.values import BadValue, parse_busy, parse_heartbeat, parse_summary
from steptrace.live.records_channel import LogTail, follow_records  # noqa: F401 - LogTail: re-exported

logger = logging.getLogger("steptrace")


def _default_store() -> Any:
    import torch.distributed as dist  # the caller checked that torch.distributed is initialized

    from torch.distributed import distributed_c10d

    if not dist.is_available() or not dist.is_initialized():
        return None
    return distributed_c10d._get_default_store()


_PROBES = 64  # most existence checks of not-yet-seen ranks per poll
#: What the thread looks at between polls (s): whether this rank began or ended an evaluation
#: or checkpoint (then it publishes at once), and, while it waits in a collective, which other
#: ranks are in one.
_TICK_S = 0.25
#: Intervals the ranks waiting for this one are told about: planned work, not a hang.
_WAITED_FOR = ("eval", "checkpoint")


def peer_notice_s(poll_s: float) -> float:
    """How long after a rank's evaluation or checkpoint begins the other ranks know of it, at
    most: its next tick publishes it (a tick), the aggregator's next poll gathers it (a
    poll), the waiting rank's next tick reads it (a tick); with a margin of another poll
    and 0.5 s for a late thread."""
    return 2 * poll_s + 2 * min(_TICK_S, poll_s) + 0.5


class ClusterExchange:
    """Publishes this rank's window summaries and heartbeats through a c10d Store and, on
    the aggregating rank, writes the cross-rank view into this rank's log. One daemon
    thread; a step never waits for it (it follows the records the pipeline wrote, in process, and
    a few atomics of the core)."""

    def __init__(self, core: Any, options: Mapping[str, Any], *, store: Any = None,
                 get_store: Callable[[], Any] = _default_store,
                 clock: Callable[[], float] = time.time) -> None:
        self._core = core
        self.options = dict(options)
        config = core.config
        self.rank = int(config.rank)
        self.world = int(config.world_size)
        self.host = socket.gethostname()
        self._prefix = f"steptrace/{config.run_id}/"
        self._store = store
        self._get_store = get_store
        self._clock = clock
        self._interval = int(self.options["cluster_interval"])
        self._aggregator = self.rank == int(self.options["cluster_rank"])
        self._analyzer = ClusterAnalyzer(self.options, rank=self.rank)
        self._stop = threading.Event()
        self._log = follow_records(core, kinds=("step",))  # this rank's steps, as dicts
        self._window_steps: list[dict] = []
        self._window_index: Optional[int] = None
        self._published_window = -1
        self._step_seen = -1
        self._activity_seen: tuple = ()
        self._progress_t = clock()
        # a rank stalled this long sends its flight recorder state (rank_silent fires later)
        self._fr_after = max(2 * float(self.options["cluster_poll_s"]), float(self.options["cluster_silent_s"]) / 2)
        self._step_ms: list[float] = []
        # aggregator state
        self._seen: set[int] = set()
        self._w_seen: set[int] = set()  # ranks whose window summary key exists
        self._hb: dict[int, dict] = {}
        self._hb_raw: dict[int, bytes] = {}
        self._hosts: dict[int, str] = {}
        self._busy_key = self._prefix + "busy"  # ranks in an evaluation or checkpoint (JSON list)
        self._busy_published: Optional[list[int]] = None
        self._busy_seen = False  # the key exists (the aggregator wrote it once)
        self._peers_busy = 0
        self._interval_seen = ""
        self._notice_s = peer_notice_s(float(self.options["cluster_poll_s"]))
        self._windows_done = -1
        # each rank's last two window summaries read, by window: a record compares one window
        self._summaries: dict[int, dict[int, dict]] = {}
        self._probe = 0
        self.errors = 0
        #: (rank, "heartbeat" / "window summary" / ...) -> why this rank could not use that
        #: rank's last such value: left out of the view until it publishes one it can use.
        self.unreadable: dict[tuple[int, str], str] = {}
        self._warned: set[int] = set()  # one warning per rank, not one per poll
        self._thread = threading.Thread(target=self._run, name="steptrace-cluster", daemon=True)

    def start(self) -> "ClusterExchange":
        self._core.set_peers_in_interval(0, self._notice_s)  # the hang rule's grace from now on
        self._thread.start()
        return self

    def stop(self, final_step: Optional[int] = None) -> None:
        """Stops the thread; the aggregator writes what its last poll found and resolves
        its open episodes."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 3 * float(self.options["cluster_poll_s"])))
        if self._aggregator and self._store is not None:
            step = final_step if final_step is not None else max(self._step_seen, 0)
            self._write_all(self._analyzer.finish(step))

    # ---- the thread ----
    def _run(self) -> None:
        poll = float(self.options["cluster_poll_s"])
        tick = min(_TICK_S, poll)
        due = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= due or self._interval_changed():
                    due = now + poll
                    self.poll_once()
                else:
                    self.tick_once()
            except Exception as exc:  # never into training: say it once, keep going
                self.errors += 1
                if self.errors == 1:
                    logger.warning("steptrace: cross-rank exchange failed (%s: %s); will retry",
                                   type(exc).__name__, exc)
            self._stop.wait(tick)
        try:
            self.poll_once()  # what the last steps published
        except Exception:
            self.errors += 1

    def poll_once(self) -> None:
        if self._store is None:
            self._store = self._get_store()
            if self._store is None:
                return  # torch.distributed not initialized yet
        self._read_own_log()
        self._publish_heartbeat()
        if self._aggregator:
            self._aggregate()
        self._read_busy()

    def tick_once(self) -> None:
        """Between polls: while this rank waits in a collective, whether the ranks it waits
        for are in an evaluation or checkpoint (the hang rule does not count that time)."""
        if self._store is not None:
            self._read_busy()

    def _interval_changed(self) -> bool:
        return self._interval_now() != self._interval_seen

    def _interval_now(self) -> str:
        kind = self._core.current_interval
        return kind if kind in _WAITED_FOR else ""

    # ---- this rank ----
    def _read_own_log(self) -> None:
        for rec in self._log.take():
            self._add_step(rec)

    def _add_step(self, rec: dict) -> None:
        step = int(rec["step"])
        self._step_seen = max(self._step_seen, step)
        self._step_ms.append(float(rec.get("host_ms", rec.get("step_ms", 0.0))))
        del self._step_ms[:-200]
        index = step // self._interval
        if self._window_index is not None and index != self._window_index:
            self._publish_window()
        self._window_index = index
        self._window_steps.append(rec)
        if step % self._interval == self._interval - 1:
            self._publish_window()

    def _publish_window(self) -> None:
        steps, index = self._window_steps, self._window_index
        self._window_steps = []
        if index is None or index <= self._published_window or len(steps) < max(1, self._interval // 2):
            return
        summary = window_summary(self.rank, index, steps, self.host)
        if summary is None:
            return
        self._store.set(self._prefix + f"w{self.rank}", json.dumps(summary, separators=(",", ":")))
        self._published_window = index

    def _publish_heartbeat(self) -> None:
        core = self._core
        in_step = bool(core.in_step)
        begun = int(core.step_index)
        phase = core.current_phase if in_step else ""
        in_collective = int(core.collectives_in_flight > 0)
        now = self._clock()
        # Progress is any change of step, phase or collective state since the last poll, not
        # only a step boundary: a rank whose all-reduce just completed (now in its optimizer)
        # is not stuck, even while the peer it waited for is still in that collective.
        interval = self._interval_seen = self._interval_now()
        activity = (begun, in_step, phase, in_collective, interval)
        if activity != self._activity_seen:
            self._activity_seen, self._progress_t = activity, now
        # Short keys: the aggregator reads every rank's heartbeat at each poll.
        hb = {"t": round(now, 3), "p": round(self._progress_t, 3), "s": max(begun - 1, 0),
              "ph": phase, "c": in_collective, "i": interval,
              "w": self._published_window,
              "m": round(statistics.median(self._step_ms) / 1000.0, 4) if self._step_ms else 0.0}
        if now - self._progress_t >= self._fr_after:
            # no progress for a while: this rank's flight recorder state, for the aggregator
            # to name where the ranks part (a full dump only when its status changed)
            hb["fr"] = flight_recorder.heartbeat_state()
        self._store.set(self._prefix + f"h{self.rank}", json.dumps(hb, separators=(",", ":")))

    # ---- the aggregating rank ----
    def _fetch(self, kind: str, ranks: list[int]) -> dict[int, bytes]:
        keys = [self._prefix + f"{kind}{r}" for r in ranks]
        if not keys:
            return {}
        values = self._store.multi_get(keys)
        return dict(zip(ranks, values))

    def _aggregate(self) -> None:
        store = self._store
        if len(self._seen) < self.world:  # keys are never deleted: seen once, readable from now on
            unseen = [r for r in range(self.world) if r not in self._seen]
            if store.check([self._prefix + f"h{r}" for r in unseen]):
                self._seen.update(unseen)  # one round trip once every rank runs
            else:  # some have not started yet: at most _PROBES round trips per poll, in turn
                start = self._probe % len(unseen)
                for r in (unseen[start:] + unseen[:start])[:_PROBES]:
                    if store.check([self._prefix + f"h{r}"]):
                        self._seen.add(r)
                self._probe += _PROBES
        raw = self._fetch("h", sorted(self._seen))
        now = self._clock()
        # unchanged: the rank published nothing since the last poll. Each value is parsed
        # alone (another rank's bytes never decide where this one's fields go) and checked.
        for r, value in raw.items():
            if self._hb_raw.get(r) == value:
                continue
            self._hb_raw[r] = value
            try:
                hb = parse_heartbeat(value)
            except BadValue as exc:
                self._hb.pop(r, None)  # no verdict from a value it cannot read (not "silent")
                self._unreadable(r, "heartbeat", exc)
                continue
            self.unreadable.pop((r, "heartbeat"), None)
            # On this rank's clock (hosts' clocks differ): seen now, progress as old as the
            # publisher says (a difference of its own clock's readings).
            age = max(0.0, hb["t"] - hb["p"])
            self._hb[r] = {"t": now, "progress_t": now - age, "step": hb["s"],
                           "phase": hb["ph"], "in_collective": hb["c"], "interval": hb["i"],
                           "window": hb["w"], "median_step_s": hb["m"],
                           "host": self._hosts.get(r, ""), "fr": hb["fr"]}
        median_step_s = _median(hb.get("median_step_s", 0.0) for hb in self._hb.values()) or 0.0
        self._publish_busy(now, median_step_s)
        unix_ns = time.time_ns()
        self._write_all(self._analyzer.silence(self._hb, now, median_step_s, self._seen, unix_ns))
        published = {r: int(hb.get("window", -1)) for r, hb in self._hb.items()}
        if len(published) < 2:
            return
        self._read_summaries(published)
        # A rank more than one window behind the newest (stopped, or hung: rank_silent says
        # so) does not hold the view back; the record's ranks_reporting shows it is missing.
        # The newest is at most one window past this rank's own (known here, not read from
        # the store): one rank's corrupt window number cannot move the view past every
        # other rank's windows for the rest of the run.
        newest = max((w for w in published.values() if w <= self._published_window + 1), default=-1)
        if newest < 0:
            return
        target = min(w for w in published.values() if w >= newest - 1)
        if target <= self._windows_done:
            return
        # The same window of every rank: a rank already one window further compares its
        # previous summary. (Each rank's latest, as before, set one rank's window beside the
        # other's previous one whenever they published in different polls: a "straggler"
        # in every other window of a 2-rank job in lockstep.) A rank that skipped the window
        # (too few steps in it) or published two since the last poll sits this record out.
        summaries = {r: kept[target] for r, kept in self._summaries.items()
                     if target in kept and published.get(r, -1) >= target}
        if not summaries:
            return
        record, alerts = self._analyzer.window(summaries, world_size=self.world, unix_ns=unix_ns)
        self._windows_done = target
        self._write_all([record, *alerts])

    def _read_summaries(self, published: dict[int, int]) -> None:
        """Reads the window summary of each rank that published a newer one than the last
        read (one multi_get; each value parsed and checked alone), keeping the last two of
        each rank."""
        newer = [r for r, w in published.items() if w > max(self._summaries.get(r, {-1: None}))]
        # Only keys that exist: get() waits for a missing key up to the store's timeout, and
        # a heartbeat's window number is the publisher's word (a corrupt one named a window
        # never published). Keys are never deleted: each checked until seen once.
        unseen = [r for r in newer if r not in self._w_seen]
        if unseen:
            if self._store.check([self._prefix + f"w{r}" for r in unseen]):
                self._w_seen.update(unseen)
            else:
                for r in unseen[:_PROBES]:
                    if self._store.check([self._prefix + f"w{r}"]):
                        self._w_seen.add(r)
            newer = [r for r in newer if r in self._w_seen]
        if not newer:
            return
        for r, value in self._fetch("w", newer).items():
            try:
                summary = parse_summary(value, r)
            except BadValue as exc:
                self._summaries.pop(r, None)  # sits the windows out until it publishes one
                self._unreadable(r, "window summary", exc)
                continue
            self.unreadable.pop((r, "window summary"), None)
            self._hosts[r] = summary["host"]
            kept = self._summaries.setdefault(r, {})
            window = int(summary["window"])
            kept[window] = summary
            for old in [w for w in kept if w < window - 1]:
                del kept[old]

    def _publish_busy(self, now: float, median_step_s: float) -> None:
        """The ranks in an evaluation or checkpoint, for the ranks that wait for them; a rank
        whose heartbeats stopped is not (rank_silent's limit)."""
        stale = self._analyzer.publishing_limit(median_step_s)
        busy = sorted(r for r, hb in self._hb.items() if hb.get("interval") and now - hb["t"] <= stale)
        if busy != self._busy_published:
            self._store.set(self._busy_key, json.dumps(busy))
            self._busy_published = busy

    def _read_busy(self) -> None:
        """Tells the core how many other ranks are in an evaluation or checkpoint: read while
        this rank waits in a collective (the only time the hang rule asks), and once more to
        clear it."""
        if not self._core.collectives_in_flight and not self._peers_busy:
            return
        if self._aggregator:
            busy = self._busy_published or []
        else:
            if not self._busy_seen:  # get() would wait for a key not yet written
                self._busy_seen = bool(self._store.check([self._busy_key]))
                if not self._busy_seen:
                    return
            try:
                busy = parse_busy(self._store.get(self._busy_key))
            except BadValue as exc:
                self._unreadable(int(self.options["cluster_rank"]), "list of busy ranks", exc)
                busy = []
        peers = sum(1 for r in busy if r != self.rank)
        if peers != self._peers_busy:
            self._peers_busy = peers
            self._core.set_peers_in_interval(peers, self._notice_s)

    def _unreadable(self, rank: int, what: str, exc: BadValue) -> None:
        """Leaves out a rank's value it cannot use; says so once per rank (a rank that keeps
        publishing one would otherwise fill the log at every poll)."""
        self.unreadable[(rank, what)] = str(exc)
        if rank not in self._warned:
            self._warned.add(rank)
            logger.warning("steptrace: rank %d published a %s this rank cannot use (%s; another steptrace "
                           "version, or a corrupt value); that rank is left out of the cross-rank view until "
                           "it publishes one it can use, the other ranks' verdicts go on", rank, what, exc)

    def _write_all(self, records: list[dict]) -> None:
        for rec in records:
            try:
                self._core.write_record(rec)  # as a value: no JSON text
            except Exception as exc:
                self.errors += 1
                logger.debug("steptrace: cluster record not written: %s", exc)
