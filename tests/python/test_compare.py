"""steptrace.analysis.compare: the rank test, the bootstrap interval and the verdicts, on
synthetic data with a known shift and with none."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from support import logfactory as lf
from steptrace._table import collect
from steptrace.analysis.compare import compare, compare_tables, format_compare, mann_whitney, median_change_ci

np = pytest.importorskip("numpy")


def _table(rng: random.Random, n: int, scale: dict[str, float] | None = None, spikes: float = 0.02,
           phases: dict[str, float] | None = None, warmup_slow: int = 10):
    """A synthetic run: lognormal phase times (sigma 0.15) around the given medians,
    a few 5x spikes, slow warmup steps; ``scale`` multiplies some phases."""
    scale = scale or {}
    base = phases or {"forward": 3.0, "loss": 0.5, "backward": 5.0, "optimizer": 1.2}
    recs = [lf.run_start(config={"warmup_steps": 10})]
    for i in range(n):
        ph = {}
        for name, med in base.items():
            v = med * scale.get(name, 1.0) * math.exp(rng.gauss(0, 0.15))
            if rng.random() < spikes:
                v *= 5
            if i < warmup_slow:
                v *= 10
            ph[name] = v
        recs.append(lf.step(i, phases=ph, data_ms=0.2 * math.exp(rng.gauss(0, 0.3))))
    recs.append(lf.run_end(n))
    return collect(recs)


# --------------------------------------------------------------------------- the test statistics


def test_mann_whitney_matches_brute_force_with_ties() -> None:
    rng = random.Random(0)
    for n1, n2 in ((8, 8), (12, 30), (40, 17)):
        x = [float(rng.randint(0, 6)) for _ in range(n1)]
        y = [float(rng.randint(1, 7)) for _ in range(n2)]
        p, p_slower = mann_whitney(x, y)
        u_y = sum((b > a) + 0.5 * (b == a) for a, b in itertools.product(x, y))
        assert p_slower == pytest.approx(u_y / (n1 * n2))
        p_swapped, p_faster = mann_whitney(y, x)
        assert p == pytest.approx(p_swapped) and p_faster == pytest.approx(1 - p_slower)
        assert 0 < p <= 1


def test_mann_whitney_normal_approximation_value() -> None:
    # x = 1..10, y = 5.5..14.5 (no ties): U_y = 5+6+7+8+9 + 5*10 = 85, mu = 50,
    # sigma^2 = 10*10*21/12 = 175, continuity correction 0.5
    p, p_slower = mann_whitney(range(1, 11), [v + 0.5 for v in range(5, 15)])
    z = (85 - 50 - 0.5) / math.sqrt(175)
    assert p == pytest.approx(math.erfc(z / math.sqrt(2)))
    assert p_slower == pytest.approx(0.85)
    # with ties (y = 6..15 shares 6..10 with x): U_y = 87.5 and the tie-corrected variance
    p, _ = mann_whitney(range(1, 11), range(6, 16))
    var = 175 * (1 - 5 * (2**3 - 2) / (20 * 19 * 21))
    assert p == pytest.approx(math.erfc((87.5 - 50 - 0.5) / math.sqrt(var) / math.sqrt(2)))
    assert mann_whitney([2.0] * 10, [2.0] * 12) == (1.0, 0.5)  # all tied: no evidence


def test_false_positive_rate_of_the_rank_test_is_alpha() -> None:
    rng = np.random.default_rng(5)
    hits = sum(mann_whitney(rng.lognormal(0, 0.3, 120), rng.lognormal(0, 0.3, 90))[0] < 0.05 for _ in range(600))
    assert 0.02 < hits / 600 < 0.09  # ~5%


def test_bootstrap_interval_covers_the_true_change() -> None:
    rng = np.random.default_rng(11)
    covered = 0
    for _ in range(40):
        x = rng.lognormal(0, 0.3, 400)
        y = rng.lognormal(0, 0.3, 400) * 1.08
        lo, hi = median_change_ci(x, y, resamples=400)
        covered += lo <= 0.08 <= hi
    assert covered >= 34  # nominal 95% of 40 = 38


def test_bootstrap_of_large_runs_rescales_the_subsample() -> None:
    rng = np.random.default_rng(2)
    x = rng.lognormal(0, 0.3, 50_000)
    y = rng.lognormal(0, 0.3, 50_000) * 1.02
    lo, hi = median_change_ci(x, y)
    assert lo < 0.02 < hi
    assert hi - lo < 0.02  # as narrow as 50k steps allow, not as wide as 2000 would give


# --------------------------------------------------------------------------- verdicts


def test_known_shift_is_a_regression_and_the_reverse_an_improvement() -> None:
    base = _table(random.Random(1), 400)
    slow = _table(random.Random(2), 400, scale={"backward": 1.15})
    res = compare_tables(base, slow)
    bwd = res["phases"]["backward"]
    assert bwd["verdict"] == "regressed"
    assert bwd["change_pct"] == pytest.approx(15, abs=4)
    assert bwd["ci_low_pct"] < 15 < bwd["ci_high_pct"] and bwd["ci_low_pct"] > 5
    assert bwd["p_value"] < 1e-6 and bwd["p_slower"] > 0.7
    assert "backward" in res["regressed"] and res["ok"] is False
    for other in ("forward", "loss", "optimizer", "data"):
        assert res["phases"][other]["verdict"] not in ("regressed", "improved"), other

    back = compare_tables(slow, base)
    assert back["phases"]["backward"]["verdict"] == "improved"
    assert back["ok"] is True and back["improved"] == ["backward", "step", "iteration"]


def test_no_false_regression_on_identical_distributions() -> None:
    # 25 pairs of independent runs of one distribution (with spikes and slow warmup):
    # never a regression or an improvement at the default threshold
    verdicts = []
    for seed in range(25):
        res = compare_tables(_table(random.Random(2 * seed), 300), _table(random.Random(2 * seed + 1), 300))
        assert res["ok"] is True and res["regressed"] == [] and res["improved"] == []
        verdicts += [r["verdict"] for r in res["phases"].values()]
    significant = sum(v in ("slower", "faster") for v in verdicts) / len(verdicts)
    assert significant < 0.05  # the rank test's own false positives at alpha = 0.01


def test_small_shift_below_threshold_is_slower_not_regressed() -> None:
    base = _table(random.Random(3), 3000, spikes=0)
    new = _table(random.Random(4), 3000, scale={"forward": 1.03}, spikes=0)
    res = compare_tables(base, new)
    assert res["phases"]["forward"]["verdict"] == "slower"
    assert res["ok"] is True
    # ... and a regression once the threshold is below the shift
    assert compare_tables(base, new, threshold=0.01)["phases"]["forward"]["verdict"] == "regressed"


def test_microsecond_phases_do_not_trip_the_gate() -> None:
    phases = {"forward": 3.0, "tiny": 0.01}
    base = _table(random.Random(5), 400, phases=phases)
    new = _table(random.Random(6), 400, phases=phases, scale={"tiny": 2.0})
    res = compare_tables(base, new)
    assert res["phases"]["tiny"]["change_pct"] == pytest.approx(100, abs=15)
    assert res["phases"]["tiny"]["verdict"] == "slower" and res["ok"]
    assert compare_tables(base, new, min_delta_ms=0)["phases"]["tiny"]["verdict"] == "regressed"


def test_gate_limits_which_phases_fail() -> None:
    base = _table(random.Random(7), 300)
    new = _table(random.Random(8), 300, scale={"loss": 1.5})
    res = compare_tables(base, new, gate=["forward", "backward"])
    assert res["phases"]["loss"]["verdict"] == "regressed" and not res["phases"]["loss"]["gated"]
    assert res["ok"] is True and res["regressed"] == []
    assert "REGRESSED (not gated)" in format_compare(res)


def test_warmup_steps_are_left_out() -> None:
    # the first 10 steps are 10x slower in NEW only; with them in, the median barely
    # moves, but the mean would: the comparison skips them (warmup_steps from run_start)
    base = _table(random.Random(9), 200, warmup_slow=0)
    new = _table(random.Random(10), 200, warmup_slow=10)
    res = compare_tables(base, new)
    assert res["warmup_steps"] == {"base": 10, "new": 10}
    assert res["phases"]["forward"]["n_new"] == 190 and res["ok"]


def test_added_removed_and_too_few() -> None:
    base = _table(random.Random(11), 100, phases={"forward": 3.0, "old": 1.0})
    new = _table(random.Random(12), 100, phases={"forward": 3.0, "fresh": 1.0})
    res = compare_tables(base, new)
    assert res["phases"]["old"]["verdict"] == "removed"
    assert res["phases"]["fresh"]["verdict"] == "added"
    tiny = _table(random.Random(13), 5, warmup_slow=0)
    res = compare_tables(tiny, tiny)
    assert res["phases"]["forward"]["verdict"] == "too few steps" and res["ok"]
    json.dumps(res, allow_nan=False)


def test_compare_accepts_paths_and_runs(tmp_path: Path) -> None:
    from steptrace.analysis.run import load_table

    path = lf.write_log(tmp_path / "a" / "rank0.jsonl", lf.run_records(30))
    res = compare(path, load_table(path))
    assert res["ok"] and res["base"] == str(path)
    with pytest.raises(ValueError, match="alpha"):
        compare(path, path, alpha=2)


# --------------------------------------------------------------------------- CLI


def _write(tmp: Path, name: str, seed: int, **kw) -> Path:
    t = _table(random.Random(seed), 300, **kw)
    recs = [*t.run_starts]
    for i in range(t.n):
        phases = {k: t.phases.cols[k][i] for k in t.phases.cols}
        recs.append(lf.step(int(t.step[i]), phases=phases, data_ms=t.data_ms[i]))
    return lf.write_log(tmp / name / "rank0.jsonl", recs)


def test_cli_compare_gate_exit_codes(tmp_path: Path) -> None:
    base = _write(tmp_path, "base", 1)
    same = _write(tmp_path, "same", 2)
    slow = _write(tmp_path, "slow", 3, scale={"backward": 1.2})
    proc = lf.run_cli("compare", base.parent, same.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("no regression")

    proc = lf.run_cli("compare", base.parent, slow.parent)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[1].split()[:3] == ["phase", "base", "p50"]
    row = next(ln for ln in lines if ln.startswith("backward"))
    assert "REGRESSED" in row and "+2" in row  # about +20%
    assert lines[-1].startswith("REGRESSION: ") and "backward" in lines[-1]

    assert lf.run_cli("compare", base.parent, slow.parent, "--threshold", "30%").returncode == 0
    assert lf.run_cli("compare", base.parent, slow.parent, "--gate", "forward,loss").returncode == 0
    proc = lf.run_cli("compare", base.parent, slow.parent, "--json", "--gate", "backward")
    assert proc.returncode == 1
    res = json.loads(proc.stdout)
    assert res["regressed"] == ["backward"] and res["threshold_pct"] == 5.0


# --------------------------------------------------------------------------- the time between steps


def test_other_is_compared_beside_data_and_is_part_of_the_iteration() -> None:
    base = collect(lf.timeline_run(n=40))
    slow = collect(lf.timeline_run(n=40, other_ms=2.0))  # 1.5 ms more host work between steps
    res = compare_tables(base, slow, warmup=0)
    assert list(res["phases"])[:2] == ["data", "other"]
    other = res["phases"]["other"]
    assert (other["base_p50_ms"], other["new_p50_ms"]) == (0.5, 2.0) and other["verdict"] == "regressed"
    it = res["phases"]["iteration"]
    # data 1 + other + step 10; the 5 ms evaluation inside step 15 is not part of it
    assert (it["base_p50_ms"], it["new_p50_ms"]) == (pytest.approx(11.5), pytest.approx(13.0))
    assert res["phases"]["step"]["verdict"] == "same" and res["phases"]["data"]["verdict"] == "same"
    assert set(res["regressed"]) == {"other", "iteration"}


def test_compare_shows_the_goodput_difference(tmp_path: Path) -> None:
    base_recs = lf.timeline_run(n=40)
    # the new run spends 1.5 ms more between steps: less of its wall clock is training
    new_recs = lf.timeline_run(n=40, other_ms=2.0)
    gb = next(r for r in base_recs if r["kind"] == "run_end")["goodput"]
    gn = next(r for r in new_recs if r["kind"] == "run_end")["goodput"]
    res = compare_tables(collect(base_recs), collect(new_recs), warmup=0)
    parts = res["goodput"]["parts"]
    assert list(parts) == ["training", "data", "eval", "checkpoint", "other", "startup", "after_last_step"]
    assert parts["training"]["base_pct"] == pytest.approx(gb["training_pct"])
    assert parts["training"]["new_pct"] == pytest.approx(gn["training_pct"])
    assert parts["training"]["delta_pts"] == pytest.approx(gn["training_pct"] - gb["training_pct"])
    assert parts["other"]["delta_pts"] == pytest.approx(100 * (gn["other_s"] / gn["wall_s"] - gb["other_s"] / gb["wall_s"]))
    assert parts["other"]["delta_pts"] > 0 > parts["training"]["delta_pts"]
    assert parts["checkpoint"]["base_s"] == pytest.approx(2.5) and parts["checkpoint"]["new_s"] == pytest.approx(2.5)
    assert res["goodput"]["base"]["from"] == "process_start"
    json.dumps(res)

    text = format_compare(res)
    lines = text.splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("wall clock share")))
    assert lines[head].split() == ["wall", "clock", "share", "base", "new", "change"]
    rows = {ln[:18].strip(): ln[18:].split() for ln in lines[head + 1:head + 9]}
    assert list(rows) == ["training (steps)", "data", "eval", "checkpoint", "other", "startup", "after last step",
                          "wall clock"]
    d = parts["training"]["delta_pts"]
    assert rows["training (steps)"] == [f"{gb['training_pct']:.1f}%", f"{gn['training_pct']:.1f}%", f"{d:+.1f}", "pts"]
    assert f"training share of the wall clock: {gb['training_pct']:.1f}% -> {gn['training_pct']:.1f}% " \
           f"({d:+.1f} points)" in lines
    assert lines[-1].startswith("REGRESSION: ")  # other and the iteration, not the goodput

    # the CLI prints the same section; a run without goodput (an older log) shows "-"
    old = lf.write_log(tmp_path / "old" / "rank0.jsonl", lf.run_records(40))
    new = lf.write_log(tmp_path / "new" / "rank0.jsonl", new_recs)
    proc = lf.run_cli("compare", old.parent, new.parent, "--gate", "forward")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("training (steps)"))
    assert row.split()[2:4] == ["-", f"{gn['training_pct']:.1f}%"]
    assert "(base has no goodput: an older log)" in proc.stdout
    proc = lf.run_cli("compare", old.parent, old.parent)
    assert proc.returncode == 0 and "wall clock share" not in proc.stdout
    proc = lf.run_cli("compare", old.parent, new.parent, "--json", "--gate", "forward")
    assert json.loads(proc.stdout)["goodput"]["parts"]["training"]["base_pct"] is None


# --------------------------------------------------------------------------- useful work


def _work_records(rng: random.Random, n: int = 300, time_scale: float = 1.0, flops: float = 2e10,
                  tokens: float = 1024) -> list[dict]:
    """A run whose steps did useful work: lognormal iterations (sigma 0.1) around 10 ms x
    ``time_scale``, each step's ``flops`` and ``tokens`` (peak 10 TFLOP/s)."""
    recs = [lf.run_start(config={"warmup_steps": 10}, work={"peak_tflops": 10.0})]
    for i in range(n):
        ms = 10.0 * time_scale * math.exp(rng.gauss(0, 0.1))
        recs.append(lf.step(i, phases={"forward": (ms - 1) / 3, "backward": 2 * (ms - 1) / 3}, data_ms=1.0,
                            work=lf.work(ms, flops=flops, tokens=tokens)))
    recs.append(lf.run_end(n))
    return recs


