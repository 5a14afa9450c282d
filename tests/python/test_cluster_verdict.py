"""The offline straggler verdict (issue 52, point 4): ``steptrace cluster`` names the rank
that held the others up, its excess and the others' wait, and says apart from that
whether the alert's floor (``straggler_min_s``, 30 s) was met: a 2-rank run of a few
seconds with one slower rank is not "no straggler". Synthetic windows for the rule, and
real 2-rank DDP runs (gloo, torchrun) with real matmuls."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from steptrace.cli import main as cli
from steptrace.cluster import analyze_records, format_cluster

SCRIPT = Path(__file__).resolve().parent / "support" / "ddp_slow_rank.py"
STEP_NS = 25_000_000  # 25 ms steps: 200 steps are 5 s, far below the 30 s floor


def records(slow_of_step, n: int = 200, seed: int = 0) -> list[dict]:
    """Two ranks' step records as DDP writes them (comm timed): the slower rank of a step
    computes 20 ms more in forward, the other waits that long in backward's all-reduce."""
    rng = random.Random(seed)
    out = []
    for r in (0, 1):
        for i in range(n):
            slow = slow_of_step(i) == r
            fwd = 10.0 + rng.uniform(-0.5, 0.5) + (20.0 if slow else 0.0)
            wait = 0.0 if slow or slow_of_step(i) is None else 20.0
            exposed = 0.5 + wait
            phases = {"forward": fwd, "loss": 0.2, "backward": 2.0 + exposed, "optimizer": 0.3}
            total = sum(phases.values())
            out.append({"kind": "step", "rank": r, "step": i, "status": "ok", "step_ms": total, "host_ms": total,
                        "start_unix_ns": 10**18 + i * STEP_NS, "data_ms": 0.0, "phases_ms": phases,
                        "comm": {"method": "host", "comm_ms": exposed, "exposed_ms": exposed,
                                 "compute_ms": total - exposed, "collectives": 1, "exposed_in": "backward"}})
    return out


def test_a_short_run_names_its_straggler_and_says_the_floor_was_not_met():
    result = analyze_records(records(lambda i: 1))
    assert result["alerts"] == []  # 5 s of windows: the alert's floor is 30 s
    v = result["verdict"]
    assert (v["straggler"], v["phase"], v["alerted"]) == (1, "forward", False)
    assert v["excess_pct"] == pytest.approx(100 * 20 / 12.5, abs=3)  # own work 32.5 vs 12.5 ms
    assert v["excess_ms"] == pytest.approx(20.0, abs=1) and v["others_wait_ms"] == pytest.approx(20.0, abs=1)
    assert v["others_wait_pct"] == pytest.approx(100 * 20 / 33.0, abs=2)
    assert v["windows_named"] == v["windows"] == 4
    text = format_cluster(result)
    assert "rank 1 is the straggler" in text and "no straggler" not in text
    assert f"the others waited {v['others_wait_pct']:.0f}% of each step" in text
    assert "shorter than straggler_min_s=30 s, so no alert would fire" in text
    # the floor lowered: the alert fires, and the verdict says the floor was met
    result = analyze_records(records(lambda i: 1), {"straggler_min_s": 0.0})
    assert [a["subject_rank"] for a in result["alerts"] if a["kind"] == "alert"] == [1]
    assert result["verdict"]["alerted"] and "met the alert's floor" in format_cluster(result)


@pytest.mark.parametrize("slow_of_step", [
    lambda i: None,  # nobody slower
    lambda i: (i // 50) % 2,  # the ranks slower in turns, window by window (a VM's vCPUs)
    lambda i: 1 if i >= 170 else None,  # one rank slower in the last window alone
], ids=["clean", "in-turns", "one-window"])
def test_no_straggler_where_no_rank_held_the_others_up_over_the_run(slow_of_step):
    result = analyze_records(records(slow_of_step))
    assert result["verdict"]["straggler"] is None
    assert "is the straggler" not in format_cluster(result)


# ---- real runs: 2 ranks, gloo, torchrun, real matmuls; a few seconds each ----
def ddp(log_dir: Path, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(SCRIPT),
         str(log_dir), "--steps", "150", "--work", "8", *args],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_real_short_ddp_run_names_the_slower_rank_not_its_victim(tmp_path, capsys, where):
    # rank 1 runs 1.5x more matmuls; in backward, the extra work sits between DDP's buckets
    # (the later layers' all-reduces overlap it). The run lasts seconds, under the floor.
    ddp(tmp_path, "--slow-rank", "1", "--slow-in", where)
    assert cli(["cluster", str(tmp_path), "--fail-on-straggler"]) == 0  # no alert: under 30 s
    text = capsys.readouterr().out
    assert cli(["cluster", str(tmp_path), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["verdict"]
    assert (v["straggler"], v["phase"], v["alerted"]) == (1, where, False), v
    assert v["excess_pct"] > 30 and v["others_wait_ms"] >= 0.5 * v["excess_ms"] > 0, v
    assert v["others_wait_pct"] > 10, v
    line = next(ln for ln in text.splitlines() if "is the straggler" in ln)
    assert line.startswith("rank 1 is the straggler") and f"slower in {where}" in line, text
    assert f"{v['excess_pct']:+.0f}% own work" in line and f"the others waited {v['others_wait_pct']:.0f}%" in line
    assert "shorter than straggler_min_s=30 s, so no alert would fire" in line, line
    assert "no straggler" not in text


def test_real_clean_ddp_run_names_no_straggler(tmp_path, capsys):
    ddp(tmp_path)
    assert cli(["cluster", str(tmp_path), "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["verdict"]
    assert v["straggler"] is None and v["windows"] >= 6, v
    assert cli(["cluster", str(tmp_path)]) == 0
    assert "no straggler" in capsys.readouterr().out
