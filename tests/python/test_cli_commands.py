"""The real ``steptrace`` console script, in a subprocess, on logs written by real CPU
training loops and on hand-crafted bad files: every command, its output, its exit code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from support import logfactory as lf

PHASES = ("forward", "loss", "backward", "clip", "optimizer")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return lf.real_runs(tmp_path_factory)


def _one_error_line(proc, needle: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("steptrace: error: "), lines[0]
    assert needle in lines[0], (needle, lines[0])
    return lines[0]


# --------------------------------------------------------------------------- help


def test_help_lists_every_command() -> None:
    proc = lf.run_cli("--help")
    assert proc.returncode == 0
    for cmd in ("summary", "compare", "plot", "export", "report"):
        assert cmd in proc.stdout
    proc = lf.run_cli("compare", "--help")
    assert proc.returncode == 0 and "Mann-Whitney" in proc.stdout and "--threshold" in proc.stdout


# --------------------------------------------------------------------------- summary


def test_summary_of_a_real_run(real: dict[str, Path]) -> None:
    proc = lf.run_cli("summary", real["base"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # not a terminal: no progress bar, no colours
    assert not ANSI.search(proc.stdout)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"run {real['base']}: 160 steps (0 errors)") and "ended normal" in lines[0]
    assert lines[1].split() == ["phase", "p50", "ms", "p95", "ms", "p99", "ms", "max", "ms", "share"]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[2:11]}
    # the loader is wrapped (data); the rest of the time between steps is other
    assert list(rows) == ["data", "other", *PHASES, "step", "iteration"]
    for name, cells in rows.items():
        p50, p95, p99, mx = (float(c) for c in cells[:4])
        assert 0 <= p50 <= p95 <= p99 <= mx, name
    assert rows["iteration"][-1] == "100.0%"
    assert any(ln.startswith("rss") for ln in lines)


def test_summary_json_of_a_real_run(real: dict[str, Path]) -> None:
    proc = lf.run_cli("summary", real["base"], "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert s["steps"] == 160 and s["error_steps"] == 0 and s["end_reason"] == "normal"
    assert list(s["phases"]) == list(PHASES)
    for st in [s["data"], s["step"], s["iteration"], *s["phases"].values()]:
        assert st["p50_ms"] <= st["p95_ms"] <= st["p99_ms"] <= st["max_ms"]
    assert s["memory"]["rss_bytes"]["peak"] >= s["memory"]["rss_bytes"]["start"] > 0
    assert s["memory_trend"]["rss_bytes"]["trend"] in ("flat", "rising", "falling")
    assert s["steps_per_s"] > 0 and s["clock"] == "host"
    # where the wall clock went, from run_end: the parts add up to the wall clock
    g = s["goodput"]
    assert g["source"] == "run_end" and g["from"] in ("process_start", "profiler_start")
    parts = [g[k] for k in ("startup_s", "steps_s", "data_s", "eval_s", "checkpoint_s", "other_s", "after_last_step_s")]
    assert sum(parts) == pytest.approx(g["wall_s"], abs=0.01 + 1e-3 * g["wall_s"])
    assert g["eval_s"] == 0 and g["checkpoint_s"] == 0 and 0 < g["training_pct"] <= 100


def test_summary_on_a_terminal_is_a_rich_table_and_plain_on_request(real: dict[str, Path]) -> None:
    rc, out, err = lf.run_cli_tty("summary", real["base"])
    assert rc == 0, err
    assert ANSI.search(out), "no colours on a terminal"
    assert "─" in out and "p99 ms" in out  # rich's table rule
    for phase in PHASES:
        assert phase in out

    rc, out, _ = lf.run_cli_tty("summary", real["base"], "--plain")
    assert rc == 0
    assert not ANSI.search(out) and "─" not in out
    assert out.replace("\r\n", "\n").splitlines()[1].split()[:4] == ["phase", "p50", "ms", "p95"]


def test_progress_bar_only_on_a_terminal(real: dict[str, Path]) -> None:
    # stderr on a terminal: a bar is drawn (no delay, for a small log) and erased again
    rc, out, err = lf.run_cli_tty("summary", real["base"], stdout_tty=False, stderr_tty=True,
                                  STEPTRACE_PROGRESS_DELAY_S="0")
    assert rc == 0
    assert "reading" in err and "%" in err and "MiB" in err, repr(err)
    assert err.rstrip().endswith("\x1b[2K"), "the bar is erased at the end"
    assert out.startswith("run ")  # stdout (a pipe) is unaffected
    # --no-progress: nothing, even on a terminal
    rc, _, err = lf.run_cli_tty("summary", real["base"], "--no-progress", stdout_tty=False, stderr_tty=True,
                                STEPTRACE_PROGRESS_DELAY_S="0")
    assert rc == 0 and err == ""


# --------------------------------------------------------------------------- compare


def test_compare_a_run_with_itself_passes(real: dict[str, Path]) -> None:
    proc = lf.run_cli("compare", real["base"], real["base"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("no regression")
    assert "REGRESSED" not in proc.stdout


def test_compare_flags_the_slower_forward_and_fails_the_gate(real: dict[str, Path]) -> None:
    proc = lf.run_cli("compare", real["base"], real["slow"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {ln.split()[0]: ln for ln in proc.stdout.splitlines()[2:] if ln.strip()}
    assert "REGRESSED" in rows["forward"]
    assert "REGRESSION:" in proc.stdout and "forward (+" in proc.stdout

    proc = lf.run_cli("compare", real["base"], real["slow"], "--json")
    assert proc.returncode == 1
    res = json.loads(proc.stdout)
    assert "forward" in res["regressed"] and "iteration" in res["regressed"] and res["ok"] is False
    fwd = res["phases"]["forward"]
    assert fwd["new_p50_ms"] - fwd["base_p50_ms"] > 2.5  # the 3 ms sleep
    # P(a slow-run step is slower than a base step): well above 0.5 even when other load
    # on the machine makes some base steps slow too
    assert fwd["p_value"] < 1e-6 and fwd["p_slower"] > 0.75 and fwd["ci_low_pct"] > 100


# --------------------------------------------------------------------------- plot / export / report


def test_plot_of_a_real_run(real: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "base.png"
    proc = lf.run_cli("plot", real["base"], "-o", out)
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert proc.stderr.strip() == f"wrote {out}"


def test_export_chrome_of_a_real_run(real: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    proc = lf.run_cli("export", real["base"], "--format", "chrome", "-o", out)
    assert proc.returncode == 0, proc.stderr
    events = lf.check_chrome_trace(json.loads(out.read_text()))
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    assert len(steps) == 160 and {e["pid"] for e in steps} == {0}
    phases = [e for e in events if e["ph"] == "X" and e.get("cat") == "phase"]
    assert {e["name"] for e in phases} == set(PHASES) and len(phases) == 5 * 160
    log = [r for r in map(json.loads, (real["base"] / "rank0.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    # durations are the logged milliseconds, in microseconds
    for ev, rec in zip(steps, log):
        assert ev["args"]["step"] == rec["step"]
        assert ev["dur"] == pytest.approx(rec["step_ms"] * 1000, abs=1e-3)


def test_export_csv_of_a_real_run(real: dict[str, Path], tmp_path: Path) -> None:
    import csv

    out = tmp_path / "steps.csv"
    proc = lf.run_cli("export", real["base"], "--format", "csv", "-o", out)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 160
    assert [f"{p}_ms" for p in PHASES] == [c for c in rows[0] if c.endswith("_ms") and c[:-3] in PHASES]
    assert [int(r["step"]) for r in rows] == list(range(160))
    assert all(r["status"] == "ok" and int(r["rss_bytes"]) > 0 for r in rows)


def test_report_of_a_real_run(real: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    proc = lf.run_cli("report", real["base"], "-o", out)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "data:image/png;base64," in text and "Content-Security-Policy" in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), "the report must not load anything"
    for phase in PHASES:
        assert f"<td>{phase}</td>" in text


# --------------------------------------------------------------------------- bad input


def _bad_inputs(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, what the error line must say)."""
    tmp.mkdir(parents=True, exist_ok=True)
    out: dict[str, tuple[Path, str]] = {}
    out["missing"] = (tmp / "nope", "no such file or directory")
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    out["empty"] = (empty, "empty log")
    csv_file = tmp / "table.jsonl"
    csv_file.write_text("a,b,c\n1,2,3\n")
    out["not a log"] = (csv_file, "not a steptrace log")
    newer = lf.write_log(tmp / "newer" / "rank0.jsonl", [lf.run_start(schema="steptrace/2"), lf.step(0)])
    out["newer schema"] = (newer, "newer steptrace")
    text = lf.lines(lf.run_records(30))
    text.insert(12, '{"rank": 0, "step": 11}')  # line 13: JSON, but not a record (torn lines are skipped)
    corrupt = tmp / "corrupt" / "rank0.jsonl"
    corrupt.parent.mkdir()
    corrupt.write_text("\n".join(text) + "\n")
    out["corrupt line"] = (corrupt, f'{corrupt}:13: record has no "kind"')
    mixed = tmp / "mixed"
    lf.write_log(mixed / "rank0.jsonl", [lf.run_start(0, 2, run_id="run-a")] + [lf.step(i) for i in range(20)])
    lf.write_log(mixed / "rank1.jsonl", [lf.run_start(1, 2, run_id="run-b")] + [lf.step(i, rank=1) for i in range(20)])
    out["mixed runs"] = (mixed, "mixed runs in one folder")
    return out


