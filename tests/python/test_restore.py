"""Checkpoint restore as its own interval kind, and the training step a run is at
(``progress``), through the public API on real CPU loops: ``steptrace run`` seeing
torch.load / safetensors / load_state_dict between steps, a user's own
``prof.interval("restore")``, and the integrations' resumes across two attempts of one
job (Hugging Face ``train(resume_from_checkpoint=...)``, Lightning ``fit(ckpt_path=...)``,
accelerate ``load_state``), each resumed attempt's steps carrying the checkpoint's step."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models are built from configs

import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import steptrace  # noqa: E402
from steptrace.cli import main as cli  # noqa: E402


def _records(path: Path) -> list[dict]:
    return list(steptrace.read(path, validate=True))


def _steps(recs):
    return [r for r in recs if r["kind"] == "step"]


def _intervals(recs, kind=None):
    return [r for r in recs if r["kind"] == "interval" and (kind is None or r["interval"] == kind)]


# ------------------------------------------------------------------ steptrace run

RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn

    ckpt, case = sys.argv[1], sys.argv[2]

    class Shard(torch.utils.data.Dataset):  # a dataset that reads its samples with torch.load
        def __init__(self, path):
            self.path = path
        def __len__(self):
            return 64
        def __getitem__(self, i):
            x = torch.load(self.path)[i]
            return x, (x[:2].sum() > 0).long()

    torch.manual_seed(0)
    model, target = nn.Linear(8, 2), nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(Shard(ckpt + ".shard"), batch_size=8)
    if case == "resume":  # before the first step: the start of attempt 2 of a job
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        if step == 4:
            torch.load(ckpt)  # inside the step: the program's business, not a restore
        loss.backward()
        opt.step()
        opt.zero_grad()
        # a target network synced every step (DQN): load_state_dict alone is not a restore
        target.load_state_dict(model.state_dict())
        if step == 1:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "blob": torch.ones(2 ** 21)}, ckpt)
        if step == 2:  # a roll-back between steps: the load and what applies it
            state = torch.load(ckpt)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
""")


def _run_script(tmp_path: Path, case: str) -> list[dict]:
    script = tmp_path / "train_resume.py"
    script.write_text(RESUME_SCRIPT)
    ckpt = tmp_path / "ckpt.pt"
    torch.save(torch.randn(64, 8), str(ckpt) + ".shard")
    if case == "resume":
        model = nn.Linear(8, 2)
        torch.save({"model": model.state_dict(), "opt": torch.optim.SGD(model.parameters(), lr=0.1).state_dict()},
                   ckpt)
    assert cli(["run", "--log-dir", str(tmp_path / "log"), str(script), str(ckpt), case]) == 0
    return _records(tmp_path / "log" / "rank0.jsonl")


@pytest.mark.parametrize("case", ["fresh", "resume"])
def test_steptrace_run_times_torch_load_between_steps_as_restore(tmp_path, case):
    recs = _run_script(tmp_path, case)
    steps = _steps(recs)
    assert len(steps) == 8
    restores = _intervals(recs, "restore")
    # the roll-back after step 2: torch.load, then the model's and the optimizer's
    # load_state_dict applying it (three intervals, no step between them); none for the
    # load inside step 4, the dataset's loads, or the target network's load_state_dict
    rollback = [r for r in restores if r["step"] == 3]
    assert len(rollback) == 3, restores
    assert steps[3]["restore_ms"] == pytest.approx(sum(r["duration_ms"] for r in rollback), rel=1e-3, abs=1e-3)
    assert all("restore_ms" not in s for i, s in enumerate(steps) if i not in (0, 3)), \
        [(i, s.get("restore_ms")) for i, s in enumerate(steps)]
    before_first = [r for r in restores if r["step"] == 0]
    if case == "resume":  # seen before the first step: the watch is in place before the script runs
        assert len(before_first) == 3 and steps[0]["restore_ms"] > 0
    else:
        assert before_first == [] and "restore_ms" not in steps[0]
    assert len(restores) == len(rollback) + len(before_first)
    # the save is the only checkpoint: no load was counted as one
    assert [r["step"] for r in _intervals(recs, "checkpoint")] == [2]
    assert all("checkpoint_ms" not in s for i, s in enumerate(steps) if i != 2)
    goodput = recs[-1]["goodput"]
    restore_s = sum(r["duration_ms"] for r in restores) / 1e3
    assert goodput["restore_s"] == pytest.approx(restore_s, rel=1e-2, abs=1.5e-3)  # run_end rounds to ms
    assert goodput["restore_s"] > 0
    assert goodput["checkpoint_s"] == pytest.approx(_intervals(recs, "checkpoint")[0]["duration_ms"] / 1e3,
                                                    rel=1e-2, abs=1.5e-3)  # run_end rounds to ms


