"""Train a small MLP on scikit-learn's digits on the CPU, profiled by steptrace.

    python examples/train_mlp.py runs/train_mlp
    steptrace summary runs/train_mlp

Every step is split into the five default phases, and the loader wait is timed as
``data``. After each epoch the model is evaluated and saved, marked as ``eval`` and
``checkpoint`` intervals: their own kinds in the log and in the run's goodput, never part
of a step. The digits data set ships inside scikit-learn, so nothing is downloaded;
``--synthetic`` uses generated data instead.
"""

from __future__ import annotations

import argparse
import os
from typing import Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import steptrace


def dataset(synthetic: bool) -> TensorDataset:
    if synthetic:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2048, 64, generator=g)
        y = (x[:, :10].argmax(dim=1)).long()
        return TensorDataset(x, y)
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    return TensorDataset(x, y)


def train_epoch(prof: steptrace.Profiler, model: nn.Module, loss_fn: nn.Module, opt: torch.optim.Optimizer,
                batches: Iterable) -> torch.Tensor:
    """One pass over ``batches`` of (x, y), each step split into the five default phases;
    returns the last loss. Wrap the loader as ``prof.data(loader)`` to time its wait."""
    params = list(model.parameters())
    for x, y in batches:
        with prof.step():
            with prof.phase("forward"):
                out = model(x)
            with prof.phase("loss"):
                loss = loss_fn(out, y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("clip"):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", nargs="?", default="runs/train_mlp")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--synthetic", action="store_true", help="generated data instead of digits")
    parser.add_argument("--metrics-port", type=int, default=-1,
                        help="serve Prometheus metrics on this port (0: any free port; -1: off)")
    args = parser.parse_args()

    torch.manual_seed(0)
    data = dataset(args.synthetic)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    with steptrace.Profiler(args.log_dir, overwrite=True, metrics_port=args.metrics_port) as prof:
        prof.watch(model, phases=False)  # each step's model FLOPs (samples come from prof.data)
        for epoch in range(args.epochs):
            loss = train_epoch(prof, model, loss_fn, opt, prof.data(loader))  # the wait for each batch is data_ms
            with prof.interval("eval"), torch.no_grad():
                x, y = data.tensors
                accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
            with prof.interval("checkpoint"):
                torch.save(model.state_dict(), os.path.join(args.log_dir, "model.pt"))
            print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f}, accuracy {accuracy:.1%}", flush=True)
    print(f"trained {prof.step_index} steps, accuracy {accuracy:.1%}; log: {prof.log_path}")


if __name__ == "__main__":
    main()
