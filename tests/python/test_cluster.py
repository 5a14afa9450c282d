"""The cross-rank view: the rules on synthetic windows (deterministic), and real
torch.distributed runs on the CPU (gloo, ranks spawned by torchrun) where one rank is a
straggler, has a slow loader, blocks, or where nothing is wrong."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path
from typing import Callable, Optional

import pytest

import steptrace
from steptrace.cli import main as cli
from steptrace.cluster import CLUSTER_OPTIONS, ClusterAnalyzer, ClusterExchange, analyze_records, window_summary
from steptrace.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def steps(rank: int, first: int, n: int, *, forward: float = 20.0, data: float = 0.0, wait: float = 0.0,
          comm: float = 0.5, noise: float = 0.0, rng: random.Random | None = None,
          runq: Optional[float] = None) -> list[dict]:
    """Step records like a DDP rank writes with prof.watch: forward compute, a backward
    that also holds the time blocked on the all-reduce (its own comm plus waiting); with
    ``runq``, the host reading: that much of forward spent waiting for a CPU."""
    rng = rng or random.Random(rank)
    out = []
    for i in range(first, first + n):
        f = forward * (1 + rng.uniform(-noise, noise))
        exposed = comm + wait
        phases = {"forward": f, "loss": 0.2, "backward": 2.0 + exposed, "optimizer": 0.3}
        total = sum(phases.values())
        out.append({"kind": "step", "rank": rank, "step": i, "status": "ok", "step_ms": total, "host_ms": total,
                    "data_ms": data, "phases_ms": phases, "memory": {"rss_bytes": 1 << 30},
                    "comm": {"method": "host", "comm_ms": exposed, "exposed_ms": exposed,
                             "compute_ms": total - exposed, "collectives": 1, "exposed_in": "backward"}})
        if runq is not None:
            out[-1]["host"] = {"runq_ms": runq, "runq_span_ms": total, "on_cpu_ms": total - exposed - runq,
                               "steal_ms": 0.0}
    return out


def run_windows(ranks: dict[int, dict], windows: int, interval: int = 50, options: dict | None = None):
    """Feeds `windows` windows of synthetic steps (per-rank kwargs of steps()) to an analyzer."""
    analyzer = ClusterAnalyzer({**CLUSTER_OPTIONS, "cluster_interval": interval, **(options or {})})
    out = []
    for w in range(windows):
        summaries = {r: window_summary(r, w, steps(r, w * interval, interval, **kw), host=f"node{r}")
                     for r, kw in ranks.items()}
        record, alerts = analyzer.window(summaries)
        out.append((record, alerts))
    return analyzer, out


def untimed(records: list[dict]) -> list[dict]:
    """The same records as a rank writes when communication is not timed (no comm)."""
    return [{k: v for k, v in r.items() if k != "comm"} for r in records]


def run_untimed_windows(ranks: dict[int, dict], windows: int, interval: int = 50):
    analyzer = ClusterAnalyzer({**CLUSTER_OPTIONS, "cluster_interval": interval})
    return [analyzer.window({r: window_summary(r, w, untimed(steps(r, w * interval, interval, **kw)))
                             for r, kw in ranks.items()}) for w in range(windows)]


def test_without_comm_timing_a_straggler_is_named_from_its_phases_with_lower_confidence():
    # rank 2's forward takes 30 ms more; the others wait that long in backward's all-reduce,
    # so every rank's step time is the same
    ranks = {0: {"wait": 30.0}, 1: {"wait": 30.0}, 2: {"forward": 50.0}, 3: {"wait": 30.0}}
    out = run_untimed_windows(ranks, 3)
    assert all(record["method"] is None for record, _ in out)
    alerts = [a for _, found in out for a in found if a["kind"] == "alert"]
    assert [(a["type"], a["subject_rank"], a["phase"]) for a in alerts] == [("straggler", 2, "forward")]
    assert alerts[0]["details"]["confidence"] == "low" and alerts[0]["details"]["others_wait_ms"] >= 29.0
    assert "lower confidence: communication was not timed" in alerts[0]["message"]
    # a rank whose forward is slower with nobody waiting for it (no collective): no verdict
    out = run_untimed_windows({0: {}, 1: {}, 2: {"forward": 50.0}}, 3)
    assert [a for _, found in out for a in found if a["kind"] == "alert"] == []


def test_window_summary_takes_blocked_time_out_of_its_phase():
    s = window_summary(0, 0, steps(0, 0, 10, forward=20.0, wait=6.0, comm=1.0))
    assert s["phases_ms"]["backward"] == pytest.approx(2.0)  # 9 ms measured, 7 ms of it blocked
    assert s["exposed_ms"] == pytest.approx(7.0)
    assert s["own_ms"] == pytest.approx(s["step_ms"] - 7.0)
    assert s["method"] == "host"
    # a barrier between steps (rank 0 saved alone): the gap's wait is not this rank's work
    barrier = steps(0, 0, 11, forward=20.0, wait=6.0, comm=1.0)
    for r in barrier[5:]:
        r["other_ms"] = 300.0
        r["comm"]["blocked_between_ms"] = 299.0
    assert window_summary(0, 0, barrier)["own_ms"] == pytest.approx(s["own_ms"] + 1.0)


def test_a_slower_rank_is_named_after_two_windows_with_its_phase_and_host():
    # 3 ranks; rank 2 computes 30% longer, ranks 0 and 1 wait for it in the all-reduce
    ranks = {0: {"wait": 6.0}, 1: {"wait": 6.0}, 2: {"forward": 26.0}}
    analyzer, out = run_windows(ranks, 4)
    assert out[0][1] == []  # one window is not enough
    alerts = [a for _, found in out for a in found]
    assert [(a["type"], a["subject_rank"], a["step"]) for a in alerts] == [("straggler", 2, 99)]
    a = alerts[0]
    assert a["phase"] == "forward" and a["details"]["host"] == "node2"
    assert a["details"]["excess_pct"] == pytest.approx(100 * (28.5 - 22.5) / 22.5, abs=0.5)
    assert "rank 2" in a["message"] and "node2" in a["message"]
    record = out[-1][0]
    assert record["slowest_rank"] == 2 and record["stragglers"] == [2]
    rows = {row["rank"]: row for row in record["ranks"]}
    assert rows[0]["wait_ms"] == pytest.approx(6.0) and rows[2]["wait_ms"] == pytest.approx(0.0)
    assert rows[0]["comm_ms"] == pytest.approx(0.5)  # communication net of waiting
    # one alert per episode; the episode resolves at the end with its repeats
    resolved = analyzer.finish(record["step"])
    assert [(r["type"], r["subject_rank"], r["repeats"]) for r in resolved] == [("straggler", 2, 2)]


def test_a_rank_slower_only_for_waiting_for_a_cpu_is_not_a_straggler():
    # A CPU hog beside a 2-rank job on a small host: rank 2's forward takes 6 ms longer, all
    # of it waiting for a CPU (its host reading). The host is oversubscribed (its own
    # host_contention), not rank 2 slower at its work: no straggler. The row shows the wait.
    ranks = {0: {"wait": 6.0, "runq": 0.2}, 1: {"wait": 6.0, "runq": 0.1}, 2: {"forward": 26.0, "runq": 6.1}}
    _, out = run_windows(ranks, 4)
    assert [a for _, found in out for a in found] == []
    rows = {row["rank"]: row for row in out[-1][0]["ranks"]}
    assert rows[2]["runq_ms"] == pytest.approx(6.1) and rows[2]["straggler_pct"] > 10
    # the same excess with little of it waiting for a CPU: the straggler it was
    ranks[2]["runq"] = 1.0
    _, out = run_windows(ranks, 4)
    assert [(a["type"], a["subject_rank"]) for _, found in out for a in found] == [("straggler", 2)]


def test_a_straggler_alert_needs_the_straggler_for_straggler_min_s():
    # Two gloo ranks on a 2-vCPU VM: one rank computes up to 50% slower for a few windows,
    # then the other (the ranks move between a slower and a faster vCPU), in windows of
    # under a second. That says nothing about a rank: an alert needs the same rank slower
    # for straggler_min_s (30 s) of its windows' own time, besides two windows in a row.
    interval, step_ns = 50, 25_000_000  # windows of 1.25 s

    def timed_windows(slow_of_window, windows, options=None):
        analyzer = ClusterAnalyzer({**CLUSTER_OPTIONS, **(options or {})})
        found = []
        for w in range(windows):
            summaries = {}
            for r in (0, 1):
                slow = slow_of_window(w) == r
                recs = steps(r, w * interval, interval, forward=30.0 if slow else 20.0, wait=0.0 if slow else 10.0)
                for rec in recs:
                    rec["start_unix_ns"] = 10**18 + rec["step"] * step_ns
                summaries[r] = window_summary(r, w, recs)
            found += [(a["type"], a["subject_rank"], a["step"]) for a in analyzer.window(summaries)[1]
                      if a["kind"] == "alert"]
        return found

    def alternating(w):
        return (w // 3) % 2  # rank 0 slower for 3 windows, then rank 1 for 3, ...

    assert timed_windows(alternating, 60) == []
    assert [rank for _, rank, _ in timed_windows(alternating, 60, {"straggler_min_s": 0.0})] == [0, 1] * 10
    # a rank that stays slower is named once its windows span 30 s: 24 windows of 1.25 s
    assert timed_windows(lambda w: 1, 30) == [("straggler", 1, 24 * interval - 1)]
    assert timed_windows(lambda w: 1, 30, {"straggler_min_s": 0.0}) == [("straggler", 1, 2 * interval - 1)]


def test_a_slow_loader_is_named_as_phase_data():
    _, out = run_windows({0: {"wait": 8.0}, 1: {"data": 8.0}}, 3)
    alerts = [a for _, found in out for a in found]
    assert [(a["type"], a["subject_rank"], a["phase"]) for a in alerts] == [("straggler", 1, "data")]
    assert "input pipeline" in alerts[0]["details"]["advice"]


def test_a_straggler_that_recovers_is_resolved():
    analyzer = ClusterAnalyzer()
    seen = []
    for w, slow in enumerate([True, True, True, False]):
        summaries = {0: window_summary(0, w, steps(0, w * 50, 50, wait=6.0 if slow else 0.0)),
                     1: window_summary(1, w, steps(1, w * 50, 50, forward=26.0 if slow else 20.0))}
        seen += analyzer.window(summaries)[1]
    assert [(r["kind"], r["type"]) for r in seen] == [("alert", "straggler"), ("resolved", "straggler")]
    assert seen[1]["first_step"] == 99 and seen[1]["repeats"] == 1


def test_no_alert_on_clean_noisy_ranks_over_many_windows():
    # 8 ranks, each step +-15% noise, 200 windows (10,000 steps a rank): no alert at all
    rng = random.Random(7)
    ranks = {r: {"noise": 0.15, "rng": rng} for r in range(8)}
    analyzer, out = run_windows(ranks, 200)
    assert [a for _, found in out for a in found] == []
    assert analyzer.alert_counts == {}


def test_one_ranks_slow_interconnect_and_a_comm_heavy_job():
    _, out = run_windows({0: {"comm": 1.0}, 1: {"comm": 1.0}, 2: {"comm": 3.0}}, 2)
    types = [(a["type"], a.get("subject_rank")) for _, found in out for a in found]
    assert types == [("comm_straggler", 2)]
    _, out = run_windows({0: {"comm": 9.0}, 1: {"comm": 9.0}}, 2)
    heavy = [a for _, found in out for a in found]
    assert [a["type"] for a in heavy] == ["comm_heavy"]
    assert "accumulate gradients" in heavy[0]["message"]
    assert out[-1][0]["comm_share_pct"] == pytest.approx(100 * 9.0 / 31.5, abs=0.1)


def test_rank_silent_names_the_rank_that_others_wait_for():
    analyzer = ClusterAnalyzer({**CLUSTER_OPTIONS, "cluster_silent_s": 2.0})
    hb = {0: {"t": 100.0, "progress_t": 95.0, "step": 40, "phase": "backward", "in_collective": True},
          1: {"t": 100.0, "progress_t": 95.0, "step": 40, "phase": "forward", "in_collective": False},
          2: {"t": 100.0, "progress_t": 99.9, "step": 41, "phase": "forward", "in_collective": False}}
    alerts = analyzer.silence(hb, now=100.0, median_step_s=0.03, expected=[0, 1, 2])
    assert [(a["type"], a["subject_rank"]) for a in alerts] == [("rank_silent", 1)]
    assert alerts[0]["details"]["last_step"] == 40 and alerts[0]["phase"] == "forward"
    assert alerts[0]["details"]["waiting_ranks"] == [0]
    # still stuck: the same episode; progress again: resolved
    assert analyzer.silence(hb, now=101.0, median_step_s=0.03, expected=[0, 1, 2]) == []
    hb[1] = {**hb[1], "progress_t": 101.5}
    hb[0] = {**hb[0], "progress_t": 101.5}
    resolved = analyzer.silence(hb, now=102.0, median_step_s=0.03, expected=[0, 1, 2])
    assert [(r["kind"], r["subject_rank"]) for r in resolved] == [("resolved", 1)]
    # a rank whose heartbeats stop is silent too, wherever the others are
    hb2 = {0: {"t": 200.0, "progress_t": 200.0, "step": 90, "in_collective": False},
           1: {"t": 150.0, "progress_t": 150.0, "step": 70, "in_collective": False}}
    alerts = analyzer.silence(hb2, now=200.0, median_step_s=0.03, expected=[0, 1])
    assert [(a["subject_rank"], a["details"]["reason"]) for a in alerts] == [(1, "stopped publishing")]


def test_offline_view_names_where_the_ranks_part_from_their_hang_alerts():
    def hang(rank: int, enq: int, done: int) -> dict:
        entry = {"seq": enq, "op": "nccl:all_reduce", "input_sizes": [[1024]]}
        group = {"group": "0", "desc": "default_pg", "last_enqueued": entry, "last_started": None,
                 "last_completed": {"seq": done}, "pending": entry if enq > done else None}
        return {"kind": "alert", "type": "hang", "rank": rank, "step": 40,
                "details": {"flight_recorder": {"recorder": "on", "groups": [group]}}}

    odd = {"kind": "alert", "type": "hang", "rank": 2, "step": 40,
           "details": {"flight_recorder": {"recorder": "on", "groups": ["not a group"]}}}
    result = analyze_records([hang(0, 81, 80), hang(1, 80, 80), odd])
    assert result["hang"]["parted"]["behind"] == [1] and result["hang"]["parted"]["seq"] == 81
    assert set(result["hang"]["ranks"]) == {"0", "1"}  # the odd record left out
    assert analyze_records([])["hang"] is None


class _RankCore:
    """What the exchange reads of a rank's core (a few atomics and its log), set by the test."""

    def __init__(self, rank: int, log_path: Path) -> None:
        self.config = types.SimpleNamespace(rank=rank, world_size=2, run_id="race")
        self.log_path = str(log_path)
        log_path.write_text("")
        self.in_step, self.step_index, self.current_phase, self.collectives_in_flight = False, 0, "", 0
        self.current_interval = ""
        self.peers_in_interval: list[tuple[int, float]] = []  # what the exchange told the core
        self.written: list[dict] = []
        self.clusters: list[dict] = []  # every cluster record written (poll() clears `written`)

    def set_peers_in_interval(self, peers: int, notice_s: float) -> None:
        self.peers_in_interval.append((peers, notice_s))

    def at(self, step: int, phase: str, collectives: int = 0) -> None:
        self.in_step, self.step_index, self.current_phase, self.collectives_in_flight = True, step + 1, phase, collectives

    def write_record(self, record: dict) -> None:  # a value, as the core's write_record takes it
        self.written.append(dict(record))
        if self.written[-1]["kind"] == "cluster":
            self.clusters.append(self.written[-1])