NESTED_SCRIPT = textwrap.dedent("""
    import io, sys, torch
    from torch import nn

    class SavesWhenLoaded:  # unpickling it saves a file: a save inside a load
        def __reduce__(self):
            return (torch.save, (torch.zeros(4), sys.argv[1] + ".inner"))

    class LoadsWhenSaved:  # pickling it loads a file: a load inside a save
        def __getstate__(self):
            return {"t": torch.load(sys.argv[1] + ".inner")}

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            torch.save(SavesWhenLoaded(), sys.argv[1])
            torch.load(sys.argv[1], weights_only=False)
        if step == 1:
            torch.save(LoadsWhenSaved(), io.BytesIO())
""")


def test_a_save_inside_a_load_and_a_load_inside_a_save_are_one_interval_of_the_outer_kind(tmp_path):
    script = tmp_path / "nested.py"
    script.write_text(NESTED_SCRIPT)
    assert cli(["run", "--log-dir", str(tmp_path / "log"), str(script), str(tmp_path / "x.pt")]) == 0
    recs = _records(tmp_path / "log" / "rank0.jsonl")
    assert (tmp_path / "x.pt.inner").exists()  # the inner save ran
    # after step 0: the save, then the load that saved inside it; after step 1: the save that loaded
    assert [(r["interval"], r["step"]) for r in _intervals(recs)] == [
        ("checkpoint", 1), ("restore", 1), ("checkpoint", 2)]


def test_a_users_own_restore_interval(tmp_path, records_of):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    with steptrace.Profiler(tmp_path / "run", detect=False) as prof:
        for i in range(4):
            if i == 2:
                with prof.interval("restore"):
                    state = torch.load(path)
                    model.load_state_dict(state["model"])
                    opt.load_state_dict(state["opt"])
                prof.set_step(100)  # where the restored checkpoint left off
            with prof.step():
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
    recs = records_of(tmp_path / "run" / "rank0.jsonl")
    steps = _steps(recs)
    (restore,) = _intervals(recs)
    assert restore["interval"] == "restore" and restore["step"] == 2
    assert steps[2]["restore_ms"] == pytest.approx(restore["duration_ms"], rel=1e-3, abs=1e-3)
    assert [s.get("progress") for s in steps] == [None, None, 100, 101]
    assert recs[-1]["goodput"]["restore_s"] == pytest.approx(restore["duration_ms"] / 1e3, abs=1.5e-3)


# ------------------------------------------------------------- integrations' resumes


class _Crash(RuntimeError):
    """The failure that ends a job's first attempt."""


