"""Device check of the NVML telemetry on a real GPU (run by tests/gpu/run.sh).

A matmul loop of about 10 s with NVML on: every step has `hw`; the mean step power agrees
with `nvidia-smi --query-gpu=power.draw.instant` (power.draw where the driver has no
instantaneous field) polled alongside within 5%, and so does the
energy counter over the run divided by its wall time; the steps' energy adds up to the
run's energy counter (the waits between steps are short); the power limit matches
`power.limit`; and the time per step (the steps alone, not the profiler's open and close), against the same loop with nvml="off" in
interleaved trials (3 pairs of 2-second runs, so that the whole device check stays
under 3 minutes), is within 3%.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import steptrace

sys.path.insert(0, str(Path(__file__).parent))
from device_check import Checks, cuda_device, log_dir, no_gpu, steps  # noqa: E402


def loop(run_dir: str, seconds: float, **options) -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    n = 0
    with steptrace.Profiler(run_dir, **options) as prof:
        # the steps alone: the sampler's open and close (and its closing PCIe reads) are
        # not a cost per step
        torch.cuda.synchronize()
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            with prof.step():
                with prof.phase("forward"):
                    for _ in range(8):
                        a = (a @ b).clamp_(-1, 1)
            n += 1
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
    return elapsed / max(n, 1)


def smi_power_field(index: int) -> str:
    """nvidia-smi's instantaneous power where the driver has it: `power.draw` is the 1 s
    average on Ampere and newer (as NVML's GetPowerUsage), and steptrace reads the
    instantaneous field (NVML_FI_DEV_POWER_INSTANT)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=power.draw.instant",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
        float(out.stdout.strip())
        return "power.draw.instant"
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return "power.draw"


def main() -> int:
    device = cuda_device()
    if device is None:
        return no_gpu()
    import torch

    index = torch.cuda.current_device()
    checks = Checks()
    field = smi_power_field(index)
    with log_dir("steptrace-nvml-") as tmp:
        smi = subprocess.Popen(
            ["nvidia-smi", f"--id={index}", f"--query-gpu={field},power.limit",
             "--format=csv,noheader,nounits", "-lms", "200"],
            stdout=subprocess.PIPE, text=True)
        loop(f"{tmp}/warm", 2)  # clocks and temperature settle first
        t0 = time.monotonic()
        loop(f"{tmp}/on", 10)
        elapsed = time.monotonic() - t0
        smi.terminate()
        out, _ = smi.communicate()
        rows = [line.split(",") for line in out.strip().splitlines() if line.strip()]
        readings = [float(p) for p, _ in rows][-int(elapsed / 0.2):]
        smi_limit = float(rows[-1][1]) if rows else 0.0

        records = list(steptrace.read(f"{tmp}/on/rank0.jsonl"))
        start = records[0]
        telemetry = start["backends"]["telemetry"]
        checks("nvml active", str(telemetry), telemetry["active"] == ["nvml"])
        s = steps(f"{tmp}/on/rank0.jsonl")[5:]
        with_hw = [r for r in s if "hw" in r]
        checks("hw in every step", f"{len(with_hw)}/{len(s)}", len(with_hw) == len(s))
        if with_hw and readings:
            mean_w = statistics.fmean(r["hw"]["power_w"] for r in with_hw)
            smi_w = statistics.fmean(readings)
            checks("power vs nvidia-smi", f"steptrace {mean_w:.0f} W, nvidia-smi {field} {smi_w:.0f} W",
                   abs(mean_w - smi_w) <= 0.05 * smi_w)
            limit = with_hw[0]["hw"].get("power_limit_w", 0)
            checks("power limit", f"{limit} W vs {smi_limit} W", abs(limit - smi_limit) <= 1)
            end = next(r for r in records if r["kind"] == "run_end")["hw"]
            steps_j = end["steps_energy_j"]
            checks("energy per step adds up", f"steps {steps_j:.0f} J, counter {end.get('energy_j', 0):.0f} J",
                   abs(steps_j - end.get("energy_j", 0)) <= 0.05 * max(steps_j, 1))
            checks("energy per 1000 steps", f"{end.get('energy_j_per_1000_steps', 0):.0f} J", steps_j > 0)
            # the energy counter against nvidia-smi's power over the same run: J / s = W
            wall_s = next(r for r in records if r["kind"] == "run_end")["wall_s"]
            counter_w = end.get("energy_j", 0) / max(wall_s, 1e-9)
            checks("energy vs nvidia-smi", f"counter {end.get('energy_j', 0):.0f} J over {wall_s:.1f} s = "
                   f"{counter_w:.0f} W, nvidia-smi {smi_w:.0f} W", abs(counter_w - smi_w) <= 0.05 * smi_w)
            # a single-GPU run moves next to nothing over NVLink: the check is that the
            # figure is read (where the device has links) and is a rate, not its size
            link = [r["hw"]["nvlink_tx_mb_s"] for r in with_hw if "nvlink_tx_mb_s" in r["hw"]]
            checks("nvlink throughput read", f"{len(link)}/{len(with_hw)} steps, mean "
                   f"{statistics.fmean(link) if link else float('nan'):.1f} MB/s TX",
                   not link or all(v >= 0 for v in link))
        # interleaved trials, so that clock and temperature drift fall on both arms
        on_t, off_t = [], []
        for i in range(3):
            on_t.append(loop(f"{tmp}/on{i}", 2))
            off_t.append(loop(f"{tmp}/off{i}", 2, nvml="off"))
        on, off = statistics.median(on_t), statistics.median(off_t)
        checks("sampler cost per step", f"on {on * 1e3:.3f} ms, off {off * 1e3:.3f} ms (x{on / off:.3f})",
               on <= off * 1.03)
    return checks.table()


if __name__ == "__main__":
    sys.exit(main())
