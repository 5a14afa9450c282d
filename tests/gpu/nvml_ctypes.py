"""NVML through ctypes for the device checks (pynvml is not a dependency): the few calls
they time or use to identify a GPU. libnvidia-ml.so.1, or $STEPTRACE_NVML_LIBRARY (the
path steptrace's own backend honours: the stand-in library of tests/cpp/fake_nvml).

Layouts and constants from nvml.h (CUDA 12/13):
- nvmlFieldValue_t {unsigned fieldId; unsigned scopeId; long long timestamp;
  long long latencyUsec; nvmlValueType_t valueType; nvmlReturn_t nvmlReturn;
  nvmlValue_t value (an 8-byte union)};
- NVML_FI_DEV_NVLINK_LINK_COUNT 91, NVML_FI_DEV_MEMORY_TEMP 82,
  NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX 138 / 139 (KiB): "Link ID needs to be
  specified in the scopeId field in nvmlFieldValue_t. A scopeId of UINT_MAX returns
  aggregate value summed up across all links";
- NVML_PCIE_UTIL_TX_BYTES 0 / _RX_BYTES 1; NVML_CLOCK_SM 1 / _MEM 2; NVML_TEMPERATURE_GPU 0.
"""

from __future__ import annotations

import ctypes
import os
import time

SUCCESS = 0
NOT_SUPPORTED = 3
UINT_MAX = 0xFFFFFFFF
FI_MEMORY_TEMP = 82
FI_NVLINK_LINK_COUNT = 91
FI_NVLINK_DATA_TX = 138
FI_NVLINK_DATA_RX = 139
NVLINK_MAX_LINKS = 36  # 18 in CUDA 12's nvml.h, 36 in CUDA 13's; links past the last answer an error


class Value(ctypes.Union):
    _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint), ("ulVal", ctypes.c_ulong),
                ("ullVal", ctypes.c_ulonglong), ("sllVal", ctypes.c_longlong), ("siVal", ctypes.c_int),
                ("usVal", ctypes.c_ushort)]


class FieldValue(ctypes.Structure):
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latencyUsec", ctypes.c_longlong), ("valueType", ctypes.c_int), ("nvmlReturn", ctypes.c_int),
                ("value", Value)]

    def number(self) -> float:
        t = self.valueType
        return {0: self.value.dVal, 1: self.value.uiVal, 2: self.value.ulVal, 3: self.value.ullVal,
                4: self.value.sllVal, 5: self.value.siVal, 6: self.value.usVal}.get(t, float("nan"))


