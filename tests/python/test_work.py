"""Useful work per step (docs/useful-work.md): samples and tokens from the batch, model
FLOPs counted once per shape, MFU against a peak, on real loops: an explicit GPT-style
loop, the same script under ``steptrace run``, the Hugging Face Trainer and Lightning.

The FLOPs are checked against nanoGPT's analytic count (``estimate_mfu``): 6·N per token
for the weights N (the position embeddings left out; the token embedding counts as the
output layer it is tied to, or as that layer where it is not) plus 12·L·d·T per token for
attention, T tokens per sequence."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import steptrace  # noqa: E402
from steptrace.live.work import batch_work, count_flops  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from support.gpt_loop import GPT, get_batch  # noqa: E402

PEAK_TFLOPS = 0.5  # a CPU has no datasheet peak: MFU needs the option


def gpt_analytic_flops(model: GPT, batch: int, seq: int) -> float:
    """nanoGPT's estimate for one forward and backward of ``batch`` sequences of ``seq``."""
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("tok.", "pos.")))
    layers, dim = len(model.blocks), model.ln.normalized_shape[0]
    return (6 * n + 12 * layers * dim * seq) * seq * batch


def iteration_s(step: dict) -> float:
    """The wall-clock iteration the rates are per second of (docs/useful-work.md)."""
    return (step["data_ms"] + step.get("other_ms", 0) + step["host_ms"] - step.get("interval_in_step_ms", 0)) / 1e3


def assert_mfu_is_flops_over_time_over_peak(step: dict, peak_tflops: float) -> None:
    work = step["work"]
    tflops_per_s = work["flops"] / iteration_s(step) / 1e12
    # the record's ms are rounded to 0.1 us: compare to a few parts in a thousand
    assert work["tflops_per_s"] == pytest.approx(tflops_per_s, rel=5e-3)
    assert work["mfu_pct"] == pytest.approx(100 * tflops_per_s / peak_tflops, rel=5e-3)


def test_batch_work_reads_the_batch_shape():
    ids = torch.randint(0, 50, (4, 16))
    assert batch_work(ids) == (4, 64)  # token ids (batch, sequence)
    assert batch_work((ids, ids)) == (4, 64)  # inputs first
    assert batch_work([torch.randn(8, 3, 32, 32), torch.zeros(8)]) == (8, -1)  # images: no tokens
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0  # padding
    assert batch_work({"input_ids": ids, "attention_mask": mask}) == (4, 48)
    assert batch_work({"input_ids": ids}) == (4, 64)
    assert batch_work({"pixels": torch.randn(2, 3)}) == (-1, -1)  # no input_ids: unknown
    assert batch_work(torch.zeros(5, 2, dtype=torch.bool)) == (5, -1)
    assert batch_work("text") == (-1, -1)
    assert batch_work(()) == (-1, -1)


def test_count_flops_on_meta_is_within_10pct_of_the_analytic_count():
    model = GPT()
    x, y = torch.randint(0, 65, (8, 32)), torch.randint(0, 65, (8, 32))
    flops = count_flops(model, x, y)
    assert flops == pytest.approx(gpt_analytic_flops(model, 8, 32), rel=0.10)
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())  # untouched


def test_explicit_gpt_loop_reports_tokens_flops_and_mfu(tmp_path, records_of):
    with steptrace.Profiler(tmp_path / "run", peak_tflops=PEAK_TFLOPS) as prof:
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(65, (5000,), generator=gen)
        model = prof.watch(GPT(), phases=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = prof.data(get_batch(data, 8, 32, gen) for _ in range(40))
        for _ in range(20):  # two micro-batches per step from the wrapped loader, taken before it
            micro_batches = [next(loader), next(loader)]
            with prof.step():
                for x, y in micro_batches:
                    with prof.phase("forward"):
                        _, loss = model(x, y)
                    with prof.phase("backward"):
                        (loss / 2).backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    records = records_of(tmp_path / "run" / "rank0.jsonl")
    steps = [r for r in records if r["kind"] == "step"]
    analytic = 2 * gpt_analytic_flops(model, 8, 32)
    for s in steps:
        work = s["work"]
        assert work["samples"] == 16 and work["tokens"] == 2 * 8 * 32  # two batches of (8, 32)
        assert work["flops"] == pytest.approx(analytic, rel=0.10)
        assert work["tokens_per_s"] == pytest.approx(work["tokens"] / iteration_s(s), rel=5e-3)
        assert_mfu_is_flops_over_time_over_peak(s, PEAK_TFLOPS)
    start = records[0]["work"]
    assert start["peak_tflops"] == PEAK_TFLOPS and start["chip"] == "peak_tflops option"
    end = records[-1]["work"]
    assert end["tokens"] == 20 * 512
    assert end["flops"] == pytest.approx(20 * analytic, rel=0.10)
    total_s = sum(iteration_s(s) for s in steps)
    assert end["mfu_pct"] == pytest.approx(100 * end["flops"] / total_s / 1e12 / PEAK_TFLOPS, rel=5e-3)


def test_evaluation_forwards_add_no_work_and_add_work_overrides(tmp_path, records_of):
    with steptrace.Profiler(tmp_path / "run") as prof:
        model = prof.watch(GPT(), phases=False)
        x = torch.randint(0, 65, (4, 32))
        for i in range(3):
            with torch.no_grad():
                model(x)  # evaluation between steps: no work
            with prof.step():
                _, loss = model(x, x)
                loss.backward()
                if i == 2:
                    prof.add_work(samples=100, flops=1e9)  # the program's own figures win
    steps = [r for r in records_of(tmp_path / "run" / "rank0.jsonl") if r["kind"] == "step"]
    assert [s["work"]["samples"] for s in steps] == [4, 4, 100]
    assert [s["work"]["tokens"] for s in steps] == [128, 128, 128]
    assert steps[0]["work"]["flops"] == steps[1]["work"]["flops"] == pytest.approx(
        gpt_analytic_flops(model, 4, 32), rel=0.10)
    assert steps[2]["work"]["flops"] == 1e9
    assert "mfu_pct" not in steps[0]["work"]  # a CPU without peak_tflops: no MFU
    assert "peak_tflops" in records_of(tmp_path / "run" / "rank0.jsonl")[0]["work"]["mfu_unavailable"]


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "many"])
def test_add_work_refuses_a_bad_figure_and_records_nothing(tmp_path, records_of, bad):
    with steptrace.Profiler(tmp_path / "run") as prof:
        with prof.step():
            with pytest.raises(ValueError, match="tokens"):
                prof.add_work(samples=4, tokens=bad)
    steps = [r for r in records_of(tmp_path / "run" / "rank0.jsonl") if r["kind"] == "step"]
    assert "work" not in steps[0]  # checked before anything was added