@pytest.mark.parametrize("bad", ["missing", "empty", "not a log", "newer schema", "corrupt line", "mixed runs"])
def test_summary_bad_input(tmp_path: Path, bad: str) -> None:
    path, needle = _bad_inputs(tmp_path)[bad]
    proc = lf.run_cli("summary", path)
    _one_error_line(proc, needle)
    assert proc.stdout == ""


def _command(cmd: str, path: Path, tmp: Path, good: Path) -> tuple[list, Path | None]:
    if cmd == "compare":
        return ["compare", good, path], None
    if cmd == "compare-base":
        return ["compare", path, good], None
    if cmd == "plot":
        return ["plot", path, "-o", tmp / "out.png"], tmp / "out.png"
    if cmd == "export":
        return ["export", path, "--format", "chrome", "-o", tmp / "out.json"], tmp / "out.json"
    if cmd == "report":
        return ["report", path, "-o", tmp / "out.html"], tmp / "out.html"
    raise AssertionError(cmd)


@pytest.mark.parametrize(
    "cmd, bad",
    [
        ("compare", "corrupt line"), ("compare-base", "missing"), ("compare", "mixed runs"),
        ("plot", "corrupt line"), ("plot", "empty"), ("plot", "newer schema"),
        ("export", "corrupt line"), ("export", "not a log"), ("export", "mixed runs"),
        ("report", "corrupt line"), ("report", "missing"), ("report", "mixed runs"),
    ],
)
def test_every_command_rejects_bad_input_in_one_line(tmp_path: Path, cmd: str, bad: str) -> None:
    inputs = _bad_inputs(tmp_path / "in")
    good = lf.write_log(tmp_path / "good" / "rank0.jsonl", lf.run_records(20))
    args, output = _command(cmd, inputs[bad][0], tmp_path, good)
    proc = lf.run_cli(*args)
    _one_error_line(proc, inputs[bad][1])
    assert proc.stdout == ""
    if output is not None:
        assert not output.exists(), "a failed command must not leave an output file"
        assert not list(tmp_path.glob("out.*.tmp"))  # the temporary: <target>.<random>.tmp


