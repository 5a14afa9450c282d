"""A real (tiny) CPU training loop for the tests, profiled with all five phases: the loop of
examples/train_mlp.py (``train_epoch``), imported from the example so the two stay one."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from train_mlp import train_epoch  # noqa: E402 - the example stays standalone; the tests use its loop

PHASES = ("forward", "loss", "backward", "clip", "optimizer")


def batches(n: int, batch_size: int = 16, features: int = 32, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(batch_size, features, generator=g)
        out.append((x, x[:, :4].argmax(dim=1)))
    return out


class SlowLoader:
    """Yields the given batches, waiting ``delay_s`` of wall time before each one."""

    def __init__(self, items: list, delay_s: float) -> None:
        self.items, self.delay_s = items, delay_s

    def __iter__(self) -> Iterator:
        for item in self.items:
            time.sleep(self.delay_s)  # the latency being measured, not synchronization
            yield item


def model(features: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 4))


def train(prof, loader: Iterable, net: Optional[nn.Module] = None, wrap: bool = True) -> nn.Module:
    """Trains ``net`` on ``loader`` with every step and phase profiled by ``prof``."""
    net = net if net is not None else model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    train_epoch(prof, net, nn.CrossEntropyLoss(), opt, prof.data(loader) if wrap else loader)
    return net
