"""Profiler.set_step_values: numbers in the step records' ``meta`` object."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import steptrace
from steptrace.errors import ConfigError, UsageWarning


def _steps(records_of, prof):
    return [r for r in records_of(prof.log_path) if r["kind"] == "step"]


def test_values_of_a_real_loop_reach_the_records(tmp_path, records_of):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        for i in range(5):
            with prof.step():
                loss = model(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                # a float, an int, a numpy scalar, a CPU tensor (read without cost on the CPU)
                prof.set_step_values(global_step=i, epoch=np.int64(0), lr=opt.param_groups[0]["lr"],
                                     loss=loss.detach())
    steps = _steps(records_of, prof)
    assert [s["meta"]["global_step"] for s in steps] == [0, 1, 2, 3, 4]
    assert all(s["meta"]["epoch"] == 0 and s["meta"]["lr"] == 0.01 for s in steps)
    assert all(isinstance(s["meta"]["loss"], float) and s["meta"]["loss"] > 0 for s in steps)
    # the DataFrame has them as columns
    frame = steptrace.load(tmp_path).steps
    assert list(frame["meta_global_step"]) == [0, 1, 2, 3, 4]


def test_between_steps_values_go_to_the_next_step_and_nan_is_null(tmp_path, records_of):
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        prof.set_step_values(epoch=1)
        with prof.step():
            prof.set_step_values(loss=float("nan"), flag=True)
        with prof.step():
            pass
    steps = _steps(records_of, prof)
    assert steps[0]["meta"] == {"epoch": 1, "loss": None, "flag": 1}
    assert "meta" not in steps[1]


def test_bad_values_and_names_are_refused(tmp_path):
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        with prof.step():
            with pytest.raises(TypeError, match=r"loss=.*must be a number.*str"):
                prof.set_step_values(loss="0.5")
            with pytest.raises(ValueError, match=r"one element, got shape \(2,\)"):
                prof.set_step_values(loss=torch.ones(2))
            for i in range(16):
                prof.set_step_values(**{f"v{i}": i})
            with pytest.raises(ConfigError, match="at most 16"):
                prof.set_step_values(v16=1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_a_device_tensor_is_skipped_with_one_warning(tmp_path, records_of):
    loss = torch.ones((), device="cuda")
    with steptrace.Profiler(tmp_path, detect=False) as prof:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with prof.step():
                    prof.set_step_values(loss=loss, global_step=1)
    assert [w.category for w in caught] == [UsageWarning]
    steps = _steps(records_of, prof)
    assert all(s["meta"] == {"global_step": 1} for s in steps)


def test_set_step_values_costs_little(tmp_path):
    # No allocation in the core after the first use of a name; from Python a few
    # hundred nanoseconds per value. A loose bound, so that a loaded machine passes.
    import time

    with steptrace.Profiler(tmp_path, detect=False) as prof:
        with prof.step():
            prof.set_step_values(global_step=0, lr=1e-3, loss=0.5)
            n = 20000
            t0 = time.perf_counter()
            for i in range(n):
                prof.set_step_values(global_step=i, lr=1e-3, loss=0.5)
            per_call_us = (time.perf_counter() - t0) / n * 1e6
    assert math.isfinite(per_call_us) and per_call_us < 50, per_call_us
