"""Device check of CUDA graph capture and CUDA contexts under steptrace (run by
tests/gpu/run.sh); prints a table, exits 1 on a failed check.

Every check runs in a child process of its own, all at once (none of them is timed, so
they may share the GPU; only the background-capture child turns the CUPTI counters on,
since one process at a time can hold them), each with a time limit.

1. Whole-network capture, PyTorch's example from its CUDA graphs notes (static input and
   target, three warmup iterations on a side stream, torch.cuda.graph capturing forward,
   loss, backward and optimizer.step(), then copy-in and g.replay() per step):
   a. under `with steptrace.Profiler(...)` with phases, the step around the capture;
   b. the same with the step (and its phases) begun inside the capture;
   c. the unmodified script under `steptrace run` (its steps begin at a grad-enabled
      forward, inside the capture, and end at optimizer.step(), inside it too).
   PASS: capture and replay raise nothing, replays train (finite losses, weights move),
   every step is written, the step during which the capture ran says "captured": true,
   replayed steps are CUDA-timed, and no timer_fallback.
2. torch.compile(mode="reduce-overhead") (CUDA graph trees) of an MLP trained under a
   Profiler with phases: nothing raises, no cudagraph skip, the loss falls, every step is
   written, the steps after the warmup are CUDA-timed, no timer_fallback.
3. A background thread capturing graphs in global mode (torch.cuda.graph's default
   capture_error_mode="global"; each capture held open about 5 ms) over and over, while
   the main thread runs profiled steps with kernel activity and counters on (counter_every
   1): no capture on the background thread fails, the main thread's steps raise nothing
   and are CUDA-timed. A control run without steptrace comes first: if the loop alone
   already breaks captures, the check cannot tell and says SKIP.
4. Contexts: steps on a fresh threading.Thread that never touched CUDA (the Profiler and
   the tensors made on the main thread); steps inside `with torch.cuda.device(0)` (and,
   with two GPUs, `torch.cuda.device(1)` with the work there); with two GPUs, a model on
   cuda:1 without set_device (plain, and with LOCAL_RANK=1 as a launcher sets it). PASS:
   every step says "clock": "cuda", none is lost, no timer_fallback. The step time
   against torch.cuda.Event pairs around the same work on the work's own stream, and the
   step's "stream" field, are printed (INFO: which GPU was timed).
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from device_check import Checks, Child, alerts, child_main, cuda_device, log_dir, no_gpu, records  # noqa: E402

SCRIPT = str(Path(__file__).resolve())
NO_COUNTERS = {"counters": "off"}  # the children share the GPU; the counters are one process's


def last_line(exc: BaseException) -> str:
    return (traceback.format_exception_only(type(exc), exc)[-1].strip())[:300]


def fallbacks(recs: list) -> str:
    found = alerts(recs, "timer_fallback")
    return f"{len(found)} ({found[0].get('message', '')[:120]})" if found else "0"


# ---- 1. whole-network capture ----

WHOLE_NETWORK = """
import torch

N, D_in, H, D_out = 640, 4096, 2048, 1024
model = torch.nn.Sequential(torch.nn.Linear(D_in, H), torch.nn.Dropout(p=0.2),
                            torch.nn.Linear(H, D_out), torch.nn.Dropout(p=0.1)).cuda()
loss_fn = torch.nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
static_input = torch.randn(N, D_in, device="cuda")
static_target = torch.randn(N, D_out, device="cuda")
"""

# PyTorch's whole-network example as a plain script, for `steptrace run`
WHOLE_NETWORK_SCRIPT = WHOLE_NETWORK + """
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for i in range(3):
        optimizer.zero_grad(set_to_none=True)
        y_pred = model(static_input)
        loss = loss_fn(y_pred, static_target)
        loss.backward()
        optimizer.step()
torch.cuda.current_stream().wait_stream(s)

g = torch.cuda.CUDAGraph()
optimizer.zero_grad(set_to_none=True)
with torch.cuda.graph(g):
    static_y_pred = model(static_input)
    static_loss = loss_fn(static_y_pred, static_target)
    static_loss.backward()
    optimizer.step()

w0 = model[0].weight.detach().clone()
real_inputs = [torch.rand_like(static_input) for _ in range(10)]
real_targets = [torch.rand_like(static_target) for _ in range(10)]
losses = []
for data, target in zip(real_inputs, real_targets):
    static_input.copy_(data)
    static_target.copy_(target)
    g.replay()
    losses.append(static_loss.detach().clone())
