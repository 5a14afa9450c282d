"""steptrace.analysis.report: one self-contained HTML file, rendered by headless Chromium."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support import logfactory as lf

pytest.importorskip("matplotlib")
pytest.importorskip("pandas")

from steptrace.analysis.report import render_report, write_report  # noqa: E402

CHROMIUM = next((c for c in ("chromium", "chromium-browser", "google-chrome") if shutil.which(c)), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                                            "(scripts/setup.sh installs Debian's chromium)")


def _run(tmp: Path) -> Path:
    folder = tmp / "run"
    for rank in (0, 1):
        recs = [lf.run_start(rank=rank, world_size=2, device={"name": "NVIDIA H100", "memory_total_bytes": 80 * 2**30})]
        for i in range(200):
            slow = 3.0 if 120 <= i < 125 else 1.0
            recs.append(lf.step(i, rank=rank, phases={"forward": 3.0 * slow, "loss": 0.5, "backward": 5.0,
                                                      "optimizer": 1.2},
                                memory={"allocated_bytes": 2**30 + i * 2**21, "rss_bytes": 2**31},
                                counters={"tensor_active_pct": 55.0, "sm_occupancy_pct": 70.0}))
            if i == 120:
                recs.append(lf.alert("step_regression", 120, rank=rank,
                                     message="step 120 took 2.1x the trailing median; forward grew most <fast>"))
        recs.append(lf.run_end(200, rank=rank))
        lf.write_log(folder / f"rank{rank}.jsonl", recs)
    return folder


def test_report_is_self_contained(tmp_path: Path) -> None:
    text = render_report(_run(tmp_path), title="nightly")
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert "<title>steptrace report: nightly</title>" in text
    # nothing loaded from anywhere: no external src/href, only data: images, a CSP to enforce it
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    # the timeline, and (two ranks) the step-time heat map by rank
    assert re.findall(r'<img [^>]*src="([^"]{0,22})', text) == ["data:image/png;base64,"] * 2
    assert "<h2>Ranks</h2>" in text and 'alt="step time by rank and step"' in text
    assert "default-src 'none'" in text
    # the summary table, memory, counters, the alerts (escaped) and the run details
    for needle in ("<td>forward</td>", "p99 ms", "rising +2.0 MiB/step", "tensor_active", "55.0%",
                   "step_regression", html.escape("forward grew most <fast>"), "NVIDIA H100, 80.0 GiB"):
        assert needle in text, needle
    assert "<fast>" not in text


def test_report_shows_useful_work_beside_step_time_and_power(tmp_path: Path) -> None:
    recs = lf.work_run(40, iteration_ms=lambda i: 10.0 if i < 20 else 12.5, energy_j=2.0)
    text = render_report(lf.write_log(tmp_path / "rank0.jsonl", recs))
    assert "<h2>Useful work</h2>" in text and "<h2>GPU hardware</h2>" in text
    cards = re.findall(r'<div class="card[^"]*"><div class="v">([^<]*)</div><div class="k">([^<]*)</div>', text)
    assert ("18.0%", "median MFU") in cards and ("92,160", "tokens / s") in cards
    for needle in ('<td class="l">MFU</td>', "falling -", "MFU against a peak of 10 TFLOP/s", "energy per token: 0.00195 J"):
        assert needle in text, needle
    plain = render_report(_run(tmp_path))
    assert "Useful work" not in plain and "median MFU" not in plain


def test_write_report(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    assert write_report(_run(tmp_path), out) == str(out)
    assert out.stat().st_size > 20_000 and list(tmp_path.glob("r.html.*.tmp")) == []


@needs_chromium
def test_chromium_renders_the_report_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    proc = lf.run_cli("report", _run(tmp_path), "-o", out)
    assert proc.returncode == 0, proc.stderr
    shot = tmp_path / "report.png"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
           f"--screenshot={shot}", "--window-size=1280,2000", "--dump-dom", out.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the DOM after load: the page's own check says every image decoded
    assert 'data-rendered="ok"' in proc.stdout, proc.stdout[:500]
    # the console: no script error, no blocked (network) request, nothing at all
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]
    assert console == [], console
    # and a screenshot that is a real page, not a blank one
    assert shot.exists(), proc.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[0] == 2000 and pixels.shape[1] == 1280
    assert pixels[..., :3].std() > 0.05  # text, tables and the plot, not an empty page
