"""The framework integrations, each driven by a real short CPU training run: Lightning's
Trainer, Hugging Face's Trainer on a tiny randomly initialised GPT-2, and an accelerate
loop. The frameworks are test dependencies (scripts/setup.sh installs them)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models are built from configs

import accelerate  # noqa: E402  (not skipped when missing: these are test dependencies)
import lightning.pytorch as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch import nn  # noqa: E402

from steptrace.errors import ConfigError, UnknownOptionError  # noqa: E402


def _steps(records):
    return [r for r in records if r["kind"] == "step"]


def _assert_phases_do_not_nest(step):
    # host clock: phases that never nest add up to at most the step
    assert sum(step["phases_ms"].values()) <= step["step_ms"] + 1e-3, step


def _dataset(n=64, features=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :2].sum(dim=1) > 0).long())


# ------------------------------------------------------------------------- Lightning


class _Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit(tmp_path, callback, **trainer_args):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[callback], default_root_dir=str(tmp_path), **trainer_args)
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=8)
    trainer.fit(_Classifier(), loader)
    return trainer


def test_lightning_fit_records_phases_and_meta(tmp_path, records_of):
    from steptrace.integrations.lightning import SteptraceCallback

    cb = SteptraceCallback(tmp_path / "run", detect=False)
    _fit(tmp_path, cb, max_steps=10)  # 8 batches an epoch: the run crosses an epoch boundary
    assert cb.profiler.closed
    records = records_of(tmp_path / "run" / "rank0.jsonl")
    steps = _steps(records)
    assert len(steps) == 10
    for i, s in enumerate(steps):
        assert s["status"] == "ok"
        assert {"forward", "backward", "optimizer"} <= set(s["phases_ms"]), s["phases_ms"]
        assert all(ms > 0 for ms in s["phases_ms"].values()), s["phases_ms"]
        _assert_phases_do_not_nest(s)
        meta = s["meta"]
        assert meta["global_step"] == i + 1
        assert meta["epoch"] == (0 if i < 8 else 1)
        assert meta["lr"] == pytest.approx(0.1 * 0.5 ** i)  # StepLR per step: the rate this update used
        assert 0 < meta["loss"] < 5
        assert "micro_steps" not in meta
    assert records[-1]["kind"] == "run_end" and records[-1]["reason"] == "normal"
    assert records[0]["rank"] == 0 and records[0]["world_size"] == 1


def test_lightning_gradient_accumulation_makes_one_step_per_optimizer_step(tmp_path, records_of):
    from steptrace.integrations.lightning import SteptraceCallback

    cb = SteptraceCallback(tmp_path / "run", detect=False)
    _fit(tmp_path, cb, max_steps=3, accumulate_grad_batches=2)
    steps = _steps(records_of(tmp_path / "run" / "rank0.jsonl"))
    assert [s["meta"]["global_step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["meta"]["micro_steps"] == 2
        assert {"forward", "backward", "optimizer"} <= set(s["phases_ms"])
        _assert_phases_do_not_nest(s)


def test_lightning_manual_optimization_with_two_optimizers(tmp_path, records_of):
    import time

    from steptrace.integrations.lightning import SteptraceCallback

    class TwoOptimizers(L.LightningModule):
        """A GAN-shaped manual loop: two losses, two backwards, two optimizer steps a batch."""

        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(8, 2), nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt_a, opt_b = self.optimizers()
            for net, opt in ((self.a, opt_a), (self.b, opt_b)):
                opt.zero_grad()
                if net is self.b:
                    time.sleep(0.03)  # stands for the second model's compute, of a length the test knows
                self.manual_backward(nn.functional.cross_entropy(net(x), y))
                opt.step()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.2)]

    cb = SteptraceCallback(tmp_path / "run", detect=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                        default_root_dir=str(tmp_path), max_epochs=1, limit_train_batches=5)
    trainer.fit(TwoOptimizers(), torch.utils.data.DataLoader(_dataset(), batch_size=8))
    records = records_of(tmp_path / "run" / "rank0.jsonl")
    steps = _steps(records)
    assert len(steps) == 5  # one record per batch
    for i, s in enumerate(steps):
        assert s["status"] == "ok"
        # the second model's forward (after the first opt.step()) is forward too
        assert list(s["phases_ms"]) == ["forward", "backward", "optimizer"], s["phases_ms"]
        assert s["phases_ms"]["forward"] >= 30, s["phases_ms"]
        assert all(ms > 0 for ms in s["phases_ms"].values())
        _assert_phases_do_not_nest(s)
        assert s["meta"]["global_step"] == 2 * (i + 1)  # Lightning counts both optimizers' steps
        assert s["meta"]["lr"] == pytest.approx(0.1)
    assert records[-1]["reason"] == "normal"


def test_lightning_validation_is_not_data_wait(tmp_path, records_of):
    import time

    from steptrace.integrations.lightning import SteptraceCallback

    class WithValidation(_Classifier):
        def validation_step(self, batch, batch_idx):
            time.sleep(0.1)  # the validation time that must stay out of data_ms, not synchronization

    cb = SteptraceCallback(tmp_path / "run", detect=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        max_steps=4, val_check_interval=2, limit_val_batches=1, callbacks=[cb],
                        default_root_dir=str(tmp_path))
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=8)
    trainer.fit(WithValidation(), loader, loader)
    steps = _steps(records_of(tmp_path / "run" / "rank0.jsonl"))
    assert len(steps) == 4
    # validation ran after step 1 (and after step 3): step 2 waited only for its batch, and
    # the validation is its own kind
    assert steps[2]["data_ms"] < 50, [s["data_ms"] for s in steps]
    assert steps[2]["eval_ms"] >= 100 * 0.95  # sleep never returns early; 5% for clock rounding
    assert steps[2]["other_ms"] < 50


def test_lightning_exception_closes_the_run_as_failed(tmp_path, records_of):
    from steptrace.integrations.lightning import SteptraceCallback

    class Boom(_Classifier):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("bad batch")
            return super().training_step(batch, batch_idx)

    cb = SteptraceCallback(tmp_path / "run", detect=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=5,
                        callbacks=[cb], default_root_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="bad batch"):
        trainer.fit(Boom(), torch.utils.data.DataLoader(_dataset(), batch_size=8))
    records = records_of(tmp_path / "run" / "rank0.jsonl")
    steps = _steps(records)
    assert [s["status"] for s in steps] == ["ok", "ok", "error"]
    assert records[-1]["reason"] == "exception" and "bad batch" in records[-1]["error"]


_PL_SCRIPT = """
import sys, torch, pytorch_lightning as pl
from torch import nn
from steptrace.integrations.lightning import SteptraceCallback
assert issubclass(SteptraceCallback, pl.Callback) and "lightning.pytorch" not in sys.modules
class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.net = nn.Linear(4, 2)
    def training_step(self, batch, i):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
