"""Device check of useful work and MFU on a real GPU (run by tests/gpu/run.sh); prints a
table, exits 1 on a failed check.

1. The peak: run_start.work names the chip the datasheet table matched for this GPU
   (torch.cuda.get_device_name) and its bf16 peak; PASS when a peak was found for a
   GPU the table lists (H100 SXM/PCIe/NVL, H200, A100, B200, L40S, L4, A10), SKIP for a
   GPU it does not list (with run_start's reason).
2. A bf16 MLP of large Linear layers (8192 wide, batch 8192), watched, in a loop with no
   synchronization: FLOPs per step against the analytic 6·N·B (no attention: within 2%),
   the record's mfu_pct against flops / (step time from a torch.cuda.Event pair around
   the same steps) / the peak (within 10%: the events bracket the same kernels), and the
   model's dtype reported as bf16. The MFU itself is INFO (a figure, no verdict).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from device_check import Checks, cuda_device, log_dir, no_gpu, records  # noqa: E402

LISTED = ("A100", "H100", "H200", "B200", "L40S", "L4", "A10")


def main() -> int:
    if cuda_device() is None:
        return no_gpu()
    import torch
    from torch import nn

    import steptrace

    check = Checks()
    name = torch.cuda.get_device_name()
    width, batch = 8192, 8192
    model = nn.Sequential(nn.Linear(width, width, bias=False), nn.ReLU(), nn.Linear(width, width, bias=False))
    model = model.to("cuda", torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
    d = log_dir("steptrace-work-")
    events = []
    with steptrace.Profiler(d) as prof:
        prof.watch(model, phases=False)
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with prof.step():
                e0.record()
                model(x).float().square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                e1.record()
            events.append((e0, e1))
    torch.cuda.synchronize()
    recs = records(d)
    start = recs[0].get("work", {})
    peak = start.get("peak_tflops")
    listed = any(tok in name.split() or tok in name for tok in LISTED)
    detail = (f"{name!r}: chip {start.get('chip')!r}, peak {peak} TFLOP/s ({start.get('mfu_dtype')}), "
              f"source {start.get('source')!r}; unavailable: {start.get('mfu_unavailable')!r}")
    if listed:
        check("datasheet peak for this GPU", detail, peak is not None)
    else:
        check.skip("datasheet peak for this GPU", detail)
    steps = [r for r in recs if r["kind"] == "step"][2:]
    ev_ms = [e0.elapsed_time(e1) for e0, e1 in events][2:]
    analytic = 6 * 2 * width * width * batch  # two Linear layers, no bias
    flops = [s.get("work", {}).get("flops") for s in steps]
    check("FLOPs per step against 6·N·B", f"counted {flops[:1]}, analytic {analytic:.4g}",
          bool(flops) and all(f is not None and abs(f / analytic - 1) < 0.02 for f in flops))
    end = recs[-1].get("work", {})
    check("the model's dtype", f"run_end.work.mfu_dtype {end.get('mfu_dtype')!r} (assumed: "
          f"{end.get('mfu_dtype_assumed', False)})", end.get("mfu_dtype") == "bf16" or peak is None)
    if peak is None:
        check.skip("mfu_pct against the events' time", "no peak for this GPU")
        return check.table()
    # The host runs ahead of the GPU here (the steps are queued, not synchronised), so each
    # record's MFU must come from its device time (clock "cuda"), compared step by step with
    # the events recorded around the same work; host-wall MFU would be inflated.
    mfu = [s["work"].get("mfu_pct") for s in steps]
    expected = [100 * f / (ms / 1e3) / 1e12 / peak for f, ms in zip(flops, ev_ms)]
    ratios = [m / e for m, e in zip(mfu, expected) if m]
    clocks = sorted({s.get("clock") for s in steps})
    host_mfu = [100 * f / (s["host_ms"] / 1e3) / 1e12 / peak for f, s in zip(flops, steps) if s.get("host_ms")]
    check("mfu_pct against the events' time", f"record/events per step {min(ratios, default=0):.3f}.."
          f"{max(ratios, default=0):.3f} over {len(ratios)} steps, clock {clocks} (record mfu p50 "
          f"{statistics.median(mfu):.1f}%, events {statistics.median(expected):.1f}%, host-wall "
          f"{statistics.median(host_mfu) if host_mfu else float('nan'):.1f}%)",
          clocks == ["cuda"] and len(ratios) == len(steps) and all(abs(r - 1) < 0.10 for r in ratios))
    check.info("MFU of a bf16 8192x8192 MLP step", f"{statistics.median(mfu):.1f}% of {peak} TFLOP/s; "
               f"tflops_per_s p50 {statistics.median(s['work']['tflops_per_s'] for s in steps):.0f}")
    return check.table()


if __name__ == "__main__":
    sys.exit(main())
