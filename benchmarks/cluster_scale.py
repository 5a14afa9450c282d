"""Cost of the live cross-rank view (steptrace.cluster.ClusterExchange) as the number of
ranks grows, through one real torch.distributed TCPStore on this machine (issue 13, point 4).

    ~/.cache/steptrace/venv/bin/python benchmarks/cluster_scale.py            # about 2-3 minutes on 2 cores
    ~/.cache/steptrace/venv/bin/python benchmarks/cluster_scale.py --quick    # a smoke run (about 20 s)
    ~/.cache/steptrace/venv/bin/python benchmarks/cluster_scale.py --ranks 2,64,1024 --json out.json
    ~/.cache/steptrace/venv/bin/python benchmarks/cluster_scale.py --cluster-py python/steptrace/cluster

``--cluster-py PATH`` measures that copy of the ``steptrace/cluster/`` package (pure Python)
instead of the installed one: the working tree's, or a candidate fix, without reinstalling
the compiled package. The run says which package it measured and whether the installed
copy matches the working tree's.

It is a benchmark, not a test: it never asserts and exits 0; whatever it measures is
reported as it is.

**The setup.** One ``torch.distributed.TCPStore`` server (``is_master=True``, a free port)
runs in this process, as the store torchrun's agent hosts. N simulated ranks (2, 8, 64,
256, 1,024) each get a real ``ClusterExchange`` with its own run of the code a rank's
background thread runs (``poll_once``: read its own log, publish the window summary when
a window completes, publish the heartbeat), and rank 0 (the aggregating rank) runs
``_aggregate`` (heartbeat reads at every poll, reading and comparing all windows). Their
``core`` is a stand-in with what ClusterExchange reads from the C++ core (``config.rank /
world_size / run_id``, ``log_path``, ``in_step``, ``step_index``, ``current_phase``,
``collectives_in_flight``, ``write_record``). Each simulated rank has a real log file
into which the benchmark appends step records shaped like the C++ writer's (kind step,
step, step_ms, data_ms, host_ms, phases_ms {forward, loss, backward, optimizer}, memory,
comm {method host, comm_ms, exposed_ms, compute_ms, collectives, exposed_in}); the ranks
are in lockstep as under DDP, and rank N-1 computes 30% slower than the others (so the
windows carry a straggler and its alert, as a real bad run would).

No threads poll: the benchmark drives the polls itself, one simulated poll
(``cluster_poll_s``, 1 s) at a time, on a simulated clock, ``--steps-per-poll`` (10) new
steps per poll: a 100 ms step, the default ``cluster_interval`` of 50 steps, so a window
is 5 polls. The publishers share ``--clients`` (8) TCPStore client connections, round
robin; rank 0 has its own. (Opening a TCPStore client while many others stay open took
about 160 ms each here, so 1,024 connections would take minutes to set up; the server's
per-request work is the same either way.)

**What it measures**, per N:

* publish, per rank: the wall and CPU time (``time.thread_time``) of a rank's
  ``poll_once`` at the poll that completes its window (read + parse 10 log lines, the
  window summary of 50 steps, ``store.set`` of the summary and of the heartbeat), and at
  the other polls (heartbeat only); and the latency of the ``store.set`` calls alone;
* aggregation, rank 0: wall and CPU time of ``_aggregate`` at a heartbeat-only poll and
  at the poll that compares a window, and at the two start-up polls (no rank started
  yet: one ``check`` per rank; the first poll that finds them);
* bytes: key + value bytes of every ``set`` / ``check`` / ``multi_get`` (the TCPStore
  framing adds a few length bytes per key), per window; and the size of the ``cluster``
  record (with its alerts) rank 0 writes into its own log per window;
* CPU share of rank 0: (CPU of a window poll + CPU of the other polls of the window) /
  the window's duration, for 50-step windows of 100 ms and of 500 ms steps (5 and 25 polls
  per window), in % of one core, against the < 1% budget: the aggregation alone, and rank
  0's total (the aggregation, its own publishing, and the real C++ core's ``write_record``
  of the window's ``cluster`` record, which parses and re-dumps it: the stand-in core
  skips that, so it is timed apart on a real ``steptrace.Profiler`` core); the same for a
  publishing rank (its polls all parse 10 new steps, so the 500 ms figure is an upper bound);
* the store server's CPU per window (the process's CPU time minus this thread's:
  informational, that server is torchrun's, not steptrace's);
* memory: the aggregator alone at the largest N over ``--memory-windows`` more windows
  (publishers replaced by ``multi_set`` of their last values, window index bumped), with
  ``tracemalloc`` (traced bytes after each window) and RSS, and the sizes of its state.

CPU times are ``time.thread_time()`` of the one thread that runs everything, so the
store server's thread and other processes on this shared machine do not count; wall
times are ``time.perf_counter`` and include being preempted. Before each of rank 0's polls
the objects alive so far are frozen out of the cyclic GC (``gc.freeze``): the other 1,023
simulated ranks' state lives in this process, a real rank 0 does not hold it, and a full
collection during rank 0's poll would scan it (about 0.2 s at 1,024 ranks). The run counts
the full collections that still happen during rank 0's polls.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import logging
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import steptrace
from steptrace import cluster as cluster_mod
from steptrace.cluster import CLUSTER_OPTIONS, ClusterExchange

logging.getLogger("steptrace").setLevel(logging.ERROR)

pc = time.perf_counter
tt = time.thread_time
REPO = Path(__file__).resolve().parent.parent
BUDGET_PCT = 1.0
STRAGGLER_FACTOR = 1.3


GC_STATS = {"gen2": 0}


def _count_gc(phase: str, info: Dict[str, Any]) -> None:
    if phase == "stop" and info.get("generation") == 2:
        GC_STATS["gen2"] += 1


gc.callbacks.append(_count_gc)


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# the store, counted
# --------------------------------------------------------------------------------------


class Tally:
    """Bytes, calls and latencies of the store operations, by operation and key kind."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = {}
        self.calls: Dict[str, int] = {}
        self.lat: Dict[str, List[float]] = {}

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.bytes[op] = self.bytes.get(op, 0) + nbytes
        self.calls[op] = self.calls.get(op, 0) + 1
        self.lat.setdefault(op, []).append(seconds)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.lat.clear()

    def total(self, prefix: str = "") -> int:
        return sum(v for k, v in self.bytes.items() if k.startswith(prefix))


