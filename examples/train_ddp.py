"""A distributed (DDP, gloo, CPU) training run profiled by steptrace: one log per rank.

    python -m torch.distributed.run --nproc-per-node 2 examples/train_ddp.py runs/ddp
    steptrace summary runs/ddp

Every rank writes runs/ddp/rank<N>.jsonl; torchrun's RANK / WORLD_SIZE and the master
address give the ranks their numbers and one shared run id.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import steptrace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", nargs="?", default="runs/ddp")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randn(32, 32, generator=g) for _ in range(8)]

    with steptrace.Profiler(args.log_dir, overwrite=True) as prof:
        for i in range(args.steps):
            x = batches[i % len(batches)]
            with prof.step():
                with prof.phase("forward"):
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
