"""The Python profiler API on real CPU training loops."""

from __future__ import annotations

import os
import sys
import time

from pathlib import Path

import pytest
import torch

import steptrace
from steptrace.errors import ConfigError, UnknownOptionError, UsageError
from support.training import PHASES, SlowLoader, batches, train


def steps_of(records):
    return [r for r in records if r["kind"] == "step"]


def test_n_steps_give_n_records_with_five_phases(tmp_path, records_of):
    with steptrace.Profiler(tmp_path / "run") as prof:
        train(prof, batches(40))
    records = records_of(prof.log_path)  # validates every record against the schema
    steps = steps_of(records)
    assert [s["step"] for s in steps] == list(range(40))
    assert records[0]["kind"] == "run_start" and records[-1]["kind"] == "run_end"
    assert records[-1]["reason"] == "normal" and records[-1]["steps"] == 40
    for s in steps:
        assert set(s["phases_ms"]) == set(PHASES)
        assert s["clock"] == "host" and s["status"] == "ok"
        # 4 decimals of rounding per phase are the only slack
        assert sum(s["phases_ms"].values()) <= s["step_ms"] + 5 * 1e-4
        assert s["memory"]["rss_bytes"] > 0
    assert records[0]["versions"]["torch"] == torch.__version__
    assert records[0]["config"]["window"] == 100


def test_slow_loader_shows_in_data_ms(tmp_path, records_of):
    with steptrace.Profiler(tmp_path) as prof:
        train(prof, SlowLoader(batches(6), delay_s=0.02))
    steps = steps_of(records_of(prof.log_path))
    assert len(steps) == 6
    for s in steps:
        assert s["data_ms"] >= 20.0 * 0.95  # sleep never returns early; 5% for clock rounding
        assert s["step_ms"] < s["data_ms"] + 1000


def test_unwrapped_loader_gap_is_other_not_data(tmp_path, records_of):
    # steptrace did not see the loader: the gap is other host work, never called data
    with steptrace.Profiler(tmp_path) as prof:
        train(prof, SlowLoader(batches(4), delay_s=0.02), wrap=False)
    steps = steps_of(records_of(prof.log_path))
    assert steps[0]["other_ms"] == 0.0  # nothing before the first step to measure from
    assert all(s["data_ms"] == 0.0 for s in steps)
    assert all(s["other_ms"] >= 19.0 for s in steps[1:])


def test_interval_kinds_and_errors(tmp_path, records_of):
    with steptrace.Profiler(tmp_path) as prof:
        with pytest.raises(ValueError, match="'evaluation' is unknown; allowed: eval, checkpoint, restore, other"):
            prof.interval("evaluation")
        train(prof, batches(2))
        with prof.interval("eval"):
            assert prof._core.open_interval == "eval"
            time.sleep(0.03)  # the evaluation being measured, not synchronization
        assert prof._core.open_interval is None
        train(prof, batches(1))
    records = records_of(prof.log_path)
    (interval,) = [r for r in records if r["kind"] == "interval"]
    assert interval["interval"] == "eval" and interval["duration_ms"] >= 30.0 * 0.95
    steps = steps_of(records)
    assert steps[2]["eval_ms"] == interval["duration_ms"]
    goodput = records[-1]["goodput"]
    assert goodput["eval_s"] * 1000 == pytest.approx(interval["duration_ms"], abs=1.0)


def test_start_and_end_calls_without_with_blocks(tmp_path, records_of):
    with steptrace.Profiler(tmp_path) as prof:
        for _ in range(3):
            prof.start_step()
            prof.start_phase("forward")
            torch.randn(64, 64) @ torch.randn(64, 64)
            prof.end_phase("forward")
            prof.end_step()
    steps = steps_of(records_of(prof.log_path))
    assert len(steps) == 3 and all(s["phases_ms"]["forward"] > 0 for s in steps)


def test_phase_scopes_are_reused(tmp_path):
    with steptrace.Profiler(tmp_path) as prof:
        assert prof.phase("forward") is prof.phase("forward")
        name = "".join(["for", "ward"])  # an equal but distinct str object
        assert prof.phase(name) is prof.phase("forward")
        assert prof.step() is prof.step()
        with prof.step():
            for i in range(3):
                with prof.phase(f"layer{i}"):
                    pass