x = torch.randn(16, 4)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)
pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
           enable_model_summary=False, max_steps=3, callbacks=[SteptraceCallback(sys.argv[1], detect=False)]).fit(M(), loader)
"""


def test_lightning_callback_follows_pytorch_lightning_when_the_program_uses_it(tmp_path, records_of):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PL_SCRIPT, str(tmp_path / "run")], timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = _steps(records_of(tmp_path / "run" / "rank0.jsonl"))
    assert [s["meta"]["global_step"] for s in steps] == [1, 2, 3]
    assert all({"forward", "backward", "optimizer"} <= set(s["phases_ms"]) for s in steps)


def test_lightning_bad_option_raises_before_anything_is_written(tmp_path):
    from steptrace.integrations.lightning import SteptraceCallback

    with pytest.raises(UnknownOptionError, match="flush_every"):
        SteptraceCallback(tmp_path / "run", flush_every=3)
    with pytest.raises(ConfigError, match="queue_capacity"):
        SteptraceCallback(tmp_path / "run", queue_capacity=1)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- transformers


class _TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=48, length=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _hf_train(tmp_path, callback, **args):
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    training_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=2,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        lr_scheduler_type="linear", **args)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=_TokenDataset(),
                                   callbacks=[callback])
    trainer.train()
    return trainer


def test_transformers_trainer_records_phases_and_meta(tmp_path, records_of):
    from steptrace.integrations.transformers import SteptraceCallback

    cb = SteptraceCallback(tmp_path / "run", detect=False)
    _hf_train(tmp_path, cb, max_steps=10)
    assert cb.profiler.closed
    records = records_of(tmp_path / "run" / "rank0.jsonl")
    steps = _steps(records)
    assert len(steps) == 10
    lrs = []
    for i, s in enumerate(steps):
        assert s["status"] == "ok"
        # clip: accelerate clips through get_total_norm / clip_grads_with_norm_ (max_grad_norm 1.0)
        assert {"forward", "backward", "clip", "optimizer"} <= set(s["phases_ms"]), s["phases_ms"]
        _assert_phases_do_not_nest(s)
        meta = s["meta"]
        assert meta["global_step"] == i + 1
        assert meta["epoch"] == pytest.approx((i + 1) / 12)  # 48 samples / 4 a batch: 12 steps an epoch
        lrs.append(meta["lr"])
        # the loss logged after step 2, 4, ... (logging_steps=2) is in the record of the step after it
        assert ("loss" in meta) == (i in (2, 4, 6, 8)), (i, meta)
        if "loss" in meta:  # and says which step it was logged at: the one before
            assert meta["loss_global_step"] == meta["global_step"] - 1
    assert lrs[0] == pytest.approx(1e-3) and all(a > b for a, b in zip(lrs, lrs[1:]))  # linear decay
    assert all(0 < s["meta"]["loss"] < 10 for s in steps if "loss" in s["meta"])
    assert records[-1]["reason"] == "normal"


def test_transformers_gradient_accumulation(tmp_path, records_of):
    from steptrace.integrations.transformers import SteptraceCallback

    cb = SteptraceCallback(tmp_path / "run", detect=False)
    _hf_train(tmp_path, cb, max_steps=3, gradient_accumulation_steps=2)
    steps = _steps(records_of(tmp_path / "run" / "rank0.jsonl"))
    assert [s["meta"]["global_step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["meta"]["micro_steps"] == 2  # two forward passes in one optimizer step
        assert {"forward", "backward", "optimizer"} <= set(s["phases_ms"])
        _assert_phases_do_not_nest(s)


# ------------------------------------------------------------------------ accelerate


def test_accelerate_profile_times_backward_and_restores_it(tmp_path, records_of):
    from steptrace.integrations.accelerate import profile

    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=8)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    with profile(accelerator, tmp_path / "run", model=model, optimizer=opt, detect=False) as prof:
        assert "backward" in vars(accelerator)  # timed while profiling
        for x, y in prof.data(loader):
            with prof.step():
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
    assert "backward" not in vars(accelerator) and "clip_grad_norm_" not in vars(accelerator)  # put back
    steps = _steps(records_of(tmp_path / "run" / "rank0.jsonl"))
    assert len(steps) == 8
    for i, s in enumerate(steps):
        assert set(s["phases_ms"]) == {"forward", "backward", "clip", "optimizer"}, s["phases_ms"]
        _assert_phases_do_not_nest(s)
        assert s["meta"] == {"global_step": i + 1, "lr": 0.05}


def test_accelerate_profile_rejects_a_non_accelerator(tmp_path):
    from steptrace.integrations.accelerate import profile

    with pytest.raises(ConfigError, match="accelerate.Accelerator"):
        profile(object(), tmp_path / "run")
    assert not (tmp_path / "run").exists()