def _kind(key: str) -> str:
    return key.rsplit("/", 1)[-1][:1]  # "w" (window summary) or "h" (heartbeat)


def _len(v: Any) -> int:
    return len(v.encode() if isinstance(v, str) else v)


class CountingStore:
    """The c10d Store calls ClusterExchange makes, passed to a real TCPStore client and
    counted: key + value bytes, and the wall time of each call."""

    def __init__(self, store: Any, tally: Tally) -> None:
        self._s = store
        self._t = tally

    def set(self, key: str, value: Any) -> None:
        t0 = pc()
        self._s.set(key, value)
        self._t.add("set_" + _kind(key), len(key) + _len(value), pc() - t0)

    def check(self, keys: List[str]) -> bool:
        t0 = pc()
        found = self._s.check(keys)
        self._t.add("check", sum(len(k) for k in keys) + 1, pc() - t0)
        return found

    def multi_get(self, keys: List[str]) -> List[bytes]:
        t0 = pc()
        values = self._s.multi_get(keys)
        nbytes = sum(len(k) for k in keys) + sum(len(v) for v in values)
        self._t.add("multi_get_" + (_kind(keys[0]) if keys else "?"), nbytes, pc() - t0)
        return values


# --------------------------------------------------------------------------------------
# the simulated ranks
# --------------------------------------------------------------------------------------


class SimClock:
    """The simulated wall clock every exchange reads (one poll = cluster_poll_s)."""

    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now


class SimCore:
    """What ClusterExchange reads from the C++ core (steptrace._core.Profiler)."""

    def __init__(self, rank: int, world: int, run_id: str, log_path: str) -> None:
        self.config = SimpleNamespace(rank=rank, world_size=world, run_id=run_id)
        self.log_path = log_path
        self.in_step = True
        self.step_index = 0
        self.current_phase = "forward"
        self.collectives_in_flight = 0
        self.records: Dict[str, int] = {}
        self.record_bytes: Dict[str, int] = {}
        self.last: Dict[str, str] = {}  # the last record of each kind (bounded)

    def write_record(self, text: str) -> None:
        kind = text[9:text.index('"', 9)] if text.startswith('{"kind":"') else "?"
        self.records[kind] = self.records.get(kind, 0) + 1
        self.record_bytes[kind] = self.record_bytes.get(kind, 0) + len(text) + 1
        self.last[kind] = text


class RankModel:
    """A rank's step times: lockstep with the others (DDP), its own compute, the rest waiting."""

    def __init__(self, rank: int, world: int, rng: random.Random) -> None:
        self.rank = rank
        self.factor = STRAGGLER_FACTOR if rank == world - 1 and world >= 2 else 1.0
        self.rng = rng

    def compute(self) -> Dict[str, float]:
        j = self.rng.uniform
        f = self.factor
        return {"forward": 30.0 * f * j(0.97, 1.03), "loss": 2.0 * j(0.95, 1.05),
                "backward": 40.0 * f * j(0.97, 1.03), "optimizer": 8.0 * f * j(0.97, 1.03),
                "data": 0.6 * j(0.8, 1.2)}