POLL_S = 0.1  # the two-rank exchanges' poll (cluster_silent_s 1.0)


def _two_ranks(tmp_path: Path, options: Optional[dict] = None
               ) -> tuple[list[_RankCore], Callable[[float], list[tuple[str, str, int]]]]:
    """Two ranks' cores and exchanges through one HashStore on a clock the test sets: poll(t)
    runs rank 1's poll, then rank 0's (publish and aggregate), and returns what rank 0 wrote
    other than cluster records, as (kind, type, subject_rank)."""
    from torch.distributed import HashStore

    now = [100.0]
    store = HashStore()
    options = {**CLUSTER_OPTIONS, "cluster_silent_s": 1.0, "cluster_poll_s": POLL_S, **(options or {})}
    cores = [_RankCore(r, tmp_path / f"rank{r}.jsonl") for r in (0, 1)]
    exchanges = [ClusterExchange(c, options, store=store, clock=lambda: now[0]) for c in cores]

    def poll(t: float) -> list[tuple[str, str, int]]:
        now[0] = t
        for ex in reversed(exchanges):
            ex.poll_once()
        out = [(r["kind"], r["type"], r["subject_rank"]) for r in cores[0].written if r["kind"] != "cluster"]
        cores[0].written.clear()
        return out

    return cores, poll