def test_hf_trainer_resume_is_a_restore_and_progress_continues(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from steptrace.integrations.transformers import SteptraceCallback

    monkeypatch.setenv("STEPTRACE_JOB", "hf-job")  # both attempts are one job: attempt 1 gets its own folder

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class CrashAfterSave(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:  # checkpoint-4 is on disk
                raise _Crash("node lost")

    def trainer(callbacks):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                                                     n_layer=2, n_head=2))
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
            save_strategy="steps", save_steps=2, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
            max_steps=7, logging_steps=100)
        return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)

    first = SteptraceCallback(tmp_path / "run", detect=False)
    with pytest.raises(_Crash):
        trainer([first, CrashAfterSave()]).train()
    first.close("exception", "node lost")
    assert (tmp_path / "hf" / "checkpoint-4").is_dir()

    second = SteptraceCallback(tmp_path / "run", detect=False)
    trainer([second]).train(resume_from_checkpoint=str(tmp_path / "hf" / "checkpoint-4"))

    attempt0 = _records(tmp_path / "run" / "rank0.jsonl")
    attempt1 = _records(tmp_path / "run" / "attempt1" / "rank0.jsonl")
    assert attempt0[0]["job"]["attempt"] == 0 and attempt1[0]["job"]["attempt"] == 1
    assert [s["progress"] for s in _steps(attempt0)] == [0, 1, 2, 3, 4]
    assert not _intervals(attempt0, "restore")
    steps = _steps(attempt1)
    # the resumed attempt goes on at the checkpoint's step: steps 4 (recomputed) to 6
    assert [s["progress"] for s in steps] == [4, 5, 6]
    assert [s["meta"]["global_step"] for s in steps] == [5, 6, 7]
    restores = _intervals(attempt1, "restore")
    # before the first step: the model's weights (in train(), before on_train_begin), the
    # optimizer's and scheduler's state, then the RNG state
    assert len(restores) >= 3 and all(r["step"] == 0 for r in restores), restores
    assert steps[0]["restore_ms"] == pytest.approx(sum(r["duration_ms"] for r in restores), rel=1e-3, abs=1e-3)
    assert attempt1[-1]["goodput"]["restore_s"] > 0
    # checkpoint-6 after step 6, and the save at the end of training (step 7)
    assert [r["step"] for r in _intervals(attempt1, "checkpoint")] == [2, 3]
    assert attempt1[-1]["reason"] == "normal"


def test_hf_trainer_load_best_model_at_end_is_a_restore(tmp_path, records_of):
    pytest.importorskip("transformers")
    from support.framework_loops import hf_trainer_run

    run = hf_trainer_run(tmp_path, max_steps=4, eval_steps=2, save_steps=2, train_samples=32, detect=False,
                         training_args={"load_best_model_at_end": True})
    recs = records_of(run / "rank0.jsonl")
    assert len(_steps(recs)) == 4
    # the best checkpoint's weights, loaded after the last step (before run_end)
    assert [(r["interval"], r["step"]) for r in _intervals(recs, "restore")] == [("restore", 4)]
    assert recs[-1]["goodput"]["restore_s"] > 0


def _lightning_job(tmp_path, module_cls, *, max_steps, every, crash_at):
    """Attempt 0 of a Lightning job (ModelCheckpoint every ``every`` steps, a crash when
    global_step reaches ``crash_at``), then attempt 1 resuming from its last checkpoint.
    Returns both attempts' records and the checkpoint's global step."""
    L = pytest.importorskip("lightning.pytorch")
    from steptrace.integrations.lightning import SteptraceCallback

    class Crash(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step >= crash_at:
                raise _Crash("node lost")

    x = torch.randn(128, 8, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, :2].sum(1) > 0).long()),
                                         batch_size=8)

    def fit(callbacks, ckpt_path=None):
        ckpt = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=every,
                                           save_top_k=-1, save_last=True)
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, max_steps=max_steps, num_sanity_val_steps=0,
                            callbacks=[*callbacks, ckpt], default_root_dir=str(tmp_path))
        trainer.fit(module_cls(), loader, ckpt_path=ckpt_path)
        return trainer

    with pytest.raises(_Crash):
        fit([SteptraceCallback(tmp_path / "run", detect=False), Crash()])
    last = tmp_path / "ckpt" / "last.ckpt"
    restored_step = torch.load(last, weights_only=False)["global_step"]
    fit([SteptraceCallback(tmp_path / "run", detect=False)], ckpt_path=str(last))
    return (_records(tmp_path / "run" / "rank0.jsonl"), _records(tmp_path / "run" / "attempt1" / "rank0.jsonl"),
            restored_step)


def _lightning_classifier():
    import lightning.pytorch as L

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Classifier