def test_an_mfu_drop_at_the_same_step_time_is_a_regression() -> None:
    # new shapes: each step does 20% fewer model FLOPs in the same time (and as many tokens)
    base = collect(_work_records(random.Random(11)))
    new = collect(_work_records(random.Random(12), flops=1.6e10))
    res = compare_tables(base, new)
    mfu = res["work"]["mfu_pct"]
    assert mfu["verdict"] == "regressed" and mfu["change_pct"] == pytest.approx(-20, abs=3)
    assert mfu["base_p50"] == pytest.approx(20.0, rel=0.05) and mfu["p_higher"] < 0.3
    assert mfu["ci_high_pct"] < 0 and mfu["p_value"] < 1e-6
    assert res["phases"]["iteration"]["verdict"] not in ("regressed", "improved")
    assert res["work"]["tokens_per_s"]["verdict"] not in ("regressed", "improved")
    assert res["regressed"] == ["mfu_pct"] and res["ok"] is False
    text = format_compare(res)
    row = next(ln for ln in text.splitlines() if ln.startswith("MFU"))
    assert "REGRESSED" in row and "-2" in row
    assert text.splitlines()[-1].startswith("REGRESSION: MFU lower beyond 5%: MFU (-")
    # the other way round it improved; gated out it does not fail
    assert compare_tables(new, base)["work"]["mfu_pct"]["verdict"] == "improved"
    gated = compare_tables(base, new, gate=["iteration"])
    assert gated["ok"] is True and not gated["work"]["mfu_pct"]["gated"]


