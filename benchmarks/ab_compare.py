"""Two builds of steptrace side by side in one session: bench_phase (phase, step and writer
throughput) and soak.py, interleaved (A B B A A B ...), medians per benchmark and the ratio.

    python benchmarks/ab_compare.py --a-bench OLD/bench_phase --a-pkg OLD_PKG \\
        --b-bench NEW/bench_phase --b-pkg NEW_PKG [--rounds 3] [--soak-s 40] [--out DIR]

A package folder is what `pip install --target DIR .` makes (soak.py runs with
PYTHONPATH=DIR); soak.py is this tree's for both. Raw output goes to DIR/raw.txt, the
figures to DIR/results.json. On a shared machine the load is printed with every run:
compare only figures from the same session.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

FILTER = "BM_(SteadyClockPair|PhaseById|PhaseByName|Step5Phases|WriterThroughput)"
SOAK = Path(__file__).resolve().parent / "soak.py"


def load() -> str:
    return open("/proc/loadavg").read().split()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-bench", required=True, help=f"bench_phase of build {side.upper()}")
        ap.add_argument(f"--{side}-pkg", required=True, help=f"package folder of build {side.upper()}")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, per build (default 3)")
    ap.add_argument("--soak-s", type=float, default=40.0, help="budget of each soak run (default 40 s)")
    ap.add_argument("--filter", default=FILTER, help="bench_phase's --benchmark_filter")
    ap.add_argument("--out", default="/tmp/steptrace-ab", help="folder for raw output and results.json")
    args = ap.parse_args()
    trees = {"a": (args.a_bench, args.a_pkg), "b": (args.b_bench, args.b_pkg)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    order = []
    for i in range(args.rounds):
        order += ["a", "b"] if i % 2 == 0 else ["b", "a"]
    res = {t: {"bench": {}, "soak": []} for t in trees}
    with open(out / "raw.txt", "a") as raw:
        for t in order:
            path = out / f"{t}-{time.time():.0f}.json"
            p = subprocess.run([trees[t][0], f"--benchmark_filter={args.filter}", f"--benchmark_out={path}",
                                "--benchmark_out_format=json"], capture_output=True, text=True, check=True)
            raw.write(f"== {t} bench_phase (load {load()})\n{p.stdout}\n")
            for b in json.loads(path.read_text())["benchmarks"]:
                if b.get("run_type", "iteration") == "iteration":
                    v = b["items_per_second"] if "WriterThroughput" in b["name"] else b["real_time"]
                    res[t]["bench"].setdefault(b["name"], []).append(v)
            print(f"{t} bench_phase done, load {load()}", flush=True)
        for t in order:
            env = dict(os.environ, PYTHONPATH=trees[t][1])
            p = subprocess.run([sys.executable, str(SOAK), "--budget-s", str(args.soak_s)],
                               capture_output=True, text=True, env=env)
            raw.write(f"== {t} soak (load {load()})\n{p.stdout}{p.stderr}\n")
            rate = re.search(r"\(([\d,]+) steps/s, ([\d.]+) us/step", p.stdout)
            growth = re.search(r"RSS growth middle -> end: ([-+\d.]+)", p.stdout)
            dec = re.search(r"first decile ([\d.]+) us, last decile ([\d.]+) us", p.stdout)
            res[t]["soak"].append({"us_per_step": float(rate.group(2)), "growth": float(growth.group(1)),
                                   "first": float(dec.group(1)), "last": float(dec.group(2)), "load": load()})
            print(f"{t} soak done, load {load()}", flush=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(f"\n{'benchmark (median; ns, writer: records/s)':70s} {'A':>11s} {'B':>11s} {'B/A':>6s}")
    for name, a in res["a"]["bench"].items():
        ma, mb = statistics.median(a), statistics.median(res["b"]["bench"].get(name, [float("nan")]))
        print(f"{name:70s} {ma:11.4g} {mb:11.4g} {mb / ma:6.3f}")
    for t in trees:
        s = res[t]["soak"]
        print(f"{t.upper()} soak us/step {[x['us_per_step'] for x in s]} (median "
              f"{statistics.median(x['us_per_step'] for x in s):.2f}), RSS growth B/step {[x['growth'] for x in s]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
