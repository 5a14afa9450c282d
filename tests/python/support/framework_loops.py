"""The framework runs shaped like the ones people run, shared by tests/python/test_real_loops.py
and benchmarks/alert_quality.py: the Hugging Face Trainer with evaluation and saves, and
Lightning with a validation loop and ModelCheckpoint, each profiled by its steptrace
callback into ``<tmp>/run``. Small enough for the CPU."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn


def hf_trainer_run(tmp: Path, *, max_steps: int, eval_steps: int, save_steps: int, save_total_limit=None,
                   loader_workers: int = 0, train_samples: int = 640, epochs: float = 3.0,
                   training_args: "dict | None" = None, **options) -> Path:
    """The Trainer on a tiny GPT-2 built from a config: evaluation every ``eval_steps``, a
    checkpoint every ``save_steps`` (0: neither); ``options`` go to the profiler. With
    ``loader_workers`` the train loader has that many workers, each of which takes 150 ms
    over its first sample (a worker's set-up: opening shards, an index), and ``max_steps``
    -1 trains ``epochs`` epochs of ``train_samples``; ``training_args`` are more
    ``TrainingArguments``. Returns the log folder."""
    import transformers

    from steptrace.integrations.transformers import SteptraceCallback

    class Tokens(torch.utils.data.Dataset):
        started = False

        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(n)
            self.ids = torch.randint(0, 64, (n, 16), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            if torch.utils.data.get_worker_info() is not None and not Tokens.started:
                Tokens.started = True  # in this worker process only
                time.sleep(0.15)
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                                                 n_layer=2, n_head=2))
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "hf"), per_device_train_batch_size=4, per_device_eval_batch_size=8,
        learning_rate=1e-3, logging_steps=10, report_to=[], eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps or None, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        save_total_limit=save_total_limit, use_cpu=True, disable_tqdm=True, dataloader_num_workers=loader_workers,
        max_steps=max_steps, num_train_epochs=epochs, **(training_args or {}))
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(train_samples), eval_dataset=Tokens(96),
                         callbacks=[SteptraceCallback(tmp / "run", **options)]).train()
    return tmp / "run"


def lightning_run(tmp: Path, *, max_steps: int, val_every: int, checkpoint_every: int) -> tuple[Path, object]:
    """Lightning: a small classifier, validation every ``val_every`` steps (and the sanity
    check), ModelCheckpoint every ``checkpoint_every`` training steps. Returns the log
    folder and the trainer."""
    import lightning.pytorch as L

    from steptrace.integrations.lightning import SteptraceCallback

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def loader(n: int, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 8, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, :2].sum(1) > 0).long()),
                                           batch_size=8)

    ckpt = L.callbacks.ModelCheckpoint(dirpath=str(tmp / "ckpt"), every_n_train_steps=checkpoint_every,
                                       save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, max_steps=max_steps, val_check_interval=val_every,
                        callbacks=[SteptraceCallback(tmp / "run"), ckpt], default_root_dir=str(tmp))
    trainer.fit(Classifier(), loader(1600, 0), loader(400, 1))
    return tmp / "run", trainer


def lightning_gpt_run(tmp: Path, *, max_steps: int, **options) -> Path:
    """Lightning training the GPT-style model of gpt_loop.py on token batches (with a
    validation loop); ``options`` go to the profiler. Returns the log folder."""
    import lightning.pytorch as L

    from support.gpt_loop import GPT
    from steptrace.integrations.lightning import SteptraceCallback

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT()

        def training_step(self, batch, batch_idx):
            x, y = batch
            _, loss = self.gpt(x, y)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", self.gpt(x, y)[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def loader(n: int, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 65, (n, 33), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8)

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, max_steps=max_steps,
                        val_check_interval=10, callbacks=[SteptraceCallback(tmp / "run", **options)],
                        default_root_dir=str(tmp))
    trainer.fit(LitGPT(), loader(400, 0), loader(64, 1))
    return tmp / "run"