def test_a_step_and_its_phases_allocate_no_python_object(tmp_path):
    # `with` binds __enter__ and __exit__ on each block; a C method would make a new object
    # for each (two allocations a block, on lines a training step has flushed: issue 30).
    # The scopes' binding is the scope itself. tracemalloc's peak over one step shows any
    # object made and freed in it; the least of a few tries leaves out another thread's.
    import tracemalloc

    with steptrace.Profiler(tmp_path) as prof:
        step, phase = prof.step, prof.phase
        forward = phase("forward")

        def one_step():
            with step():
                with forward:
                    pass
                with phase("backward"):
                    pass

        for _ in range(20):
            one_step()
        peaks = []
        tracemalloc.start()
        try:
            for _ in range(5):
                tracemalloc.reset_peak()
                before, _ = tracemalloc.get_traced_memory()
                one_step()
                peaks.append(tracemalloc.get_traced_memory()[1] - before)
        finally:
            tracemalloc.stop()
    assert min(peaks) == 0, f"bytes allocated during a step, per try: {peaks}"


def test_scopes_enter_and_exit_as_context_managers_do_everywhere(tmp_path, records_of):
    # The scope is its own bound __enter__/__exit__; the unbound ones (on the type) take
    # the scope first, as contextlib.ExitStack and explicit calls use them.
    import contextlib

    with steptrace.Profiler(tmp_path) as prof:
        scope = prof.phase("forward")
        assert scope.__enter__ is scope and scope.__exit__ is scope
        assert "phase" in type(scope).__enter__.__doc__
        with contextlib.ExitStack() as stack:
            stack.enter_context(prof.step())
            stack.enter_context(prof.phase("forward"))
        with prof.step():
            loss = prof.phase("loss")
            assert loss.__enter__() is loss
            assert loss.__exit__(None, None, None) is False
            type(loss).__enter__(loss)
            assert type(loss).__exit__(loss, None, None, None) is False
        with pytest.raises(TypeError, match="called only by `with`"):
            scope(1)
        with pytest.raises(TypeError, match="doesn't apply to a 'int' object"):
            type(scope).__enter__.__get__(1)
        with pytest.raises(TypeError, match="needs one as its first argument"):
            type(scope).__exit__(prof.step(), None, None, None)
        with pytest.raises(TypeError, match="takes 4 positional arguments"):
            type(scope).__exit__(scope)
    steps = steps_of(records_of(prof.log_path))
    assert [sorted(s["phases_ms"]) for s in steps] == [["forward"], ["loss"]]
    assert all(s["status"] == "ok" for s in steps)


def test_every_name_object_finds_its_own_scope(tmp_path, records_of):
    # prof.phase remembers the name objects it has seen, up to a cap; an equal str that is
    # not the same object, and any name once the cap is reached, takes the slower path:
    # each must still give the one scope of its name.
    names = [sys.intern(f"block{i}") for i in range(12)]
    with steptrace.Profiler(tmp_path) as prof:
        scopes = [prof.phase(n) for n in names]
        for n, scope in zip(names, scopes):
            assert scope.name == n
            assert prof.phase(n) is scope
            other = n[:1] + n[1:]  # equal, not the same object
            assert other is not n and prof.phase(other) is scope
        for i in range(200):  # past the cap of remembered objects
            n = names[i % len(names)]
            assert prof.phase(n[:1] + n[1:]) is scopes[i % len(names)]
        assert [prof.phase(n) for n in names] == scopes
        assert len({id(s) for s in scopes}) == len(names)
        with prof.step():
            for n in reversed(names):
                with prof.phase(n):
                    pass
    step = steps_of(records_of(prof.log_path))[0]
    assert list(step["phases_ms"]) == list(reversed(names))


def test_custom_phase_names_are_recorded(tmp_path, records_of):
    with steptrace.Profiler(tmp_path) as prof:
        with prof.step():
            with prof.phase("forward"):
                with prof.phase("attention \"block\""):
                    pass
    step = steps_of(records_of(prof.log_path))[0]
    assert set(step["phases_ms"]) == {"forward", 'attention "block"'}


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"window": 1}, "window=1"),
        ({"regression_threshold": 1.0}, "regression_threshold=1"),
        ({"stall_threshold": 0.9}, "stall_threshold=0.9"),
        ({"flush_interval_ms": 0}, "flush_interval_ms=0"),
        ({"phases": ["forward", ""]}, "empty"),
        ({"window": "10"}, "must be an int"),
        ({"overwrite": 1}, "must be a bool"),
        ({"clock": "sundial"}, "sundial"),
    ],
)
def test_bad_config_raises_before_any_file(tmp_path, options, needle):
    target = tmp_path / "run"
    with pytest.raises(ConfigError, match=needle) as info:
        steptrace.Profiler(target, **options)
    assert isinstance(info.value, ValueError)
    assert not target.exists()