def test_loader_counts_tensor_batches_in_c_as_batch_work_does(tmp_path, records_of):
    """prof.data()'s C iterator counts a tensor, or an exact tuple or list led by one,
    itself (issue 30: batch_work's Python frames cost ~6 us a batch with cold caches); the
    other batches reach on_item. Either way the step's work is batch_work's."""
    from collections import namedtuple

    from steptrace.live.work import batch_counter, data_fast_path

    ids = torch.randint(0, 50, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0
    pair = namedtuple("pair", "x y")
    in_c = [
        torch.randn(8, 3),  # samples only
        ids,  # token ids (batch, sequence)
        ids.to(torch.int32), ids.to(torch.uint8),
        torch.zeros(5, 2, dtype=torch.bool),  # not an integer dtype: no tokens
        torch.zeros(3, 4, 2, dtype=torch.long),  # 3-d: no tokens
        torch.zeros(7),  # 1-d
        torch.nn.Parameter(torch.randn(6, 2)),  # a subclass of Tensor
        (ids, ids), [torch.randn(2, 3), torch.zeros(2)],  # inputs first
        (), [],  # empty: nothing
        torch.tensor(3.0), (torch.tensor(1),),  # 0-d: no batch dimension
    ]
    to_python = [
        {"input_ids": ids, "attention_mask": mask},  # a mapping
        ({"input_ids": ids},),  # a tuple led by a mapping
        pair(ids, ids),  # a tuple subclass: batch_work reads no work from it
        "text", 3, None,  # not tensors
    ]
    seen = []
    with steptrace.Profiler(tmp_path / "run") as prof:
        count = batch_counter(prof._core)

        def on_item(item):
            seen.append(item)
            count(item)

        for _ in prof._core.data(in_c + to_python, on_item, *data_fast_path()):
            with prof.step():
                pass
    assert [id(x) for x in seen] == [id(x) for x in to_python]
    steps = [r for r in records_of(tmp_path / "run" / "rank0.jsonl") if r["kind"] == "step"]
    assert len(steps) == len(in_c) + len(to_python)
    for batch, step in zip(in_c + to_python, steps):
        samples, tokens = batch_work(batch)
        work = step.get("work", {})
        assert (work.get("samples", -1), work.get("tokens", -1)) == (samples, tokens), batch


def test_loader_sees_a_shape_patched_on_torch_tensor_after_it_was_wrapped(tmp_path, records_of, monkeypatch):
    """The C iterator calls torch's `shape` and `dtype` getters straight for an exact
    torch.Tensor (issue 30); a change to the type's attributes after that (here a patched
    `shape`) must reach the count, as the attribute lookup would."""
    batches = [torch.randn(8, 3), torch.randn(8, 3)]
    with steptrace.Profiler(tmp_path / "run") as prof:
        for i, _ in enumerate(prof.data(batches)):
            with prof.step():
                if i == 0:  # the first batch was counted; the second is read after this
                    monkeypatch.setattr(torch.Tensor, "shape", property(lambda self: torch.Size([5, 3])))
    monkeypatch.undo()
    steps = [r for r in records_of(tmp_path / "run" / "rank0.jsonl") if r["kind"] == "step"]
    assert [s["work"]["samples"] for s in steps] == [8, 5]


def test_count_work_off_counts_nothing(tmp_path, records_of):
    with steptrace.Profiler(tmp_path / "run", count_work=False) as prof:
        with pytest.raises(steptrace.ConfigError, match="count_work=False"):
            prof.watch(GPT(), phases=False)  # nothing left to watch on a plain model
        model = prof.watch(GPT())
        for x in prof.data([torch.randint(0, 65, (2, 32))] * 2):
            with prof.step():
                model(x, x)[1].backward()
    steps = [r for r in records_of(tmp_path / "run" / "rank0.jsonl") if r["kind"] == "step"]
    assert steps and all("work" not in s for s in steps)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpt_script_under_steptrace_run_reports_work(tmp_path, records_of, mode):
    # mode "eval": the model trains in eval mode throughout (a from_pretrained model that
    # never gets model.train()): each step begins after its first forward shows it was
    # training (steptrace.live.autophase._EvalModeForwards), and its work is still counted
    log_dir = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "steptrace.cli", "run", "--log-dir", str(log_dir),
                           "-o", f"peak_tflops={PEAK_TFLOPS}", str(HERE / "support" / "gpt_loop.py"), "--iters", "30",
                           "--eval-interval", "10"] + (["--eval-mode-training"] if mode == "eval" else []),
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    records = records_of(log_dir / "rank0.jsonl")
    steps = [r for r in records if r["kind"] == "step"]
    analytic = 2 * gpt_analytic_flops(GPT(), 8, 32)  # gpt_loop.py: two micro-batches of (8, 32)
    assert len(steps) == 30
    for s in steps:
        work = s["work"]
        assert work["tokens"] == 512 and work["tokens_per_s"] > 0
        assert work["flops"] == pytest.approx(analytic, rel=0.10)
        assert_mfu_is_flops_over_time_over_peak(s, PEAK_TFLOPS)


