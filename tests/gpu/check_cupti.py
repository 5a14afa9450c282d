"""Checks steptrace's CUPTI backends on a real GPU; prints a table, exits 1 on failure.

1. kernel activity and counters are active (else run_start's reasons are printed);
2. a bf16 matmul-heavy step shows tensor-core activity well above a memory-bound
   elementwise step, which shows DRAM throughput above the matmul step;
3. counters are present on the sampled steps (counter_every) and only there;
4. kernel busy time per step (compute + exposed NCCL) is within 5% of the CUDA-event
   step time minus idle;
5. steptrace and torch.profiler in one process both keep working;
6. overhead on step time: counters sampled on every step, and kernel activity, against
   both off, in the same process (A/B/A).
"""

from __future__ import annotations

import statistics
import sys
import tempfile

import torch

import steptrace

from device_check import Checks, cuda_device, steps

check = Checks()
WARMUP = 5


def records(path):
    return list(steptrace.read(path))


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def run(workload, n: int, **options):
    """n profiled steps of workload(i); returns (run_start, steps after warmup)."""
    d = tempfile.mkdtemp(prefix="steptrace-cupti-")
    with steptrace.Profiler(d, **options) as prof:
        for i in range(n):
            with prof.step():
                with prof.phase("forward"):
                    workload(i)
    recs = records(d)
    return recs[0], [r for r in recs if r["kind"] == "step"][WARMUP:]


def main() -> int:
    dev = cuda_device()
    if dev is None:
        return 1
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    big = torch.randn(1 << 28, device=dev, dtype=torch.float32)  # 1 GiB: streams through DRAM
    torch.cuda.synchronize()

    def matmul(_i):
        for _ in range(8):
            a @ b

    def elementwise(_i):
        for _ in range(4):
            big.mul_(1.0001).add_(1e-6)

    # 1. backends
    start, mm = run(matmul, 40, counter_every=1)
    backends = start["backends"]
    act, cnt = backends["kernel_activity"], backends["counters"]
    check("kernel activity active", f"active={act['active']} unavailable={act['unavailable']}", act["active"] == ["cupti"])
    check("counters active", f"active={cnt['active']} metrics={cnt.get('metrics')} unavailable={cnt['unavailable']}",
          bool(cnt["active"]))

    # 2. matmul vs elementwise
    _, ew = run(elementwise, 40, counter_every=1)
    tc_mm = mean(s["counters"]["tensor_active_pct"] for s in mm if "tensor_active_pct" in s.get("counters", {}))
    tc_ew = mean(s["counters"]["tensor_active_pct"] for s in ew if "tensor_active_pct" in s.get("counters", {}))
    dr_mm = mean(s["counters"]["dram_throughput_pct"] for s in mm if "dram_throughput_pct" in s.get("counters", {}))
    dr_ew = mean(s["counters"]["dram_throughput_pct"] for s in ew if "dram_throughput_pct" in s.get("counters", {}))
    check("tensor cores: matmul >> elementwise", f"{tc_mm:.1f}% vs {tc_ew:.1f}%", tc_mm > 20 and tc_mm > 3 * max(tc_ew, 1))
    check("DRAM: elementwise > matmul", f"{dr_ew:.1f}% vs {dr_mm:.1f}%", dr_ew > dr_mm and dr_ew > 50)
    occ_ew = mean(s["counters"].get("sm_occupancy_pct", float("nan")) for s in ew if "counters" in s)
    print(f"  (elementwise: occupancy {occ_ew:.1f}%; matmul kernels/step {mean(s['kernels']['count'] for s in mm if 'kernels' in s):.1f})")

    # 3. counters on the sampled steps only
    _, sampled = run(matmul, 45, counter_every=4)
    with_counters = [s["step"] for s in sampled if "counters" in s]
    wanted = [s["step"] for s in sampled if s["step"] % 4 == 0]
    check("counters on sampled steps", f"{len(set(with_counters) & set(wanted))}/{len(wanted)} sampled steps, "
          f"{len(set(with_counters) - set(wanted))} others",
          set(with_counters) <= set(wanted) and len(with_counters) >= 0.8 * len(wanted))

    # 4. kernel time vs CUDA-event step time minus idle
    errs = []
    for s in mm:
        k = s.get("kernels")
        if not k or s["clock"] != "cuda":
            continue
        busy = k["compute_ms"] + k["exposed_nccl_ms"]
        errs.append(abs(busy - (s["step_ms"] - k["idle_ms"])) / s["step_ms"])
    check("kernel busy = step - idle", f"max error {100 * max(errs, default=float('nan')):.2f}% over {len(errs)} steps",
          bool(errs) and max(errs) < 0.05)

    # 5. torch.profiler beside steptrace
    d = tempfile.mkdtemp(prefix="steptrace-cupti-")
    with steptrace.Profiler(d) as prof:
        for i in range(12):
            if i == 4:
                tp = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA])
                tp.__enter__()
            with prof.step():
                matmul(i)
            if i == 7:
                torch.cuda.synchronize()
                tp.__exit__(None, None, None)
    recs = steps(d)
    ours = ["kernels" in r for r in recs]
    device_us = sum(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) for e in tp.key_averages())
    check("torch.profiler coexistence", f"steptrace kernels per step {''.join('k' if x else '.' for x in ours)}, "
          f"torch.profiler device time {device_us / 1e3:.1f} ms",
          device_us > 0 and all(ours[:4]) and all(ours[9:]))

    # 6. overhead on step time (device step_ms medians, A/B/A)
    def median_step(**opts) -> float:
        _, s = run(matmul, 60, **opts)
        return statistics.median(r["step_ms"] for r in s)

    off = [median_step(kernel_activity="off", counters="off")]
    counters_on = median_step(kernel_activity="off", counter_every=1)
    off.append(median_step(kernel_activity="off", counters="off"))
    activity_on = median_step(counters="off")
    off.append(median_step(kernel_activity="off", counters="off"))
    base = statistics.median(off)
    check("counter sampling overhead", f"{100 * (counters_on / base - 1):+.2f}% step time (target < 2%)",
          counters_on / base - 1 < 0.02)
    check("kernel activity overhead", f"{100 * (activity_on / base - 1):+.2f}% step time (target < 3%)",
          activity_on / base - 1 < 0.03)

    return check.table()


if __name__ == "__main__":
    sys.exit(main())
