"""What the Prometheus endpoint costs the training loop (issue 15 point 7).

    python benchmarks/bench_metrics.py            # 7 interleaved trials of 5,000 steps
    python benchmarks/bench_metrics.py --quick

The CPU training loop of bench_nvml.py (MLP 64->256->10, batch 64, SGD, one torch thread,
phases forward / loss / backward / optimizer; NVML off) runs three ways, interleaved with
the order rotating every trial: JSONL only (twice: an A/A comparison, how much of a
difference is noise), and with ``metrics_port=0`` while a separate process scrapes
``/metrics`` every second (Prometheus's usual interval is 15-60 s: this is a stress
figure) and, as a harder case, every 50 ms. It prints, medians over the trials, the
training thread's time per step (wall and CPU) and the ratio to JSONL only, the CPU that
all steptrace threads (writer, HTTP server, watchdog) use per second of training, and the
scrapes served during the timed loop (the scraper is started, and has scraped once, before
the loop: its start-up is not timed).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import steptrace  # noqa: E402
from bench_nvml import Loop, fake_library, med  # noqa: E402  (the same loop and helpers)

SCRAPER = """
import sys, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
n = 0
while True:
    try:
        urllib.request.urlopen(url, timeout=5).read()
        n += 1
    except Exception:
        pass
    sys.stdout.write(f"{n}\\n"); sys.stdout.flush()
    time.sleep(every)
"""
# The scraper's interpreter start-up (30-40 ms of CPU on this VM) and its first connection
# happen before the timed loop: on_start waits for the first scrape. The first version of
# this benchmark started the scraper and timed at once, so that start-up landed inside a
# ~1 s run on 2 vCPUs and read as a per-step cost of the endpoint.


def scraping(every_s: Optional[float], counts: List[int]):
    """on_start for Loop.run: a scraper process on the profiler's endpoint."""
    if every_s is None:
        return None

    def start(prof):
        proc = subprocess.Popen([sys.executable, "-c", SCRAPER, f"http://127.0.0.1:{prof.metrics_port}/metrics",
                                 str(every_s)], stdout=subprocess.PIPE, text=True)
        first = proc.stdout.readline()  # blocks until the first scrape is done
        if int(first or 0) < 1:
            sys.exit("the scraper could not reach the endpoint")

        def stop():
            proc.kill()
            out = proc.communicate()[0].split()
            counts.append((int(out[-1]) if out else 1) - 1)  # scrapes during the timed loop

        return stop

    return start


def main() -> int:
    parser = argparse.ArgumentParser(description="Prometheus endpoint cost on a CPU training loop")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--trials", type=int)
    args = parser.parse_args()
    steps = args.steps or (1500 if args.quick else 5000)
    trials = args.trials or (3 if args.quick else 7)
    torch.set_num_threads(1)
    arms: List[Tuple[str, Optional[dict], Optional[float]]] = [
        ("JSONL only", None, None), ("JSONL only (A/A)", None, None),
        ("endpoint, scraped every 1 s", {"metrics_port": 0}, 1.0),
        ("endpoint, scraped every 50 ms", {"metrics_port": 0}, 0.05)]
    with tempfile.TemporaryDirectory(prefix="bench_metrics-") as tmp:
        tmp_path = Path(tmp)
        lib = fake_library(None, tmp_path)  # NVML stays off; Loop.run wants a path
        loop = Loop(steps, 256)
        results: Dict[str, List[Dict[str, float]]] = {label: [] for label, _, _ in arms}
        scrapes: Dict[str, List[int]] = {label: [] for label, _, _ in arms}
        for label, extra, every in arms:  # warm-up
            loop.run(tmp_path / "warm", None, lib, extra, scraping(every, []))
        for t in range(trials):
            for label, extra, every in arms[t % len(arms):] + arms[: t % len(arms)]:
                results[label].append(loop.run(tmp_path / f"r{t}", None, lib, extra, scraping(every, scrapes[label])))
    load = os.getloadavg()
    print(f"steptrace {steptrace.__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{steps} steps per run, {trials} interleaved trials, medians")
    base = results[arms[0][0]]
    b_wall, b_cpu, b_all = med(base, "step_us"), med(base, "cpu_us"), med(base, "all_ms_per_s")
    print(f"{'arm':32} {'step us':>8} {'ratio':>6} {'train CPU us':>12} {'ratio':>6} "
          f"{'steptrace thr CPU ms/s':>22} {'minus JSONL':>11} {'scrapes':>8}")
    for label, _, _ in arms:
        rows = results[label]
        wall, cpu, all_ms = med(rows, "step_us"), med(rows, "cpu_us"), med(rows, "all_ms_per_s")
        n = int(sorted(scrapes[label])[len(scrapes[label]) // 2]) if scrapes[label] else 0
        print(f"{label:32} {wall:8.1f} {wall / b_wall:6.3f} {cpu:12.1f} {cpu / b_cpu:6.3f} "
              f"{all_ms:22.2f} {all_ms - b_all:+11.2f} {n:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
