"""Device check of NVML's timing and device mapping (run by tests/gpu/run.sh); prints a
table, exits 1 on a failed check.

1. NVML call latencies (INFO): each query steptrace's sampler makes in one reading, timed
   through ctypes on libnvidia-ml.so.1 (nvmlInit_v2 and nvmlDeviceGetHandleByIndex_v2
   once; the others 5 times, median and max), and their sum per reading. NVML's
   documentation says nvmlDeviceGetPcieThroughput samples a byte counter over 20 ms, so
   each of its two calls is expected to take about 20 ms. PASS only needs power to answer.
2. NVLink per-link sum against the all-links total (INFO): fields
   NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX (138/139) read with scopeId = each active
   link and with scopeId = UINT_MAX (nvml.h: the aggregate over all links), before and
   after a device-to-device copy (two GPUs with peer access) or with nothing running; the
   counters and their growth are printed both ways. Per-link answers all equal to the
   total mean the driver answers each link with the total (the sum overcounts by the link
   count). SKIP without an active NVLink.
3. CUDA_VISIBLE_DEVICES as a full UUID, an abbreviated UUID (GPU- and the first 8 hex
   digits) and an index: in a child process per form, a few profiled steps with NVML on;
   PASS when run_start.backends.telemetry is active and names the same GPU as the child's
   CUDA device 0 (its uuid / pci_bus_id fields where the record has them, else the
   GPU named in its `device` text, resolved through NVML).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from device_check import Checks, Child, child_main, cuda_device, log_dir, no_gpu, records, steps  # noqa: E402
from nvml_ctypes import (  # noqa: E402
    FI_NVLINK_DATA_RX, FI_NVLINK_DATA_TX, SUCCESS, UINT_MAX, Nvml, norm_uuid, time_call, torch_identity)

SCRIPT = str(Path(__file__).resolve())


def nvml_handle_for_cuda(nv: Nvml, ident: dict):
    """The NVML handle of the CUDA device whose torch identity is `ident` (PCI bus id,
    else UUID), with how it was found."""
    if ident["pci_bus_id"]:
        h = nv.handle_by_pci(ident["pci_bus_id"])
        if h is not None:
            return h, f"PCI bus id {ident['pci_bus_id']}"
    if ident["uuid_hex"]:
        for i in range(nv.count()):
            h = nv.handle(i)
            if norm_uuid(nv.uuid(h)) == ident["uuid_hex"]:
                return h, f"UUID (NVML index {i})"
    return nv.handle(0), "NVML index 0 (no PCI bus id or UUID matched)"


# ---- 1. NVML call latencies ----

def check_latencies(check: Checks, nv_init_ms: float, nv: Nvml, h, links: list) -> None:
    t0 = time.perf_counter()
    nv.handle(0)
    handle_ms = (time.perf_counter() - t0) * 1e3
    rows = [("nvmlInit_v2", [nv_init_ms], SUCCESS), ("nvmlDeviceGetHandleByIndex_v2", [handle_ms], SUCCESS)]
    per_reading = 0.0
    for label, fn in nv.timed_calls(h, links):
        times, r = time_call(fn, 5)
        rows.append((label, times, r))
        if r == SUCCESS:
            per_reading += statistics.median(times)
    print("\nNVML call latencies (ms; 5 calls each, the first two once):")
    print(f"  {'call':<52} {'median':>8} {'max':>8}  return")
    for label, times, r in rows:
        print(f"  {label:<52} {statistics.median(times):8.3f} {max(times):8.3f}  {r}")
    pcie = [statistics.median(t) for label, t, r in rows if "Pcie" in label and r == SUCCESS]
    check.info("NVML calls per sampler reading",
               f"{per_reading:.1f} ms in all over {len(rows) - 2} queries; PCIe throughput "
               f"{'/'.join(f'{v:.1f}' for v in pcie) or 'n/a'} ms per call (documented: a 20 ms sample)")
    power = next((r for label, _, r in rows if label == "nvmlDeviceGetPowerUsage"), -1)
    check("NVML answers power", f"nvmlDeviceGetPowerUsage returned {power}", power == SUCCESS)


# ---- 2. NVLink: per-link sum against the all-links total ----

def nvlink_read(nv: Nvml, h, links: list) -> dict:
    wanted = [(f, link) for f in (FI_NVLINK_DATA_TX, FI_NVLINK_DATA_RX) for link in links]
    wanted += [(FI_NVLINK_DATA_TX, UINT_MAX), (FI_NVLINK_DATA_RX, UINT_MAX)]
    r, vals = nv.fields(h, wanted)
    out = {"call": r, "per_link": {}, "total": {}, "errors": []}
    for v in vals:
        key = "tx" if v.fieldId == FI_NVLINK_DATA_TX else "rx"
        if v.nvmlReturn != SUCCESS:
            out["errors"].append(f"{key}@{'all' if v.scopeId == UINT_MAX else v.scopeId}: {v.nvmlReturn}")
            continue
        if v.scopeId == UINT_MAX:
            out["total"][key] = v.number()
        else:
            out["per_link"].setdefault(key, []).append(v.number())
    return out


def check_nvlink(check: Checks, nv: Nvml, h, links: list) -> None:
    if not links:
        check.skip("NVLink per-link sum vs total", "no active NVLink on this GPU (nvmlDeviceGetNvLinkState)")
        return
    import torch

    peer = torch.cuda.device_count() >= 2 and torch.cuda.can_device_access_peer(0, 1)
    if peer:
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:1")
    before = nvlink_read(nv, h, links)
    t0 = time.monotonic()
    if peer:
        for _ in range(8):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
    else:
        time.sleep(0.5)
    after = nvlink_read(nv, h, links)
    dt = time.monotonic() - t0
    what = "8 GiB copied cuda:0 -> cuda:1" if peer else "nothing running (one GPU, or no peer access)"
    if before["call"] != SUCCESS or after["call"] != SUCCESS:
        check.info("NVLink per-link sum vs total", f"nvmlDeviceGetFieldValues returned {after['call']}")
        return
    parts = []
    for key in ("tx", "rx"):
        pl0, pl1 = before["per_link"].get(key, []), after["per_link"].get(key, [])
        t0_, t1_ = before["total"].get(key), after["total"].get(key)
        link_sum = sum(pl1)
        same = len(set(pl1)) == 1 and len(pl1) > 1
        grow_sum = sum(pl1) - sum(pl0) if len(pl0) == len(pl1) and pl1 else float("nan")
        grow_total = (t1_ - t0_) if t0_ is not None and t1_ is not None else float("nan")
        parts.append(f"{key.upper()}: sum of {len(pl1)} links {link_sum:.0f} KiB vs all-links "
                     f"{'n/a' if t1_ is None else f'{t1_:.0f}'} KiB"
                     f"{' (every link answers the same figure)' if same else ''}; growth over {dt:.2f} s: "
                     f"links {grow_sum:.0f} vs total {grow_total:.0f} KiB")
    if after["errors"]:
        parts.append(f"errors {after['errors'][:6]}")
    check.info("NVLink per-link sum vs total", f"{len(links)} active links, {what}; " + "; ".join(parts))


# ---- 3. CUDA_VISIBLE_DEVICES forms (child) ----

def telemetry_gpu(nv: Nvml, telemetry: dict) -> "tuple[str, str]":
    """The GPU run_start.backends.telemetry names, as bare UUID hex, and how it was told:
    its uuid / pci_bus_id fields where it has them, else the `device` text ("device 0
    (default, GPU-... in CUDA_VISIBLE_DEVICES, NVML device 2, NVIDIA H200)"), resolved
    through NVML; ("", "") when nothing in it tells a GPU."""
    for key in ("uuid", "gpu_uuid"):
        if telemetry.get(key):
            return norm_uuid(telemetry[key]), f"telemetry.{key}"
    for key in ("pci_bus_id", "bus_id"):
        if telemetry.get(key):
            h = nv.handle_by_pci(str(telemetry[key]))
            return (norm_uuid(nv.uuid(h)) if h is not None else ""), f"telemetry.{key} {telemetry[key]}"
    text = str(telemetry.get("device", ""))
    m = re.search(r"GPU-[0-9a-fA-F-]{30,}", text)
    if m:
        return norm_uuid(m.group(0)), "UUID in telemetry.device text"
    n = re.search(r"NVML device (\d+)", text)
    if n:
        return norm_uuid(nv.uuid(nv.handle(int(n.group(1))))), f"NVML device {n.group(1)} in telemetry.device text"
    c = re.match(r"device (\d+)", text)
    if c and "GPU-" not in text and "MIG-" not in text:
        return norm_uuid(nv.uuid(nv.handle(int(c.group(1))))), \
            f"telemetry.device text: NVML index {c.group(1)} (no mapping said)"
    return "", ""


def child_visible(check: Checks, log_dir: str, form: str, label: str) -> None:
    """In a child under the CUDA_VISIBLE_DEVICES being checked: a few steps with NVML on;
    does run_start's telemetry name the GPU that CUDA device 0 is?"""
    import torch

    import steptrace

    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    name = f"CUDA_VISIBLE_DEVICES as {label}"
    ident = torch_identity(torch, 0)
    nv = Nvml()
    if not ident["uuid_hex"] and ident["pci_bus_id"]:  # torch without a UUID: ask NVML by bus id
        h = nv.handle_by_pci(ident["pci_bus_id"])
        ident["uuid_hex"] = norm_uuid(nv.uuid(h)) if h is not None else ""
    a = torch.randn(2048, 2048, device="cuda")
    with steptrace.Profiler(log_dir, nvml="auto", nvml_interval_ms=20, counters="off") as prof:
        for _ in range(8):
            with prof.step():
                with prof.phase("forward"):
                    for _ in range(4):
                        a = (a @ a).clamp_(-1, 1)
            time.sleep(0.01)
    recs = records(log_dir)
    telemetry = recs[0]["backends"]["telemetry"]
    s = steps(log_dir)
    hw = sum("hw" in r for r in s)
    if telemetry.get("active") != ["nvml"]:
        check(name, f"({cvd}) NVML telemetry not active: {json.dumps(telemetry.get('unavailable'))[:300]}", False)
        return
    named, how = telemetry_gpu(nv, telemetry)
    text = str(telemetry.get("device", ""))
    ok = bool(named) and named == ident["uuid_hex"]
    check(name, f"({cvd}) CUDA device 0 {ident['name']} {ident['pci_bus_id']} uuid {ident['uuid_hex'][:8]}..; "
                f"telemetry names {named[:8] + '..' if named else 'no GPU it can be told by'} ({how or 'nothing'}); "
                f"device {text!r}; {hw}/{len(s)} steps with hw", ok)


def check_visible_devices(check: Checks, nv: Nvml, ident: dict) -> None:
    full = ""
    if ident["uuid_hex"]:
        h = nv.handle_by_pci(ident["pci_bus_id"]) if ident["pci_bus_id"] else None
        full = nv.uuid(h) if h is not None else ""
        if not full:
            u = ident["uuid_hex"]
            full = f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"
    # the index form names a CUDA index of the parent's enumeration; under a parent
    # CUDA_VISIBLE_DEVICES the child's indices are physical ones, so use the UUID's index
    import torch

    n = torch.cuda.device_count()
    index = str(n - 1) if n >= 2 and "CUDA_VISIBLE_DEVICES" not in os.environ else "0"
    forms = []
    if full:
        forms += [("full UUID", full), ("abbreviated UUID", full[:12])]
    else:
        check.skip("CUDA_VISIBLE_DEVICES as a UUID", "torch gives no UUID for device 0")
    forms.append(("index", index))
    children = []
    for label, value in forms:
        d = log_dir("steptrace-cvd-")
        children.append(Child(f"CUDA_VISIBLE_DEVICES ({label}) child", SCRIPT, "visible", d, value, label,
                              timeout_s=60, env={"CUDA_VISIBLE_DEVICES": value}))
    for c in children:  # they run together: each only names a GPU, none is timed
        c.finish(check)


def main() -> int:
    dev = cuda_device()
    if dev is None:
        return no_gpu()
    import torch

    check = Checks()
    ident = torch_identity(torch, 0)
    try:
        t0 = time.perf_counter()
        nv = Nvml()
        init_ms = (time.perf_counter() - t0) * 1e3
    except (OSError, RuntimeError, AttributeError) as e:
        check.skip("NVML", f"no usable NVML ({e}): nothing here can run")
        return check.table()
    h, how = nvml_handle_for_cuda(nv, ident)
    links = nv.active_links(h)
    print(f"NVML device of CUDA device 0: {nv.name(h)} {nv.uuid(h)} (found by {how}); active NVLinks {links}")
    check_latencies(check, init_ms, nv, h, links)
    check_nvlink(check, nv, h, links)
    check_visible_devices(check, nv, ident)
    return check.table()


if __name__ == "__main__":
    code = child_main({"visible": child_visible})
    sys.exit(code if code is not None else main())