def step_line(rank: int, step: int, own: Dict[str, float], step_ms: float, comm_ms: float) -> str:
    """One step record as the C++ writer formats it (keys in its order)."""
    compute_ms = own["forward"] + own["loss"] + own["backward"] + own["optimizer"]
    exposed = max(0.0, step_ms - own["data"] - compute_ms)  # blocked in backward's all-reduce
    backward = own["backward"] + exposed
    host_ms = step_ms
    return (f'{{"kind":"step","rank":{rank},"step":{step},"start_unix_ns":{1_796_000_000_000_000_000 + step * 100_000_000},'
            f'"clock":"host","status":"ok","step_ms":{step_ms:.4f},"data_ms":{own["data"]:.4f},'
            f'"host_ms":{host_ms:.4f},"phases_ms":{{"forward":{own["forward"]:.4f},"loss":{own["loss"]:.4f},'
            f'"backward":{backward:.4f},"optimizer":{own["optimizer"]:.4f}}},'
            f'"memory":{{"rss_bytes":{3_221_225_472 + rank * 4096},"heap_bytes":{1_073_741_824 + step * 64}}},'
            f'"comm":{{"method":"host","comm_ms":{comm_ms:.4f},"exposed_ms":{exposed:.4f},'
            f'"compute_ms":{host_ms - exposed:.4f},"collectives":4,"exposed_in":"backward"}}}}\n')