def test_unknown_option_is_a_type_error_listing_the_allowed(tmp_path):
    with pytest.raises(UnknownOptionError, match="windw.*allowed: .*window") as info:
        steptrace.Profiler(tmp_path / "run", windw=50)
    assert isinstance(info.value, TypeError)
    assert not (tmp_path / "run").exists()


def test_log_dir_that_is_a_file_or_unwritable(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        steptrace.Profiler(a_file)
    with pytest.raises(ConfigError, match="cannot create log_dir"):
        steptrace.Profiler(a_file / "sub")  # under a file: unwritable even for root
    with pytest.raises(ConfigError, match="must be a path"):
        steptrace.Profiler(None)


def test_existing_log_is_not_overwritten_by_default(tmp_path):
    with steptrace.Profiler(tmp_path):
        pass
    before = (tmp_path / "rank0.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="already exists.*overwrite=True"):
        steptrace.Profiler(tmp_path)
    assert (tmp_path / "rank0.jsonl").read_bytes() == before
    with steptrace.Profiler(tmp_path, overwrite=True):
        pass


def test_empty_phase_name_is_a_value_error(tmp_path):
    with steptrace.Profiler(tmp_path) as prof:
        with prof.step():
            with pytest.raises(ConfigError, match="empty"):
                prof.phase("")
            with pytest.raises(ConfigError, match="reserved"):
                prof.phase("data")
            with pytest.raises(TypeError):
                prof.phase(3)


def test_misuse_raises_and_the_log_stays_valid(tmp_path, records_of):
    with steptrace.Profiler(tmp_path) as prof:
        with pytest.raises(UsageError, match="outside a step"):
            with prof.phase("forward"):
                pass
        with pytest.raises(UsageError, match="without its start"):
            prof.end_step()
        with prof.step():
            with pytest.raises(UsageError, match="still running"):
                with prof.step():
                    pass
            with prof.phase("forward"):
                with pytest.raises(UsageError, match="nested in itself"):
                    with prof.phase("forward"):
                        pass
            with pytest.raises(UsageError, match="end of phase \"loss\" without its start"):
                prof.end_phase("loss")
        with pytest.raises(UsageError, match="end_data without begin_data"):
            prof._core.end_data()
    records = records_of(prof.log_path)
    assert len(steps_of(records)) == 1
    assert records[-1]["reason"] == "normal"
    assert isinstance(UsageError("x"), RuntimeError)


def test_exception_in_a_phase_propagates_unchanged(tmp_path, records_of):
    class Boom(Exception):
        pass

    boom = Boom("bad batch")
    with pytest.raises(Boom) as info:
        with steptrace.Profiler(tmp_path) as prof:
            train(prof, batches(3))
            with prof.step():
                with prof.phase("forward"):
                    raise boom
    assert info.value is boom
    records = records_of(prof.log_path)
    steps = steps_of(records)
    assert [s["status"] for s in steps] == ["ok", "ok", "ok", "error"]
    assert "forward" in steps[-1]["phases_ms"]
    assert records[-1]["reason"] == "exception"
    assert records[-1]["error"] == "Boom: bad batch"
    assert records[-1]["error_steps"] == 1


def test_records_are_written_while_the_run_goes_on(tmp_path):
    with steptrace.Profiler(tmp_path) as prof:
        train(prof, batches(5))
        prof.flush()
        lines = (tmp_path / "rank0.jsonl").read_text().splitlines()
        assert len(lines) == 1 + 5  # run_start and the 5 steps, before close
        assert prof.step_index == 5 and not prof.closed
    assert prof.closed


def test_rank_and_world_size_from_torchrun_environment(tmp_path, monkeypatch, records_of):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with steptrace.Profiler(tmp_path) as prof:
        pass
    assert os.path.basename(prof.log_path) == "rank1.jsonl"
    start = records_of(prof.log_path)[0]
    assert (start["rank"], start["world_size"]) == (1, 2)


def test_using_a_closed_profiler_is_misuse(tmp_path):
    prof = steptrace.Profiler(tmp_path)
    prof.close()
    prof.close()  # idempotent
    with pytest.raises(UsageError, match="closed"):
        with prof.step():
            pass


def test_without_a_gpu_the_host_clock_is_used_and_run_start_says_why(tmp_path, records_of):
    with steptrace.Profiler(tmp_path) as prof:
        prof.set_stream(1)  # no CUDA driver here: ignored
        train(prof, batches(2))
    records = records_of(prof.log_path)
    timer = records[0]["backends"]["timer"]
    if timer["active"][0] == "cuda":
        pytest.skip("a CUDA driver is present")
    assert timer["active"] == ["host"]
    assert "libcuda" in timer["unavailable"]["cuda"] or "cuInit" in timer["unavailable"]["cuda"]
    assert all(r["clock"] == "host" for r in records if r["kind"] == "step")
    with pytest.raises(ConfigError, match="clock=\"cuda\" but CUDA event timing is unavailable"):
        steptrace.Profiler(tmp_path / "cuda", clock="cuda")
    assert not (tmp_path / "cuda").exists()


def _kernel_keeps_time_with_tsc() -> bool:
    try:
        return Path("/sys/devices/system/clocksource/clocksource0/current_clocksource").read_text() == "tsc\n"
    except OSError:
        return False


def test_run_start_says_how_the_host_clock_is_read_and_the_environment_can_choose(
        tmp_path, monkeypatch, records_of):
    tsc = "host: the CPU's time-stamp counter, calibrated against CLOCK_MONOTONIC and checked every second"
    with steptrace.Profiler(tmp_path / "default") as prof:
        train(prof, batches(2))
    method = records_of(prof.log_path)[0]["backends"]["timer"]["method"]
    assert method in (tsc, "host: CLOCK_MONOTONIC")
    if not _kernel_keeps_time_with_tsc():  # the counter is used only where the kernel uses it
        assert method == "host: CLOCK_MONOTONIC"
    monkeypatch.setenv("STEPTRACE_HOST_CLOCK", "monotonic")
    with steptrace.Profiler(tmp_path / "monotonic") as prof:
        train(prof, batches(2))
    records = records_of(prof.log_path)
    assert records[0]["backends"]["timer"]["method"] == "host: CLOCK_MONOTONIC"
    assert len([r for r in records if r["kind"] == "step"]) == 2


def test_step_hooks_feed_stream_and_memory(tmp_path, records_of):
    calls = []

    def begin():
        calls.append("begin")
        return None  # host clock

    def end():
        calls.append("end")
        return (100, 200, 150, 1000, 4000)

    with steptrace.Profiler(tmp_path) as prof:
        prof._core.set_step_hooks(begin, end)
        train(prof, batches(2))
        prof.start_step()
        prof.end_step()
    steps = [r for r in records_of(prof.log_path) if r["kind"] == "step"]
    assert calls == ["begin", "end"] * 3
    assert steps[0]["memory"]["allocated_bytes"] == 100
    assert steps[0]["memory"]["peak_bytes"] == 150
    assert steps[0]["memory"]["device_total_bytes"] == 4000


def test_data_wrapper_passes_loader_errors(tmp_path, records_of):
    def loader():
        yield from batches(2)
        raise KeyError("worker died")

    with steptrace.Profiler(tmp_path) as prof:
        with pytest.raises(KeyError, match="worker died"):
            train(prof, loader())
        it = prof.data(batches(3))
        assert iter(it) is it
    steps = [r for r in records_of(prof.log_path) if r["kind"] == "step"]
    assert len(steps) == 2 and all(s["status"] == "ok" for s in steps)


def test_data_wrapper_advanced_inside_a_step_warns_once_and_counts(tmp_path, records_of):
    # e.g. gradient accumulation pulling the extra micro-batches with next(it) in the step
    items = list(range(10))
    with steptrace.Profiler(tmp_path) as prof:
        it = prof.data(iter(items))
        got = []
        with pytest.warns(steptrace.UsageWarning, match="advanced inside a step") as caught:
            for first in it:
                with prof.step():
                    got += [first, next(it)]  # the item is still handed over
        assert got == items
        assert len([w for w in caught if w.category is steptrace.UsageWarning]) == 1  # once per run
        assert prof._core.data_inside_step == 5
    records = records_of(prof.log_path)  # validated against the schema
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 5 and all(s["status"] == "ok" for s in steps)
    assert records[-1]["kind"] == "run_end" and records[-1]["data_inside_step"] == 5
