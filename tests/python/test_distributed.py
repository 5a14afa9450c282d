"""A real two-rank DDP run (gloo on the CPU, launched by torchrun): one log per rank, one
run id, and the folder reads as one run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import steptrace
from steptrace.analysis.summary import summarize

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def test_two_ranks_write_one_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(EXAMPLE), str(tmp_path), "--steps", "30"],  # a free port
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == ["rank0.jsonl", "rank1.jsonl"]
    records = list(steptrace.read(tmp_path, validate=True))  # checks it is one run
    starts = [r for r in records if r["kind"] == "run_start"]
    assert sorted((s["rank"], s["world_size"]) for s in starts) == [(0, 2), (1, 2)]
    assert len({s["run_id"] for s in starts}) == 1
    summary = summarize(records)
    assert summary["steps"] == 30
    ends = [r for r in records if r["kind"] == "run_end"]
    assert [e["reason"] for e in ends] == ["normal", "normal"]