def _hf_analytic_flops(batch: int, seq: int) -> float:
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    n = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name)  # wte is the tied lm_head
    return (6 * n + 12 * config.n_layer * config.n_embd * seq) * seq * batch


def test_hf_trainer_reports_tokens_flops_and_mfu(tmp_path, records_of):
    pytest.importorskip("transformers")
    from support.framework_loops import hf_trainer_run

    run = hf_trainer_run(tmp_path, max_steps=12, eval_steps=6, save_steps=100, peak_tflops=PEAK_TFLOPS)
    steps = [r for r in records_of(run / "rank0.jsonl") if r["kind"] == "step"]
    assert len(steps) == 12
    for s in steps:
        work = s["work"]
        assert work["samples"] == 4 and work["tokens"] == 64  # batches of 4 sequences of 16
        assert work["flops"] == pytest.approx(_hf_analytic_flops(4, 16), rel=0.10)
        assert_mfu_is_flops_over_time_over_peak(s, PEAK_TFLOPS)


def test_lightning_reports_tokens_flops_and_mfu(tmp_path, records_of):
    pytest.importorskip("lightning")
    from support.framework_loops import lightning_gpt_run

    run = lightning_gpt_run(tmp_path, max_steps=12, peak_tflops=PEAK_TFLOPS)
    steps = [r for r in records_of(run / "rank0.jsonl") if r["kind"] == "step"]
    assert len(steps) == 12
    analytic = gpt_analytic_flops(GPT(), 8, 32)
    for s in steps:
        work = s["work"]
        assert work["samples"] == 8 and work["tokens"] == 256
        assert work["flops"] == pytest.approx(analytic, rel=0.10)
        assert_mfu_is_flops_over_time_over_peak(s, PEAK_TFLOPS)
    assert not math.isnan(steps[-1]["work"]["tokens_per_s"])


def test_energy_per_token_and_tokens_per_kwh_where_nvml_measures_energy(tmp_path, monkeypatch, fake_nvml):
    monkeypatch.setenv("STEPTRACE_NVML_LIBRARY", str(fake_nvml))  # the stand-in: a steady ~650 W
    a = torch.randn(96, 96)
    with steptrace.Profiler(tmp_path / "run", nvml_interval_ms=1) as prof:
        for _ in range(40):
            with prof.step():
                for _ in range(20):
                    a = torch.tanh(a @ a)  # a few ms of work, so that the sampler reads inside steps
                prof.add_work(samples=4, tokens=1000)
    records = records_of_path(tmp_path / "run" / "rank0.jsonl")
    with_hw = [r for r in records if r["kind"] == "step" and "hw" in r]
    assert with_hw, "the sampler read no step"
    for r in with_hw:
        assert r["work"]["j_per_token"] == pytest.approx(r["hw"]["energy_j"] / 1000, rel=5e-3, abs=1e-6)
        assert r["work"]["j_per_sample"] == pytest.approx(r["hw"]["energy_j"] / 4, rel=5e-3, abs=2e-4)
    end = records[-1]["work"]
    energy = sum(r["hw"]["energy_j"] for r in with_hw)
    assert end["energy_j"] == pytest.approx(energy, rel=1e-2)
    assert end["tokens_per_kwh"] == pytest.approx(1000 * len(with_hw) / (energy / 3.6e6), rel=1e-2)


def records_of_path(path):
    return list(steptrace.read(path, validate=True))
