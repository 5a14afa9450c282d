"""Fuzzed logs through the reader, steptrace.load and every log-reading CLI subcommand.

Seeded (mutant i is ``fuzzing.Mutator(i)`` applied to a seed; nothing depends on the
clock), so a failure names the mutant that reproduces it: ``make_mutant(i, ...)``. The
seeds are a real CPU training run (fuzz_corpus/seed_real.jsonl: step, alert, resolved,
run_start/run_end records) and a two-rank factory folder with every optional step group
and the cluster, alert_update and resolved records. The guarantee: each call gives a
correct result or a clean error (docs/hardening.md), never a traceback, a stray warning,
a hang (a time limit per call) or a memory blow-up (peak RSS bounded on long lines).

Cost on 2 cores: the mutants run every cheap check (read, summary, export, cluster);
compare and steptrace.load every 4th, schema validation every 10th, plot and report
every 50th: 2,000 mutants by default, about 3 minutes (``STEPTRACE_FUZZ_MUTANTS`` changes
the count; 500 found nothing that 2,000 did: keep it high).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from support import fuzzing as fz
from support import logfactory as lf
import steptrace

MUTANTS = int(os.environ.get("STEPTRACE_FUZZ_MUTANTS", "2000"))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return fz.write_seeds(tmp_path_factory.mktemp("fuzz_seeds"))


@pytest.fixture
def oracle(tmp_path: Path, seeds: dict[str, Path]) -> fz.Oracle:
    return fz.Oracle(tmp_path, seeds["real"].parent)


def test_seeds_are_valid_logs_that_every_command_reads(seeds, oracle):
    oracle.nesting = True  # correct logs export as properly nested traces
    for name in ("real", "factory0"):
        path = seeds[name] if name == "real" else seeds[name].parent
        assert list(steptrace.read(path, validate=True))
        result = oracle.check(path, name, heavy=True)
        codes = result["codes"]
        assert all(rc == 0 or (cmd.startswith("compare") and rc == 1) for cmd, rc in codes.items()), codes
    kinds = {r["kind"] for r in steptrace.read(seeds["real"])}
    assert {"run_start", "step", "alert", "resolved", "run_end"} <= kinds
    kinds = {r["kind"] for r in steptrace.read(seeds["factory0"].parent)}
    assert {"cluster", "alert_update", "resolved", "alert", "interval"} <= kinds


def test_mutants(tmp_path, seeds, oracle):
    failures = []
    for i in range(MUTANTS):
        op, which, path = fz.make_mutant(i, seeds, tmp_path)
        try:
            oracle.check(path, f"m{i}", heavy=i % 50 == 0, validate=i % 10 == 0, compare=i % 4 == 0,
                         load=i % 4 == 1)
        except fz.Failure as exc:
            failures.append(f"mutant {i} ({op} of {which}): {exc}")
            if len(failures) >= 5:
                break
    assert not failures, "\n\n".join(failures)
    assert oracle.calls >= 8 * MUTANTS


@pytest.mark.filterwarnings("ignore::steptrace.analysis.reader.TruncatedLogWarning")
def test_truncation_keeps_every_whole_record(tmp_path, seeds):
    original = seeds["real"].read_bytes()
    rng = random.Random(7)
    cuts = [rng.randrange(len(original) + 1) for _ in range(150)] + [0, 1, len(original) - 1, len(original)]
    path = tmp_path / "cut.jsonl"
    for cut in cuts:
        path.write_bytes(original[:cut])
        expected = fz.expected_after_truncation(original, cut)
        if expected is None:
            with pytest.raises(steptrace.LogFormatError, match="empty log"):
                list(steptrace.read(path))
        else:
            got = list(steptrace.read(path))
            assert got == expected, f"cut at byte {cut}"


def test_special_files(tmp_path, oracle):
    for name, data in fz.special_files(random.Random(3)):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        result = oracle.check(path, name, heavy=True)
        if name in ("crlf",):  # CRLF line ends are still JSON lines
            assert result["codes"]["summary"] == 0
        if name in ("empty", "newline", "blank", "nul", "garbage", "json_array", "deep_header", "utf16"):
            assert result["codes"]["summary"] == 2, name


@pytest.mark.parametrize("mib", [40, 6])
def test_long_lines_keep_memory_bounded(tmp_path, seeds, oracle, mib):
    """A line of 40 MiB (beyond the reader's 16 MiB limit) is skipped as a torn line,
    read in pieces: the peak RSS of every command stays far below the line's size. A
    line of 6 MiB is parsed: the peak is a bounded multiple of the line (Python objects
    for a 1.5-million-element array take ~30x its text)."""
    from steptrace.analysis.reader import MAX_LINE_BYTES

    for name, data, line in fz.long_line_files(seeds["real"].read_bytes(), mib << 20):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        del data
        with fz.peak_rss() as peak:
            result = oracle.check(path, name, validate=False, compare=False, load=True)
        # measured: ~66 MiB (pieces of 16 MiB and their copies) and ~30x a parsed line
        bound = 4 * MAX_LINE_BYTES + 32 * 2**20 if line > MAX_LINE_BYTES else 40 * line + 128 * 2**20
        assert peak[0] < bound, f"{name}: peak RSS growth {peak[0] / 2**20:.0f} MiB for a {line / 2**20:.0f} MiB line"
        if line > MAX_LINE_BYTES and name != "long_header_schema":  # the rest of the log reads
            assert result["codes"]["summary"] == 0, name
        path.unlink()


def test_corpus(tmp_path, seeds, oracle):
    """The mutants that found bugs (fuzz_corpus/README.md says which), plus the big ones
    generated here; correct logs among them must export nested traces."""
    files = sorted(p for p in fz.CORPUS.glob("*.jsonl") if p != fz.REAL_SEED)
    assert len(files) >= 8
    for f in files:
        if ".rank" in f.name:  # one rank of the factory folder; the other rank comes from the seed
            rank = f.name.rsplit(".rank", 1)[1].split(".")[0]
            folder = tmp_path / f.stem
            folder.mkdir()
            (folder / f"rank{rank}.jsonl").write_bytes(f.read_bytes())
            other = seeds["factory1" if rank == "0" else "factory0"]
            (folder / other.name).write_bytes(other.read_bytes())
            path = folder
        else:
            path = f
        oracle.nesting = "overlap" not in f.name
        oracle.check(path, f.stem, heavy="heatmap" in f.name)  # plot and report where the bug was
    deep = tmp_path / "deep_record_starts.jsonl"  # was quadratic: a minute per read
    deep.write_bytes(seeds["real"].read_bytes() + b'{"kind":"step","phases_ms":[' * 100_000 + b"\n")
    oracle.limit = 5.0
    oracle.check(deep, "deep", heavy=False)


def test_rank_that_is_not_an_int64_stays_on_its_own_timeline(tmp_path, seeds):
    """orjson reads -9223372036854775809 as a float: such a step belonged to rank 0
    (overlapping rank 0's steps in the trace); it is the file's rank."""
    path = fz.CORPUS / "rank_beyond_int64.rank1.jsonl"
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "rank1.jsonl").write_bytes(path.read_bytes())
    (folder / "rank0.jsonl").write_bytes(seeds["factory0"].read_bytes())
    run = steptrace.load(folder)
    assert run.steps.groupby("rank").size().to_dict() == {0: 40, 1: 40}
    out = tmp_path / "t.json"
    from steptrace.cli import main

    assert main(["export", str(folder), "--format", "chrome", "-o", str(out)]) == 0
    lf.check_chrome_trace(json.loads(out.read_text()))


def test_json_fallback_reader_without_orjson(tmp_path, seeds):
    """Without orjson (json's scanner): deep nesting is a torn line, not a RecursionError."""
    path = tmp_path / "deep.jsonl"
    path.write_bytes(seeds["real"].read_bytes() + b"[" * 100_000 + b"\n" + b'{"kind":"step"}\n')
    code = ("import sys; sys.modules['orjson'] = None\n"
            "from steptrace.cli import main\n"
            f"sys.exit(main(['summary', {str(path)!r}, '--json']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "torn line skipped" in proc.stderr
    assert json.loads(proc.stdout)["steps"] == 61


def test_cli_commands_without_a_log(tmp_path):
    """The subcommands that take no log: junk arguments are clean usage errors."""
    oracle = fz.Oracle(tmp_path, tmp_path)
    rng = random.Random(5)
    chips = ["", "x" * 200, "GH100\n", "\u202e", "GH100", "GA100", "gh100", "GH1000", "../GH100", "\x00", "nan"]
    for _ in range(40):  # junk chips, modes and flags: a report, or one clean error
        argv = ["metrics", "--chip", rng.choice(chips)]
        if rng.random() < 0.5:
            argv += ["--mode", rng.choice(["auto", "pm_sampling", "range_profiler", "", "PM", "x" * 50])]
        if rng.random() < 0.5:
            argv += ["--json"]
        rc, out, _ = oracle.cli(argv)
        assert rc in (0, 2)
        if rc == 0 and "--json" in argv:
            assert isinstance(fz.strict_json(out), dict)
    rc, _, _ = oracle.cli(["summary", str(tmp_path / "nope")])
    assert rc == 2
    rc, _, _ = oracle.cli(["export", str(tmp_path), "--format", "chrome", "-o", str(tmp_path / "no" / "x.json")])
    assert rc == 2


def test_run_with_fuzzed_arguments_refuses_cleanly_before_the_script_runs(tmp_path, monkeypatch):
    """``steptrace run`` with seeded junk arguments: a bad one is exit 2 with one error line,
    raised before the script ran or a log was written; good ones run the script."""
    script = tmp_path / "train.py"
    marker = tmp_path / "ran"
    script.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('1')\n")
    monkeypatch.chdir(tmp_path)
    oracle = fz.Oracle(tmp_path, tmp_path)
    good = {"--log-dir": [str(tmp_path / "logs")], "--discover-steps": ["0", "3"],
            "-o": ["window=30", "warmup_steps=2", 'clock="host"']}
    bad = {"--log-dir": ["/proc/steptrace/x", str(script), ""],
           "--nproc-per-node": ["0", "-3", "x", "1e9", ""],
           "--discover-steps": ["-1", "two", "1.5", ""],
           "-o": ["window", "=3", "window=abc", "nosuch=1", "window=-5", "window=1e400", "warmup_steps=[1]",
                  "clock=\"gpu\"", "detect=NaN", "window=" + "9" * 400, "\u202e=1", "window=1=2"]}
    scripts = [str(script), str(tmp_path / "nope.py"), str(tmp_path), "", "\x7f.py"]
    rng = random.Random(11)
    ran = refused = 0
    for i in range(120):
        argv, ok = ["run"], True
        for flag in rng.sample(sorted(good), rng.randrange(len(good) + 1)):
            if rng.random() < 0.4:
                argv += [flag, rng.choice(bad[flag])] if flag in bad else [flag, rng.choice(good[flag])]
                ok = ok and flag not in bad
            else:
                argv += [flag, rng.choice(good[flag])]
        if rng.random() < 0.3:
            argv += ["--nproc-per-node", rng.choice(bad["--nproc-per-node"])]
            ok = False
        target = scripts[0] if rng.random() < 0.6 else rng.choice(scripts)
        ok = ok and target == str(script)
        argv += [target] if target else []
        ok = ok and bool(target)
        argv += ["--lr", "0.1"] if rng.random() < 0.3 else []
        marker.unlink(missing_ok=True)
        rc, _, err = oracle.cli(argv)
        if ok:
            assert rc == 0 and marker.exists(), f"argv {argv}: exit {rc} {err[-500:]}"
            ran += 1
        else:
            assert rc == 2 and not marker.exists(), f"argv {argv}: exit {rc} {err[-500:]}"
            refused += 1
    assert ran >= 10 and refused >= 40, (ran, refused)
