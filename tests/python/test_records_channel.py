"""The record channel (steptrace.live.records_channel, Profiler.records in C++): the records a
profiler writes reach Python as dicts decoded in C++, only the kinds asked for, exactly as
the log has them; Python's own records go in as dicts and are written as the JSON text path
wrote them; a channel nobody takes from is bounded and never holds the writer back."""

from __future__ import annotations

import json

import pytest

import steptrace
from steptrace.live.records_channel import LogTail, follow_records

MAX_KEPT = 1 << 16  # RecordTap::kMaxLines: what a channel keeps for a taker that falls behind


def _steps(prof: steptrace.Profiler, n: int) -> None:
    for _ in range(n):
        with prof.step():
            with prof.phase("forward"):
                pass


def test_a_kind_filter_gives_only_those_records_with_their_fields_typed(tmp_path):
    with steptrace.Profiler(tmp_path / "run", detect=False) as prof:
        steps = follow_records(prof._core, kinds=("step",))
        everything = follow_records(prof._core)
        _steps(prof, 5)
        prof._core.flush()
        got = steps.take()
        assert [r["kind"] for r in got] == ["step"] * 5  # no run_start: not asked for
        first = got[0]
        assert type(first["step"]) is int and first["step"] == 0
        assert type(first["step_ms"]) is float
        assert type(first["phases_ms"]) is dict and type(first["phases_ms"]["forward"]) is float
        assert type(first["memory"]) is dict
        assert steps.take() == []  # each record once
        seen = everything.take()
    seen += everything.take()  # run_end, after close
    # the same records as the log, field for field and in order
    on_disk = [json.loads(line) for line in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()]
    assert seen == on_disk
    assert [r["kind"] for r in seen][:1] == ["run_start"] and seen[-1]["kind"] == "run_end"
    assert list(seen[1]) == list(on_disk[1])  # key order kept too


def test_python_records_go_in_as_dicts_and_are_written_as_the_text_path_wrote_them(tmp_path):
    record = {"kind": "cluster", "step": 3, "window": 0, "world_size": 2, "ranks_reporting": 2,
              "stragglers": [1], 7: "int key", "ranks": [{"rank": 1, "comm_ms": None, "straggler_pct": 30.77,
                                                         "ok": True, "tup": (1, 2.5)}]}
    with steptrace.Profiler(tmp_path / "run", detect=False) as prof:
        clusters = prof._core.records(["cluster"])
        prof._core.write_record(record)
        prof._core.write_record(json.dumps(record))  # the text path, still taken
        with pytest.raises(ValueError, match="not finite"):
            prof._core.write_record({**record, "bad": float("nan")})
        with pytest.raises(TypeError, match="not a JSON value"):
            prof._core.write_record({**record, "bad": object()})
        prof._core.flush()
        got = clusters.take()
    lines = [line for line in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()
             if line.startswith('{"kind":"cluster"')]
    assert len(lines) == 2 and lines[0] == lines[1]
    assert got[0] == got[1] == json.loads(lines[0])
    assert got[0]["7"] == "int key" and got[0]["ranks"][0]["tup"] == [1, 2.5] and got[0]["rank"] == 0


def test_a_channel_nobody_takes_from_is_bounded_and_never_holds_the_writer_back(tmp_path):
    n = MAX_KEPT + 2000
    prof = steptrace.Profiler(tmp_path / "run", detect=False, queue_capacity=1 << 16)
    idle = prof._core.records(["step"])  # never taken from while the run goes on
    core = prof._core
    for _ in range(n):
        core.begin_step()
        core.end_step()
    prof.close()  # returns: the writer wrote every record past the idle channel
    written = [r["step"] for r in steptrace.read(tmp_path / "run" / "rank0.jsonl") if r["kind"] == "step"]
    assert written[-1] == n - 1 and len(written) > MAX_KEPT
    kept = [r["step"] for r in idle.take()]
    # the channel holds at most MAX_KEPT records of its kinds, the newest steps, the oldest
    # dropped; the tap queues no other kind for it (run_start and run_end took no place)
    assert len(kept) == MAX_KEPT
    assert kept == written[-len(kept):]


def test_a_stand_in_core_is_followed_through_its_log_file(tmp_path):
    log = tmp_path / "rank0.jsonl"
    log.write_text('{"kind":"run_start"}\n{"kind":"step","step":0}\n{"kind":"st')

    class StandIn:
        log_path = str(log)

    tail = follow_records(StandIn(), kinds=["step"])
    assert isinstance(tail, LogTail)
    assert tail.take() == [{"kind": "step", "step": 0}]
    with log.open("a") as f:
        f.write('ep","step":1}\n')
    assert tail.take() == [{"kind": "step", "step": 1}]


def test_the_flight_recorders_answer_goes_in_as_a_dict(tmp_path):
    # The hang alert's details.flight_recorder (steptrace.flight_recorder.snapshot()) is handed
    # to the core as a value; the live hang in test_cluster.py shows it in the alert.
    with steptrace.Profiler(tmp_path / "run", detect=False) as prof:
        core = prof._core
        core.answer_collectives({"recorder": "off", "why": "no process group", "summary": ""})
        core.answer_collectives(None)  # nothing to say
        core.answer_collectives('{"recorder":"off"}')  # JSON text, as C++ callers give it
        with pytest.raises(TypeError, match="a dict or None"):
            core.answer_collectives([1])
        with pytest.raises(ValueError, match=r"answer_collectives: answer\.groups\[0\] is not finite"):
            core.answer_collectives({"groups": [float("inf")]})
