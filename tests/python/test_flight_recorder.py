"""PyTorch's flight recorder read for hang alerts (steptrace.live.flight_recorder): the dump
format PyTorch documents, the cross-rank comparison, and what is said when the recorder is
off. Real gloo ranks with the recorder on run in test_cluster.py (torch 2.9.1 records gloo's
collectives) and test_launcher.py (steptrace run turns it on)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from steptrace.live import flight_recorder as fr

# The example of PyTorch's tutorial "Flight Recorder for Debugging Stuck Jobs", section
# "Flight Recorder File Formats" (docs.pytorch.org/tutorials/unstable/flight_recorder_tutorial.html),
# frames left out, with a second, outstanding all-reduce added (seq 3, as a stuck rank has).
DOCUMENTED = {
    "version": "2.5",
    "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
    "pg_status": {"0": {"last_enqueued_collective": 3, "last_started_collective": -1,
                        "last_completed_collective": 2}},
    "entries": [
        {"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 2,
         "p2p_seq_id": 0, "op_id": 2, "profiling_name": "nccl:all_reduce", "time_created_ns": 1724779239936775119,
         "input_sizes": [[3, 4]], "input_dtypes": ["Float"], "output_sizes": [[3, 4]], "output_dtypes": ["Float"],
         "state": "completed", "time_discovered_started_ns": None,
         "time_discovered_completed_ns": 1724779239975811724, "retired": True, "timeout_ms": 600000,
         "is_p2p": False},
        {"record_id": 1, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 3,
         "p2p_seq_id": 0, "op_id": 3, "profiling_name": "nccl:all_reduce", "time_created_ns": 1724779239976775119,
         "input_sizes": [[4, 5]], "input_dtypes": ["Float"], "output_sizes": [[4, 5]], "output_dtypes": ["Float"],
         "state": "scheduled", "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
         "retired": False, "timeout_ms": 600000, "is_p2p": False},
    ],
}


def test_the_documented_dump_gives_the_last_enqueued_started_and_completed_collective():
    snap = fr.snapshot(dump=json.dumps(DOCUMENTED))
    assert snap["recorder"] == "on" and snap["version"] == "2.5"
    [group] = snap["groups"]
    assert (group["group"], group["desc"], group["ranks"]) == ("0", "default_pg", "[0, 1]")
    assert group["last_completed"] == {"seq": 2, "op": "nccl:all_reduce", "input_sizes": [[3, 4]],
                                       "output_sizes": [[3, 4]], "dtypes": ["Float"], "state": "completed"}
    assert group["last_enqueued"]["seq"] == 3 and group["last_enqueued"]["input_sizes"] == [[4, 5]]
    assert group["last_started"] is None  # -1: not tracked (no TORCH_NCCL_ENABLE_TIMING)
    assert group["pending"]["seq"] == 3  # the oldest collective not completed: where it waits
    assert snap["summary"] == ("flight recorder: group 0 (default_pg): last completed #2 nccl:all_reduce "
                               "[[3,4]]; #3 nccl:all_reduce [[4,5]] not completed")
    assert fr.compact(snap) == {"0": [3, 2, ["nccl:all_reduce", [[4, 5]]], "nccl:all_reduce"]}


def test_a_collective_the_ring_no_longer_holds_is_given_by_its_sequence_number():
    dump = {**DOCUMENTED, "pg_status": {"0": {"last_enqueued_collective": "9", "last_started_collective": "-1",
                                              "last_completed_collective": "9"}}}  # gloo's are strings
    [group] = fr.snapshot(dump=dump)["groups"]
    assert group["last_completed"] == {"seq": 9} and group["pending"] is None


def test_where_the_ranks_part():
    behind = fr.parting({0: {"0": [5, 4, ["gloo:all_reduce", [[1000]]], "gloo:all_reduce"]},
                         1: {"0": [4, 4, None, "gloo:all_reduce"]},
                         2: {"0": [5, 4, ["gloo:all_reduce", [[1000]]], "gloo:all_reduce"]}})
    assert (behind["kind"], behind["seq"], behind["op"], behind["behind"], behind["waiting"]) == \
        ("behind", 5, "gloo:all_reduce", [1], [0, 2])
    assert behind["message"] == ("the ranks part at collective #5 gloo:all_reduce [[1000]] of group 0: "
                                 "rank(s) 0, 2 called it, rank(s) 1 did not (last: #4 gloo:all_reduce, completed)")
    mismatch = fr.parting({0: {"0": [5, 4, ["nccl:all_reduce", [[8]]], "nccl:all_reduce"]},
                           1: {"0": [5, 4, ["nccl:broadcast", [[8]]], "nccl:broadcast"]}})
    assert mismatch["kind"] == "mismatch" and mismatch["seq"] == 5
    stuck = fr.parting({0: {"0": [5, 4, ["nccl:all_reduce", [[8]]], "nccl:all_reduce"]},
                        1: {"0": [5, 4, ["nccl:all_reduce", [[8]]], "nccl:all_reduce"]}})
    assert stuck["kind"] == "stuck" and "none completed" in stuck["message"]
    assert fr.parting({0: {"0": [5, 5, None, "x"]}, 1: {"0": [5, 5, None, "x"]}}) is None  # nothing parts
    assert fr.parting({0: {"0": [5, 4, None, "x"]}, 1: "off: not set"}) is None  # one rank with a recorder


def test_the_cross_rank_view_says_what_is_missing():
    assert fr.cross_rank({0: {}, 1: {}})["recorder"] == "not sent"
    off = fr.cross_rank({0: {"fr": "off: TORCH_FR_BUFFER_SIZE is not set"}, 1: {"fr": "off: x"}})
    assert off["recorder"] == "off" and "TORCH_FR_BUFFER_SIZE" in off["why"]
    on = fr.cross_rank({0: {"fr": {"0": [5, 4, ["a", [[1]]], "a"]}}, 1: {"fr": {"0": [4, 4, None, "a"]}}})
    assert on["parted"]["behind"] == [1] and set(on["ranks"]) == {"0", "1"}


def test_enable_leaves_the_users_setting_alone():
    env: dict = {}
    assert fr.enable(env) and env == {"TORCH_FR_BUFFER_SIZE": "2000"}
    for setting in ({"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}):
        env = dict(setting)
        assert not fr.enable(env) and env == setting
    assert fr.buffer_size({"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"}) == 500 and fr.buffer_size({}) is None


CASE = """
import json, os, torch, torch.distributed as dist
from steptrace.live import flight_recorder as fr
before = fr.snapshot()  # no process group: nothing to say
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str({port}))
dist.init_process_group("gloo", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
dist.broadcast(torch.ones(3), 0)
print(json.dumps({{"before": before, "now": fr.snapshot()}}))
dist.destroy_process_group()
"""


def _run(env_extra: dict) -> dict:
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in fr.ENV_VARS}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CASE.format(port=port))], capture_output=True,
                          text=True, timeout=120, env={**env, **env_extra})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gloo_with_the_recorder_on_and_off():
    on = _run({"TORCH_FR_BUFFER_SIZE": "100"})
    assert on["before"] is None
    [group] = on["now"]["groups"]  # torch 2.9.1 records gloo's collectives
    assert (group["last_completed"]["seq"], group["last_completed"]["op"]) == (2, "gloo:broadcast")
    assert group["last_completed"]["input_sizes"] == [[3]] and group["pending"] is None
    off = _run({})
    assert off["now"]["recorder"] == "off" and "TORCH_FR_BUFFER_SIZE is not set" in off["now"]["why"]


def test_a_stalled_heartbeat_dumps_the_whole_ring_only_when_the_status_changed(monkeypatch):
    calls = []

    def dump(includeCollectives=True):  # noqa: N803 - torch's keyword
        calls.append(includeCollectives)
        return json.dumps(DOCUMENTED if includeCollectives else {"pg_status": DOCUMENTED["pg_status"]})

    monkeypatch.setattr(fr, "_dump_function", lambda: dump)
    monkeypatch.setattr(fr, "_process_group_exists", lambda: True)
    monkeypatch.setattr(fr, "_heartbeat_cache", {})
    env = {"TORCH_FR_BUFFER_SIZE": "2000"}
    states = [fr.heartbeat_state(env) for _ in range(3)]
    assert states == [{"0": [3, 2, ["nccl:all_reduce", [[4, 5]]], "nccl:all_reduce"]}] * 3
    assert calls == [False, True, False, False]  # one full dump, then the status alone
    assert fr.heartbeat_state({}) == "off: TORCH_FR_BUFFER_SIZE is not set: the flight recorder is off " \
        "(steptrace run turns it on; else export TORCH_FR_BUFFER_SIZE=2000 before the process group is made)"