def test_rank_past_its_collective_is_not_silent_while_the_late_peer_is_in_it(tmp_path):
    # The race a loaded CI host hit: rank 1 hung in forward at step 40 (rank 0 waits in the
    # all-reduce); rank 1 resumes and reaches the all-reduce, rank 0's completes and it moves
    # on to its optimizer, both before either ends the step. Only rank 1 was ever silent.
    cores, poll = _two_ranks(tmp_path)
    cores[0].at(40, "backward", collectives=1)
    cores[1].at(40, "forward")
    assert poll(100.0) == []
    assert poll(101.5) == [("alert", "rank_silent", 1)]  # rank 1 blocked outside communication
    cores[1].at(40, "backward", collectives=1)  # resumed, now in the all-reduce
    cores[0].at(40, "optimizer")  # its all-reduce completed
    assert poll(101.6) == [("resolved", "rank_silent", 1)]
    assert poll(101.7) == [] and poll(102.0) == []
    cores[0].at(41, "forward")
    cores[1].at(41, "forward")
    assert poll(102.1) == []


def test_a_rank_evaluating_alone_is_not_silent_and_the_ranks_waiting_for_it_are_told(tmp_path):
    # nanoGPT under DDP: rank 0 evaluates and saves alone between steps while rank 1 waits
    # in the next step's all-reduce. Planned work: no rank_silent, and rank 1's core learns
    # that a peer is in an evaluation (its hang rule does not count that wait).
    from steptrace.cluster.exchange import peer_notice_s

    cores, poll = _two_ranks(tmp_path)
    notice = peer_notice_s(POLL_S)
    cores[0].at(49, "optimizer")
    cores[0].in_step, cores[0].current_interval = False, "eval"  # after step 49, evaluating
    cores[1].at(50, "backward", collectives=1)  # waits for rank 0 in step 50's all-reduce
    assert poll(100.0) == []
    assert poll(100.1) == []
    assert cores[1].peers_in_interval == [(1, notice)]  # told at its next poll
    for t in (101.5, 103.0, 110.0):  # 10 s of evaluation: silent for none of it
        assert poll(t) == []
    cores[0].current_interval = "checkpoint"  # then saves: still planned
    assert poll(111.5) == []
    cores[0].current_interval = ""  # done; rank 0 now stuck between steps for no reason
    assert poll(111.6) == [] and poll(111.7) == []
    assert cores[1].peers_in_interval[-1] == (0, notice)  # rank 1 is told it ended
    assert poll(113.0) == [("alert", "rank_silent", 0)]  # unexplained: the page is rank 0's
    assert cores[0].peers_in_interval == []  # rank 0 waited in nothing: never read


