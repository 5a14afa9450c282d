"""A plain PyTorch training loop with no steptrace in it, for ``steptrace run``:

    steptrace run --log-dir runs/plain examples/train_plain.py --steps 200
    steptrace summary runs/plain

A small MLP on synthetic data: forward, cross-entropy loss, backward, gradient clipping,
SGD step. ``--accumulate K`` takes K forward/backward micro-steps per optimizer step;
``--fail-at N`` raises at step N (to see the exit status and run_end of a failed run).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step")
    parser.add_argument("--fail-at", type=int, default=-1, help="raise RuntimeError at this step")
    parser.add_argument("--exit-code", type=int, default=0, help="sys.exit with this status at the end")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [(torch.randn(args.batch, 32), torch.randint(0, 10, (args.batch,))) for _ in range(16)]

    for step in range(args.steps):
        if step == args.fail_at:
            raise RuntimeError(f"failing at step {step} as asked")
        for micro in range(args.accumulate):
            x, y = data[(step * args.accumulate + micro) % len(data)]
            loss = loss_fn(model(x), y) / args.accumulate
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # an evaluation pass after training: outside any step
        x, y = data[0]
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"{args.steps} steps, last loss {loss.item() * args.accumulate:.4f}, accuracy {accuracy:.2f}")
    if args.exit_code:
        raise SystemExit(args.exit_code)


if __name__ == "__main__":
    main()
