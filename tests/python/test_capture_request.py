"""``steptrace capture`` (issue 54, point 3): a request file in the run's log folder, taken
by the profiler's alert thread, answered, and followed by the evidence record.

Real PyTorch loops on the CPU. The loops run until what they wait for is on disk (the
evidence record, the answer file) or a step cap: no sleeps as synchronization. Detectors
stay in warm-up so no alert's own capture competes with the request.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading

import pytest

torch = pytest.importorskip("torch")

import steptrace  # noqa: E402
from steptrace import cli  # noqa: E402
from steptrace.analysis.reader import validate_record  # noqa: E402
from steptrace.live import capture_request as cr  # noqa: E402

STEP_CAP = 20000  # a loop that never sees what it waits for fails here, not by hanging


def open_profiler(path, **options):
    opts = dict(evidence=True, evidence_baseline_step=2, evidence_steps=3, capture_min_interval_s=0.0,
                warmup_steps=10**6)
    opts.update(options)
    return steptrace.Profiler(path, **opts)


class Loop:
    """A small real training step."""

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = torch.randn(32, 64), torch.randn(32, 8)

    def run_until(self, prof, done):
        for _ in range(STEP_CAP):
            if done():
                return True
            with prof.step():
                with prof.phase("forward"):
                    out = self.model(self.x)
                with prof.phase("loss"):
                    loss = torch.nn.functional.mse_loss(out, self.y)
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    self.opt.step()
                    self.opt.zero_grad()
        return done()


def requested(prof, rid):
    return [r for r in prof.evidence.records if r["details"]["evidence"].get("request") == rid]


def listing(path):
    return sorted(os.listdir(path))


def test_cli_request_while_the_loop_runs_brings_the_evidence(tmp_path):
    loop = Loop()
    with open_profiler(tmp_path) as prof:
        assert loop.run_until(prof, lambda: prof.evidence.baseline is not None)  # not busy with it
        prof.flush()
        out, rc = io.StringIO(), []
        cli_thread = threading.Thread(target=lambda: rc.append(cr.capture(str(tmp_path), 4, None, 60.0, out)))
        cli_thread.start()
        assert loop.run_until(prof, lambda: any(r["details"]["evidence"].get("request")
                                                for r in prof.evidence.records))
        cli_thread.join(60)  # the CLI sees the record once the writer flushed it (<= ~100 ms)
        assert not cli_thread.is_alive()
    assert rc == [0], out.getvalue()
    with open(prof.log_path) as f:
        logged = [json.loads(line) for line in f if '"request"' in line]
    assert len(logged) == 1
    rec = logged[0]
    ev = rec["details"]["evidence"]
    validate_record(rec)
    assert rec["type"] == "capture"
    assert ev["steps"][1] - ev["steps"][0] + 1 == 4  # the request's --steps, not evidence_steps (3)
    assert ev["baseline"] is not None
    text = out.getvalue()
    assert "capture armed before step" in text
    assert f"verdict: {ev['verdict']}" in text
    assert f"trace: {os.path.join(str(tmp_path), ev['trace'])}" in text
    assert os.path.exists(os.path.join(str(tmp_path), ev["trace"]))
    assert not os.path.exists(cr.request_path(str(tmp_path), 0))  # taken and removed


def test_request_written_before_the_loop_is_taken(tmp_path):
    loop = Loop()
    with open_profiler(tmp_path, evidence_baseline_step=10**6) as prof:
        cr._write_atomic(cr.request_path(str(tmp_path), 0), {"id": "early1", "steps": 2})
        assert loop.run_until(prof, lambda: requested(prof, "early1"))
        ev = requested(prof, "early1")[0]["details"]["evidence"]
    assert ev["steps"][1] - ev["steps"][0] == 1
    assert ev["verdict"].startswith("no baseline yet")
    with open(cr.answer_path(str(tmp_path), 0)) as f:
        answer = json.load(f)
    assert answer["id"] == "early1" and answer["accepted"] is True and isinstance(answer["step"], int)


def test_a_refused_request_says_why(tmp_path):
    with open_profiler(tmp_path, capture_max=0) as prof:
        prof.flush()
        out = io.StringIO()
        # the alert thread answers without any step; the CLI returns on the answer
        assert cr.capture(str(tmp_path), 2, 0, 60.0, out) == 1
        assert prof.evidence.skipped == {"capture_max": 1}
    assert "rank 0: refused: capture_max" in out.getvalue()


def test_garbage_huge_and_fifo_requests_are_ignored_without_harm(tmp_path, caplog):
    loop = Loop()
    req, ans = cr.request_path(str(tmp_path), 0), cr.answer_path(str(tmp_path), 0)
    bad = [b"\x00\xffnot json", json.dumps({"id": "x" * 65, "steps": 2}).encode(),
           json.dumps({"id": "ok", "steps": 0}).encode(), b"{" + b" " * (8 << 20)]
    with caplog.at_level(logging.WARNING, logger="steptrace"):
        with open_profiler(tmp_path, evidence_baseline_step=10**6) as prof:
            taken = []
            for data in bad:
                with open(req + ".w", "wb") as f:
                    f.write(data)
                os.replace(req + ".w", req)
                assert loop.run_until(prof, lambda: not os.path.exists(req) and os.path.exists(ans))
                with open(ans) as f:
                    taken.append(json.load(f))
                os.unlink(ans)
            os.mkfifo(req)  # opening a FIFO for reading would block: it is never opened
            assert loop.run_until(prof, lambda: os.path.exists(ans))
            with open(ans) as f:
                taken.append(json.load(f))
            assert not os.path.exists(req)
            os.unlink(ans)
            os.symlink("/dev/zero", req)  # read through the link, it would never end: never opened
            assert loop.run_until(prof, lambda: os.path.exists(ans))
            with open(ans) as f:
                taken.append(json.load(f))
            assert not os.path.lexists(req) and os.path.exists("/dev/zero")
            assert all(a["accepted"] is False and a["reason"].startswith("unreadable request") for a in taken)
            assert "over 4096 bytes" in taken[3]["reason"] and "not a regular file" in taken[4]["reason"]
            assert "not a regular file" in taken[5]["reason"]
            assert "steps=0 is out of range" in taken[2]["reason"]
            assert prof.evidence.skipped == {}  # nothing reached the capture
            # and a good request afterwards is served as usual
            cr._write_atomic(req, {"id": "good1", "steps": 1})
            assert loop.run_until(prof, lambda: requested(prof, "good1"))
    warnings = [r for r in caplog.records if "ignored a capture request" in r.getMessage()]
    assert len(warnings) == 1
    assert [n for n in listing(tmp_path) if n.startswith("capture-request")] == []


def test_cli_errors_name_the_bad_value_and_write_nothing(tmp_path, capsys):
    def fails(args, needle):
        assert cli.main(["capture", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("steptrace: error: ") and needle in err, err

    fails([str(tmp_path / "nope")], "no such folder; allowed: a run's log folder")
    fails([str(tmp_path)], "not a steptrace run")
    with open_profiler(tmp_path / "run") as prof:
        prof.flush()
        before = listing(tmp_path / "run")
        fails([str(tmp_path / "run"), "--steps", "0"], "--steps 0 is out of range; allowed: 1..100")
        fails([str(tmp_path / "run"), "--steps", "101"], "--steps 101 is out of range; allowed: 1..100")
        fails([str(tmp_path / "run"), "--rank", "3"], "--rank 3: no rank3.jsonl")
        fails([str(tmp_path / "run"), "--timeout", "0"], "--timeout 0 must be > 0")
        assert listing(tmp_path / "run") == before
        # a PID: the folder of the rank log the process holds open
        assert cr.resolve_target(str(os.getpid())) == (str(tmp_path / "run"), [0])
    fails([str(tmp_path / "run")], "the run has ended")
    fails(["4194999"], "no such process")
    with steptrace.Profiler(tmp_path / "nodetect", detect=False, evidence=True) as prof:
        prof.flush()
        fails([str(tmp_path / "nodetect")], "detect=False")
    assert not any(n.startswith("capture-") for n in listing(tmp_path / "run"))


def test_a_run_with_evidence_off_times_out_and_the_request_is_removed(tmp_path):
    with steptrace.Profiler(tmp_path) as prof:  # evidence off: nothing takes the request
        prof.flush()
        out = io.StringIO()
        assert cr.capture(str(tmp_path), 2, None, 0.5, out) == 1
    assert "no evidence within 0.5 s: the request was not taken" in out.getvalue()
    assert "evidence=True" in out.getvalue()
    assert not os.path.exists(cr.request_path(str(tmp_path), 0))


def test_latest_attempt_folder_is_the_live_one(tmp_path):
    for folder in (tmp_path, tmp_path / "attempt1", tmp_path / "attempt2"):
        folder.mkdir(exist_ok=True)
        (folder / "rank0.jsonl").write_text("{}\n")
    (tmp_path / "attempt3").mkdir()  # no log yet
    assert cr.resolve_target(str(tmp_path)) == (str(tmp_path / "attempt2"), [0])