def test_lightning_resume_is_a_restore_and_progress_continues(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPTRACE_JOB", "pl-job")
    attempt0, attempt1, restored = _lightning_job(tmp_path, _lightning_classifier(), max_steps=8, every=3,
                                                  crash_at=5)
    assert restored == 3
    assert attempt0[-1]["reason"] == "exception" and attempt1[0]["job"]["attempt"] == 1
    assert [s["progress"] for s in _steps(attempt0)] == [0, 1, 2, 3, 4]
    assert not _intervals(attempt0, "restore")
    steps = _steps(attempt1)
    assert [s["progress"] for s in steps] == [3, 4, 5, 6, 7]  # steps 3 and 4 recomputed
    assert [s["meta"]["global_step"] for s in steps] == [4, 5, 6, 7, 8]
    restores = _intervals(attempt1, "restore")
    # the checkpoint's load with the model's state (before the strategy's setup and
    # on_fit_start), then the optimizer's and loops' state
    assert len(restores) == 2 and all(r["step"] == 0 for r in restores), restores
    assert steps[0]["restore_ms"] == pytest.approx(sum(r["duration_ms"] for r in restores), rel=1e-3, abs=1e-3)
    assert attempt1[-1]["goodput"]["restore_s"] > 0 and attempt1[-1]["reason"] == "normal"


def test_lightning_progress_of_two_optimizers_counts_both(tmp_path, monkeypatch):
    # A GAN-shaped manual loop: two optimizer steps a batch. trainer.global_step counts
    # both (Lightning's documented unit, the one of max_steps and of ModelCheckpoint's
    # every_n_train_steps), so the progress goes 0, 2, 4, ... one record a batch, and a
    # resume continues in the same unit.
    import lightning.pytorch as L

    class TwoOptimizers(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(0)
            self.g, self.d = nn.Linear(8, 2), nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            for net, opt in zip((self.g, self.d), self.optimizers()):
                opt.zero_grad()
                self.manual_backward(nn.functional.cross_entropy(net(x), y))
                opt.step()

        def configure_optimizers(self):
            return [torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)]

    monkeypatch.setenv("STEPTRACE_JOB", "gan-job")
    attempt0, attempt1, restored = _lightning_job(tmp_path, TwoOptimizers, max_steps=12, every=4, crash_at=6)
    assert restored == 4
    assert [s["progress"] for s in _steps(attempt0)] == [0, 2, 4]
    assert [s["progress"] for s in _steps(attempt1)] == [4, 6, 8, 10]
    assert len(_intervals(attempt1, "restore")) == 2


def test_accelerate_load_state_is_a_restore_and_set_step_continues_global_step(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    from steptrace.integrations.accelerate import profile

    def setup():
        accelerator = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        return (accelerator, *accelerator.prepare(model, opt))

    def train(prof, accelerator, model, opt, steps):
        for _ in range(steps):
            with prof.step():
                accelerator.backward(model(torch.randn(8, 8)).sum())
                opt.step()
                opt.zero_grad()

    accelerator, model, opt = setup()
    with profile(accelerator, tmp_path / "run0", model=model, optimizer=opt, detect=False) as prof:
        train(prof, accelerator, model, opt, 3)
        accelerator.save_state(str(tmp_path / "state"))
    accelerator, model, opt = setup()
    with profile(accelerator, tmp_path / "run1", model=model, optimizer=opt, detect=False) as prof:
        accelerator.load_state(str(tmp_path / "state"))
        prof.set_step(3)  # accelerate keeps no step count: the program says where it resumed
        train(prof, accelerator, model, opt, 2)
    recs = _records(tmp_path / "run1" / "rank0.jsonl")
    steps = _steps(recs)
    (restore,) = _intervals(recs)
    assert restore["interval"] == "restore" and restore["step"] == 0
    assert steps[0]["restore_ms"] == pytest.approx(restore["duration_ms"], rel=1e-3, abs=1e-3)
    assert [s["progress"] for s in steps] == [3, 4]
    assert [s["meta"]["global_step"] for s in steps] == [4, 5]
    assert "load_state" not in vars(accelerator)  # put back at close
    first = _records(tmp_path / "run0" / "rank0.jsonl")
    assert [r["interval"] for r in _intervals(first)] == ["checkpoint"]