def pct(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def med(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------------------
# one size
# --------------------------------------------------------------------------------------


def write_record_cpu(real_core: Any, text: str, repeats: int = 5) -> float:
    """CPU seconds (this thread) of the real C++ core's write_record of one record: it
    parses the JSON, sets the rank and dumps it again before the writer thread writes it."""
    times = []
    for _ in range(repeats):
        c0 = tt()
        real_core.write_record(text)
        times.append(tt() - c0)
    return med(times)


def run_size(n: int, args: argparse.Namespace, port: int, clients: List[Any], workdir: Path,
             memory: bool, real_core: Any) -> Dict[str, Any]:
    interval = int(CLUSTER_OPTIONS["cluster_interval"])
    poll_s = float(CLUSTER_OPTIONS["cluster_poll_s"])
    spp = args.steps_per_poll
    polls_per_window = interval // spp
    windows = args.windows if n <= 256 else args.windows_large
    run_id = f"scale-{n}-{os.getpid()}"
    options = dict(CLUSTER_OPTIONS)
    clock = SimClock()
    rng = random.Random(n)
    pub_tally, agg_tally = Tally(), Tally()
    agg_client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    cores, exchanges, models, files = [], [], [], []
    rdir = workdir / f"n{n}"
    rdir.mkdir()
    for r in range(n):
        path = rdir / f"rank{r}.jsonl"
        path.write_text("")
        core = SimCore(r, n, run_id, str(path))
        store = CountingStore(agg_client if r == 0 else clients[r % len(clients)],
                              agg_tally if r == 0 else pub_tally)
        cores.append(core)
        exchanges.append(ClusterExchange(core, options, store=store, clock=clock))
        models.append(RankModel(r, n, rng))
        files.append(path)
    agg, agg_core = exchanges[0], cores[0]
    agg_store = agg._store

    # start-up: rank 0 polls before any rank has started (one check per rank), then the
    # first poll that finds them all
    t0, c0 = pc(), tt()
    agg._aggregate()
    startup_empty = (pc() - t0, tt() - c0, agg_tally.calls.get("check", 0))

    step = 0
    pub_window: List[tuple] = []  # (wall, cpu) of a rank's poll that published its window
    pub_hb: List[tuple] = []
    agg_window: List[tuple] = []
    agg_hb: List[tuple] = []
    agg_total_cpu = 0.0  # rank 0's CPU over the measured polls (aggregation + own publishing)
    lag_polls: List[int] = []  # polls from a window's last step to the poll that compared it
    gen2_collections = 0  # full collections of the cyclic GC during rank 0's measured polls
    agg_own: List[tuple] = []  # rank 0's own publishing (its poll without _aggregate)
    startup_found = None
    server_cpu: List[float] = []
    bytes_window: List[int] = []
    pub_set_lat: Dict[str, List[float]] = {"w": [], "h": []}
    rss_start = rss_bytes()
    total_polls = (windows + 1) * polls_per_window
    progress(f"N={n}: {windows + 1} windows ({total_polls} polls), {len(clients)} client connections")
    heartbeat_bytes = window_bytes = 0.0
    for poll in range(total_polls):
        measured = poll >= polls_per_window  # window 0 warms up (and holds the start-up poll)
        window_closes = (poll + 1) % polls_per_window == 0
        if poll % polls_per_window == 0:
            wstart_proc, wstart_thread = time.process_time(), tt()
            pub_tally.reset()
            agg_tally.reset()
        clock.now += poll_s
        # the steps of this poll, on every rank (lockstep)
        chunks = [[] for _ in range(n)]
        for _ in range(spp):
            owns = [m.compute() for m in models]
            comm_ms = 15.0 * rng.uniform(0.97, 1.03)
            slowest = max(o["data"] + o["forward"] + o["loss"] + o["backward"] + o["optimizer"] for o in owns)
            step_ms = slowest + 5.0  # + the part of the all-reduce nobody hides
            for r in range(n):
                chunks[r].append(step_line(r, step, owns[r], step_ms, comm_ms))
            step += 1
        for r in range(n):
            with open(files[r], "a") as f:
                f.write("".join(chunks[r]))
            cores[r].step_index = step
            cores[r].current_phase = "forward"
            cores[r].collectives_in_flight = rng.randint(0, 1)
        # the publishers' polls (each rank's background thread would do this)
        for r in range(1, n):
            t0, c0 = pc(), tt()
            exchanges[r].poll_once()
            dt = (pc() - t0, tt() - c0)
            if measured:
                (pub_window if window_closes else pub_hb).append(dt)
        # rank 0: its own publishing, then the aggregation. The other simulated ranks' objects
        # are frozen out of the cyclic GC first: a real rank 0 does not hold them, and a
        # collection during its poll would otherwise scan all of them.
        gc.freeze()
        gc_before = GC_STATS["gen2"]
        t0, c0 = pc(), tt()
        agg._read_own_log()
        agg._publish_heartbeat()
        own = (pc() - t0, tt() - c0)
        before = agg_core.records.get("cluster", 0)
        t0, c0 = pc(), tt()
        agg._aggregate()
        dt = (pc() - t0, tt() - c0)
        compared = agg_core.records.get("cluster", 0) > before  # this poll compared a window
        if measured:
            gen2_collections += GC_STATS["gen2"] - gc_before
        if compared:
            last_close = poll - poll % polls_per_window + polls_per_window - 1
            lag_polls.append(poll - (last_close if last_close <= poll else last_close - polls_per_window))
        if poll == 0:
            startup_found = (dt[0], dt[1], agg_tally.calls.get("check", 0))
        elif measured:
            agg_own.append(own)
            agg_total_cpu += dt[1] + own[1]
            (agg_window if compared else agg_hb).append(dt)
        if window_closes and measured:
            for op in ("set_w", "set_h"):
                pub_set_lat[op[-1]] += pub_tally.lat.get(op, [])
            bytes_window.append(pub_tally.total() + agg_tally.total())
            server_cpu.append((time.process_time() - wstart_proc) - (tt() - wstart_thread))
            heartbeat_bytes = (pub_tally.bytes.get("set_h", 0) + agg_tally.bytes.get("set_h", 0)
                               + agg_tally.bytes.get("multi_get_h", 0)) / polls_per_window
            window_bytes = (pub_tally.bytes.get("set_w", 0) + agg_tally.bytes.get("set_w", 0)
                            + agg_tally.bytes.get("multi_get_w", 0))
    gc.unfreeze()
    rss_end = rss_bytes()
    cluster_records = agg_core.records.get("cluster", 0)
    last_cluster = json.loads(agg_core.last["cluster"]) if "cluster" in agg_core.last else {}
    alert = json.loads(agg_core.last["alert"]) if "alert" in agg_core.last else {}
    record_bytes_per_window = (agg_core.record_bytes.get("cluster", 0) / cluster_records
                               if cluster_records else 0.0)
    # what the stand-in core's write_record skipped: the real core's parse + dump
    wr_cpu = write_record_cpu(real_core, agg_core.last["cluster"]) if "cluster" in agg_core.last else 0.0
    alert_bytes = agg_core.record_bytes.get("alert", 0)

    def cpu_share(step_s: float, win: tuple, hb: tuple) -> float:
        polls = interval * step_s / poll_s
        return 100.0 * (win + (polls - 1) * hb) / (interval * step_s)

    aw_cpu, ah_cpu = med([c for _, c in agg_window]), med([c for _, c in agg_hb])
    own_cpu = med([c for _, c in agg_own])
    rank0_window = aw_cpu + wr_cpu + own_cpu  # + write_record of the window's alerts: rare, small
    pw_cpu, ph_cpu = med([c for _, c in pub_window]), med([c for _, c in pub_hb])
    res: Dict[str, Any] = {
        "ranks": n, "windows": windows, "polls": total_polls, "clients": len(clients),
        "cluster_records": cluster_records,
        "ranks_reporting": last_cluster.get("ranks_reporting"),
        "slowest_rank": last_cluster.get("slowest_rank"),
        "straggler_alert": {"type": alert.get("type"), "subject_rank": alert.get("subject_rank"),
                            "phase": alert.get("phase")} if alert else None,
        "startup_empty_poll": {"wall_ms": startup_empty[0] * 1e3, "cpu_ms": startup_empty[1] * 1e3,
                               "checks": startup_empty[2]},
        "startup_found_poll": ({"wall_ms": startup_found[0] * 1e3, "cpu_ms": startup_found[1] * 1e3,
                                "checks": startup_found[2]} if startup_found else None),
        "publish_window_poll_us": {"wall_p50": med([w for w, _ in pub_window]) * 1e6,
                                   "wall_p99": pct([w for w, _ in pub_window], 0.99) * 1e6,
                                   "cpu_p50": pw_cpu * 1e6},
        "publish_hb_poll_us": {"wall_p50": med([w for w, _ in pub_hb]) * 1e6,
                               "wall_p99": pct([w for w, _ in pub_hb], 0.99) * 1e6, "cpu_p50": ph_cpu * 1e6},
        "set_us": {"w_p50": med(pub_set_lat["w"]) * 1e6, "w_p99": pct(pub_set_lat["w"], 0.99) * 1e6,
                   "h_p50": med(pub_set_lat["h"]) * 1e6, "h_p99": pct(pub_set_lat["h"], 0.99) * 1e6},
        "agg_hb_poll_ms": {"wall_p50": med([w for w, _ in agg_hb]) * 1e3,
                           "wall_max": max([w for w, _ in agg_hb], default=float("nan")) * 1e3,
                           "cpu_p50": ah_cpu * 1e3},
        "agg_window_poll_ms": {"wall_p50": med([w for w, _ in agg_window]) * 1e3,
                               "wall_max": max([w for w, _ in agg_window], default=float("nan")) * 1e3,
                               "cpu_p50": aw_cpu * 1e3,
                               "cpu_max": max([c for _, c in agg_window], default=float("nan")) * 1e3},
        "rank0_own_publish_cpu_us": own_cpu * 1e6,
        "compare_lag_polls": max(lag_polls, default=None),
        "gen2_collections_in_rank0_polls": gen2_collections,
        "rank0_measured_pct_100ms": 100.0 * (agg_total_cpu + wr_cpu * len(agg_window))
                                    / ((total_polls - polls_per_window) * poll_s),
        "write_record_cpu_ms": wr_cpu * 1e3,
        "bytes_per_window_100ms": med(bytes_window),
        "bytes_window_part": window_bytes,
        "bytes_heartbeat_per_poll": heartbeat_bytes,
        "cluster_record_bytes": record_bytes_per_window,
        "alert_bytes_total": alert_bytes,
        "server_cpu_ms_per_window": med(server_cpu) * 1e3,
        "rss_growth_bytes": rss_end - rss_start,
        "cpu_pct": {
            "agg_100ms": cpu_share(0.1, aw_cpu, ah_cpu),
            "agg_500ms": cpu_share(0.5, aw_cpu, ah_cpu),
            "rank0_100ms": cpu_share(0.1, rank0_window, ah_cpu + own_cpu),
            "rank0_500ms": cpu_share(0.5, rank0_window, ah_cpu + own_cpu),
            "pub_100ms": cpu_share(0.1, pw_cpu, ph_cpu),
            "pub_500ms": cpu_share(0.5, pw_cpu, ph_cpu),
        },
    }
    if memory:
        res["memory"] = memory_run(n, args.memory_windows, agg, agg_core, clients, run_id, clock, poll_s)
    agg_client = None
    shutil.rmtree(rdir, ignore_errors=True)
    return res


def memory_run(n: int, windows: int, agg: ClusterExchange, agg_core: SimCore, clients: List[Any],
               run_id: str, clock: SimClock, poll_s: float) -> Dict[str, Any]:
    """The aggregator alone over many more windows: the publishers' last values are set
    again with the window index bumped (and a new heartbeat time), one poll per window."""
    prefix = f"steptrace/{run_id}/"
    store = clients[0]
    last_w = [json.loads(v) for v in store.multi_get([prefix + f"w{r}" for r in range(n)])]
    last_h = [json.loads(v) for v in store.multi_get([prefix + f"h{r}" for r in range(n)])]
    progress(f"N={n}: memory, {windows} more windows of the aggregator alone (tracemalloc on)")
    gc.collect()
    tracemalloc.start()
    traced, rss = [], []
    cpu = []
    for i in range(windows):
        clock.now += poll_s
        for r in range(n):
            last_w[r]["window"] += 1
            last_w[r]["first_step"] += 50
            last_w[r]["last_step"] += 50
            last_h[r]["w"] = last_w[r]["window"]
            last_h[r]["t"] = round(clock.now, 3)
            last_h[r]["p"] = round(clock.now, 3)
            last_h[r]["s"] += 50
        keys = [prefix + f"w{r}" for r in range(n)] + [prefix + f"h{r}" for r in range(n)]
        values = [json.dumps(v, separators=(",", ":")) for v in last_w + last_h]
        store.multi_set(keys, values)
        del keys, values
        c0 = tt()
        agg._aggregate()
        cpu.append(tt() - c0)
        gc.collect()
        traced.append(tracemalloc.get_traced_memory()[0])
        rss.append(rss_bytes())
    tracemalloc.stop()
    a = agg._analyzer
    return {
        "windows": windows,
        "traced_bytes": traced,
        "traced_growth_per_window": (traced[-1] - traced[1]) / max(1, windows - 2),
        "traced_after_2": traced[1], "traced_last": traced[-1],
        "traced_min": min(traced[1:]), "traced_max": max(traced[1:]),
        "rss_first": rss[0], "rss_last": rss[-1],
        "cpu_ms_p50_traced": med(cpu) * 1e3,
        "state": {"seen": len(agg._seen), "hb": len(agg._hb), "hb_raw": len(agg._hb_raw),
                  "hosts": len(agg._hosts), "episodes": len(a._episodes),
                  "alert_counts": dict(a.alert_counts)},
        "cluster_records": agg_core.records.get("cluster", 0),
    }


# --------------------------------------------------------------------------------------
# the report
# --------------------------------------------------------------------------------------


def use_cluster_py(path: str) -> None:
    """Measure this package folder as steptrace.cluster (it imports only steptrace.errors)."""
    global cluster_mod, CLUSTER_OPTIONS, ClusterExchange
    pkg = Path(path)
    if pkg.name == "__init__.py":
        pkg = pkg.parent
    for name in [n for n in sys.modules if n == "steptrace.cluster" or n.startswith("steptrace.cluster.")]:
        del sys.modules[name]  # its modules come from this folder, not the installed package
    spec = importlib.util.spec_from_file_location("steptrace.cluster", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["steptrace.cluster"] = mod
    spec.loader.exec_module(mod)
    cluster_mod, CLUSTER_OPTIONS, ClusterExchange = mod, mod.CLUSTER_OPTIONS, mod.ClusterExchange


def _sha(path: str) -> str:
    """Of a file, or of a package folder's .py files (their names and bytes)."""
    try:
        p = Path(path)
        if not p.is_dir():
            return hashlib.sha256(p.read_bytes()).hexdigest()[:12]
        files = sorted(p.glob("*.py"))
        if not files:
            return "-"
        return hashlib.sha256(b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)).hexdigest()[:12]
    except OSError:
        return "-"


def machine() -> Dict[str, Any]:
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "load": os.getloadavg(),
            "python": platform.python_version(), "torch": torch.__version__,
            "steptrace": getattr(steptrace, "__version__", "?"), "host": socket.gethostname(),
            "cluster_py": str(Path(cluster_mod.__file__).parent),
            "cluster_py_sha": _sha(str(Path(cluster_mod.__file__).parent)),
            "tree_cluster_py_sha": _sha(str(REPO / "python" / "steptrace" / "cluster"))}


def print_report(results: List[Dict[str, Any]], m: Dict[str, Any], args: argparse.Namespace) -> None:
    interval = CLUSTER_OPTIONS["cluster_interval"]
    poll_s = CLUSTER_OPTIONS["cluster_poll_s"]
    nan = float("nan")
    print(f"== steptrace.cluster: {m['cluster_py']} (sha256 {m['cluster_py_sha']}; working tree "
          f"{m['tree_cluster_py_sha']}) ==")
    print(f"== machine: {m['nproc']} CPUs ({m['cpu']}), load {m['load'][0]:.2f} {m['load'][1]:.2f} "
          f"{m['load'][2]:.2f}; Python {m['python']}, torch {m['torch']} ==")
    print(f"== setup: one TCPStore server in this process, rank 0 on its own client, the others "
          f"on {results[0]['clients']} shared clients; cluster_interval {interval}, cluster_poll_s "
          f"{poll_s:g}, {args.steps_per_poll} steps per poll; rank N-1 computes "
          f"{STRAGGLER_FACTOR:.1f}x ==")
    print()
    print("== publishing, per rank: poll_once (us; CPU = thread_time) ==")
    print(f"{'ranks':>6} | {'window poll: wall p50':>21} {'p99':>6} {'cpu p50':>7} | {'heartbeat poll: wall p50':>24} "
          f"{'p99':>6} {'cpu p50':>7} | {'set(summary) p50':>16} {'p99':>6} | {'set(heartbeat) p50':>18} {'p99':>6}")
    for r in results:
        pw, ph, s = r["publish_window_poll_us"], r["publish_hb_poll_us"], r["set_us"]
        print(f"{r['ranks']:>6} | {pw['wall_p50']:>21.0f} {pw['wall_p99']:>6.0f} {pw['cpu_p50']:>7.0f} | "
              f"{ph['wall_p50']:>24.0f} {ph['wall_p99']:>6.0f} {ph['cpu_p50']:>7.0f} | "
              f"{s['w_p50']:>16.1f} {s['w_p99']:>6.0f} | {s['h_p50']:>18.1f} {s['h_p99']:>6.0f}")
    print()
    print("== aggregation, rank 0: _aggregate (ms; CPU = thread_time) ==")
    print(f"{'ranks':>6} | {'start-up, none yet':>18} {'checks':>6} | {'first':>6} {'checks':>6} | "
          f"{'heartbeat poll wall':>19} {'cpu':>6} | {'window poll wall':>16} {'cpu':>7} {'cpu max':>7} | "
          f"{'write_record':>12} | {'store srv':>9} | {'windows':>7} {'lag':>3} {'ranks':>5} {'alert':>16}")
    for r in results:
        se, sf = r["startup_empty_poll"], r["startup_found_poll"] or {}
        ah, aw = r["agg_hb_poll_ms"], r["agg_window_poll_ms"]
        al = r["straggler_alert"]
        alert = f"{al['type']} r{al['subject_rank']}" if al else "-"
        print(f"{r['ranks']:>6} | {se['wall_ms']:>18.1f} {se['checks']:>6} | {sf.get('wall_ms', nan):>6.1f} "
              f"{sf.get('checks', 0):>6} | {ah['wall_p50']:>19.2f} {ah['cpu_p50']:>6.2f} | "
              f"{aw['wall_p50']:>16.2f} {aw['cpu_p50']:>7.2f} {aw['cpu_max']:>7.2f} | "
              f"{r['write_record_cpu_ms']:>12.2f} | {r['server_cpu_ms_per_window']:>9.1f} | "
              f"{r['cluster_records']:>7} {r['compare_lag_polls']!s:>3} {r['ranks_reporting']!s:>5} {alert:>16}")
    print("  (start-up: rank 0's polls before any rank started, and the first that finds them; "
          "write_record: the real C++ core's, per cluster record; store srv: the TCPStore server "
          "thread's CPU per window; lag: polls from a window's last step to its comparison)")
    print()
    print("== bytes through the store (keys + values) per window, and into rank 0's log ==")
    print(f"{'ranks':>6} | {'100 ms steps (5 polls)':>22} | {'500 ms steps (25 polls)':>23} | "
          f"{'summaries':>10} | {'heartbeats per poll':>19} | {'cluster record':>14}")
    for r in results:
        b500 = r["bytes_window_part"] + 25 * r["bytes_heartbeat_per_poll"]
        print(f"{r['ranks']:>6} | {r['bytes_per_window_100ms'] / 1024:>19.1f} KB | {b500 / 1024:>20.1f} KB | "
              f"{r['bytes_window_part'] / 1024:>7.1f} KB | {r['bytes_heartbeat_per_poll'] / 1024:>16.1f} KB | "
              f"{r['cluster_record_bytes'] / 1024:>11.1f} KB")
    print()
    print(f"== CPU share, % of one core: {interval}-step windows, a poll every {poll_s:g} s; "
          f"budget < {BUDGET_PCT:g}% for rank 0 ==")
    print(f"{'ranks':>6} | {'aggregation 100 ms':>18} {'500 ms':>7} | {'rank 0 100 ms':>13} {'500 ms':>7} "
          f"{'(run)':>7} | {'publisher 100 ms':>16} {'500 ms':>7} | budget 100 / 500 ms")
    for r in results:
        c = r["cpu_pct"]
        verdict = " / ".join("PASS" if c[k] < BUDGET_PCT else "FAIL" for k in ("rank0_100ms", "rank0_500ms"))
        print(f"{r['ranks']:>6} | {c['agg_100ms']:>17.3f}% {c['agg_500ms']:>6.3f}% | {c['rank0_100ms']:>12.3f}% "
              f"{c['rank0_500ms']:>6.3f}% {r['rank0_measured_pct_100ms']:>6.3f}% | {c['pub_100ms']:>15.3f}% "
              f"{c['pub_500ms']:>6.3f}% | {verdict}")
    print("  (from the medians: (window poll + the window's other polls) / window; rank 0 adds its own "
          "publishing and write_record; (run): rank 0's CPU summed over the simulated 100 ms-step run)")
    print("  full GC collections during rank 0's measured polls: " + ", ".join(
        f"N={r['ranks']}: {r['gen2_collections_in_rank0_polls']}" for r in results))
    mem = [r for r in results if "memory" in r]
    if mem:
        r = mem[0]
        mm = r["memory"]
        print()
        print(f"== memory of the aggregator, N={r['ranks']}, {mm['windows']} more windows ==")
        print(f"tracemalloc: {mm['traced_after_2'] / 2**20:.2f} MiB after window 2, "
              f"{mm['traced_last'] / 2**20:.2f} MiB after window {mm['windows']} (range "
              f"{mm['traced_min'] / 2**20:.2f}..{mm['traced_max'] / 2**20:.2f} MiB): "
              f"{mm['traced_growth_per_window'] / 1024:+.1f} KiB per window; "
              f"RSS {mm['rss_first'] / 2**20:.0f} -> {mm['rss_last'] / 2**20:.0f} MiB")
        print(f"state: {mm['state']}; window poll CPU under tracemalloc {mm['cpu_ms_p50_traced']:.1f} ms")
        print("RSS growth of the whole process (all simulated ranks) over each size's run (MiB): " + ", ".join(
            f"N={x['ranks']}: {x['rss_growth_bytes'] / 2**20:+.1f}" for x in results))


def main() -> int:
    parser = argparse.ArgumentParser(description="cost of steptrace's cross-rank exchange as ranks grow")
    parser.add_argument("--ranks", default="2,8,64,256,1024", help="comma-separated rank counts")
    parser.add_argument("--windows", type=int, default=8, help="measured windows per size up to 256 ranks")
    parser.add_argument("--windows-large", type=int, default=5, help="measured windows above 256 ranks")
    parser.add_argument("--memory-windows", type=int, default=12,
                        help="windows of the aggregator alone at the largest size (memory)")
    parser.add_argument("--clients", type=int, default=8, help="TCPStore client connections the publishers share")
    parser.add_argument("--steps-per-poll", type=int, default=10, help="steps per 1 s poll (10: a 100 ms step)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2,64,256 ranks, 2 windows")
    parser.add_argument("--cluster-py", metavar="PATH",
                        help="measure this steptrace/cluster package folder instead of the installed one")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    if args.cluster_py:
        use_cluster_py(args.cluster_py)
    if args.quick:
        args.ranks, args.windows, args.windows_large, args.memory_windows = "2,64,256", 2, 1, 4
    interval = int(CLUSTER_OPTIONS["cluster_interval"])
    if interval % args.steps_per_poll:
        parser.error(f"--steps-per-poll must divide cluster_interval ({interval})")
    sizes = [int(x) for x in args.ranks.split(",")]
    m = machine()
    progress(f"steptrace.cluster from {m['cluster_py']} (sha256 {m['cluster_py_sha']}; the working "
             f"tree's python/steptrace/cluster: {m['tree_cluster_py_sha']}"
             + (", the same)" if m["cluster_py_sha"] == m["tree_cluster_py_sha"] else
                ", DIFFERENT: --cluster-py python/steptrace/cluster measures the tree's)"))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = server.port
    progress(f"TCPStore server on port {port}; opening {args.clients} client connections")
    clients = [dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
               for _ in range(args.clients)]
    workdir = Path(tempfile.mkdtemp(prefix="steptrace-cluster-scale-"))
    real = steptrace.Profiler(workdir / "real-core", cluster="off")  # only for write_record's cost
    results = []
    t_start = pc()
    try:
        for n in sizes:
            gc.collect()
            results.append(run_size(n, args, port, clients, workdir, memory=(n == max(sizes)),
                                    real_core=real._core))
    finally:
        real.close()
        shutil.rmtree(workdir, ignore_errors=True)
    progress(f"done in {pc() - t_start:.0f} s")
    print_report(results, m, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m, "results": results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
