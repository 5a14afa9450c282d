"""A distillation script shaped like the ones people run, small enough for the CPU: a
student MLP learns from a frozen teacher run under ``no_grad`` before each of its
forwards; batches come from a ``DataLoader`` with two workers (no ``persistent_workers``,
the default), epochs of 1,000 samples in batches of 32 (a short last batch of 8); the
student is compiled with ``torch.compile`` (inductor), so the short batch recompiles it;
evaluation and a ``torch.save`` checkpoint after every epoch. No steptrace code: run it
under ``steptrace run`` (``alert_quality.py``'s ``distill-run`` loop)::

    steptrace run --log-dir runs/distill benchmarks/distill_epochs.py --epochs 6

Each of its per-epoch events paged before steptrace told them apart: the teacher's
forward was an evaluation before every step, each epoch's worker start a ``stall`` in
``data``, the recompile a ``hang`` and a ``stall``."""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn
from torch.nn import functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compile", default="inductor", help="torch.compile backend ('none': not compiled)")
    parser.add_argument("--out", default=None, help="folder for the checkpoint (default: a temporary one)")
    args = parser.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, 64, generator=g)
    train = torch.utils.data.TensorDataset(x, torch.zeros(1000))
    val = torch.randn(256, 64, generator=g)
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, num_workers=args.workers)
    teacher = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    teacher.eval().requires_grad_(False)
    student = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model = student if args.compile == "none" else torch.compile(student, backend=args.compile)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    out = args.out or tempfile.mkdtemp(prefix="distill-")
    for epoch in range(args.epochs):
        student.train()
        for xb, _ in loader:
            with torch.no_grad():
                target = F.softmax(teacher(xb), dim=-1)
            loss = F.kl_div(F.log_softmax(model(xb), dim=-1), target, reduction="batchmean")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        student.eval()
        with torch.no_grad():
            val_loss = F.kl_div(F.log_softmax(student(val), dim=-1), F.softmax(teacher(val), dim=-1),
                                reduction="batchmean")
        torch.save({"model": student.state_dict(), "epoch": epoch}, os.path.join(out, "ckpt.pt"))
        print(f"epoch {epoch}: train {loss.item():.4f} val {val_loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
