"""A GPT-style training script shaped like the ones people run (nanoGPT's loop: random
token batches, gradient accumulation, periodic evaluation under ``no_grad`` in eval
mode, ``torch.save`` checkpoints, logging), small enough for the CPU.

Used two ways by the tests:

- ``train(prof=..., ...)``: a hand-written loop with explicit phases and, with
  ``intervals=True``, ``prof.interval("eval")`` / ``prof.interval("checkpoint")``;
- as a script under ``steptrace run`` (no steptrace code at all): ``python gpt_loop.py
  --iters 300 --out DIR [--stall-at N]``.

Under ``torch.distributed`` (an initialized process group, or the script under
``torchrun``) it trains as nanoGPT does with DDP: each rank draws its own batches, the
gradients are all-reduced on the last micro-step only, and rank 0 alone evaluates and
saves while the other ranks wait for it in the next step's all-reduce.

``stall_at``: one training step sleeps ``stall_s`` inside the model's forward (an
injected fault, the stall the detectors must still catch); under DDP on ``stall_rank``
alone (-1: every rank).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 65, block: int = 32, dim: int = 32, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.stall_s = 0.0  # the injected fault: a sleep inside the next training forward

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> Any:
        if self.stall_s and torch.is_grad_enabled():
            time.sleep(self.stall_s)  # the fault being injected, not synchronization
            self.stall_s = 0.0
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x, y


def train(prof: Any = None, *, iters: int = 300, eval_interval: int = 50, eval_iters: int = 20,
          accumulation: int = 2, out_dir: Optional[str] = None, stall_at: int = -1, stall_s: float = 1.5,
          intervals: bool = True, log_interval: int = 10, stall_rank: int = -1,
          eval_unwrapped: bool = False, eval_with_grad: bool = False,
          after_step: Optional[Callable[[GPT, int], None]] = None, eval_mode_training: bool = False) -> GPT:
    """nanoGPT's loop in small. With ``prof``, each iteration is a step with explicit
    phases; with ``intervals`` the evaluation and the checkpoint are marked as such. With
    ``eval_unwrapped`` the evaluation calls the model inside the DDP wrapper
    (``model.module``), as scripts that unwrap it for evaluation or sampling do; with
    ``eval_with_grad`` it runs without ``no_grad`` (``model.eval()`` alone, a common slip).
    ``after_step(model, it)`` runs after each iteration's step (logging of the script's own).
    ``eval_mode_training``: the model trains in eval mode throughout, as a custom loop over
    a Hugging Face ``from_pretrained`` model that never calls ``model.train()`` does."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(65, (20_000,), generator=gen)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    raw = model = GPT()
    ddp = dist.is_available() and dist.is_initialized()
    master = not ddp or dist.get_rank() == 0
    if ddp:  # nanoGPT: the same weights everywhere, each rank its own batches
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(raw)
        gen.manual_seed(1000 + dist.get_rank())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    nothing = contextlib.nullcontext()

    def scope(kind: str) -> Any:
        return prof.interval(kind) if prof is not None and intervals else nothing

    def phase(name: str) -> Any:
        return prof.phase(name) if prof is not None else nothing

    def estimate_loss() -> dict:
        with nothing if eval_with_grad else torch.no_grad():
            return evaluate()

    def evaluate() -> dict:
        model.eval()  # nanoGPT evaluates through the DDP wrapper (no_grad: no all-reduce)
        evaluated = raw if eval_unwrapped else model
        out = {}
        for name, source in (("train", train_data), ("val", val_data)):
            losses = torch.zeros(eval_iters)
            for k in range(eval_iters):
                _, loss = evaluated(*get_batch(source, 8, 32, gen))
                losses[k] = loss.item()
            out[name] = losses.mean().item()
        model.train(not eval_mode_training)
        return out

    best = math.inf
    if eval_mode_training:
        model.eval()
    for it in range(iters + 1):
        if it % eval_interval == 0 and it > 0 and master:  # nanoGPT: rank 0 alone
            with scope("eval"):
                losses = estimate_loss()
            print(f"step {it}: train {losses['train']:.3f} val {losses['val']:.3f}", flush=True)
            if out_dir is not None and losses["val"] < best + 1.0:
                best = min(best, losses["val"])
                with scope("checkpoint"):
                    torch.save({"model": raw.state_dict(), "optimizer": opt.state_dict(), "iter": it},
                               os.path.join(out_dir, "ckpt.pt"))
        if it == iters:
            break
        if it == stall_at and (stall_rank < 0 or not ddp or dist.get_rank() == stall_rank):
            raw.stall_s = stall_s
        with prof.step() if prof is not None else nothing:
            for micro in range(accumulation):
                if ddp:  # all-reduce the gradients on the last micro-step only (nanoGPT)
                    model.require_backward_grad_sync = micro == accumulation - 1
                x, y = get_batch(train_data, 8, 32, gen)
                with phase("forward"):
                    _, loss = model(x, y)
                    loss = loss / accumulation
                with phase("backward"):
                    loss.backward()
            with phase("clip"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
        if it % log_interval == 0 and master:
            print(f"iter {it}: loss {loss.item() * accumulation:.4f}", flush=True)
        if after_step is not None:
            after_step(raw, it)
    return raw


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--stall-at", type=int, default=-1)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--eval-unwrapped", action="store_true", help="evaluate with model.module, not the DDP wrapper")
    p.add_argument("--eval-with-grad", action="store_true", help="evaluate without no_grad (model.eval() alone)")
    p.add_argument("--eval-mode-training", action="store_true", help="train in eval mode (model.train() never called)")
    a = p.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun
        dist.init_process_group("gloo")
    train(iters=a.iters, eval_interval=a.eval_interval, eval_iters=a.eval_iters, out_dir=a.out, stall_at=a.stall_at,
          stall_rank=a.stall_rank, eval_unwrapped=a.eval_unwrapped, eval_with_grad=a.eval_with_grad,
          eval_mode_training=a.eval_mode_training)
    if dist.is_initialized():
        dist.destroy_process_group()