@pytest.mark.parametrize("cmd", ["summary", "compare", "export", "report"])
def test_skip_bad_reads_past_the_corrupt_line(tmp_path: Path, cmd: str) -> None:
    inputs = _bad_inputs(tmp_path / "in")
    path = inputs["corrupt line"][0]
    good = lf.write_log(tmp_path / "good" / "rank0.jsonl", lf.run_records(30))
    args, output = _command(cmd, path, tmp_path, good) if cmd != "summary" else (["summary", path], None)
    proc = lf.run_cli(*args, "--skip-bad")
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("steptrace: warning: ")]
    assert len(warnings) == 1 and ':13: skipped: record has no "kind"' in warnings[0]
    assert "Traceback" not in proc.stderr
    if output is not None:
        assert output.stat().st_size > 0


@pytest.mark.parametrize("cmd", ["summary", "compare", "plot", "export", "report"])
def test_a_torn_line_is_one_warning_and_the_command_works(tmp_path: Path, cmd: str) -> None:
    text = lf.lines(lf.run_records(30))
    text.insert(12, '{"kind": "step", "rank": 0, "step": 11, "data_ms": 0.1')  # line 13: cut off
    text.insert(20, "\x00\x00\x00")  # line 21: what a crash can leave
    path = tmp_path / "torn" / "rank0.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(text) + "\n")
    good = lf.write_log(tmp_path / "good" / "rank0.jsonl", lf.run_records(30))
    args, output = _command(cmd, path, tmp_path, good) if cmd != "summary" else (["summary", path], None)
    proc = lf.run_cli(*args)  # no --skip-bad needed
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("steptrace: warning: ")]
    assert len(warnings) == 1, proc.stderr
    assert f"{path}: 2 torn lines skipped (lines 13, 21)" in warnings[0]
    if output is not None:
        assert output.stat().st_size > 0
    elif cmd == "compare":
        assert "no regression" in proc.stdout  # the same 30 steps as the intact log
    else:
        assert "30 steps" in proc.stdout  # every record after the torn lines was read


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plot", "{good}", "-o", "{tmp}/x.txt"], "the output must end in .png, .svg, .pdf"),
        (["report", "{good}", "-o", "{tmp}/no/such/dir/r.html"], "no such directory"),
        (["compare", "{good}", "{good}", "--gate", "nonsense"], "--gate names nonsense"),
        (["plot", "{good}", "-o", "{tmp}/x.png", "--rank", "3"], "rank 3 is not in this log"),
    ],
)
def test_usage_errors_are_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    good = lf.write_log(tmp_path / "good" / "rank0.jsonl", lf.run_records(20))
    proc = lf.run_cli(*[a.format(good=good, tmp=tmp_path) for a in args])
    _one_error_line(proc, needle)