def test_slower_steps_of_the_same_work_regress_time_mfu_and_tokens() -> None:
    res = compare_tables(collect(_work_records(random.Random(13))),
                         collect(_work_records(random.Random(14), time_scale=1.2)))
    assert {"iteration", "mfu_pct", "tokens_per_s"} <= set(res["regressed"])
    assert res["work"]["tokens_per_s"]["change_pct"] == pytest.approx(-100 / 6, abs=3)


def test_no_false_work_regression_on_identical_runs() -> None:
    for seed in range(10):
        res = compare_tables(collect(_work_records(random.Random(100 + 2 * seed), n=200)),
                             collect(_work_records(random.Random(101 + 2 * seed), n=200)))
        assert res["ok"] is True, seed
        assert {r["verdict"] for r in res["work"].values()} <= {"same", "lower", "higher"}


def test_runs_without_work_compare_no_work_and_one_side_is_added() -> None:
    plain = _table(random.Random(15), 100)
    res = compare_tables(plain, _table(random.Random(16), 100))
    assert res["work"] == {} and "MFU" not in format_compare(res)
    one = compare_tables(plain, collect(_work_records(random.Random(17), n=100)))
    assert one["work"]["mfu_pct"]["verdict"] == "added" and "mfu_pct" not in one["regressed"]


