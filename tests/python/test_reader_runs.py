"""steptrace.analysis.reader: run folders must hold one run; the progress bar of long reads."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from support import logfactory as lf
from steptrace._progress import Progress
from steptrace.errors import LogFormatError
from steptrace.analysis.reader import log_files, read

AUTO_A = "20260101T120000Z-node1-4242"
AUTO_B = "20260101T120002Z-node2-977"


def _rank_file(folder: Path, rank: int, world: int = 2, **start) -> Path:
    recs = [lf.run_start(rank=rank, world_size=world, **start)] + [lf.step(i, rank=rank) for i in range(3)]
    return lf.write_log(folder / f"rank{rank}.jsonl", recs)


def test_ranks_of_one_run_read_together(tmp_path: Path) -> None:
    _rank_file(tmp_path, 0, run_id="job-7")
    _rank_file(tmp_path, 1, run_id="job-7")
    assert len(list(read(tmp_path))) == 8


def test_different_run_ids_in_one_folder_are_mixed_runs(tmp_path: Path) -> None:
    _rank_file(tmp_path, 0, run_id="run-a")
    _rank_file(tmp_path, 1, run_id="run-b")
    with pytest.raises(LogFormatError) as info:
        list(read(tmp_path))
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path}: mixed runs in one folder: ")
    assert "rank0.jsonl is run 'run-a' but rank1.jsonl is run 'run-b'" in msg


def test_generated_ids_of_ranks_started_together_are_one_run(tmp_path: Path) -> None:
    # torchrun without a rendezvous id: every rank process makes up its own run id
    _rank_file(tmp_path, 0, run_id=AUTO_A, start_unix_ns=lf.T0_NS)
    _rank_file(tmp_path, 1, run_id=AUTO_B, start_unix_ns=lf.T0_NS + 2 * 10**9)
    assert len(list(read(tmp_path))) == 8


def test_generated_ids_far_apart_are_mixed_runs(tmp_path: Path) -> None:
    _rank_file(tmp_path, 0, run_id=AUTO_A, start_unix_ns=lf.T0_NS)
    _rank_file(tmp_path, 1, run_id=AUTO_B, start_unix_ns=lf.T0_NS + 3600 * 10**9)  # an hour later
    with pytest.raises(LogFormatError, match="mixed runs"):
        list(read(tmp_path))


def test_same_rank_twice_or_other_world_size_are_mixed_runs(tmp_path: Path) -> None:
    a = tmp_path / "a"
    _rank_file(a, 0, run_id="x")
    lf.write_log(a / "old.jsonl", [lf.run_start(rank=0, world_size=2, run_id="x"), lf.step(0)])
    with pytest.raises(LogFormatError, match=r"mixed runs in one folder: rank0\.jsonl and old\.jsonl are both rank 0"):
        list(read(a))
    b = tmp_path / "b"
    _rank_file(b, 0, world=2, run_id="x")
    _rank_file(b, 1, world=4, run_id="x")
    with pytest.raises(LogFormatError, match="rank0.jsonl has world_size 2 but rank1.jsonl has 4"):
        list(read(b))


def test_several_runs_given_as_a_list_are_fine(tmp_path: Path) -> None:
    _rank_file(tmp_path / "a", 0, world=1, run_id="run-a")
    _rank_file(tmp_path / "b", 0, world=1, run_id="run-b")
    recs = list(read([tmp_path / "a", tmp_path / "b"]))
    assert [r["run_id"] for r in recs if r["kind"] == "run_start"] == ["run-a", "run-b"]
    assert log_files([tmp_path / "b", tmp_path / "a" / "rank0.jsonl"]) == [
        tmp_path / "b" / "rank0.jsonl", tmp_path / "a" / "rank0.jsonl"]


# --------------------------------------------------------------------------- progress


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_and_erases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPTRACE_PROGRESS_DELAY_S", "0")
    tty = _FakeTTY()
    bar = Progress(200 * 2**20, "reading run", stream=tty)
    assert bar.enabled
    bar.update(50 * 2**20)
    text = tty.getvalue()
    assert text.startswith("\r\x1b[2Kreading run [#######") and " 25%" in text and "50/200 MiB" in text
    bar.update(60 * 2**20)  # within 0.1 s of the last draw: not redrawn
    assert tty.getvalue() == text
    bar.close()
    assert tty.getvalue().endswith("\r\x1b[2K")


def test_progress_waits_before_drawing_and_never_draws_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPTRACE_PROGRESS_DELAY_S", raising=False)
    tty = _FakeTTY()
    bar = Progress(100, stream=tty)
    bar.update(50)  # before DELAY_S: a quick read prints nothing
    bar.close()
    assert tty.getvalue() == ""
    pipe = io.StringIO()
    monkeypatch.setenv("STEPTRACE_PROGRESS_DELAY_S", "0")
    bar = Progress(100, stream=pipe)
    assert not bar.enabled
    bar.update(100)
    bar.close()
    assert pipe.getvalue() == ""


def test_read_reports_progress_through_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPTRACE_PROGRESS_DELAY_S", "0")
    _rank_file(tmp_path, 0, run_id="r")
    lf.write_log(tmp_path / "rank1.jsonl", [lf.run_start(rank=1, world_size=2, run_id="r")]
                 + [lf.step(i, rank=1) for i in range(10_000)])
    total = sum(f.stat().st_size for f in log_files(tmp_path))
    seen = []

    class Recorder(Progress):
        def update(self, done: int) -> None:
            seen.append(done)

    bar = Recorder(total, stream=_FakeTTY())
    assert len(list(read(tmp_path, progress=bar))) == 4 + 10_001
    assert seen == sorted(seen) and seen[-1] == total and len(seen) >= 3  # per 4096 lines and per file
    assert not bar.enabled  # closed at the end
