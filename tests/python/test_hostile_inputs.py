"""Inputs from outside the trainer's control, each case bounded and stopping by itself
(issue 50): other ranks' values in the store (a poisoned, a two-object, a version-skewed
heartbeat or summary), files planted in the folders steptrace writes in, an exception
whose text cannot cross into C++, a log crafted to break the reader or drive the
terminal. Each asserts that the trainer (or the CLI) is unharmed: the alerts still raised,
the steps still recorded, the user's exception unchanged, one line and exit 2."""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import types
from pathlib import Path
from typing import Callable, Optional

import pytest

import steptrace
from support.logfactory import alert, run_end, run_start, run_cli_tty, step, write_log
from steptrace.cli import main as cli
from steptrace.cluster import CLUSTER_OPTIONS, ClusterExchange
from steptrace.errors import ConfigError

# ---------------------------------------------------------------- the cross-rank view


class _Core:
    """What the exchange reads of a rank's core, set by the test (test_cluster.py's
    _RankCore, for any world size)."""

    def __init__(self, rank: int, world: int, log_path: Path) -> None:
        self.config = types.SimpleNamespace(rank=rank, world_size=world, run_id="hostile")
        self.log_path = str(log_path)
        log_path.write_text("")
        self.in_step, self.step_index, self.current_phase, self.collectives_in_flight = False, 0, "", 0
        self.current_interval = ""
        self.written: list[dict] = []

    def set_peers_in_interval(self, peers: int, notice_s: float) -> None:
        pass

    def at(self, step: int, phase: str, collectives: int = 0) -> None:
        self.in_step, self.step_index, self.current_phase, self.collectives_in_flight = True, step + 1, phase, collectives

    def write_record(self, record: dict) -> None:  # a value, as the core's write_record takes it
        self.written.append(dict(record))


def _ranks(tmp_path: Path, world: int, hostile: int, options: Optional[dict] = None):
    """`world` ranks through one HashStore on a clock the test sets; rank `hostile` runs no
    exchange: the test writes its store values itself. poll(t, hb=None) runs the honest
    ranks' polls (the aggregator, rank 0, last), after setting the hostile rank's heartbeat
    to `hb` (bytes) when given, and returns what rank 0 wrote other than cluster records."""
    from torch.distributed import HashStore

    now = [100.0]
    store = HashStore()
    options = {**CLUSTER_OPTIONS, "cluster_silent_s": 1.0, "cluster_poll_s": 0.1, **(options or {})}
    cores = {r: _Core(r, world, tmp_path / f"rank{r}.jsonl") for r in range(world)}
    exchanges = {r: ClusterExchange(cores[r], options, store=store, clock=lambda: now[0])
                 for r in range(world) if r != hostile}

    def poll(t: float, hb: Optional[bytes] = None) -> list[tuple]:
        now[0] = t
        if hb is not None:
            store.set(f"steptrace/hostile/h{hostile}", hb)
        for r in sorted(exchanges, reverse=True):
            exchanges[r].poll_once()  # raises on the code as it was: the poll failed for every rank
        out = [(r["kind"], r["type"], r["subject_rank"]) for r in cores[0].written if r["kind"] != "cluster"]
        cores[0].written.clear()
        return out

    return cores, exchanges, store, poll


def _hb(t: float, step: int = 40, phase: str = "forward", progress: Optional[float] = None, **over) -> bytes:
    """A heartbeat as exchange.py publishes it."""
    hb = {"t": t, "p": t if progress is None else progress, "s": step, "ph": phase, "c": 0, "i": "", "w": -1,
          "m": 0.02, **over}
    return json.dumps(hb, separators=(",", ":")).encode()


def _warnings_naming(caplog, rank: int) -> list[str]:
    return [m for m in caplog.messages if f"rank {rank} published" in m]