def test_the_live_view_compares_the_same_window_of_every_rank(tmp_path):
    # Each rank publishes its latest window summary. Where rank 0 had published two windows
    # since the aggregator's last poll and rank 1 one, the view set rank 0's newer window
    # beside rank 1's older one: when the job's steps changed between those windows, a
    # "straggler" that neither rank was (rank 0 of the GPT-style DDP script, 3 of 4 clean
    # runs of 1,500 iterations). Here both ranks' steps grow from 20 to 30 ms at window 2.
    interval = 10
    cores, poll = _two_ranks(tmp_path, {"cluster_interval": interval, "straggler_windows": 1})

    def write(rank: int, window: int, forward: float) -> None:
        with open(cores[rank].log_path, "a") as f:
            for rec in steps(rank, window * interval, interval, forward=forward):
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")

    write(0, 0, 20.0)
    write(1, 0, 20.0)
    assert poll(100.0) == []
    write(0, 1, 20.0)
    write(0, 2, 30.0)  # rank 0 two windows on before the next poll, rank 1 one
    write(1, 1, 20.0)
    assert poll(100.1) == []  # (was a straggler alert naming rank 0)
    write(1, 2, 30.0)
    assert poll(100.2) == []
    records = cores[0].clusters
    assert [(r["window"], r["ranks_reporting"], r["stragglers"]) for r in records] == \
        [(0, 2, []), (1, 1, []), (2, 2, [])]  # rank 0's window 1 was overwritten before it was read
    for r in records:
        assert len({row["step_ms"] for row in r["ranks"]}) == 1  # the same steps on both ranks


