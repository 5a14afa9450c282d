"""A short DDP run (gloo, CPU) with real compute, for the offline straggler verdict
(issue 52): every rank runs the same matmuls in forward; ``--slow-rank R`` gives rank R
``--extra`` times more of them, in forward or, with ``--slow-in backward``, inside
backward (a custom autograd function on the first layer, whose gradient is computed last,
while DDP's small buckets are already being all-reduced).

    python -m torch.distributed.run --nproc-per-node 2 --standalone ddp_slow_rank.py LOG_DIR
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import steptrace


class _Busy(torch.autograd.Function):
    """Identity in forward; ``n`` extra matmuls in backward (a slower backward)."""

    @staticmethod
    def forward(ctx, x, w, n):  # noqa: D102
        ctx.save_for_backward(w)
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (w,) = ctx.saved_tensors
        acc = w
        for _ in range(ctx.n):
            acc = torch.tanh(acc @ w)
        return grad + 0.0 * acc.sum(), None, None


class _BusyBackward(nn.Module):
    """After the first layer: its gradient waits for ``n`` matmuls, in the middle of backward
    (the later layers' buckets are all-reduced meanwhile)."""

    def __init__(self, w: torch.Tensor, n: int) -> None:
        super().__init__()
        self.w, self.n = w, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return _Busy.apply(x, self.w, self.n) if self.n else x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("log_dir")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--work", type=int, default=6, help="matmuls of 192x192 in forward, every rank")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--extra", type=float, default=1.5, help="the slow rank's extra work, x --work")
    p.add_argument("--slow-in", choices=("forward", "backward"), default="forward")
    p.add_argument("--cluster-interval", type=int, default=20)
    a = p.parse_args()

    torch.set_num_threads(1)  # two ranks on a small host: one core each
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    extra = int(round(a.extra * a.work)) if rank == a.slow_rank else 0
    w = torch.randn(192, 192) / 192**0.5
    busy = _BusyBackward(w, extra if a.slow_in == "backward" else 0)
    net = nn.Sequential(nn.Linear(64, 128), busy, nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    model = DistributedDataParallel(net, bucket_cap_mb=0.02)  # several buckets, overlapped with backward
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 8, (32,), generator=torch.Generator().manual_seed(rank))

    def matmuls(n: int) -> torch.Tensor:
        acc = w
        for _ in range(n):
            acc = torch.tanh(acc @ w)
        return acc

    with steptrace.Profiler(a.log_dir, overwrite=True, cluster_interval=a.cluster_interval,
                            cluster_poll_s=0.1) as prof:
        for _ in prof.data(iter([x] * a.steps)):
            with prof.step():
                with prof.phase("forward"):
                    bias = matmuls(a.work + (extra if a.slow_in == "forward" else 0)).mean()
                    out = model(x + 0.0 * bias)
                with prof.phase("loss"):
                    loss = nn.functional.cross_entropy(out, y)
                with prof.phase("backward"):
                    loss.backward()  # DDP's all-reduces, bucket by bucket
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