class Nvml:
    """A loaded and initialized NVML; raises OSError / RuntimeError when there is none."""

    def __init__(self) -> None:
        path = os.environ.get("STEPTRACE_NVML_LIBRARY") or "libnvidia-ml.so.1"
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.nvmlErrorString.restype = ctypes.c_char_p
        r = self.lib.nvmlInit_v2()
        if r != SUCCESS:
            raise RuntimeError(f"nvmlInit_v2 failed: {self.error(r)}")

    def error(self, r: int) -> str:
        try:
            return f"{self.lib.nvmlErrorString(r).decode()} ({r})"
        except Exception:  # noqa: BLE001
            return f"NVML error {r}"

    def has(self, name: str) -> bool:
        return hasattr(self.lib, name)

    def count(self) -> int:
        n = ctypes.c_uint(0)
        r = self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n))
        if r != SUCCESS:
            raise RuntimeError(f"nvmlDeviceGetCount_v2 failed: {self.error(r)}")
        return n.value

    def handle(self, index: int) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        r = self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(h))
        if r != SUCCESS:
            raise RuntimeError(f"nvmlDeviceGetHandleByIndex_v2({index}) failed: {self.error(r)}")
        return h

    def handle_by_pci(self, bus_id: str) -> "ctypes.c_void_p | None":
        if not self.has("nvmlDeviceGetHandleByPciBusId_v2"):
            return None
        h = ctypes.c_void_p()
        r = self.lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), ctypes.byref(h))
        return h if r == SUCCESS else None

    def handle_by_uuid(self, uuid: str) -> "ctypes.c_void_p | None":
        h = ctypes.c_void_p()
        r = self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(h))
        return h if r == SUCCESS else None

    def uuid(self, h) -> str:
        buf = ctypes.create_string_buffer(96)
        r = self.lib.nvmlDeviceGetUUID(h, buf, ctypes.c_uint(96))
        return buf.value.decode() if r == SUCCESS else ""

    def pci_bus_id(self, h) -> str:
        """The bus id in nvmlPciInfo_t's busId (the v3 struct: busIdLegacy[16], domain, bus,
        device, pciDeviceId, pciSubSystemId, busId[32]), or "" when NVML has no answer."""
        class PciInfo(ctypes.Structure):
            _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                        ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint),
                        ("pciSubSystemId", ctypes.c_uint), ("busId", ctypes.c_char * 32)]
        for name in ("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2"):
            if self.has(name):
                info = PciInfo()
                if getattr(self.lib, name)(h, ctypes.byref(info)) == SUCCESS:
                    return f"{info.domain:08x}:{info.bus:02x}:{info.device:02x}.0"
        return ""

    def name(self, h) -> str:
        buf = ctypes.create_string_buffer(96)
        return buf.value.decode() if self.lib.nvmlDeviceGetName(h, buf, ctypes.c_uint(96)) == SUCCESS else ""

    def fields(self, h, wanted: "list[tuple[int, int]]") -> "tuple[int, list[FieldValue]]":
        """nvmlDeviceGetFieldValues for (fieldId, scopeId) pairs: (the call's return, values)."""
        arr = (FieldValue * len(wanted))()
        for i, (fid, scope) in enumerate(wanted):
            arr[i].fieldId, arr[i].scopeId, arr[i].nvmlReturn = fid, scope, -1
        r = self.lib.nvmlDeviceGetFieldValues(h, ctypes.c_int(len(wanted)), arr)
        return r, list(arr)

    def active_links(self, h) -> "list[int]":
        if not self.has("nvmlDeviceGetNvLinkState"):
            return []
        links = []
        for link in range(NVLINK_MAX_LINKS):
            state = ctypes.c_uint(0)
            if self.lib.nvmlDeviceGetNvLinkState(h, ctypes.c_uint(link), ctypes.byref(state)) == SUCCESS \
                    and state.value == 1:
                links.append(link)
        return links

    def timed_calls(self, h, links: "list[int]") -> "list[tuple[str, object]]":
        """The calls steptrace's sampler makes in one reading (csrc/backends/nvml), each a
        (label, zero-argument callable returning the nvmlReturn) to time."""
        u, ull, util = ctypes.c_uint(), ctypes.c_ulonglong(), (ctypes.c_uint * 8)()
        lib = self.lib
        calls = [
            ("nvmlDeviceGetPowerUsage", lambda: lib.nvmlDeviceGetPowerUsage(h, ctypes.byref(u))),
            ("nvmlDeviceGetTotalEnergyConsumption",
             lambda: lib.nvmlDeviceGetTotalEnergyConsumption(h, ctypes.byref(ull))),
            ("nvmlDeviceGetTemperature(GPU)", lambda: lib.nvmlDeviceGetTemperature(h, 0, ctypes.byref(u))),
            ("nvmlDeviceGetClockInfo(SM)", lambda: lib.nvmlDeviceGetClockInfo(h, 1, ctypes.byref(u))),
            ("nvmlDeviceGetClockInfo(MEM)", lambda: lib.nvmlDeviceGetClockInfo(h, 2, ctypes.byref(u))),
            ("nvmlDeviceGetUtilizationRates", lambda: lib.nvmlDeviceGetUtilizationRates(h, util)),
        ]
        reasons = "nvmlDeviceGetCurrentClocksEventReasons"
        if not self.has(reasons):
            reasons = "nvmlDeviceGetCurrentClocksThrottleReasons"
        calls.append((reasons, lambda: getattr(lib, reasons)(h, ctypes.byref(ull))))
        calls.append(("nvmlDeviceGetPcieThroughput(TX)", lambda: lib.nvmlDeviceGetPcieThroughput(h, 0, ctypes.byref(u))))
        calls.append(("nvmlDeviceGetPcieThroughput(RX)", lambda: lib.nvmlDeviceGetPcieThroughput(h, 1, ctypes.byref(u))))
        calls.append(("nvmlDeviceGetFieldValues(MEMORY_TEMP)",
                      lambda: self.fields(h, [(FI_MEMORY_TEMP, 0)])[0]))
        if links:
            pairs = [(f, link) for link in links for f in (FI_NVLINK_DATA_TX, FI_NVLINK_DATA_RX)]
            calls.append((f"nvmlDeviceGetFieldValues(NVLINK TX/RX x{len(links)} links)",
                          lambda: self.fields(h, pairs)[0]))
            c = ctypes.c_ulonglong()
            calls.append((f"nvmlDeviceGetNvLinkErrorCounter x{2 * len(links)}",
                          lambda: max(lib.nvmlDeviceGetNvLinkErrorCounter(h, link, k, ctypes.byref(c))
                                      for link in links for k in (0, 2))))
        if self.has("nvmlDeviceGetRemappedRows"):
            a, b, c2, d = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
            calls.append(("nvmlDeviceGetRemappedRows", lambda: lib.nvmlDeviceGetRemappedRows(
                h, ctypes.byref(a), ctypes.byref(b), ctypes.byref(c2), ctypes.byref(d))))
        if self.has("nvmlDeviceGetTotalEccErrors"):
            calls.append(("nvmlDeviceGetTotalEccErrors",
                          lambda: lib.nvmlDeviceGetTotalEccErrors(h, 1, 0, ctypes.byref(ull))))
        return calls


def time_call(fn, reps: int) -> "tuple[list[float], int]":
    """Wall time of each of reps calls, ms, and the last return code."""
    times, r = [], -1
    for _ in range(reps):
        t0 = time.perf_counter()
        r = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times, r


def norm_uuid(u: str) -> str:
    """A GPU UUID as bare lowercase hex ("GPU-8932f937-5b4c-..." and torch's "8932f937-..."
    alike)."""
    u = str(u).strip().lower()
    if u.startswith("gpu-"):
        u = u[4:]
    return "".join(c for c in u if c in "0123456789abcdef")


def torch_identity(torch, index: int = 0) -> dict:
    """The CUDA device's UUID and PCI bus id as torch reports them."""
    p = torch.cuda.get_device_properties(index)
    uuid = str(getattr(p, "uuid", ""))
    bus = ""
    if hasattr(p, "pci_bus_id"):
        bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    return {"uuid": uuid, "uuid_hex": norm_uuid(uuid), "pci_bus_id": bus, "name": p.name}