def test_a_poisoned_heartbeat_is_skipped_and_a_silent_rank_is_still_named(tmp_path, caplog):
    # rank 1 publishes `{"t":` at every poll; rank 2 blocks in forward at step 40 while rank 0
    # waits for it in the all-reduce. The whole poll used to fail on rank 1's value (60 of
    # 60 polls), and rank 2 was never reported.
    caplog.set_level(logging.WARNING, logger="steptrace")
    cores, exchanges, _, poll = _ranks(tmp_path, 3, hostile=1)
    cores[0].at(40, "backward", collectives=1)
    cores[2].at(40, "forward")
    found = []
    for i in range(30):  # 3 s of polls, every one with the poisoned value
        found += poll(100.0 + 0.1 * i, hb=b'{"t":')
    assert found == [("alert", "rank_silent", 2)]  # rank 2 named, rank 1 never
    assert exchanges[0].errors == 0
    assert "not one JSON object" in exchanges[0].unreadable[(1, "heartbeat")]
    assert len(_warnings_naming(caplog, 1)) == 1  # once, not once per poll


def test_a_two_object_heartbeat_cannot_speak_for_another_rank(tmp_path, caplog):
    # rank 1's value holds two objects; the second says "progress now, step 999". Parsed
    # together, it took rank 2's slot: rank 2, blocked in forward, looked busy and was never
    # reported, and "rank 2 at step 999" was what rank 0 believed.
    caplog.set_level(logging.WARNING, logger="steptrace")
    cores, exchanges, _, poll = _ranks(tmp_path, 3, hostile=1)
    cores[0].at(40, "backward", collectives=1)
    cores[2].at(40, "forward")
    found = []
    for i in range(30):
        t = 100.0 + 0.1 * i
        found += poll(t, hb=_hb(t) + b"," + _hb(t, step=999, phase="optimizer"))
    assert found == [("alert", "rank_silent", 2)]
    hb = exchanges[0]._hb
    assert 1 not in hb and hb[2]["step"] == 40  # rank 2's own heartbeat in rank 2's slot
    assert "not one JSON object" in exchanges[0].unreadable[(1, "heartbeat")]
    assert len(_warnings_naming(caplog, 1)) == 1


@pytest.mark.parametrize("value,reason", [
    (_hb(100.0)[:-1] + b',"s":"40"}', "field 's' is a str"),  # an older/newer version's types
    (json.dumps({"t": 100.0, "p": 100.0}).encode(), "no field"),  # fields missing
    (_hb(100.0, c="yes"), "field 'c'"),
    (_hb(100.0, w=None), "field 'w'"),
    (_hb(100.0).replace(b'"t":100.0', b'"t":1e999'), "field 't'|not one JSON object"),  # inf
    (_hb(100.0).replace(b'"s":40', b'"s":' + b"9" * 5000), "not one JSON object"),  # past int()'s limit
    (_hb(100.0, fr={"0": "not a group state"}), "field 'fr'"),
    (b"[1, 2]", "a JSON list"),
    (b"\xff\xfe", "not one JSON object"),
    (b"[" * 100_000, "not one JSON object"),  # nesting deeper than any parser's stack
    (b" " * (2 << 20), "bytes, more than"),
])
def test_a_version_skewed_or_corrupt_heartbeat_is_left_out_alone(tmp_path, caplog, value, reason):
    caplog.set_level(logging.WARNING, logger="steptrace")
    cores, exchanges, _, poll = _ranks(tmp_path, 3, hostile=1)
    cores[0].at(40, "backward", collectives=1)
    cores[2].at(40, "forward")
    found = []
    for i in range(25):
        found += poll(100.0 + 0.1 * i, hb=value)
    assert found == [("alert", "rank_silent", 2)]
    assert re.search(reason, exchanges[0].unreadable[(1, "heartbeat")])
    assert len(_warnings_naming(caplog, 1)) == 1
    assert 1 not in exchanges[0]._hb


def test_a_rank_that_publishes_a_good_heartbeat_again_is_back_in_the_view(tmp_path):
    cores, exchanges, _, poll = _ranks(tmp_path, 3, hostile=1)
    assert poll(100.0, hb=b"garbage") == []
    assert (1, "heartbeat") in exchanges[0].unreadable
    assert poll(100.1, hb=_hb(100.1, step=3)) == []
    assert exchanges[0].unreadable == {} and exchanges[0]._hb[1]["step"] == 3