@pytest.mark.parametrize("option,value", [("cluster", "maybe"), ("cluster_interval", 1),
                                          ("straggler_pct", 0), ("cluster_poll_s", -1.0)])
def test_bad_cluster_options_are_refused_before_any_file(tmp_path, option, value):
    with pytest.raises(ConfigError, match=option):
        steptrace.Profiler(tmp_path / "run", **{option: value})
    assert not (tmp_path / "run").exists()


def test_without_torch_distributed_there_is_no_cluster_view(tmp_path):
    with steptrace.Profiler(tmp_path, cluster="on") as prof:  # one process: nothing to compare
        assert prof._cluster is None
        for _ in range(60):
            with prof.step():
                pass
    kinds = {r["kind"] for r in steptrace.read(tmp_path, validate=True)}
    assert "cluster" not in kinds
    assert analyze_records(steptrace.read(tmp_path))["windows"] == []


# ---- real runs: torchrun, gloo, 2 ranks on the CPU ----
def torchrun(log_dir: Path, *args: str, steps: int = 120, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    from steptrace.live.flight_recorder import ENV_VARS

    # PyTorch's flight recorder only where a test turns it on
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(EXAMPLE), str(log_dir), "--steps", str(steps), "--work-ms", "20", "--cluster-interval", "20",
         "--cluster-poll-s", "0.1", "--straggler-min-s", "0", *args],  # runs of seconds: windows alone
        capture_output=True, text=True, timeout=300, env={**base, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def records_of(path: Path, kind: str) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if f'"kind":"{kind}"' in line]