torch.cuda.synchronize()
moved = float((model[0].weight - w0).abs().max())
print("REPLAYED", len(losses), all(torch.isfinite(x).item() for x in losses), moved)
"""


def child_graph_profiler(check: Checks, log_dir: str, where: str) -> None:
    """1a (where="around": the step encloses the capture) and 1b ("inside": the step and
    its phases begin inside the capture)."""
    import torch

    import steptrace

    name = f"whole-network capture, step {where} it"
    ns: dict = {}
    exec(WHOLE_NETWORK, ns)  # noqa: S102 - the example's setup, shared with the script
    model, loss_fn, optimizer = ns["model"], ns["loss_fn"], ns["optimizer"]
    static_input, static_target = ns["static_input"], ns["static_target"]
    losses, pairs = [], []
    n_steps = 0
    try:
        with steptrace.Profiler(log_dir, max_inflight_steps=16, **NO_COUNTERS) as prof:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    with prof.step():
                        with prof.phase("forward"):
                            optimizer.zero_grad(set_to_none=True)
                            loss = loss_fn(model(static_input), static_target)
                        with prof.phase("backward"):
                            loss.backward()
                        with prof.phase("optimizer"):
                            optimizer.step()
                    n_steps += 1
            torch.cuda.current_stream().wait_stream(s)

            g = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=True)

            def captured_step():
                with prof.phase("forward"):
                    out = loss_fn(model(static_input), static_target)
                with prof.phase("backward"):
                    out.backward()
                with prof.phase("optimizer"):
                    optimizer.step()
                return out

            capture_index = n_steps
            if where == "around":
                with prof.step():
                    with torch.cuda.graph(g):
                        static_loss = captured_step()
            else:
                with torch.cuda.graph(g):
                    with prof.step():
                        static_loss = captured_step()
            n_steps += 1
            w0 = model[0].weight.detach().clone()
            for _ in range(20):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with prof.step():
                    with prof.phase("replay"):
                        static_input.copy_(torch.rand_like(static_input))
                        static_target.copy_(torch.rand_like(static_target))
                        e0.record()
                        g.replay()
                        e1.record()
                n_steps += 1
                pairs.append((e0, e1))
                losses.append(static_loss.detach().clone())
            torch.cuda.synchronize()
        moved = float((model[0].weight - w0).abs().max())
    except Exception as e:  # noqa: BLE001 - the check fails with the reason
        check(f"{name}: capture and replay", f"raised after {n_steps} steps: {last_line(e)}", False)
        return
    finite = all(math.isfinite(float(x)) for x in losses)
    check(f"{name}: capture and replay", f"20 replays, losses finite {finite}, weights moved by {moved:.2e}",
          finite and moved > 0)
    recs = records(log_dir)
    st = [r for r in recs if r["kind"] == "step"]
    cap = st[capture_index] if len(st) > capture_index else {}
    replays = st[capture_index + 1:]
    check(f"{name}: steps written", f"{len(st)}/{n_steps} step records, status "
          f"{sorted({r['status'] for r in st})}, run_end {any(r['kind'] == 'run_end' for r in recs)}",
          len(st) == n_steps and all(r["status"] == "ok" for r in st))
    check(f"{name}: captured step says so", f"capture step: clock {cap.get('clock')}, captured "
          f"{cap.get('captured')}; captured elsewhere: "
          f"{[r['step'] for i, r in enumerate(st) if r.get('captured') and i != capture_index]}",
          cap.get("captured") is True)
    ref = [e0.elapsed_time(e1) for e0, e1 in pairs]
    check(f"{name}: replays CUDA-timed", f"replay steps' clocks {sorted({r['clock'] for r in replays})}, "
          f"median step_ms {statistics.median([r['step_ms'] for r in replays] or [float('nan')]):.3f} vs "
          f"replay Event pair {statistics.median(ref):.3f} ms; timer_fallback {fallbacks(recs)}",
          bool(replays) and all(r["clock"] == "cuda" and not r.get("captured") for r in replays)
          and not alerts(recs, "timer_fallback"))


def child_graph_run(check: Checks, log_dir: str) -> None:
    """1c: the unmodified example under `steptrace run`."""
    name = "whole-network capture under steptrace run"
    script = Path(log_dir("steptrace-graph-run-")) / "whole_network.py"
    script.write_text(WHOLE_NETWORK_SCRIPT)
    cmd = [sys.executable, "-m", "steptrace.cli", "run", "--log-dir", log_dir,
           "--option", "counters=\"off\"", str(script)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=75)
    except subprocess.TimeoutExpired:
        check(name, "steptrace run did not finish in 75 s", False)
        return
    out = proc.stdout + proc.stderr
    replayed = [line for line in out.splitlines() if line.startswith("REPLAYED")]
    fields = replayed[0].split() if replayed else []
    ok = proc.returncode == 0 and len(fields) == 4 and fields[2] == "True" and float(fields[3]) > 0
    check(f"{name}: capture and replay", f"exit {proc.returncode}; {replayed[0] if replayed else 'no REPLAYED line'}"
          f"{'' if ok else '; ' + ' | '.join(out.strip().splitlines()[-3:])[-400:]}", ok)
    try:
        recs = records(Path(log_dir) / "rank0.jsonl")
    except Exception as e:  # noqa: BLE001
        check(f"{name}: steps written", f"no log: {last_line(e)}", False)
        return
    st = [r for r in recs if r["kind"] == "step"]
    captured = [r for r in st if r.get("captured")]
    # three warmup iterations and the captured one end at an optimizer step each; the
    # replays call no optimizer.step() from Python, so they make no steps
    check(f"{name}: steps written", f"{len(st)} step records (4 expected: 3 warmup + the capture), "
          f"run_end {any(r['kind'] == 'run_end' for r in recs)}", len(st) >= 4)
    check(f"{name}: captured step says so", f"steps with captured: true {[r['step'] for r in captured]} "
          f"(clock {[r['clock'] for r in captured]}); timer_fallback {fallbacks(recs)}",
          len(captured) >= 1 and not alerts(recs, "timer_fallback"))


# ---- 2. torch.compile(mode="reduce-overhead") ----

def child_compile(check: Checks, log_dir: str) -> None:
    import torch
    import torch._dynamo.utils as dynamo_utils

    import steptrace

    name = "torch.compile(mode=\"reduce-overhead\")"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(),
                                torch.nn.Linear(2048, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cmodel = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(512, 1024, device="cuda")
    y = torch.randn(512, 1024, device="cuda")
    losses, n = [], 0
    t0 = time.monotonic()
    try:
        with steptrace.Profiler(log_dir, max_inflight_steps=16, **NO_COUNTERS) as prof:
            for _ in range(20):
                with prof.step():
                    torch.compiler.cudagraph_mark_step_begin()
                    with prof.phase("forward"):
                        loss = torch.nn.functional.mse_loss(cmodel(x), y)
                    with prof.phase("backward"):
                        loss.backward()
                    with prof.phase("optimizer"):
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                n += 1
                losses.append(loss.detach().clone())
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        check(f"{name}: compile, capture, replay", f"raised at step {n}: {last_line(e)}", False)
        return
    inductor = dict(dynamo_utils.counters.get("inductor", {}))
    skips = inductor.get("cudagraph_skips", 0)
    lv = [float(v) for v in losses]
    check(f"{name}: compile, capture, replay", f"{n} steps in {time.monotonic() - t0:.1f} s, loss {lv[0]:.4f} -> "
          f"{lv[-1]:.4f}, cudagraph_skips {skips}",
          all(math.isfinite(v) for v in lv) and lv[-1] < lv[0] and skips == 0)
    recs = records(log_dir)
    st = [r for r in recs if r["kind"] == "step"]
    late = st[5:]
    check(f"{name}: steps written and CUDA-timed",
          f"{len(st)}/{n} steps; clocks after step 5 {sorted({r['clock'] for r in late})}; captured: true on "
          f"{[r['step'] for r in st if r.get('captured')]}; timer_fallback {fallbacks(recs)}",
          len(st) == n and bool(late) and all(r["clock"] == "cuda" for r in late)
          and not alerts(recs, "timer_fallback"))


# ---- 3. a background thread capturing in global mode ----

def child_background_capture(check: Checks, log_dir: str) -> None:
    import torch

    import steptrace

    name = "global-mode capture beside profiled steps"
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)  # cuBLAS handle and workspace now, not during a capture
    torch.cuda.synchronize()

    def capturer(stop: threading.Event, stats: dict) -> None:
        x = torch.randn(1 << 20, device="cuda")
        y = torch.empty_like(x)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            y.copy_(x).mul_(0.5).add_(1.0)
        torch.cuda.synchronize()
        while not stop.is_set() and len(stats["errors"]) < 5:
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, stream=side):  # capture_error_mode="global" (the default)
                    for _ in range(10):
                        y.copy_(x).mul_(0.5).add_(1.0)
                        time.sleep(0.0005)  # the capture stays open ~5 ms: main-thread steps run in it
                g.replay()
                stats["ok"] += 1
            except Exception as e:  # noqa: BLE001 - counted
                stats["errors"].append(last_line(e))
            del g

    def loop(prof, seconds: float) -> dict:
        stats = {"ok": 0, "errors": []}
        stop = threading.Event()
        t = threading.Thread(target=capturer, args=(stop, stats), name="capturer")
        t.start()
        main_errors, n = [], 0
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                try:
                    if prof is None:
                        for _ in range(4):
                            torch.matmul(a, b, out=c)
                    else:
                        with prof.step():
                            with prof.phase("forward"):
                                for _ in range(4):
                                    torch.matmul(a, b, out=c)
                    n += 1
                except Exception as e:  # noqa: BLE001
                    main_errors.append(last_line(e))
                    if len(main_errors) >= 5:
                        break
                # paced so the GPU keeps up (about 1 ms of work per iteration) without a
                # synchronize, which would itself break the other thread's global-mode capture
                time.sleep(0.002)
        finally:
            stop.set()
            t.join(timeout=30)
        torch.cuda.synchronize()
        stats.update(main_errors=main_errors, steps=n)
        return stats

    control = loop(None, 1.5)
    if control["errors"] or control["main_errors"]:
        check.skip(name, f"without steptrace the loop already breaks captures ({control['ok']} ok, errors "
                         f"{control['errors'][:2]}, main {control['main_errors'][:2]}): the check cannot tell")
        return
    with steptrace.Profiler(log_dir, counter_every=1, max_inflight_steps=8) as prof:
        stats = loop(prof, 3.0)
    recs = records(log_dir)
    backends = recs[0]["backends"]
    act = backends.get("kernel_activity", {}).get("active")
    cnt = backends.get("counters", {}).get("active")
    st = [r for r in recs if r["kind"] == "step"]
    check(f"{name}: no capture error", f"{stats['ok']} captures ok, {len(stats['errors'])} failed "
          f"{stats['errors'][:2]}; control without steptrace: {control['ok']} ok; kernel activity {act}, "
          f"counters {cnt}", not stats["errors"] and stats["ok"] >= 10)
    check(f"{name}: main-thread steps", f"{stats['steps']} steps, {len(st)} records, main-thread errors "
          f"{stats['main_errors'][:2]}, clocks {sorted({r['clock'] for r in st})}, with kernels "
          f"{sum('kernels' in r for r in st)}, with counters {sum('counters' in r for r in st)}; "
          f"timer_fallback {fallbacks(recs)}",
          not stats["main_errors"] and len(st) == stats["steps"] and all(r["clock"] == "cuda" for r in st)
          and not alerts(recs, "timer_fallback"))


# ---- 4. contexts: a fresh thread, torch.cuda.device(i), a model on cuda:1 ----

def work(torch, device: int) -> tuple:
    """A tensor on `device` and that device's current stream, made by the caller (so that
    a fresh thread's first CUDA call is steptrace's step, not this)."""
    return torch.randn(4096, 4096, device=f"cuda:{device}", dtype=torch.bfloat16), torch.cuda.current_stream(device)


def timed_steps(prof, torch, a, stream, n: int = 12) -> list:
    """n steps of matmuls on `a`'s device, each bracketed by a torch.cuda.Event pair on
    `stream` (that device's current stream); returns the pairs."""
    pairs = []
    for _ in range(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with prof.step():
            with prof.phase("forward"):
                e0.record(stream)
                for _ in range(8):
                    a = (a @ a).clamp_(-1, 1)
                e1.record(stream)
        pairs.append((e0, e1))
    for e0, e1 in pairs:
        e1.synchronize()
    return pairs


def judge_context(check: Checks, name: str, log_dir: str, pairs: list, n: int) -> None:
    recs = records(log_dir)
    st = [r for r in recs if r["kind"] == "step"]
    ok = len(st) == n and all(r["clock"] == "cuda" for r in st) and not alerts(recs, "timer_fallback")
    check(name, f"{len(st)}/{n} steps, clocks {[r['clock'] for r in st][:3]}.. "
                f"({sum(r['clock'] == 'cuda' for r in st)} cuda); timer_fallback {fallbacks(recs)}", ok)
    if pairs and st:
        ev = statistics.median(e0.elapsed_time(e1) for e0, e1 in pairs[2:])
        ms = statistics.median(r["step_ms"] for r in st[2:]) if len(st) > 2 else float("nan")
        check.info(f"{name}: timed GPU", f"median step_ms {ms:.3f} vs Event pair on the work's stream {ev:.3f} "
                                         f"ms (far below: another GPU's stream was timed); step stream "
                                         f"{st[-1].get('stream', '(no stream field)')}")


def child_fresh_thread(check: Checks, log_dir: str) -> None:
    import torch

    import steptrace

    a, stream = work(torch, 0)  # CUDA initialized by the main thread, not the new one
    torch.cuda.synchronize()
    prof = steptrace.Profiler(log_dir, **NO_COUNTERS)
    result: dict = {}

    def body() -> None:  # its first CUDA call is steptrace's, at the first step
        try:
            result["pairs"] = timed_steps(prof, torch, a, stream)
            prof.close()  # from the thread that drove the steps
        except Exception as e:  # noqa: BLE001
            result["error"] = last_line(e)

    t = threading.Thread(target=body, name="fresh-trainer")
    t.start()
    t.join(timeout=60)
    prof.close()  # a no-op once closed
    if "error" in result:
        check("steps on a fresh thread", f"raised: {result['error']}", False)
        return
    judge_context(check, "steps on a fresh thread", log_dir, result.get("pairs", []), 12)


def child_device_context(check: Checks, log_dir: str, device: str) -> None:
    import torch

    import steptrace

    i = int(device)
    name = f"steps inside torch.cuda.device({i})"
    a, stream = work(torch, i)
    try:
        with steptrace.Profiler(log_dir, **NO_COUNTERS) as prof:
            with torch.cuda.device(i):
                pairs = timed_steps(prof, torch, a, stream)
    except Exception as e:  # noqa: BLE001
        check(name, f"raised: {last_line(e)}", False)
        return
    judge_context(check, name, log_dir, pairs, 12)


def child_other_gpu(check: Checks, log_dir: str) -> None:
    """A model on cuda:1 with the current device left at 0 (no set_device); run plain and
    with LOCAL_RANK=1 (a launcher's rank on cuda:LOCAL_RANK)."""
    import torch

    import steptrace

    local = os.environ.get("LOCAL_RANK")
    name = "model on cuda:1 without set_device" + (f" (LOCAL_RANK={local})" if local else "")
    a, stream = work(torch, 1)  # the current device stays 0
    try:
        with steptrace.Profiler(log_dir, **NO_COUNTERS) as prof:
            pairs = timed_steps(prof, torch, a, stream)
    except Exception as e:  # noqa: BLE001
        check(name, f"raised: {last_line(e)}", False)
        return
    judge_context(check, name, log_dir, pairs, 12)


CHILDREN = {
    "graph_profiler": child_graph_profiler,
    "graph_run": child_graph_run,
    "compile": child_compile,
    "background_capture": child_background_capture,
    "fresh_thread": child_fresh_thread,
    "device_context": child_device_context,
    "other_gpu": child_other_gpu,
}


def main() -> int:
    if cuda_device() is None:
        return no_gpu()
    import torch

    check = Checks()
    n = torch.cuda.device_count()

    def d() -> str:
        return log_dir("steptrace-graphs-")

    children = [
        Child("whole-network capture (step around) child", SCRIPT, "graph_profiler", d(), "around", timeout_s=90),
        Child("whole-network capture (step inside) child", SCRIPT, "graph_profiler", d(), "inside", timeout_s=90),
        Child("whole-network capture (steptrace run) child", SCRIPT, "graph_run", d(), timeout_s=90),
        Child("torch.compile reduce-overhead child", SCRIPT, "compile", d(), timeout_s=120),
        Child("global-mode capture child", SCRIPT, "background_capture", d(), timeout_s=60),
        Child("fresh thread child", SCRIPT, "fresh_thread", d(), timeout_s=60),
        Child("torch.cuda.device(0) child", SCRIPT, "device_context", d(), "0", timeout_s=60),
    ]
    if n >= 2:
        children.append(Child("torch.cuda.device(1) child", SCRIPT, "device_context", d(), "1", timeout_s=60))
        children.append(Child("model on cuda:1 child", SCRIPT, "other_gpu", d(), timeout_s=60))
        children.append(Child("model on cuda:1, LOCAL_RANK=1 child", SCRIPT, "other_gpu", d(), timeout_s=60,
                              env={"LOCAL_RANK": "1"}))
    for c in children:
        c.finish(check)
    if n < 2:
        check.skip("steps inside torch.cuda.device(1)", f"{n} GPU visible: needs two")
        check.skip("model on cuda:1 without set_device", f"{n} GPU visible: needs two")
    return check.table()


if __name__ == "__main__":
    code = child_main(CHILDREN)
    sys.exit(code if code is not None else main())