def _write_steps(core: _Core, rank: int, first: int, n: int, forward: float, wait: float) -> None:
    with open(core.log_path, "a") as f:
        for i in range(first, first + n):
            exposed = 0.5 + wait
            phases = {"forward": forward, "loss": 0.2, "backward": 2.0 + exposed, "optimizer": 0.3}
            total = sum(phases.values())
            rec = {"kind": "step", "rank": rank, "step": i, "status": "ok", "step_ms": total, "host_ms": total,
                   "data_ms": 0.0, "phases_ms": phases, "memory": {"rss_bytes": 1 << 30},
                   "comm": {"method": "host", "comm_ms": exposed, "exposed_ms": exposed,
                            "compute_ms": total - exposed, "collectives": 1, "exposed_in": "backward"}}
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")


@pytest.mark.parametrize("summary", [
    b'{"rank":1,"window":',  # torn
    b'{"rank":1,"window":"0"}',  # another version's types, fields missing
    b'{"rank":2,"window":0}',  # a summary for another rank in rank 1's key
])
def test_a_poisoned_window_summary_leaves_the_straggler_verdict(tmp_path, caplog, summary):
    # ranks 0, 2 and 3 publish real windows, rank 3 computes 30% longer; rank 1 heartbeats
    # like a rank with a window and publishes a summary nobody can use.
    caplog.set_level(logging.WARNING, logger="steptrace")
    interval = 10
    cores, exchanges, store, poll = _ranks(tmp_path, 4, hostile=1, options={
        "cluster_interval": interval, "straggler_windows": 1, "straggler_min_s": 0.0})
    found = []
    for w in range(3):
        for r in (0, 2, 3):
            _write_steps(cores[r], r, w * interval, interval, forward=26.0 if r == 3 else 20.0,
                         wait=0.0 if r == 3 else 6.0)
        store.set("steptrace/hostile/w1", summary)
        t = 100.0 + 0.1 * w
        found += poll(t, hb=_hb(t, step=(w + 1) * interval, w=w))
    assert ("alert", "straggler", 3) in found and all(subject != 1 for _, _, subject in found)
    assert "window summary" in " ".join(k for _, k in exchanges[0].unreadable)
    assert len(_warnings_naming(caplog, 1)) == 1
    assert exchanges[0].errors == 0


def test_a_corrupt_window_number_does_not_stop_the_cross_rank_records(tmp_path):
    # rank 1's heartbeat is well formed but says window 10**15 (a flipped bit): the view
    # used to move past every honest rank's windows for the rest of the run.
    interval = 10
    cores, exchanges, _, poll = _ranks(tmp_path, 3, hostile=1, options={"cluster_interval": interval})
    for w in range(4):
        for r in (0, 2):
            _write_steps(cores[r], r, w * interval, interval, forward=20.0, wait=0.0)
        t = 100.0 + 0.1 * w
        poll(t, hb=_hb(t, step=(w + 1) * interval, w=10**15))
    last = exchanges[0]._analyzer.last_cluster
    assert last is not None and last["window"] >= 2 and last["ranks_reporting"] == 2


def test_a_corrupt_busy_list_is_ignored_by_a_waiting_rank(tmp_path, caplog):
    # the aggregator's list of ranks in an evaluation, read by a rank waiting in a collective
    caplog.set_level(logging.WARNING, logger="steptrace")
    cores, exchanges, store, poll = _ranks(tmp_path, 3, hostile=1)
    cores[2].at(5, "backward", collectives=1)
    poll(100.0, hb=_hb(100.0))
    store.set("steptrace/hostile/busy", b'{"not": "a list"}')
    for i in range(5):
        exchanges[2].tick_once()
        poll(100.1 + 0.1 * i, hb=_hb(100.1 + 0.1 * i))
    assert exchanges[2].errors == 0 and (0, "list of busy ranks") in exchanges[2].unreadable
    assert len(_warnings_naming(caplog, 0)) == 1


