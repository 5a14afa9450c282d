"""What timing the collectives costs (steptrace.live.comm): a gloo ``all_reduce`` loop on 2 ranks
(processes on this machine; ``--world 1``: one, whose all-reduce moves nothing) under a Profiler with ``comm_timing="auto"`` (the default: the
call goes through comm.py's wrapper, its work to the completion poller or its future) and
with ``comm_timing="off"`` (torch.distributed untouched), in interleaved blocks of the same
run, so that both see the same machine load.

    ~/.cache/steptrace/venv/bin/python benchmarks/bench_comm.py                  # about 3 minutes
    ~/.cache/steptrace/venv/bin/python benchmarks/bench_comm.py --blocks 4 --calls 200   # quicker

Each block opens a Profiler (``cluster="off"``, its log in a temporary folder), runs
``--calls`` steps of one ``dist.all_reduce`` each, and closes it: synchronous calls
(``sync``: on gloo timed in the calling thread, up to ``wait()``'s return) and
``async_op=True`` ones waited for at once (``async``: the completion poller's path, which
DDP's buckets take); per block it
takes the wall time per call and the process CPU time per call (every thread: the poller's
too) on rank 0. It prints, per tensor size, the medians over the blocks of each mode and
their difference: the cost per collective. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import steptrace

    import logging

    logging.getLogger("steptrace").setLevel(logging.ERROR)  # the loaded host's step alerts: not the point
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for numel in args.numel:
            tensor = torch.ones(numel)
            for _ in range(20):  # warm the connections up
                dist.all_reduce(tensor)
            for call in ("sync", "async"):
                rows: dict = {"off": [], "auto": []}
                for block in range(args.blocks):
                    order = ("off", "auto") if block % 2 == 0 else ("auto", "off")
                    for mode in order:
                        prof = steptrace.Profiler(os.path.join(tmp, f"{mode}{block}"), comm_timing=mode,
                                                  cluster="off", overwrite=True)
                        dist.barrier()
                        wall0, cpu0 = time.perf_counter(), time.process_time()
                        for _ in range(args.calls):
                            with prof.step():
                                if call == "sync":
                                    dist.all_reduce(tensor)
                                else:  # the completion poller's path (as DDP's buckets)
                                    dist.all_reduce(tensor, async_op=True).wait()
                        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                        prof.close()
                        rows[mode].append((wall / args.calls * 1e6, cpu / args.calls * 1e6))
                results[f"{numel} {call}"] = rows
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10, help="blocks per mode, interleaved (default 10)")
    p.add_argument("--calls", type=int, default=500, help="all_reduce calls per block (default 500)")
    p.add_argument("--world", type=int, default=2,
                   help="ranks (default 2; 1: no partner, no transfer: the timing's own cost alone)")
    p.add_argument("--numel", type=int, nargs="+", default=[256, 262144],
                   help="float32 elements per all_reduce (default 256 = 1 KiB and 262144 = 1 MiB)")
    args = p.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    mp.spawn(_rank_main, args=(args.world, port, args, out), nprocs=args.world)
    with open(out) as f:
        results = json.load(f)
    os.unlink(out)
    import torch

    print(f"bench_comm: {args.world} gloo rank(s) on this host, torch {torch.__version__}, python {sys.version.split()[0]}, "
          f"{args.blocks} blocks x {args.calls} calls per mode, load average {os.getloadavg()[0]:.1f}")
    print(f"{'payload, call':>16} {'off us/call':>12} {'auto us/call':>13} {'cost us':>8} "
          f"{'off cpu us':>11} {'auto cpu us':>12} {'cpu cost us':>12}")
    for key, rows in results.items():
        numel, call = key.split()
        med = {m: (statistics.median(w for w, _ in rows[m]), statistics.median(c for _, c in rows[m]))
               for m in ("off", "auto")}
        size = int(numel) * 4
        label = (f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB") + f", {call}"
        print(f"{label:>16} {med['off'][0]:12.1f} {med['auto'][0]:13.1f} {med['auto'][0] - med['off'][0]:8.1f} "
              f"{med['off'][1]:11.1f} {med['auto'][1]:12.1f} {med['auto'][1] - med['off'][1]:12.1f}")
        spread = {m: (min(w for w, _ in rows[m]), max(w for w, _ in rows[m])) for m in ("off", "auto")}
        print(f"{'':>16} wall per call over the blocks: off {spread['off'][0]:.1f}-{spread['off'][1]:.1f}, "
              f"auto {spread['auto'][0]:.1f}-{spread['auto'][1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
