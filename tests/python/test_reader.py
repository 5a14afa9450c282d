"""Tests of steptrace.analysis.reader: reading files and run folders, truncation, corruption, schema."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from support import logfactory as lf
import steptrace
from steptrace.errors import LogFormatError
from steptrace.analysis.reader import CorruptLineWarning, TornLineWarning, TruncatedLogWarning, read, validate_record


def _read_all(path, **kw) -> list[dict]:
    return list(read(path, **kw))


# --------------------------------------------------------------------------- factory


def test_factory_records_validate_against_schema() -> None:
    recs = lf.run_records(3) + [lf.alert("stall", 2), lf.step(3, status="error")]
    for rec in recs:
        validate_record(rec)  # raises if the factory drifted from the schema


def test_validate_record_names_the_bad_field() -> None:
    bad = lf.step(0, step_ms=-1.0)
    with pytest.raises(LogFormatError, match=r"step record .*step_ms.*minimum"):
        validate_record(bad)


def test_validate_record_rejects_unknown_field_and_kind() -> None:
    with pytest.raises(LogFormatError, match="bogus"):
        validate_record(lf.step(0, bogus=1))
    with pytest.raises(LogFormatError, match="unknown record kind 'nonsense'"):
        validate_record({"kind": "nonsense", "rank": 0})


def test_interval_records_and_the_time_between_steps_are_read_and_validated(tmp_path: Path) -> None:
    recs = lf.timeline_run()
    path = lf.write_log(tmp_path / "rank0.jsonl", recs)
    read_back = _read_all(path, validate=True)
    assert read_back == recs
    intervals = [r for r in read_back if r["kind"] == "interval"]
    assert [(r["interval"], r["step"], r["inside_step"]) for r in intervals] == [
        ("checkpoint", 8, False), ("eval", 10, False), ("eval", 15, True), ("checkpoint", 16, False),
        ("checkpoint", 24, False), ("checkpoint", 30, False)]
    # each is written before the step record that lists it (the last before run_end)
    for i, rec in enumerate(read_back):
        if rec["kind"] == "interval":
            listed = next(r for r in read_back[i:] if r["kind"] in ("step", "run_end"))
            assert listed.get("step", listed.get("steps")) == rec["step"]
    step15 = next(r for r in read_back if r["kind"] == "step" and r["step"] == 15)
    assert step15["eval_ms"] == 5.0 and step15["interval_in_step_ms"] == 5.0
    assert read_back[-1]["goodput"]["from"] == "process_start"


def test_older_logs_without_the_between_step_fields_still_validate() -> None:
    for rec in lf.run_records(3):  # no other_ms, no host, no goodput: a log of an older steptrace
        assert "other_ms" not in rec and "goodput" not in rec
        validate_record(rec)


@pytest.mark.parametrize("change, needle", [
    ({"interval": "lunch"}, r"interval record does not match schema steptrace/1 at interval: 'lunch' is not one of"),
    ({"duration_ms": -3.0}, r"interval record .* at duration_ms: -3.0 is less than the minimum of 0"),
    ({"inside_step": "yes"}, r"interval record .* at inside_step: 'yes' is not of type 'boolean'"),
    ({"step": None}, r"interval record .* at step: None is not of type 'integer'"),
    ({"extra": 1}, r"interval record .*'extra' was unexpected"),
])
def test_a_malformed_interval_record_is_rejected_naming_the_field(change: dict, needle: str) -> None:
    with pytest.raises(LogFormatError, match=needle):
        validate_record({**lf.interval("eval", 3, 12.5), **change})


def test_a_missing_interval_field_is_named(tmp_path: Path) -> None:
    bad = lf.interval("checkpoint", 3, 1200.0)
    del bad["duration_ms"]
    path = lf.write_log(tmp_path / "rank0.jsonl", [lf.run_start(), lf.step(0), bad, lf.step(1)])
    with pytest.raises(LogFormatError, match=r"rank0\.jsonl:3: interval record .*'duration_ms' is a required property"):
        _read_all(path, validate=True)
    assert len(_read_all(path)) == 4  # not validated by default: read, and ignored by the summary


def test_malformed_between_step_fields_and_goodput_are_named() -> None:
    with pytest.raises(LogFormatError, match=r"step record .* at other_ms: -1.0 is less than the minimum"):
        validate_record(lf.step(0, other_ms=-1.0))
    with pytest.raises(LogFormatError, match=r"step record .* at host: 'runq_span_ms' is a required property"):
        validate_record(lf.step(0, host={"runq_ms": 1.0}))
    with pytest.raises(LogFormatError, match=r"run_end record .* at goodput/from: 'boot' is not one of"):
        validate_record(lf.run_end(3, goodput=lf.goodput(**{"from": "boot"})))
    bad = lf.goodput()
    del bad["steps_s"]
    with pytest.raises(LogFormatError, match=r"run_end record .* at goodput: 'steps_s' is a required property"):
        validate_record(lf.run_end(3, goodput=bad))


def test_public_api_exports_reader() -> None:
    assert steptrace.read is read
    assert steptrace.validate_record is validate_record


# --------------------------------------------------------------------------- reading


def test_read_file(tmp_path: Path) -> None:
    recs = lf.run_records(4)
    path = lf.write_log(tmp_path / "rank0.jsonl", recs)
    got = _read_all(path)
    assert got == recs
    assert [r["kind"] for r in got] == ["run_start"] + ["step"] * 4 + ["run_end"]


def test_read_accepts_str_path_and_validates(tmp_path: Path) -> None:
    recs = lf.run_records(2)
    path = lf.write_log(tmp_path / "rank0.jsonl", recs)
    assert _read_all(str(path), validate=True) == recs


def test_read_dir_of_two_ranks_in_rank_order(tmp_path: Path) -> None:
    # rank10 must come after rank2 (numeric, not lexical, order)
    for rank in (10, 2):
        lf.write_log(tmp_path / f"rank{rank}.jsonl", lf.run_records(3, rank=rank, world_size=11))
    (tmp_path / "notes.txt").write_text("not a log\n")
    got = _read_all(tmp_path)
    assert len(got) == 2 * 5
    assert [r["rank"] for r in got] == [2] * 5 + [10] * 5
    assert got[0]["kind"] == "run_start" and got[5]["kind"] == "run_start"


def test_read_list_of_paths(tmp_path: Path) -> None:
    a = lf.write_log(tmp_path / "a" / "rank0.jsonl", lf.run_records(1))
    b = lf.write_log(tmp_path / "b" / "rank0.jsonl", lf.run_records(2))
    got = _read_all([b, a.parent])
    assert len(got) == 4 + 3
    assert got[0]["kind"] == "run_start" and got[4]["kind"] == "run_start"


def test_empty_lines_are_ignored(tmp_path: Path) -> None:
    recs = lf.run_records(2)
    text = "\n".join(lf.lines(recs[:2])) + "\n\n   \n" + "\n".join(lf.lines(recs[2:])) + "\n"
    path = tmp_path / "rank0.jsonl"
    path.write_text(text)
    assert _read_all(path) == recs


def test_last_line_without_newline_but_complete_is_read(tmp_path: Path) -> None:
    recs = lf.run_records(2)
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(lf.lines(recs)))  # no final newline, yet valid JSON
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning either
        assert _read_all(path) == recs


def test_truncated_last_line_warns_and_keeps_the_rest(tmp_path: Path) -> None:
    recs = lf.run_records(3, end=False)
    partial = json.dumps(lf.step(3))[:40]  # the writer died mid-line
    path = lf.write_log(tmp_path / "rank0.jsonl", recs, tail=partial)
    with pytest.warns(TruncatedLogWarning, match=r"rank0\.jsonl:5"):
        got = _read_all(path)
    assert got == recs


def test_truncated_only_line_is_an_empty_log(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_text(json.dumps(lf.run_start())[:30])
    with pytest.warns(TruncatedLogWarning):
        with pytest.raises(LogFormatError, match="empty log"):
            _read_all(path)


def test_torn_middle_line_is_skipped_with_a_warning_and_reading_goes_on(tmp_path: Path) -> None:
    recs = lf.run_records(3)
    text = lf.lines(recs)
    text.insert(2, '{"kind": "step", "rank": 0, oops')  # becomes line 3: a write cut off
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(text) + "\n")
    with pytest.warns(TornLineWarning) as caught:
        got = _read_all(path)
    assert got == recs  # every record after the torn line too
    assert len(caught) == 1
    w = caught[0].message
    assert (w.path, w.count, w.lines) == (str(path), 1, (3,))
    msg = str(w)
    assert f"{path}:3: torn line skipped" in msg and "reading went on" in msg and "\n" not in msg


def test_torn_lines_are_counted_in_one_warning_per_file(tmp_path: Path) -> None:
    recs = lf.run_records(20)
    text = lf.lines(recs)
    for at in (3, 6, 9, 12, 16, 23):  # becomes lines 4, 7, 10, 13, 17, 24
        text.insert(at, json.dumps(lf.step(99))[:25])
    text.insert(len(text) - 1, "\x00\x00\x00\x00")  # NULs a crash left behind
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(text) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _read_all(path, validate=True)
    assert got == recs
    (w,) = [c.message for c in caught]
    assert isinstance(w, TornLineWarning)
    assert w.count == 7 and w.lines == (4, 7, 10, 13, 17)
    assert "7 torn lines skipped (lines 4, 7, 10, 13, 17, ...)" in str(w)


def test_a_record_written_after_a_tear_is_kept(tmp_path: Path) -> None:
    # the writer died mid-line and a resumed run appended to the same file: the next
    # record starts on the torn line
    recs = lf.run_records(3)
    text = lf.lines(recs)
    text[2] = json.dumps(lf.step(7))[:33] + text[2]
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(text) + "\n")
    with pytest.warns(TornLineWarning, match=r":3: torn line skipped.*1 complete record after a tear kept"):
        got = _read_all(path)
    assert got == recs


def test_torn_line_with_newline_at_end_is_not_truncation(tmp_path: Path) -> None:
    # a bad LAST line that does end in a newline is torn, not a truncated last write
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(1), tail="{garbage\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _read_all(path) == lf.run_records(1)
    assert [type(c.message) for c in caught] == [TornLineWarning]
    assert ":4: torn line skipped" in str(caught[0].message)


def test_a_torn_first_line_is_still_not_a_log(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_text(json.dumps(lf.run_start())[:30] + "\n" + "\n".join(lf.lines(lf.run_records(1)[1:])) + "\n")
    with pytest.raises(LogFormatError, match=r":1: not a steptrace log"):
        _read_all(path)


def test_skip_bad_warns_and_continues(tmp_path: Path) -> None:
    recs = lf.run_records(3)
    text = lf.lines(recs)
    text.insert(2, "{not json")
    text.insert(4, "[1, 2, 3]")
    text.insert(5, '{"no_kind": true}')
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n".join(text) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _read_all(path, skip_bad=True)
    assert got == recs
    messages = [str(w.message) for w in caught if w.category is CorruptLineWarning]
    assert len(messages) == 2
    assert any(":5: skipped: record is not a JSON object" in m for m in messages)
    assert any(':6: skipped: record has no "kind"' in m for m in messages)
    assert [w.message.lines for w in caught if w.category is TornLineWarning] == [(3,)]  # skipped anyway


def test_record_that_is_not_an_object_raises(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", [lf.run_start(), [1, 2]])
    with pytest.raises(LogFormatError, match=r":2: record is not a JSON object"):
        _read_all(path)


def test_record_without_kind_raises(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", [lf.run_start(), {"rank": 0}])
    with pytest.raises(LogFormatError, match=r':2: record has no "kind"'):
        _read_all(path)


def test_validate_reports_file_line_and_schema_message(tmp_path: Path) -> None:
    recs = lf.run_records(2)
    recs[2]["data_ms"] = "fast"
    path = lf.write_log(tmp_path / "rank0.jsonl", recs)
    assert len(_read_all(path)) == 4  # not validated by default
    with pytest.raises(LogFormatError, match=r"rank0\.jsonl:3: step record .*data_ms.*'fast' is not of type"):
        _read_all(path, validate=True)
    with pytest.warns(CorruptLineWarning):
        assert len(_read_all(path, validate=True, skip_bad=True)) == 3


# --------------------------------------------------------------------------- not a log


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_text("")
    with pytest.raises(LogFormatError, match="empty log"):
        _read_all(path)


def test_blank_only_file_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_text("\n\n  \n")
    with pytest.raises(LogFormatError, match="empty log"):
        _read_all(path)


@pytest.mark.parametrize(
    "first",
    [
        {"kind": "step", "rank": 0},  # no run_start
        {"kind": "run_start", "rank": 0},  # no schema
        {"kind": "run_start", "rank": 0, "schema": "otherlib/1"},
        {"hello": "world"},
    ],
)
def test_not_a_steptrace_log(tmp_path: Path, first: dict) -> None:
    path = lf.write_log(tmp_path / "x.jsonl", [first, lf.step(0)])
    with pytest.raises(LogFormatError, match=r"x\.jsonl:1: not a steptrace log"):
        _read_all(path)


def test_not_json_at_all(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(LogFormatError, match=r"data\.jsonl:1: not a steptrace log"):
        _read_all(path, skip_bad=True)  # skip_bad must not let a non-log through


def test_newer_schema(tmp_path: Path) -> None:
    path = lf.write_log(tmp_path / "rank0.jsonl", [lf.run_start(schema="steptrace/2"), lf.step(0)])
    with pytest.raises(LogFormatError, match="newer steptrace"):
        _read_all(path)


def test_missing_path_raises_at_call(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(LogFormatError, match=r"nope: no such file or directory"):
        read(missing)  # raised eagerly, before iterating


def test_dir_without_logs(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("hi\n")
    with pytest.raises(LogFormatError, match="no .jsonl log files"):
        read(tmp_path)


def test_bad_second_file_in_dir_names_that_file(tmp_path: Path) -> None:
    lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(2))
    (tmp_path / "rank1.jsonl").write_text("")
    it = read(tmp_path)
    with pytest.raises(LogFormatError, match=r"rank1\.jsonl: empty log"):
        list(it)


def test_log_format_error_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        read(tmp_path / "missing.jsonl")


def test_large_file_streams_all_records(tmp_path: Path) -> None:
    # read() returns an iterator: the first record comes before the rest is consumed
    n = 20_000
    path = lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(n))
    it = read(path)
    assert next(it)["kind"] == "run_start"
    rest = sum(1 for _ in it)
    assert rest == n + 1
