"""A short profiled training loop for scripts/check_wheel.sh, run by the fresh virtual
environment's Python into which only the release wheel (and its declared dependencies)
was installed. It needs no torch: a linear model fitted by plain-Python gradient descent,
with the same phases as a torch loop (the profiler never imports torch itself). It also
scrapes the Prometheus endpoint once, which the wheel serves with the bundled header-only
cpp-httplib.

    python wheel_smoke.py RUN_DIR EXPECTED_VERSION
"""

from __future__ import annotations

import json
import random
import sys
import urllib.request
from pathlib import Path


def fail(message: str) -> None:
    print(f"[wheel-smoke] FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def main() -> None:
    run_dir, expected = Path(sys.argv[1]), sys.argv[2]
    if "torch" in sys.modules or _importable("torch"):
        fail("torch is importable: this environment is not the fresh one")

    import steptrace
    from steptrace import _core

    prefix = Path(sys.prefix).resolve()
    for name, path in (("steptrace", steptrace.__file__), ("steptrace._core", _core.__file__)):
        if prefix not in Path(path).resolve().parents:
            fail(f"{name} was imported from {path}, not from the environment {prefix}")
    if steptrace.__version__ != expected or _core.version() != expected:
        fail(f"versions: steptrace.__version__={steptrace.__version__}, "
             f"_core.version()={_core.version()}, CMakeLists.txt says {expected}")

    rng = random.Random(0)
    data = [([rng.uniform(-1, 1) for _ in range(8)], 0.0) for _ in range(256)]
    true_w = [rng.uniform(-2, 2) for _ in range(8)]
    data = [(x, sum(a * b for a, b in zip(x, true_w))) for x, _ in data]
    w = [0.0] * 8
    lr = 0.05
    steps = 60
    scraped = ""

    def batches():
        for i in range(steps):
            yield data[(i * 16) % 256:(i * 16) % 256 + 16]

    with steptrace.Profiler(run_dir, metrics_port=0, job="wheel-smoke") as prof:
        for batch in prof.data(batches()):
            with prof.step():
                with prof.phase("forward"):
                    preds = [sum(a * b for a, b in zip(x, w)) for x, _ in batch]
                with prof.phase("loss"):
                    loss = sum((p - y) ** 2 for p, (_, y) in zip(preds, batch)) / len(batch)
                with prof.phase("backward"):
                    grad = [0.0] * 8
                    for p, (x, y) in zip(preds, batch):
                        for j in range(8):
                            grad[j] += 2 * (p - y) * x[j] / len(batch)
                with prof.phase("optimizer"):
                    w = [wj - lr * gj for wj, gj in zip(w, grad)]
            if prof.step_index == steps // 2:
                port = prof.metrics_port
                if port <= 0:
                    fail(f"the metrics endpoint did not start (metrics_port={port})")
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    scraped = r.read().decode()
        log_path = prof.log_path

    if "steptrace_info" not in scraped:
        fail("GET /metrics returned no steptrace_info series")
    records = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line]
    start = records[0]
    if start["kind"] != "run_start" or start["versions"]["steptrace"] != expected:
        fail(f"run_start versions: {start.get('versions')}")
    n_steps = sum(1 for r in records if r["kind"] == "step")
    if n_steps != steps or records[-1]["kind"] != "run_end":
        fail(f"{n_steps} step records (want {steps}), last record {records[-1]['kind']}")
    for r in records:
        steptrace.validate_record(r)
    print(f"[wheel-smoke] {n_steps} steps profiled (final loss {loss:.4f}), metrics scraped, "
          f"steptrace {expected} from {Path(steptrace.__file__).parent}")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
