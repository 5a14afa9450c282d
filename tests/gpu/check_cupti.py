"""Checks steptrace's CUPTI backends on a real GPU; prints a table, exits 1 on failure.

1. kernel activity and counters are active (else run_start's reasons are printed);
2. a bf16 matmul-heavy step shows tensor-core activity well above a memory-bound
   elementwise step, which shows DRAM throughput above the matmul step;
3. counters are present on the sampled steps (counter_every) and only there;
4. kernel busy time per step (compute + exposed NCCL) is within 5% of the CUDA-event
   step time minus idle;
5. steptrace and torch.profiler in one process both keep working;
6. overhead on step time: counters sampled on every step, and kernel activity, against
   both off, in the same process (A/B/A);
7. attribution across threads: a training step whose backward runs on autograd's device
   thread and whose DDP all-reduce (and a comm hook's own kernel) is launched from hooks
   there has all of its kernels in the step record (the count torch.profiler sees for the
   same step), none outside any step or late, busy + idle = step time, and NCCL time
   where NCCL launched a kernel. DDP runs as one NCCL rank (two ranks cannot share a GPU
   in NCCL; tried first, reported, not required);
8. coexistence: a Kineto session started without torch.profiler's Python entry point (as
   dynolog's on-demand trace starts one) takes CUPTI's activity callbacks: steptrace's
   steps then carry no `kernels` (never zeros), run_end says why, and Kineto's trace has
   its kernels; with TEARDOWN_CUPTI=1 (cuptiFinalize after a torch.profiler session, in a
   subprocess) the run survives, the counters stop with the reason in run_end and no step
   has zero kernels; LOCAL_RANK picks the GPU the counters sample (on a 1-GPU machine: a
   LOCAL_RANK beyond the visible devices falls back to the current device).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import subprocess
import sys
import textwrap
import time
import traceback

import torch

import steptrace

from device_check import Checks, cuda_device, limit, log_dir, no_gpu, steps

check = Checks()
WARMUP = 5


def records(path):
    return list(steptrace.read(path))


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def run(workload, n: int, **options):
    """n profiled steps of workload(i); returns (run_start, steps after warmup)."""
    d = log_dir("steptrace-cupti-")
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
        return no_gpu()
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
    d = log_dir("steptrace-cupti-")
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
    zeros = [r["step"] for r in recs if "kernels" in r and r["kernels"]["count"] == 0]
    device_us = sum(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) for e in tp.key_averages())
    check("torch.profiler coexistence", f"steptrace kernels per step {''.join('k' if x else '.' for x in ours)}, "
          f"zero-kernel steps {zeros}, torch.profiler device time {device_us / 1e3:.1f} ms",
          device_us > 0 and all(ours[:4]) and all(ours[9:]) and not zeros)

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

    # 7. backward and all-reduce kernels launched from other threads are in the step
    check_attribution_across_threads(dev)

    # 8. other CUPTI users: unhooked Kineto, TEARDOWN_CUPTI=1, LOCAL_RANK
    check_unhooked_kineto(matmul)
    check_teardown_cupti()
    check_local_rank()

    return check.table()


# ---- 7. attribution across threads (backward, DDP all-reduce) ----

def reference_kernels(step, n_warm: int = 3) -> list[str]:
    """Kernel names of one step as torch.profiler sees them (steptrace is closed then)."""
    for _ in range(n_warm):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
        step()
        torch.cuda.synchronize()
    names = []
    for e in tp.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")):
            continue
        names.append(e.name)
    return names


def is_nccl_kernel(name: str) -> bool:
    """NCCL's kernels by their real names, as torch.profiler shows them: ncclKernel_* (NCCL
    2.18 and older), ncclDevKernel_* (2.19 and newer), and the one-rank reduction
    (`(anonymous namespace)::oneRankReduce<FuncPreMulSum<T>>`, src/device/onerank.cu: a
    one-rank group's premul sum); the same families as csrc/backends/cupti/kernel_classes.cpp."""
    bare = name.removeprefix("void ").lstrip()
    return bare.startswith("nccl") or "ncclDevKernel" in name or "oneRankReduce<" in name


def ddp_model(dev, hidden: int = 4096, layers: int = 6):
    """A bf16 MLP under DDP in a one-rank NCCL group, with a comm hook that launches a
    kernel of its own from the backward thread before its all-reduce."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Sequential(*[m for _ in range(layers)
                                  for m in (torch.nn.Linear(hidden, hidden), torch.nn.GELU())])
    model = model.to(dev, torch.bfloat16)
    ddp = DistributedDataParallel(model, device_ids=[dev.index or 0], bucket_cap_mb=25)

    # NCCL copies instead of launching a kernel for a plain one-rank sum; a pre-multiplied
    # sum makes it reduce (a kernel), where this torch has it
    premul = getattr(dist, "_make_nccl_premul_sum", None)

    def hook(_state, bucket):
        buf = bucket.buffer()
        buf.mul_(1.0)  # a kernel launched from the hook, on autograd's device thread
        op = premul(1.0) if premul is not None else dist.ReduceOp.SUM
        fut = dist.all_reduce(buf, op=op, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    return ddp


def two_ranks_on_one_gpu(timeout_s: float = 30.0) -> str:
    """Tries DDP with two NCCL ranks on this one GPU; returns what happened (one line)."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(log_dir("steptrace-2rank-"), "store")
    procs = [ctx.Process(target=_two_rank_worker, args=(r, store, q)) for r in range(2)]
    deadline = time.monotonic() + limit(timeout_s)
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join()
            return "timed out"
    out = []
    while not q.empty():
        out.append(q.get())
    return "; ".join(sorted(out)) or "no report"


def _two_rank_worker(rank: int, store_path: str, q) -> None:
    import torch.distributed as dist

    try:
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2)
        t = torch.ones(1 << 20, device="cuda:0")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        q.put(f"rank {rank}: all-reduce ran (sum {t[0].item():.0f})")
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        q.put(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")


def check_attribution_across_threads(dev) -> None:
    x = torch.randn(512, 4096, device=dev, dtype=torch.bfloat16)
    try:
        ddp = ddp_model(dev)
    except Exception:  # noqa: BLE001 - the check fails with the reason
        check("DDP one-rank NCCL group", traceback.format_exc().splitlines()[-1], False)
        return
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def train_step():
        loss = ddp(x).float().pow(2).mean()
        loss.backward()  # on autograd's device thread; DDP's hooks all-reduce from there
        opt.step()
        opt.zero_grad(set_to_none=True)

    def forward_only():
        with torch.no_grad():
            ddp.module(x)

    n = 30
    d = log_dir("steptrace-cupti-ddp-")
    with steptrace.Profiler(d) as prof:
        for _ in range(n):
            with prof.step():
                with prof.phase("forward"):
                    loss = ddp(x).float().pow(2).mean()
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        for _ in range(n):  # forward-only steps, for comparison
            with prof.step():
                forward_only()
    recs = records(d)
    all_steps = [r for r in recs if r["kind"] == "step"]
    train = [r for r in all_steps[WARMUP:n] if "kernels" in r]
    fwd = [r for r in all_steps[n + WARMUP:] if "kernels" in r]
    ends = [r for r in recs if r["kind"] == "run_end"]
    kernels_end = ends[0].get("device_activity", {}).get("kernels", {}) if ends else {}

    ref = reference_kernels(train_step)
    ref_nccl = [k for k in ref if is_nccl_kernel(k)]
    counts = [r["kernels"]["count"] for r in train]
    fwd_counts = [r["kernels"]["count"] for r in fwd]
    check("backward + all-reduce kernels in the step",
          f"kernels/step {min(counts, default=0)}..{max(counts, default=0)} vs torch.profiler {len(ref)} "
          f"(forward-only steps {statistics.median(fwd_counts) if fwd_counts else 'n/a'})",
          bool(counts) and all(abs(c - len(ref)) <= max(2, 0.05 * len(ref)) for c in counts)
          and (not fwd_counts or statistics.median(counts) > 2 * statistics.median(fwd_counts)))
    check("no kernel outside a step or late",
          f"outside_step_records {kernels_end.get('outside_step_records')}, late_records "
          f"{kernels_end.get('late_records')}, dropped {kernels_end.get('dropped_records')} "
          f"of {kernels_end.get('records')}",
          kernels_end.get("late_records") == 0
          and (kernels_end.get("outside_step_records") or 0) <= 0.01 * (kernels_end.get("records") or 1))
    nccl = [r["kernels"]["nccl_ms"] for r in train]
    check("all-reduce time in the step",
          f"torch.profiler NCCL kernels/step {len(ref_nccl)} ({ref_nccl[0][:50] if ref_nccl else 'none: NCCL copied'}); "
          f"steptrace nccl_ms median {statistics.median(nccl) if nccl else float('nan'):.3f}",
          bool(nccl) and bool(ref_nccl) and sum(1 for v in nccl if v > 0) >= 0.9 * len(nccl))
    errs = []
    for s in train:
        k = s["kernels"]
        if s["clock"] == "cuda":
            errs.append(abs(k["compute_ms"] + k["exposed_nccl_ms"] - (s["step_ms"] - k["idle_ms"])) / s["step_ms"])
    check("training step: kernel busy = step - idle",
          f"max error {100 * max(errs, default=float('nan')):.2f}% over {len(errs)} steps",
          bool(errs) and max(errs) < 0.10)
    print(f"  (two NCCL ranks on one GPU: {two_ranks_on_one_gpu()})")



# ---- 8. other CUPTI users ----

def check_unhooked_kineto(matmul) -> None:
    """A Kineto session that bypasses torch.profiler's Python entry point (steptrace's
    hook), as dynolog's on-demand trace does: its callbacks replace steptrace's."""
    from torch.autograd import profiler as ap

    d = log_dir("steptrace-cupti-unhooked-")
    result = None
    try:
        kp = ap.profile(use_device="cuda", use_kineto=True)
        with steptrace.Profiler(d, counters="off") as prof:
            for _ in range(10):
                with prof.step():
                    matmul(0)
            ap._prepare_profiler(kp.config(create_trace_id=True), kp.kineto_activities)
            ap._enable_profiler(kp.config(), kp.kineto_activities)
            t0 = time.monotonic()
            n = 0
            while n < 10 or time.monotonic() - t0 < 4.0:  # past the 8 steps / 3 s it takes
                with prof.step():
                    matmul(0)
                n += 1
            torch.cuda.synchronize()
            result = ap._disable_profiler()
            for _ in range(5):
                with prof.step():
                    matmul(0)
    except Exception:  # noqa: BLE001 - the check fails with the reason
        check("unhooked Kineto session", traceback.format_exc().splitlines()[-1], False)
        return
    recs = records(d)
    all_steps = [r for r in recs if r["kind"] == "step"]
    end = [r for r in recs if r["kind"] == "run_end"][0]
    k_end = end.get("device_activity", {}).get("kernels", {})
    before = all_steps[WARMUP:8]  # the last ones' records may be in the buffer Kineto then gets
    during = all_steps[10:10 + n]
    zeros = [r["step"] for r in all_steps if "kernels" in r and r["kernels"]["count"] == 0]
    theirs = 0
    try:
        theirs = sum(1 for e in result.events() if e.device_type() == torch.autograd.DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - counted as none
        pass
    check("unhooked Kineto: steps without kernels, not zeros",
          f"before {sum('kernels' in r for r in before)}/{len(before)} with kernels, during "
          f"{sum('kernels' in r for r in during)}/{len(during)}, zero-kernel steps {zeros}, "
          f"not_collected_steps {k_end.get('not_collected_steps')}, Kineto's CUDA events {theirs}",
          all("kernels" in r for r in before) and sum("kernels" in r for r in during) <= 2
          and not zeros and (k_end.get("not_collected_steps") or 0) >= len(during) - 2 and theirs > 0)
    check("unhooked Kineto: reason in run_end",
          f"not_collected: {k_end.get('not_collected', '')[:160]!r}; status: {k_end.get('status', '')[:160]!r}",
          "another tool" in k_end.get("not_collected", "") and "callbacks" in k_end.get("status", ""))


_TEARDOWN_CHILD = textwrap.dedent("""
    import os, sys
    os.environ["TEARDOWN_CUPTI"] = "1"
    import torch, steptrace
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with steptrace.Profiler(sys.argv[1], counter_every=1) as prof:
        for i in range(60):
            if i == 10:
                tp = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                tp.__enter__()
            with prof.step():
                for _ in range(8):
                    a @ a
            if i == 13:
                torch.cuda.synchronize()
                tp.__exit__(None, None, None)  # Kineto tears CUPTI down shortly after
    print("child done")
""")


def check_teardown_cupti() -> None:
    """Kineto's TEARDOWN_CUPTI=1 calls cuptiFinalize under the PM sampler (or range
    profiler): the run must survive and say so; run in a child so that a crash inside
    libcupti is reported instead of ending this script."""
    d = log_dir("steptrace-cupti-teardown-")
    try:
        proc = subprocess.run([sys.executable, "-c", _TEARDOWN_CHILD, d], capture_output=True, text=True,
                              timeout=limit(90))
    except subprocess.TimeoutExpired:
        check("TEARDOWN_CUPTI=1: run survives", "child stopped at its time limit", False)
        return
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    if proc.returncode != 0:
        check("TEARDOWN_CUPTI=1: run survives", f"child exit {proc.returncode}: {' | '.join(tail)}", False)
        return
    recs = records(d)
    all_steps = [r for r in recs if r["kind"] == "step"]
    ends = [r for r in recs if r["kind"] == "run_end"]
    da = ends[0].get("device_activity", {}) if ends else {}
    c_status = da.get("counters", {}).get("status", "")
    k = da.get("kernels", {})
    late = all_steps[30:]
    zeros = [r["step"] for r in all_steps if "kernels" in r and r["kernels"]["count"] == 0]
    with_counters = sum("counters" in r for r in late)
    check("TEARDOWN_CUPTI=1: run survives", f"{len(all_steps)} steps, run_end {bool(ends)}, clock "
          f"{sorted({r['clock'] for r in all_steps})}", len(all_steps) == 60 and bool(ends))
    # either CUPTI's teardown reached the sampler (then it says so and samples no more) or
    # sampling went on; both are honest, silence about a stop is not
    torn = "cuptiFinalize" in c_status
    check("TEARDOWN_CUPTI=1: counters stop with a reason",
          f"counters on steps 30+: {with_counters}/{len(late)}; counters.status {c_status[:200]!r}",
          (torn and with_counters == 0) or (not torn and with_counters >= 0.8 * len(late)))
    check("TEARDOWN_CUPTI=1: no zero-kernel steps",
          f"zero-kernel steps {zeros}; kernels on steps 30+: {sum('kernels' in r for r in late)}/{len(late)}; "
          f"kernels.status {k.get('status', '')[:160]!r}; not_collected_steps {k.get('not_collected_steps')}",
          not zeros)


_LOCAL_RANK_CHILD = textwrap.dedent("""
    import sys
    import torch, steptrace
    work = int(sys.argv[2])
    torch.cuda.set_device(work)
    a = torch.randn(8192, 8192, device=f"cuda:{work}", dtype=torch.bfloat16)
    with steptrace.Profiler(sys.argv[1], counter_every=1) as prof:
        for i in range(30):
            with prof.step():
                for _ in range(8):
                    a @ a
""")


def _local_rank_run(local_rank: int, work: int):
    d = log_dir("steptrace-cupti-localrank-")
    env = dict(os.environ, LOCAL_RANK=str(local_rank))
    try:
        proc = subprocess.run([sys.executable, "-c", _LOCAL_RANK_CHILD, d, str(work)], env=env,
                              capture_output=True, text=True, timeout=limit(60))
    except subprocess.TimeoutExpired:
        return None, "child stopped at its time limit"
    if proc.returncode != 0:
        return None, "child failed: " + " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-2:])
    recs = records(d)
    dev = recs[0]["backends"].get("counters", {}).get("device", "")
    tc = mean(s["counters"]["tensor_active_pct"] for s in recs[WARMUP + 1:]
              if s["kind"] == "step" and "tensor_active_pct" in s.get("counters", {}))
    return (dev, tc), ""


def check_local_rank() -> None:
    """The counters sample LOCAL_RANK's GPU, not device 0, whatever the current device."""
    n = torch.cuda.device_count()
    if n >= 2:
        own, err = _local_rank_run(local_rank=n - 1, work=n - 1)
        other, err2 = _local_rank_run(local_rank=n - 1, work=0)  # work on another GPU
        ok = own is not None and other is not None
        check("LOCAL_RANK picks the sampled GPU",
              f"LOCAL_RANK={n - 1}: {own or err}; same rank, work on GPU 0: {other or err2}",
              ok and own[0].startswith(f"device {n - 1} (LOCAL_RANK={n - 1})") and own[1] > 20
              and other[1] < max(5.0, own[1] / 4))
    else:
        own, err = _local_rank_run(local_rank=0, work=0)
        beyond, err2 = _local_rank_run(local_rank=3, work=0)  # per-rank CUDA_VISIBLE_DEVICES
        ok = own is not None and beyond is not None
        check("LOCAL_RANK picks the sampled GPU (1 GPU)",
              f"LOCAL_RANK=0: {own or err}; LOCAL_RANK=3: {beyond or err2}",
              ok and own[0].startswith("device 0 (LOCAL_RANK=0)") and own[1] > 20
              and "not among the 1 visible devices" in beyond[0] and beyond[1] > 20)


if __name__ == "__main__":
    sys.exit(main())