def test_cli_compare_fails_on_an_mfu_drop_and_gates_it_by_name(tmp_path: Path) -> None:
    base = lf.write_log(tmp_path / "base" / "rank0.jsonl", _work_records(random.Random(21)))
    new = lf.write_log(tmp_path / "new" / "rank0.jsonl", _work_records(random.Random(22), flops=1.5e10))
    proc = lf.run_cli("compare", base.parent, new.parent)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(ln.split()[:3] == ["work", "base", "p50"] for ln in lines)
    assert lines[-1].startswith("REGRESSION: MFU lower")
    assert lf.run_cli("compare", base.parent, new.parent, "--gate", "iteration,tokens_per_s").returncode == 0
    proc = lf.run_cli("compare", base.parent, new.parent, "--json", "--gate", "mfu_pct")
    assert proc.returncode == 1
    res = json.loads(proc.stdout)
    assert res["regressed"] == ["mfu_pct"] and res["work"]["mfu_pct"]["verdict"] == "regressed"
    bad = lf.run_cli("compare", base.parent, new.parent, "--gate", "mfu")
    assert bad.returncode == 2 and "mfu_pct" in bad.stderr
    # on a terminal: the rich tables, the work table among them
    rc, out, _ = lf.run_cli_tty("compare", base.parent, new.parent, NO_COLOR="1")
    assert rc == 1
    mfu = next(ln for ln in out.splitlines() if ln.startswith("MFU"))
    assert "REGRESSED" in mfu and "%" in mfu