# ---------------------------------------------------------------- files in shared folders


def test_a_symlink_planted_at_the_log_path_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "rank0.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"rank0\.jsonl.* is a symbolic link"):
        steptrace.Profiler(run, overwrite=True)  # steptrace run's default
    assert victim.read_text() == "precious\n"
    # the user removes the link: the run goes on as usual
    (run / "rank0.jsonl").unlink()
    with steptrace.Profiler(run, overwrite=True) as prof:
        with prof.step():
            pass
    assert [r["kind"] for r in steptrace.read(run)] == ["run_start", "step", "run_end"]


def test_logs_are_not_world_readable_by_default_and_log_mode_changes_it(tmp_path):
    old = os.umask(0o022)
    try:
        with steptrace.Profiler(tmp_path / "a"):
            pass
        with steptrace.Profiler(tmp_path / "b", log_mode=0o644):
            pass
        with pytest.raises(ConfigError, match="log_mode"):
            steptrace.Profiler(tmp_path / "c", log_mode=0o400)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "rank0.jsonl").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "b" / "rank0.jsonl").stat().st_mode) == 0o644
    assert not (tmp_path / "c").exists()


def test_the_metrics_textfile_temporary_never_follows_a_planted_link(tmp_path):
    # the temporary was <textfile>.<pid>.tmp, opened with fopen("w"): a link planted under
    # that name in a shared node-exporter folder overwrote its target every second
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    textfile = tmp_path / "collector" / "steptrace.prom"
    textfile.parent.mkdir()
    (textfile.parent / f"steptrace.prom.{os.getpid()}.tmp").symlink_to(victim)
    with steptrace.Profiler(tmp_path / "run", metrics_textfile=str(textfile)) as prof:
        for _ in range(3):
            with prof.step():
                pass
    assert victim.read_text() == "precious\n"
    assert "steptrace_" in textfile.read_text()
    assert sorted(p.name for p in textfile.parent.iterdir()) == ["steptrace.prom",
                                                                 f"steptrace.prom.{os.getpid()}.tmp"]


@pytest.mark.parametrize("command,output", [("report", "out.html"), ("export", "out.csv")])
def test_report_and_export_temporaries_never_follow_a_planted_link(tmp_path, command, output):
    pytest.importorskip("numpy")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = write_log(tmp_path / "run" / "rank0.jsonl", [run_start(), *[step(i) for i in range(20)], run_end(20)])
    out = tmp_path / output
    (tmp_path / f"{output}.tmp-{os.getpid()}").symlink_to(victim)  # the old temporary's name
    args = [command, str(run.parent), "-o", str(out)] + (["--format", "csv"] if command == "export" else [])
    assert cli(args) == 0
    assert victim.read_text() == "precious\n"
    assert out.stat().st_size > 100 and not out.is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # nothing left behind


# ---------------------------------------------------------------- the user's exception


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


@pytest.mark.parametrize("exc,text", [
    (ValueError("\udcff"), "ValueError: \\udcff"),  # a lone surrogate: no UTF-8 for it
    (ValueError("bad byte \udc80 in a path"), "ValueError: bad byte \\udc80 in a path"),
    (_Unprintable(), "_Unprintable: <_Unprintable: str() failed>"),
])
def test_the_users_exception_propagates_unchanged_and_run_end_says_exception(tmp_path, exc, text):
    with pytest.raises(type(exc)) as caught:
        with steptrace.Profiler(tmp_path) as prof:
            with prof.step():
                pass
            raise exc
    assert caught.value is exc and caught.value.__context__ is None  # not a TypeError chained onto it
    end = [r for r in steptrace.read(tmp_path) if r["kind"] == "run_end"]
    assert [(e["reason"], e.get("error")) for e in end] == [("exception", text)]


# ---------------------------------------------------------------- crafted logs and the CLI


