"""Device check of what a step covers and what it costs the host on a real GPU (run by
tests/gpu/run.sh); prints a table, exits 1 on a failed check. Runs with the GPU to itself.

1. Side-stream coverage: a step whose kernels run on a side stream (a torch.cuda.Event
   pair on the side stream times them), with the side stream joined before the step ends
   (current_stream().wait_stream(side)) and not joined. Joined: PASS when step_ms is at
   least the side-stream kernel time (2% or 20 us slack). Not joined: INFO (step_ms may
   be far smaller: the step's events sit on the current stream only). Each step's
   "stream" field ({"id", "device"}, where the record has it) is printed.
2. torch.cuda.mem_get_info latency (INFO): with the GPU idle, and with about 200 ms of
   matmuls queued and no synchronize, with whether the call returned before that work
   was done (an event recorded after it had not completed: no sync); and the host time of
   a profiled step's end (steptrace's step hook reads device memory there) with 200 ms
   queued in the step.
3. Comm timing against nccl_ms: a one-rank NCCL group (init_method file://, backend nccl)
   and a DDP MLP made before the Profiler, no watch() (the program registers a
   pre-multiplied-sum comm hook inside it, so that NCCL launches a kernel for its one-rank
   all-reduce; steptrace.live.comm puts it behind its dispatcher); per step the completion-timed
   comm.comm_ms against the kernel activity's kernels.nccl_ms, medians printed; PASS when
   the steps have `comm` (and `kernels` where kernel activity is active), when comm_ms is
   at least half of nccl_ms (timed to completion, not to the launch: NCCL's futures are
   complete at enqueue) and exposed_ms is 0 (the host does not wait for NCCL), in a child
   with a time limit.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from device_check import Checks, Child, child_main, cuda_device, log_dir, no_gpu, records, steps  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()[:300]


# ---- 1. side-stream coverage ----

def check_side_streams(check: Checks) -> None:
    import torch

    import steptrace

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    with torch.cuda.stream(side):
        (a @ a).clamp_(-1, 1)  # cuBLAS on the side stream set up before timing
    torch.cuda.synchronize()
    results = {}
    for joined in (True, False):
        d = log_dir("steptrace-streams-")
        pairs = []
        with steptrace.Profiler(d, max_inflight_steps=16) as prof:
            for _ in range(12):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with prof.step():
                    with prof.phase("forward"):
                        side.wait_stream(cur)
                        with torch.cuda.stream(side):
                            e0.record(side)
                            x = a
                            for _ in range(8):
                                x = (x @ a).clamp_(-1, 1)
                            e1.record(side)
                        if joined:
                            cur.wait_stream(side)
                pairs.append((e0, e1))
                torch.cuda.synchronize()  # between steps: each step's side work is its own
        recs = steps(d)[2:]
        side_ms = [e0.elapsed_time(e1) for e0, e1 in pairs][2:]
        results[joined] = (recs, side_ms)
    for joined, (recs, side_ms) in results.items():
        step_ms = [r["step_ms"] for r in recs]
        stream = recs[0].get("stream") if recs else None
        label = "side stream joined" if joined else "side stream not joined"
        detail = (f"median step_ms {statistics.median(step_ms):.3f} vs side-stream kernels "
                  f"{statistics.median(side_ms):.3f} ms; clocks {sorted({r['clock'] for r in recs})}; "
                  f"stream {stream if stream is not None else '(no stream field)'}")
        if joined:
            short = [(s, k) for s, k in zip(step_ms, side_ms) if s < k - max(0.02 * k, 0.02)]
            check(label, detail + f"; steps shorter than their side work: {len(short)}/{len(step_ms)}",
                  bool(step_ms) and not short and all(r["clock"] == "cuda" for r in recs))
        else:
            check.info(label, detail + " (a step covers its current stream only)")


# ---- 2. mem_get_info latency ----

def check_mem_get_info(check: Checks) -> None:
    import torch

    import steptrace

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.matmul(a, b, out=out)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        torch.matmul(a, b, out=out)
    e1.record()
    e1.synchronize()
    per_mm = e0.elapsed_time(e1) / 10
    n = max(1, min(2000, int(200 / max(per_mm, 1e-3))))

    idle = []
    for _ in range(20):
        t0 = time.perf_counter()
        torch.cuda.mem_get_info()
        idle.append((time.perf_counter() - t0) * 1e3)

    def queued(fn) -> tuple:
        for _ in range(n):
            torch.matmul(a, b, out=out)
        done = torch.cuda.Event()
        done.record()
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        finished = done.query()  # True: the call waited for the queue (or it ran dry)
        torch.cuda.synchronize()
        return ms, finished

    busy = [queued(torch.cuda.mem_get_info) for _ in range(3)]
    check.info("mem_get_info latency", f"idle median {statistics.median(idle) * 1e3:.0f} us; with {n} matmuls "
               f"(~{n * per_mm:.0f} ms) queued: {', '.join(f'{ms:.2f} ms' for ms, _ in busy)}; queued work done "
               f"when it returned: {[f for _, f in busy]} (True: it waited for the GPU)")

    # the same through a profiled step's end (steptrace's step hook)
    d = log_dir("steptrace-memgetinfo-")
    ends = []
    with steptrace.Profiler(d, max_inflight_steps=64, kernel_activity="off", counters="off") as prof:
        for _ in range(4):
            step = prof.step()
            step.__enter__()
            for _ in range(n):
                torch.matmul(a, b, out=out)
            t0 = time.perf_counter()
            step.__exit__(None, None, None)
            ends.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
    recs = steps(d)
    used = [r["memory"].get("device_used_bytes") for r in recs]
    check.info("step end with 200 ms queued", f"host time of the step's end {', '.join(f'{v:.2f}' for v in ends)} ms "
               f"(ends with a device sync would take ~{n * per_mm:.0f} ms); device_used_bytes on "
               f"{sum(v is not None for v in used)}/{len(recs)} steps")


# ---- 3. comm timing against nccl_ms (child) ----

def child_comm(check: Checks, log_dir: str, store: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import steptrace

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(4096, 4096), torch.nn.GELU())])
        ddp = DistributedDataParallel(model.cuda().to(torch.bfloat16), device_ids=[0], bucket_cap_mb=25)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        premul = getattr(dist, "_make_nccl_premul_sum", None)

        def hook(_state, bucket):
            # NCCL copies instead of launching a kernel for a plain one-rank sum
            op = premul(1.0) if premul is not None else dist.ReduceOp.SUM
            fut = dist.all_reduce(bucket.buffer(), op=op, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
        with steptrace.Profiler(log_dir, counters="off") as prof:
            ddp.register_comm_hook(None, hook)  # behind steptrace's dispatcher: no watch()
            for _ in range(25):
                with prof.step():
                    loss = ddp(x).float().pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    recs = records(log_dir)
    act = recs[0]["backends"].get("kernel_activity", {}).get("active")
    st = [r for r in recs if r["kind"] == "step"][5:]
    comm = [r["comm"]["comm_ms"] for r in st if "comm" in r]
    nccl = [r["kernels"]["nccl_ms"] for r in st if "kernels" in r]
    exposed = [r["comm"]["exposed_ms"] for r in st if "comm" in r]

    def med(v):
        return f"{statistics.median(v):.3f}" if v else "n/a"

    check.info("comm_ms vs nccl_ms (1 rank)", f"median comm.comm_ms {med(comm)} (exposed {med(exposed)}) vs "
               f"kernels.nccl_ms {med(nccl)} over {len(st)} steps; premul sum {premul is not None}; "
               f"kernel activity {act}")
    check("DDP steps carry comm and kernels", f"{len(comm)}/{len(st)} with comm, {len(nccl)}/{len(st)} with kernels "
          f"(kernel activity {act})", bool(st) and len(comm) == len(st) and (act != ["cupti"] or len(nccl) == len(st)))
    if act == ["cupti"]:
        # a one-rank group's all-reduce runs NCCL's oneRankReduce kernel (premul sum): a zero
        # nccl_ms means the kernels were not classified, and the comparison tests nothing
        check("comm timed to completion, not launch", f"median comm_ms {med(comm)} >= half of nccl_ms {med(nccl)} "
              f"(nccl_ms > 0 in {sum(v > 0 for v in nccl)}/{len(nccl)} steps)",
              bool(comm) and bool(nccl) and statistics.median(nccl) > 0
              and statistics.median(comm) >= 0.5 * statistics.median(nccl))
    else:
        check.skip("comm timed to completion, not launch", f"no kernel activity ({act}): nccl_ms not measured")
    if exposed:
        check("NCCL never counted as host-blocked", f"median exposed_ms {med(exposed)}",
              statistics.median(exposed) == 0.0)


def main() -> int:
    if cuda_device() is None:
        return no_gpu()
    check = Checks()
    for fn in (check_side_streams, check_mem_get_info):
        try:
            fn(check)
        except Exception as e:  # noqa: BLE001 - one check's failure does not hide the others
            check(fn.__name__, f"raised: {last_line(e)}", False)
    tmp = log_dir("steptrace-comm-")
    Child("comm vs nccl_ms child", SCRIPT, "comm", f"{tmp}/log", f"{tmp}/store", timeout_s=60).finish(check)
    return check.table()


if __name__ == "__main__":
    code = child_main({"comm": child_comm})
    sys.exit(code if code is not None else main())