def test_argparse_errors_exit_2(tmp_path: Path) -> None:
    good = lf.write_log(tmp_path / "rank0.jsonl", lf.run_records(3))
    for args in (["export", good, "-o", tmp_path / "x"], ["export", good, "--format", "xml", "-o", "x"],
                 ["compare", good], ["compare", good, good, "--threshold", "lots"], ["plot", good, "--steps", "a:b",
                                                                                     "-o", tmp_path / "x.png"]):
        proc = lf.run_cli(*args)
        assert proc.returncode == 2, args
        assert "Traceback" not in proc.stderr and "error:" in proc.stderr


def test_every_command_handles_a_run_without_steps(tmp_path: Path) -> None:
    # a run that crashed before its first step: no error, nothing made up
    path = lf.write_log(tmp_path / "run" / "rank0.jsonl", [lf.run_start()])
    proc = lf.run_cli("summary", path.parent)
    assert proc.returncode == 0 and "no completed steps recorded" in proc.stdout and "ended missing" in proc.stdout
    proc = lf.run_cli("compare", path.parent, path.parent)
    assert proc.returncode == 0 and "too few steps" in proc.stdout
    for args in (["plot", "-o", tmp_path / "p.png"], ["report", "-o", tmp_path / "r.html"],
                 ["export", "--format", "chrome", "-o", tmp_path / "t.json"]):
        proc = lf.run_cli(args[0], path.parent, *args[1:])
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.startswith("wrote ") and proc.stderr.count("\n") == 1, proc.stderr
    lf.check_chrome_trace(json.loads((tmp_path / "t.json").read_text()))