def test_a_schema_of_5000_digits_is_one_line_and_exit_2(tmp_path, capsys):
    run = write_log(tmp_path / "run" / "rank0.jsonl", [run_start(schema="steptrace/" + "9" * 5000)])
    assert cli(["summary", str(run.parent)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("steptrace: error: ") and err.count("\n") == 1, err[:500]
    assert "unknown schema version" in err and len(err) < 400
    with pytest.raises(steptrace.LogFormatError, match="unknown schema version"):
        list(steptrace.read(run))


#: What a crafted log put on the terminal: clear the screen, retitle the window, an OSC 8
#: link, a CSI as one 8-bit byte, a right-to-left override, and rich markup.
_NASTY = "\x1b[2J\x1b]0;pwned\x07\x1b]8;;http://x\x07x\x1b]8;;\x07\x9b31m\u202e[link=http://y]z[/link]"


def _crafted_run(path: Path, rank: int = 0, world: int = 1) -> Path:
    phases = {"forward": 3.0, f"fwd{_NASTY}": 1.0}
    records = [run_start(rank=rank, world_size=world, host=f"node{_NASTY}"),
               *[step(i, rank=rank, phases=phases) for i in range(30)],
               alert("step_regression", 12, rank=rank, phase=f"fwd{_NASTY}", message=f"slow {_NASTY}\nALL CLEAR"),
               run_end(30, rank=rank)]
    return write_log(path / f"rank{rank}.jsonl", records)


def _no_control(text: str) -> None:
    for bad in ("\x1b[2J", "\x1b]", "\x07", "\x9b", "\u202e", "\nALL CLEAR"):
        assert bad not in text, (bad, text[:2000])


def test_summary_cluster_and_compare_print_no_control_characters(tmp_path, capsys):
    pytest.importorskip("numpy")
    run = tmp_path / "run"
    _crafted_run(run)
    assert cli(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    _no_control(out)
    assert "fwd\\x1b[2J" in out and "\\u202e" in out  # shown, inert
    assert cli(["compare", str(run), str(run)]) == 0
    _no_control(capsys.readouterr().out)
    two = tmp_path / "two"
    _crafted_run(two, 0, 2)
    _crafted_run(two, 1, 2)
    cli(["cluster", str(two), "--straggler-min-s", "0"])
    out = capsys.readouterr().out
    _no_control(out)
    assert "node\\x1b" in out
    # an error message naming a file: the name is shown inert too
    assert cli(["summary", str(tmp_path / f"missing{_NASTY}")]) == 2
    _no_control(capsys.readouterr().err)


def test_rich_tables_on_a_terminal_print_no_control_characters_and_no_markup(tmp_path):
    pytest.importorskip("rich")
    pytest.importorskip("numpy")
    run = tmp_path / "run"
    _crafted_run(run)
    for args in (["summary", run], ["compare", run, run]):
        rc, out, _ = run_cli_tty(*args)
        assert rc == 0, out[-2000:]
        _no_control(out)
        assert "\x1b]8;" not in out  # rich made no link of the markup in the phase name
        assert "fwd\\x1b[2J" in out
        if args[0] == "summary":  # (compare cuts the long name short)
            assert "[/link]" in out  # shown as the text it is, not read as markup


def test_printable_keeps_text_and_layout():
    from steptrace._terminal import printable

    assert printable("forward  12.5 ms\tß 数据 ✓") == "forward  12.5 ms\tß 数据 ✓"
    assert printable("a\nb") == "a\nb" and printable("a\nb", one_line=True) == "a\\x0ab"
    assert printable("\x1b[2J\x9b\u202e\udcff") == "\\x1b[2J\\x9b\\u202e\\udcff"
    assert printable(printable("\x1b")) == "\\x1b"


def test_a_phase_name_with_a_lone_surrogate_is_printed():
    # the reader's json fallback (no orjson) lets "\udcff" through: printing it raised
    # UnicodeEncodeError on a UTF-8 terminal instead of the summary
    from steptrace.analysis.summary import format_summary, summarize

    records = [run_start(), *[step(i, phases={"forward": 3.0, "fwd\udcff": 1.0}) for i in range(20)], run_end(20)]
    text = format_summary(summarize(records))
    assert "fwd\\udcff" in text
    text.encode("utf-8")  # would raise UnicodeEncodeError