def test_live_straggler_rank_named_on_rank0_and_by_the_cli(tmp_path, capsys):
    torchrun(tmp_path, "--straggler-rank", "1", "--straggler-pct", "30")
    rank0 = tmp_path / "rank0.jsonl"
    alerts = [a for a in records_of(rank0, "alert") if a["type"] == "straggler"]
    assert alerts, rank0.read_text()[-2000:]
    assert alerts[0]["subject_rank"] == 1 and alerts[0]["phase"] == "forward"
    assert alerts[0]["step"] < 3 * 20  # within 3 windows of 20 steps
    assert alerts[0]["unix_ns"] < records_of(rank0, "run_end")[0]["end_unix_ns"]  # while it ran
    clusters = records_of(rank0, "cluster")
    assert len(clusters) >= 3 and all(c["world_size"] == 2 for c in clusters)
    assert records_of(rank0, "run_end")[0]["alerts"]["straggler"] == 1
    assert not [r for r in records_of(tmp_path / "rank1.jsonl", "cluster")]  # rank 0 aggregates
    list(steptrace.read(tmp_path, validate=True))  # the new records follow the schema
    assert cli(["cluster", str(tmp_path), "--fail-on-straggler", "--straggler-min-s", "0"]) == 1
    out = capsys.readouterr().out
    assert "STRAGGLER: rank 1" in out and "slower in forward" in out
    per_rank = steptrace.load(tmp_path).per_rank  # the same table for pandas
    assert list(per_rank.index) == [0, 1]
    assert per_rank.loc[1, "straggler_pct"] > 10 and per_rank.loc[0, "wait_ms"] > per_rank.loc[1, "wait_ms"]


def test_live_straggler_named_from_phases_when_communication_is_not_timed(tmp_path, capsys):
    torchrun(tmp_path, "--straggler-rank", "1", "--straggler-pct", "60", "--no-comm-timing")
    rank0 = tmp_path / "rank0.jsonl"
    assert all("comm" not in s for s in records_of(rank0, "step"))
    alerts = [a for a in records_of(rank0, "alert") if a["type"] == "straggler"]
    assert [(a["subject_rank"], a["phase"], a["details"]["confidence"]) for a in alerts] == [(1, "forward", "low")]
    assert cli(["cluster", str(tmp_path), "--straggler-min-s", "0"]) == 0
    assert "communication timed by: nothing" in capsys.readouterr().out


def test_live_slow_loader_named_with_phase_data(tmp_path):
    torchrun(tmp_path, "--slow-data-rank", "1", "--slow-data-ms", "10")
    alerts = [a for a in records_of(tmp_path / "rank0.jsonl", "alert") if a["type"] == "straggler"]
    assert [(a["subject_rank"], a["phase"]) for a in alerts] == [(1, "data")]


