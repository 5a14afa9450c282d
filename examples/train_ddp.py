"""A distributed (DDP, gloo, CPU) training run profiled by steptrace: one log per rank,
and the cross-rank view on rank 0.

    python -m torch.distributed.run --nproc-per-node 2 examples/train_ddp.py runs/ddp
    steptrace summary runs/ddp
    steptrace cluster runs/ddp

Every rank writes runs/ddp/rank<N>.jsonl; torchrun's RANK / WORLD_SIZE and the master
address give the ranks their numbers and one shared run id. The Profiler times DDP's
gradient all-reduces by itself (no extra call), so that each step says how long the rank
computed and how long it was blocked on communication; every ``cluster_interval`` steps the ranks publish
a summary through torch.distributed's store and rank 0 writes ``cluster`` records.

To see a straggler: ``--straggler-rank 1 --straggler-pct 30`` makes rank 1 do 30% more
work per step (``--work-ms`` of simulated compute in forward on every rank); rank 0's log
then holds a ``straggler`` alert naming rank 1 (in a run shorter than the rule's 30 s,
with ``--straggler-min-s 0``). ``--slow-data-rank 1`` slows that rank's
loader instead; ``--block-rank 1 --block-at 60 --block-s 5`` blocks it once (a hang).
``--rank0-eval-every 40 --rank0-eval-ms 400`` has rank 0 alone evaluate (a marked interval)
every 40 steps while the others wait for it in a barrier, as scripts that save on rank 0 do:
a planned wait, which pages nobody.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import steptrace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", nargs="?", default="runs/ddp")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--work-ms", type=float, default=0.0, help="simulated compute per step, every rank")
    parser.add_argument("--straggler-rank", type=int, default=-1)
    parser.add_argument("--straggler-pct", type=float, default=30.0)
    parser.add_argument("--slow-data-rank", type=int, default=-1)
    parser.add_argument("--slow-data-ms", type=float, default=10.0)
    parser.add_argument("--block-rank", type=int, default=-1)
    parser.add_argument("--block-at", type=int, default=60)
    parser.add_argument("--block-s", type=float, default=5.0)
    parser.add_argument("--rank0-eval-every", type=int, default=0, help="rank 0 alone evaluates every N steps")
    parser.add_argument("--rank0-eval-ms", type=float, default=400.0)
    parser.add_argument("--cluster-interval", type=int, default=50)
    parser.add_argument("--cluster-poll-s", type=float, default=1.0)
    parser.add_argument("--cluster-silent-s", type=float, default=10.0)
    parser.add_argument("--straggler-min-s", type=float, default=30.0,
                        help="a straggler alert needs it for this long (0: two windows, for a short demo)")
    parser.add_argument("--no-comm-timing", action="store_true", help="do not time the collectives")
    parser.add_argument("--flops-per-step", type=float, default=0.0, help="model FLOPs of a step (for MFU)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak TFLOP/s (MFU on a CPU)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(32, 32, generator=g) for _ in range(8)]
    work_s = args.work_ms / 1000.0 * (1 + args.straggler_pct / 100.0 if rank == args.straggler_rank else 1.0)

    def loader():
        for i in range(args.steps):
            if rank == args.slow_data_rank:
                time.sleep(args.slow_data_ms / 1000.0)  # a slow input pipeline on this rank
            yield batches[i % len(batches)]

    with steptrace.Profiler(args.log_dir, overwrite=True, cluster_interval=args.cluster_interval,
                            cluster_poll_s=args.cluster_poll_s, cluster_silent_s=args.cluster_silent_s,
                            straggler_min_s=args.straggler_min_s,
                            comm_timing="off" if args.no_comm_timing else "auto",
                            flops_per_step=args.flops_per_step, peak_tflops=args.peak_tflops) as prof:
        for i, x in enumerate(prof.data(loader())):
            if args.rank0_eval_every and i and i % args.rank0_eval_every == 0:
                if rank == 0:
                    with prof.interval("eval"):
                        time.sleep(args.rank0_eval_ms / 1000.0)  # stands for the evaluation's work
                dist.barrier()  # the others wait here for rank 0
            with prof.step():
                with prof.phase("forward"):
                    if work_s > 0:
                        time.sleep(work_s)  # stands for the model's compute
                    if rank == args.block_rank and i == args.block_at:
                        time.sleep(args.block_s)  # this rank hangs; the others wait for it
                    out = model(x)
                with prof.phase("loss"):
                    loss = nn.functional.cross_entropy(out, x[:, :4].argmax(dim=1))
                with prof.phase("backward"):
                    loss.backward()  # DDP's gradient all-reduce runs here
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
    print(f"rank {rank}: {prof.step_index} steps, loss {loss.item():.4f}, log {prof.log_path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