def test_live_clean_run_has_cluster_records_and_no_cluster_alert(tmp_path, capsys):
    # each step does 1e9 model FLOPs on a device of 1 TFLOP/s: MFU = 1e9 / iteration s / 1e12
    torchrun(tmp_path, "--flops-per-step", "1e9", "--peak-tflops", "1", steps=200)
    rank0 = tmp_path / "rank0.jsonl"
    clusters = records_of(rank0, "cluster")
    assert len(clusters) >= 5
    cluster_types = {"straggler", "comm_straggler", "comm_heavy", "rank_silent"}
    assert [a for a in records_of(rank0, "alert") if a["type"] in cluster_types] == []
    list(steptrace.read(tmp_path, validate=True))  # the rows' work follows the schema
    # each rank's median MFU in the rows: about 1e9 / (20 ms of compute and a little more)
    for row in clusters[-1]["ranks"]:
        assert 0.5 < row["mfu_pct"] < 1e9 / 0.020 / 1e12 * 100 * 1.01, row
    assert cli(["cluster", str(tmp_path), "--fail-on-straggler", "--straggler-min-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "no straggler" in out
    head = next(ln for ln in out.splitlines() if ln.split()[:2] == ["rank", "host"])
    assert head.split()[-1] == "MFU"
    per_rank = steptrace.load(tmp_path).per_rank
    assert (per_rank["mfu_pct"] > 0.5).all()


def test_live_rank0_evaluating_alone_before_a_barrier_pages_nobody(tmp_path):
    # rank 0 evaluates 0.4 s alone every 40 steps (20x the step) while rank 1 waits in a
    # barrier between steps: rank 1's next step records the wait as the gap's blocked time,
    # and neither rank pages (rank 1 had a stall in "other" at every evaluation)
    torchrun(tmp_path, "--rank0-eval-every", "40", "--rank0-eval-ms", "400")
    alerts = {r: records_of(tmp_path / f"rank{r}.jsonl", "alert") for r in (0, 1)}
    assert alerts == {0: [], 1: []}, alerts
    waited = [s for s in records_of(tmp_path / "rank1.jsonl", "step") if s["step"] in (40, 80)]
    assert [s["comm"]["blocked_between_ms"] > 300 for s in waited] == [True, True], waited
    assert all(s["other_ms"] >= s["comm"]["blocked_between_ms"] - 5 for s in waited), waited
    list(steptrace.read(tmp_path, validate=True))  # blocked_between_ms follows the schema


def test_live_blocked_rank_reported_silent_while_it_blocks(tmp_path):
    torchrun(tmp_path, "--block-rank", "1", "--block-at", "40", "--block-s", "5", "--cluster-silent-s", "1.0",
             steps=60)
    silent = [a for a in records_of(tmp_path / "rank0.jsonl", "alert") if a["type"] == "rank_silent"]
    assert [(a["subject_rank"], a["details"]["last_step"], a["phase"]) for a in silent] == [(1, 40, "forward")]
    blocked = next(s for s in records_of(tmp_path / "rank1.jsonl", "step") if s["step"] == 40)
    resumed_ns = blocked["start_unix_ns"] + blocked["host_ms"] * 1e6
    assert silent[0]["unix_ns"] < resumed_ns  # reported while rank 1 was still blocked
    resolved = [r for r in records_of(tmp_path / "rank0.jsonl", "resolved") if r["type"] == "rank_silent"]
    assert [r["subject_rank"] for r in resolved] == [1]
    # PyTorch's flight recorder is off here: the alerts say so, and how to turn it on
    assert silent[0]["details"]["flight_recorder"]["recorder"] == "off"
    hangs = [a for r in (0, 1) for a in records_of(tmp_path / f"rank{r}.jsonl", "alert") if a["type"] == "hang"]
    assert hangs and all(h["details"]["flight_recorder"]["recorder"] == "off" for h in hangs), hangs
    assert "TORCH_FR_BUFFER_SIZE is not set" in hangs[0]["details"]["flight_recorder"]["why"]


def test_live_hang_with_the_flight_recorder_names_the_collective_where_the_ranks_part(tmp_path, capsys):
    # rank 1 stops 5 s in its forward at step 40; rank 0 waits in that step's all-reduce
    torchrun(tmp_path, "--block-rank", "1", "--block-at", "40", "--block-s", "5", "--cluster-silent-s", "1.0",
             steps=60, env={"TORCH_FR_BUFFER_SIZE": "2000"})
    [silent] = [a for a in records_of(tmp_path / "rank0.jsonl", "alert") if a["type"] == "rank_silent"]
    parted = silent["details"]["flight_recorder"]["parted"]
    assert (parted["kind"], parted["behind"], parted["waiting"], parted["op"]) == \
        ("behind", [1], [0], "gloo:all_reduce"), silent
    assert "the ranks part at collective #" in silent["message"] and "rank(s) 1 did not" in silent["message"]
    # each rank's own hang alert carries its last collectives: rank 0 waits in the one rank 1 never called
    hang = {r: next(a for a in records_of(tmp_path / f"rank{r}.jsonl", "alert") if a["type"] == "hang")
            for r in (0, 1)}
    [g0] = hang[0]["details"]["flight_recorder"]["groups"]
    [g1] = hang[1]["details"]["flight_recorder"]["groups"]
    assert g0["pending"]["seq"] == parted["seq"] and g0["pending"]["op"] == "gloo:all_reduce"
    assert g1["pending"] is None and g1["last_completed"]["seq"] == parted["seq"] - 1
    assert g0["last_completed"]["seq"] == parted["seq"] - 1
    assert "flight recorder: group 0" in hang[0]["message"] and "not completed" in hang[0]["message"]
    list(steptrace.read(tmp_path, validate=True))
    # afterwards, from the ranks' hang alerts: the same verdict
    cli(["cluster", str(tmp_path), "--straggler-min-s", "0"])
    assert f"HANG: {parted['message']}" in capsys.readouterr().out


def test_at_scale_the_record_lists_the_notable_ranks_and_the_cli_all():
    # 200 ranks, rank 137 slow: the record keeps it (and at most cluster_max_rows rows)
    ranks = {r: {"wait": 6.0} for r in range(200)}
    ranks[137] = {"forward": 26.0}
    _, out = run_windows(ranks, 2, options={"cluster_max_rows": 16})
    record, alerts = out[-1]
    kept = [row["rank"] for row in record["ranks"]]
    assert len(kept) == 16 and 137 in kept and record["ranks_omitted"] == 184
    assert [a["subject_rank"] for a in alerts] == [137]


def with_work(records: list[dict], tokens_per_s: float, mfu_pct: float) -> list[dict]:
    """The same records, each step with useful work at these rates."""
    return [{**r, "work": {"tokens": tokens_per_s * r["step_ms"] / 1e3, "tokens_per_s": tokens_per_s,
                           "mfu_pct": mfu_pct}} for r in records]


def test_rows_and_the_table_carry_each_ranks_mfu_and_tokens_per_s(capsys):
    records = [{"kind": "run_start", "rank": r, "world_size": 2, "host": f"node{r}"} for r in (0, 1)]
    records += with_work(steps(0, 0, 100), 50_000.0, 41.0) + with_work(steps(1, 0, 100), 40_000.0, 33.0)
    result = analyze_records(records)
    rows = {row["rank"]: row for row in result["table"]["ranks"]}
    assert (rows[0]["mfu_pct"], rows[0]["tokens_per_s"]) == (41.0, 50_000.0)
    assert (rows[1]["mfu_pct"], rows[1]["tokens_per_s"]) == (33.0, 40_000.0)
    assert all(row["mfu_pct"] in (41.0, 33.0) for w in result["windows"] for row in w["ranks"])
    from steptrace.cluster import format_cluster

    lines = format_cluster(result).splitlines()
    head = next(ln for ln in lines if ln.split()[:2] == ["rank", "host"])
    assert head.split()[-2:] == ["MFU", "tokens/s"]
    row1 = next(ln for ln in lines if ln.split()[:2] == ["1", "node1"])
    assert row1.split()[-2:] == ["33.0%", "40,000"]
    # without work: no such columns
    plain = format_cluster(analyze_records(records[:2] + steps(0, 0, 100) + steps(1, 0, 100)))
    assert "MFU" not in plain and "tokens/s" not in plain


def test_hot_gpu_against_gpus_at_similar_power():
    analyzer = ClusterAnalyzer()
    found = []
    for w in range(3):
        summaries = {}
        for r in range(4):
            summary = window_summary(r, w, steps(r, w * 50, 50))
            # rank 2 runs 9 C hotter at the same power; rank 3 is hot but draws far more power
            summary["hw"] = {"max_temp_c": 71.0 + (9.0 if r == 2 else 0.0) + (12.0 if r == 3 else 0.0),
                             "power_w": 500.0 if r != 3 else 690.0}
            summaries[r] = summary
        record, alerts = analyzer.window(summaries)
        found += alerts
    assert [(a["type"], a["subject_rank"]) for a in found] == [("hot_gpu", 2)]
    assert found[0]["details"]["delta_c"] == pytest.approx(9.0)
    assert record["temp_delta_c"]["2"] == pytest.approx(9.0)


def test_live_hot_gpu_named_on_rank0_and_shown_by_the_cli(tmp_path, monkeypatch, fake_nvml, capsys):
    # rank 1's (stand-in) GPU runs 10 C hotter than rank 0's at the same power
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady,hot")
    torchrun(tmp_path)
    rank0 = tmp_path / "rank0.jsonl"
    hot = [a for a in records_of(rank0, "alert") if a["type"] == "hot_gpu"]
    assert [a["subject_rank"] for a in hot] == [1], rank0.read_text()[-2000:]
    assert hot[0]["details"]["delta_c"] == pytest.approx(10.0, abs=1.0)
    assert [a for a in records_of(rank0, "alert") if a["type"] == "straggler"] == []
    assert cli(["cluster", str(tmp_path), "--straggler-min-s", "0"]) == 0
    out = capsys.readouterr().out
    head, row0, row1 = out.splitlines()[1:4]
    assert head.split()[-2:] == ["power", "temp"]
    assert row0.split()[-4:] == ["650", "W", "66", "C"] and row1.split()[-2:] == ["76", "C"]
    assert "HOT_GPU at step" in out and "rank 1's GPU" in out


def test_live_gpus_at_one_temperature_raise_no_hot_gpu(tmp_path, monkeypatch, fake_nvml):
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady")
    torchrun(tmp_path)
    alerts = records_of(tmp_path / "rank0.jsonl", "alert")
    assert alerts == [] and len(records_of(tmp_path / "rank0.jsonl", "cluster")) >= 3
