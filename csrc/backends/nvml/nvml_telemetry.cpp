// NVML telemetry: libnvidia-ml.so.1 loaded at run time (nothing linked, no NVML header:
// the few types and entry points used are declared here, as NVML's ABI defines them;
// checked against nvml.h of nvidia-nvml-dev 12.9.79 and 13.5.37), read on a sampler
// thread of its own.
#include <dlfcn.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "steptrace/backend.hpp"
#include "steptrace/ext/background_thread.hpp"
#include "steptrace/ext/telemetry.hpp"

#include "../host/monotonic_clock.hpp"
#include "nvml_testing.hpp"

namespace steptrace {
namespace detail::nvml {
namespace {

using Return = int;  // nvmlReturn_t
struct Memory {      // nvmlMemory_t
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
using Device = struct DeviceSt*;
using EventSet = struct EventSetSt*;
constexpr Return kSuccess = 0;
constexpr Return kNotSupported = 3;
constexpr Return kTimeout = 10;
constexpr unsigned kTemperatureGpu = 0;                // NVML_TEMPERATURE_GPU
constexpr unsigned kClockSm = 1;                       // NVML_CLOCK_SM
constexpr unsigned kMemoryErrorUncorrected = 1;        // NVML_MEMORY_ERROR_TYPE_UNCORRECTED
constexpr unsigned kVolatileEcc = 0;                   // NVML_VOLATILE_ECC
constexpr unsigned long long kEventXidCritical = 0x8;  // nvmlEventTypeXidCriticalError
constexpr unsigned kClockMem = 2;                      // NVML_CLOCK_MEM
constexpr unsigned kPcieTxBytes = 0;                   // NVML_PCIE_UTIL_TX_BYTES
constexpr unsigned kPcieRxBytes = 1;                   // NVML_PCIE_UTIL_RX_BYTES
constexpr unsigned kFieldMemoryTemp = 82;              // NVML_FI_DEV_MEMORY_TEMP
constexpr unsigned kFieldNvLinkTxKib = 138;            // NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB
constexpr unsigned kFieldNvLinkRxKib = 139;            // NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, KiB
// The NVLink throughput fields' all-links scope: "A scopeId of UINT_MAX returns aggregate
// value summed up across all links" (nvml.h). A link's own scopeId is answered with that
// same all-links figure by the drivers seen so far, so links are never summed as they are.
constexpr unsigned kAllLinksScope = 0xFFFFFFFFu;
// NVML_FI_DEV_POWER_INSTANT, mW: "Current GPU power, supported on all architectures"; scope 0
// is the GPU alone ("1 - Module scope ... (e.g. CPU + GPU)"), nvml.h
constexpr unsigned kFieldPowerInstant = 186;
constexpr unsigned kPowerScopeGpu = 0;
constexpr unsigned kMigEnabled = 1;  // NVML_DEVICE_MIG_ENABLE
// Slow readings (PCIe throughput, which samples for 20 ms per counter; NVLink counters, one
// call per link; ECC, row remapping, memory clock and temperature) are taken at most this
// often; the fast ones (power, energy, temperature, SM clock, utilization, throttle
// reasons, device memory) at every tick. Each slow figure holds until its next reading.
constexpr std::int64_t kSlowPeriodNs = 1'000'000'000;
// NVML_NVLINK_MAX_LINKS: 18 in CUDA 12's nvml.h, 36 in CUDA 13's; links past a device's
// last answer INVALID_ARGUMENT, so probing the larger bound is safe with either driver.
constexpr unsigned kNvLinkMaxLinks = 36;
constexpr unsigned kNvLinkErrorReplay = 0;   // NVML_NVLINK_ERROR_DL_REPLAY
constexpr unsigned kNvLinkErrorCrcFlit = 2;  // NVML_NVLINK_ERROR_DL_CRC_FLIT
constexpr unsigned kFeatureEnabled = 1;      // NVML_FEATURE_ENABLED
// NVLink CRC errors "keep growing" when the sum rises in this many consecutive readings
// at least kNvLinkGrowthGapNs apart (closer readings are skipped): one corrupted flit
// is noise, a link that keeps corrupting is failing.
constexpr int kNvLinkGrowthReadings = 3;
constexpr std::int64_t kNvLinkGrowthGapNs = 1'000'000'000;

struct Utilization {
  unsigned gpu;
  unsigned memory;
};
// nvmlFieldValue_t
struct FieldValue {
  unsigned field_id;
  unsigned scope_id;
  long long timestamp;
  long long latency_usec;
  unsigned value_type;  // nvmlValueType_t
  Return nvml_return;
  union {
    double d;
    unsigned ui;
    unsigned long ul;
    unsigned long long ull;
    long long sll;
    int si;
  } value;
};
// the union member value_type names (NVML_VALUE_TYPE_DOUBLE .. _SIGNED_INT)
double field_number(const FieldValue& f) {
  switch (f.value_type) {
    case 0:
      return f.value.d;
    case 1:
      return f.value.ui;
    case 2:
      return static_cast<double>(f.value.ul);
    case 3:
      return static_cast<double>(f.value.ull);
    case 4:
      return static_cast<double>(f.value.sll);
    case 5:
      return f.value.si;
    default:
      return std::numeric_limits<double>::quiet_NaN();
  }
}
struct EventData {
  Device device;
  unsigned long long event_type;
  unsigned long long event_data;
  unsigned gpu_instance_id;
  unsigned compute_instance_id;
};

struct Api {
  Return (*init)() = nullptr;
  Return (*get_count)(unsigned*) = nullptr;
  Return (*get_handle)(unsigned, Device*) = nullptr;
  Return (*get_handle_by_uuid)(const char*, Device*) = nullptr;
  Return (*get_handle_by_pci)(const char*, Device*) = nullptr;
  Return (*get_uuid)(Device, char*, unsigned) = nullptr;
  Return (*mig_mode)(Device, unsigned*, unsigned*) = nullptr;
  Return (*mig_parent)(Device, Device*) = nullptr;
  Return (*memory_info)(Device, Memory*) = nullptr;
  Return (*get_name)(Device, char*, unsigned) = nullptr;
  Return (*power_usage)(Device, unsigned*) = nullptr;
  Return (*power_limit)(Device, unsigned*) = nullptr;
  Return (*energy)(Device, unsigned long long*) = nullptr;
  Return (*temperature)(Device, unsigned, unsigned*) = nullptr;
  Return (*clock_info)(Device, unsigned, unsigned*) = nullptr;
  Return (*throttle)(Device, unsigned long long*) = nullptr;
  Return (*utilization)(Device, Utilization*) = nullptr;
  Return (*ecc)(Device, unsigned, unsigned, unsigned long long*) = nullptr;
  Return (*event_set_create)(EventSet*) = nullptr;
  Return (*register_events)(Device, unsigned long long, EventSet) = nullptr;
  Return (*event_wait)(EventSet, EventData*, unsigned) = nullptr;
  Return (*pcie_throughput)(Device, unsigned, unsigned*) = nullptr;
  Return (*field_values)(Device, int, FieldValue*) = nullptr;
  Return (*nvlink_state)(Device, unsigned, unsigned*) = nullptr;
  Return (*nvlink_error)(Device, unsigned, unsigned, unsigned long long*) = nullptr;
  Return (*remapped_rows)(Device, unsigned*, unsigned*, unsigned*, unsigned*) = nullptr;
  const char* (*error_string)(Return) = nullptr;

  std::string error(Return r) const {
    const char* s = error_string != nullptr ? error_string(r) : nullptr;
    return s != nullptr ? fmt::format("{} ({})", s, r) : fmt::format("NVML error {}", r);
  }
};

bool load(Api& api, std::string* why) {
  const char* override_path = std::getenv("STEPTRACE_NVML_LIBRARY");
  const std::string path =
      override_path != nullptr && *override_path != '\0' ? override_path : "libnvidia-ml.so.1";
  // Never dlclosed: NVML keeps threads of its own, and the process may use it elsewhere.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    *why = fmt::format("{} could not be loaded (no NVIDIA driver on this machine)", path);
    return false;
  }
  bool ok = true;
  auto resolve = [&](auto& fn, const char* name, bool required = true) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (fn == nullptr && required && ok) {
      *why = fmt::format("{} has no {}", path, name);
      ok = false;
    }
  };
  resolve(api.init, "nvmlInit_v2");
  resolve(api.get_count, "nvmlDeviceGetCount_v2");
  resolve(api.get_handle, "nvmlDeviceGetHandleByIndex_v2");
  resolve(api.get_handle_by_uuid, "nvmlDeviceGetHandleByUUID", false);
  resolve(api.get_name, "nvmlDeviceGetName", false);
  resolve(api.get_handle_by_pci, "nvmlDeviceGetHandleByPciBusId_v2", false);
  resolve(api.get_uuid, "nvmlDeviceGetUUID", false);
  resolve(api.mig_mode, "nvmlDeviceGetMigMode", false);
  resolve(api.mig_parent, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", false);
  resolve(api.memory_info, "nvmlDeviceGetMemoryInfo", false);
  resolve(api.power_usage, "nvmlDeviceGetPowerUsage");
  resolve(api.power_limit, "nvmlDeviceGetEnforcedPowerLimit", false);
  resolve(api.energy, "nvmlDeviceGetTotalEnergyConsumption", false);
  resolve(api.temperature, "nvmlDeviceGetTemperature", false);
  resolve(api.clock_info, "nvmlDeviceGetClockInfo", false);
  // Renamed "clocks event reasons" in CUDA 12.2's NVML; the old name stays as an alias.
  resolve(api.throttle, "nvmlDeviceGetCurrentClocksEventReasons", false);
  if (api.throttle == nullptr) {
    resolve(api.throttle, "nvmlDeviceGetCurrentClocksThrottleReasons", false);
  }
  resolve(api.utilization, "nvmlDeviceGetUtilizationRates", false);
  resolve(api.ecc, "nvmlDeviceGetTotalEccErrors", false);
  resolve(api.event_set_create, "nvmlEventSetCreate", false);
  resolve(api.register_events, "nvmlDeviceRegisterEvents", false);
  resolve(api.event_wait, "nvmlEventSetWait_v2", false);
  resolve(api.pcie_throughput, "nvmlDeviceGetPcieThroughput", false);
  resolve(api.field_values, "nvmlDeviceGetFieldValues", false);
  resolve(api.nvlink_state, "nvmlDeviceGetNvLinkState", false);
  resolve(api.nvlink_error, "nvmlDeviceGetNvLinkErrorCounter", false);
  resolve(api.remapped_rows, "nvmlDeviceGetRemappedRows", false);
  resolve(api.error_string, "nvmlErrorString", false);
  if (!ok) return false;
  if (const Return r = api.init(); r != kSuccess) {
    *why = fmt::format("nvmlInit_v2 failed: {}", api.error(r));
    return false;
  }
  return true;
}

// The power now, W. nvmlDeviceGetPowerUsage returns "on Ampere (except GA100) or newer GPUs
// ... power averaged over 1 sec interval" (NVML reference): read every 100 ms, a 700 -> 200 W
// drop would show as ten falls of 50 W and never as a power_drop. Hence the instantaneous
// field, where the driver has it; nvmlDeviceGetPowerUsage (instantaneous itself on GA100 and
// older) where it answers NOT_SUPPORTED. The field's own outcome is in its nvmlReturn.
Return instant_power_w(const Api& api, Device dev, double* w) {
  if (api.field_values == nullptr) return kNotSupported;
  FieldValue f{};
  f.field_id = kFieldPowerInstant;
  f.scope_id = kPowerScopeGpu;
  f.nvml_return = -1;  // unanswered
  if (const Return r = api.field_values(dev, 1, &f); r != kSuccess) return r;
  if (f.nvml_return != kSuccess) return f.nvml_return;
  const double mw = field_number(f);
  if (!(mw >= 0)) return kNotSupported;  // a value type this build does not know
  *w = mw / 1000.0;
  return kSuccess;
}

// The CUDA driver entry points the device choice needs, through cuGetProcAddress_v2. The
// driver the process already loaded (torch's) is used; else it is loaded, as the CUDA timer
// does. CUDA's numbering is the one the user means (after CUDA_VISIBLE_DEVICES,
// CUDA_DEVICE_ORDER and the container's cgroup filter); NVML's indices are not.
class CudaDriver {
 public:
  CudaDriver() {
    using GetProc = CuResult (*)(const char*, void**, int, std::uint64_t, int*);
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      why_ = "no libcuda.so.1";
      return;
    }
    auto get_proc = reinterpret_cast<GetProc>(dlsym(lib, "cuGetProcAddress_v2"));
    auto resolve = [&](auto& fn, const char* name) {
      void* p = nullptr;
      int status = 0;
      if (get_proc != nullptr && get_proc(name, &p, 12000, 0, &status) == 0) {
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      }
    };
    CuResult (*cu_init)(unsigned) = nullptr;
    resolve(cu_init, "cuInit");
    resolve(device_get_, "cuDeviceGet");
    resolve(bus_id_, "cuDeviceGetPCIBusId");
    resolve(device_count_, "cuDeviceGetCount");
    resolve(ctx_device_, "cuCtxGetDevice");
    if (cu_init == nullptr || device_get_ == nullptr || bus_id_ == nullptr) {
      why_ = "libcuda.so.1 has no cuDeviceGetPCIBusId";
      return;
    }
    if (const CuResult r = cu_init(0); r != 0) {
      why_ = fmt::format("cuInit failed: CUDA error {}", r);
      return;
    }
    ok_ = true;
  }

  // The devices CUDA shows this process; -1 when unknown.
  int visible() const {
    int n = 0;
    return ok_ && device_count_ != nullptr && device_count_(&n) == 0 ? n : -1;
  }
  // The device of the calling thread's current context; -1 without one.
  int current() const {
    int device = -1;
    return ok_ && ctx_device_ != nullptr && ctx_device_(&device) == 0 ? device : -1;
  }
  // The PCI bus id of CUDA device `cuda_index` ("" with `why` when there is none):
  // cuDeviceGetPCIBusId gives "[domain]:[bus]:[device].[function]" in hex, which
  // nvmlDeviceGetHandleByPciBusId_v2 accepts; the bus id is the same to CUDA and NVML.
  std::string pci_bus_id(int cuda_index, std::string* why) const {
    if (!ok_) {
      *why = why_;
      return {};
    }
    int device = 0;
    char id[32] = {};
    CuResult r = device_get_(&device, cuda_index);
    if (r == 0) r = bus_id_(id, sizeof(id), device);
    if (r != 0) {
      *why = fmt::format("cuDeviceGetPCIBusId({}) failed: CUDA error {}", cuda_index, r);
      return {};
    }
    return id;
  }

 private:
  using CuResult = int;
  CuResult (*device_get_)(int*, int) = nullptr;
  CuResult (*bus_id_)(char*, int, int) = nullptr;
  CuResult (*device_count_)(int*) = nullptr;
  CuResult (*ctx_device_)(int*) = nullptr;
  bool ok_ = false;  // loaded and initialized
  std::string why_;  // why not
};

// The entries of $CUDA_VISIBLE_DEVICES; empty when it is unset or empty.
std::vector<std::string> visible_entries() {
  std::vector<std::string> out;
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr || *visible == '\0') return out;
  const std::string list = visible;
  std::size_t pos = 0;
  while (true) {
    const std::size_t comma = list.find(',', pos);
    out.push_back(list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (comma == std::string::npos) return out;
    pos = comma + 1;
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A GPU UUID from CUDA_VISIBLE_DEVICES, whole or abbreviated ("GPU-8932f937": CUDA takes
// any unique prefix, NVML's lookup only the whole UUID): the one NVML device whose UUID
// starts with it. "" on success.
std::string by_uuid_prefix(const Api& api, const std::string& entry, Device* out) {
  if (api.get_handle_by_uuid != nullptr && api.get_handle_by_uuid(entry.c_str(), out) == kSuccess) {
    return {};
  }
  unsigned count = 0;
  if (api.get_uuid == nullptr || api.get_count(&count) != kSuccess) {
    return fmt::format("nvmlDeviceGetHandleByUUID({}) found no device", entry);
  }
  int matches = 0;
  for (unsigned i = 0; i < count; ++i) {
    Device d = nullptr;
    char uuid[96] = {};
    // a device the cgroup hides answers NO_PERMISSION: not ours, skipped
    if (api.get_handle(i, &d) != kSuccess || api.get_uuid(d, uuid, sizeof(uuid)) != kSuccess) {
      continue;
    }
    if (lower(uuid).rfind(lower(entry), 0) == 0) {
      *out = d;
      ++matches;
    }
  }
  if (matches == 1) return {};
  return matches == 0
             ? fmt::format("no NVML device has a UUID starting {}", entry)
             : fmt::format("{} is ambiguous: {} NVML devices' UUIDs start with it", entry, matches);
}

// The NVML device of CUDA device `cuda_index`; `*mig` set when the device is a MIG slice
// (the handle is then its parent board's). "" on success.
std::string nvml_device(const Api& api, const CudaDriver& cuda, int cuda_index, Device* out,
                        std::string* how, bool* mig) {
  // 1. through the PCI bus id, where the CUDA driver is there
  std::string cuda_why;
  const std::string bus =
      api.get_handle_by_pci != nullptr ? cuda.pci_bus_id(cuda_index, &cuda_why) : std::string();
  if (!bus.empty()) {
    if (const Return r = api.get_handle_by_pci(bus.c_str(), out); r != kSuccess) {
      return fmt::format("nvmlDeviceGetHandleByPciBusId_v2({}) failed: {}", bus, api.error(r));
    }
    *how += fmt::format(", PCI {}", bus);
  } else {
    // 2. without the CUDA driver: CUDA_VISIBLE_DEVICES' entry for the device
    const std::vector<std::string> visible = visible_entries();
    std::string entry;
    if (!visible.empty()) {
      if (cuda_index < static_cast<int>(visible.size())) entry = visible[cuda_index];
      if (entry.empty()) {
        return fmt::format("CUDA device {} is not in CUDA_VISIBLE_DEVICES={}", cuda_index,
                           std::getenv("CUDA_VISIBLE_DEVICES"));
      }
    }
    if (entry.rfind("MIG-", 0) == 0) {
      // a MIG device: its handle, then its parent board's
      Device slice = nullptr;
      if (api.get_handle_by_uuid == nullptr || api.mig_parent == nullptr) {
        return fmt::format("{} is a MIG device and this NVML cannot look it up", entry);
      }
      if (const Return r = api.get_handle_by_uuid(entry.c_str(), &slice); r != kSuccess) {
        return fmt::format("nvmlDeviceGetHandleByUUID({}) failed: {}", entry, api.error(r));
      }
      if (const Return r = api.mig_parent(slice, out); r != kSuccess) {
        return fmt::format("nvmlDeviceGetDeviceHandleFromMigDeviceHandle({}) failed: {}", entry,
                           api.error(r));
      }
      *mig = true;
      *how += fmt::format(", {} in CUDA_VISIBLE_DEVICES", entry);
    } else if (entry.rfind("GPU-", 0) == 0) {
      if (std::string why = by_uuid_prefix(api, entry, out); !why.empty()) return why;
      *how += fmt::format(", {} in CUDA_VISIBLE_DEVICES", entry);
    } else {
      // an index: NVML's numbering is taken for CUDA's (PCI order; CUDA's default order
      // is fastest first, which agrees on machines of one GPU model)
      unsigned index = static_cast<unsigned>(cuda_index);
      if (!entry.empty()) {
        char* end = nullptr;
        const long parsed = std::strtol(entry.c_str(), &end, 10);
        if (*end != '\0' || parsed < 0) {
          return fmt::format("CUDA_VISIBLE_DEVICES entry {:?} is neither an index nor a UUID",
                             entry);
        }
        index = static_cast<unsigned>(parsed);
      }
      unsigned count = 0;
      if (const Return r = api.get_count(&count); r != kSuccess) {
        return fmt::format("nvmlDeviceGetCount_v2 failed: {}", api.error(r));
      }
      if (count == 0) return "NVML sees no GPU on this machine";
      if (index >= count)
        return fmt::format("NVML device {} does not exist ({} visible)", index, count);
      if (const Return r = api.get_handle(index, out); r != kSuccess) {
        return fmt::format("nvmlDeviceGetHandleByIndex_v2({}) failed: {}", index, api.error(r));
      }
      *how += fmt::format(", NVML device {} by index ({})", index, cuda_why);
    }
  }
  char uuid[96] = {};
  if (api.get_uuid != nullptr && api.get_uuid(*out, uuid, sizeof(uuid)) == kSuccess) {
    *how += fmt::format(", {}", uuid);
  }
  unsigned current = 0, pending = 0;
  if (api.mig_mode != nullptr && api.mig_mode(*out, &current, &pending) == kSuccess &&
      current == kMigEnabled) {
    *mig = true;
  }
  if (*mig) *how += ", MIG: board-wide figures";
  return {};
}

class NvmlTelemetry final : public TelemetrySource {
 public:
  NvmlTelemetry(const Api& api, Device dev, std::string device, int interval_ms, Clock* clock,
                bool mig, bool instant_power)
      : api_(api),
        dev_(dev),
        device_(std::move(device)),
        interval_ms_(interval_ms),
        clock_(clock),
        mig_(mig),
        instant_power_(instant_power) {
    // device-wide memory, unless the handle is a MIG slice's board (whose memory is every
    // slice's: the step's own is torch's mem_get_info then)
    Memory m{};
    reads_memory_ = !mig_ && api_.memory_info != nullptr && api_.memory_info(dev_, &m) == kSuccess;
    unsigned mw = 0;
    if (api_.power_limit != nullptr && api_.power_limit(dev_, &mw) == kSuccess) {
      power_limit_w_ = mw / 1000.0;
    }
    if (api_.event_set_create != nullptr && api_.register_events != nullptr &&
        api_.event_wait != nullptr && api_.event_set_create(&events_) == kSuccess &&
        api_.register_events(dev_, kEventXidCritical, events_) != kSuccess) {
      events_ = nullptr;  // not supported (a vGPU, a MIG slice): no XID events then
    }
    // the active links, once: NOT_SUPPORTED without NVLink, INVALID_ARGUMENT past the last
    if (api_.nvlink_state != nullptr && api_.nvlink_error != nullptr) {
      for (unsigned link = 0; link < kNvLinkMaxLinks; ++link) {
        unsigned state = 0;
        if (api_.nvlink_state(dev_, link, &state) == kSuccess && state == kFeatureEnabled) {
          nvlinks_.push_back(link);
        }
      }
    }
    // one field-value request for both throughput counters, all links' scope
    if (!nvlinks_.empty()) {
      for (const unsigned field : {kFieldNvLinkTxKib, kFieldNvLinkRxKib}) {
        FieldValue f{};
        f.field_id = field;
        f.scope_id = kAllLinksScope;
        nvlink_fields_.push_back(f);
      }
    }
  }
  ~NvmlTelemetry() override { finish(); }

  const char* name() const noexcept override { return "nvml"; }
  std::int64_t now_ns() noexcept override {
    return clock_ != nullptr ? clock_->now_ns() : monotonic_now_ns();
  }
  double power_limit_w() const noexcept override { return power_limit_w_; }
  std::string device() const override { return device_; }
  void set_error_handler(std::function<void(const HardwareError&)> handler) override {
    on_error_ = std::move(handler);
  }
  void start() override {
    if (interval_ms_ <= 0 || thread_.joinable()) return;
    thread_ = start_background_thread([this] { loop(); });
  }
  void take(std::vector<TelemetrySample>& out) override {
    std::lock_guard<std::mutex> lock(mu_);
    out.insert(out.end(), pending_.begin(), pending_.end());
    pending_.clear();
  }
  void finish() noexcept override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
      // a closing reading: the last steps' periods end after them
      sample();
    }
  }
  std::string status() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  std::vector<std::string> board_wide() const override {
    if (!mig_) return {};
    // a MIG slice shares its board's power supply, sensors, clocks and links
    return {"power_w",        "energy_j",       "temp_c",          "sm_clock_mhz",
            "mem_clock_mhz",  "max_mem_temp_c", "pcie_tx_mb_s",    "pcie_rx_mb_s",
            "nvlink_tx_mb_s", "nvlink_rx_mb_s", "throttle_reasons"};
  }
  bool device_memory(std::int64_t* used, std::int64_t* total) const noexcept override {
    if (!reads_memory_) return false;
    *used = mem_used_.load(std::memory_order_relaxed);
    *total = mem_total_.load(std::memory_order_relaxed);
    return true;
  }

  // One reading of every figure; the hardware-error checks too. Sampler thread (or the
  // test's, with interval_ms = 0).
  bool sample() {
    TelemetrySample s;
    constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
    unsigned v = 0;
    Return pr = kNotSupported;
    if (instant_power_) {
      pr = instant_power_w(api_, dev_, &s.power_w);
      // a field the driver stopped knowing: GetPowerUsage from now on; another failure:
      // GetPowerUsage for this reading
      if (pr == kNotSupported) instant_power_ = false;
    }
    if (pr != kSuccess) {
      pr = api_.power_usage(dev_, &v);
      if (pr != kSuccess) {
        std::lock_guard<std::mutex> lock(mu_);
        if (status_.empty()) status_ = "nvmlDeviceGetPowerUsage failed: " + api_.error(pr);
        return false;
      }
      s.power_w = v / 1000.0;
    }
    unsigned long long mj = 0;
    s.energy_j = api_.energy != nullptr && api_.energy(dev_, &mj) == kSuccess
                     ? static_cast<double>(mj) / 1000.0
                     : kNaN;
    // the reading's time: power and energy's, taken right after them (the other fast
    // figures follow within microseconds; the slow ones come after, held until read again)
    s.t_ns = now_ns();
    s.temp_c =
        api_.temperature != nullptr && api_.temperature(dev_, kTemperatureGpu, &v) == kSuccess
            ? v
            : kNaN;
    s.sm_clock_mhz =
        api_.clock_info != nullptr && api_.clock_info(dev_, kClockSm, &v) == kSuccess ? v : kNaN;
    Utilization u{};
    s.util_pct =
        api_.utilization != nullptr && api_.utilization(dev_, &u) == kSuccess ? u.gpu : kNaN;
    unsigned long long reasons = 0;
    if (api_.throttle != nullptr && api_.throttle(dev_, &reasons) == kSuccess) {
      s.throttle_reasons = reasons;
    }
    if (reads_memory_) {
      Memory m{};
      if (api_.memory_info(dev_, &m) == kSuccess) {
        mem_total_.store(static_cast<std::int64_t>(m.total), std::memory_order_relaxed);
        mem_used_.store(static_cast<std::int64_t>(m.total - m.free), std::memory_order_relaxed);
      }
    }
    if (slow_t_ns_ == INT64_MIN || s.t_ns - slow_t_ns_ >= kSlowPeriodNs) {
      TelemetrySample& slow = slow_;
      slow = TelemetrySample{};
      slow.t_ns = s.t_ns;
      read_nvlink_throughput(slow);  // first: its rate is over the time between readings
      read_optional(slow);
      slow_t_ns_ = s.t_ns;
      check_errors(slow, true);
    } else {
      check_errors(s, false);  // the XID events only
    }
    hold_slow(s);
    std::lock_guard<std::mutex> lock(mu_);
    // Bounded: a writer that stopped taking must not grow this without end.
    if (pending_.size() < kMaxPending) pending_.push_back(s);
    return true;
  }

 private:
  // The readings a device may lack (NaN / -1 then); each stops being asked for once NVML
  // says the device does not support it.
  void read_optional(TelemetrySample& s) {
    unsigned v = 0;
    auto pcie = [&](unsigned counter, double* out) {
      if (api_.pcie_throughput == nullptr || pcie_unsupported_) return;
      const Return r = api_.pcie_throughput(dev_, counter, &v);
      if (r == kSuccess) *out = v / 1000.0;  // KB/s
      pcie_unsupported_ = r == kNotSupported;
    };
    pcie(kPcieTxBytes, &s.pcie_tx_mb_s);
    pcie(kPcieRxBytes, &s.pcie_rx_mb_s);
    if (api_.clock_info != nullptr && api_.clock_info(dev_, kClockMem, &v) == kSuccess) {
      s.mem_clock_mhz = v;
    }
    if (api_.field_values != nullptr && !mem_temp_unsupported_) {
      FieldValue f{};
      f.field_id = kFieldMemoryTemp;
      const Return r = api_.field_values(dev_, 1, &f);
      if (r == kSuccess && f.nvml_return == kSuccess) s.mem_temp_c = field_number(f);
      mem_temp_unsupported_ = r == kNotSupported || f.nvml_return == kNotSupported;
    }
    if (!nvlinks_.empty()) {
      // summed over the links that answered; none answering leaves the count unknown (-1),
      // not a 0 that a later answer would read as a rise
      auto link_errors = [&](unsigned counter, std::int64_t* out) {
        for (const unsigned link : nvlinks_) {
          unsigned long long n = 0;
          if (api_.nvlink_error(dev_, link, counter, &n) != kSuccess) continue;
          *out = std::max<std::int64_t>(*out, 0) + static_cast<std::int64_t>(n);
        }
      };
      link_errors(kNvLinkErrorCrcFlit, &s.nvlink_crc_errors);
      link_errors(kNvLinkErrorReplay, &s.nvlink_replay_errors);
    }
    if (api_.remapped_rows != nullptr && !remap_unsupported_) {
      unsigned corrected = 0, uncorrected = 0, pending = 0, failure = 0;
      const Return r = api_.remapped_rows(dev_, &corrected, &uncorrected, &pending, &failure);
      if (r == kSuccess) {
        s.remap_corrected = corrected;
        s.remap_uncorrected = uncorrected;
        s.remap_pending = pending;
        s.remap_failure = failure;
      }
      remap_unsupported_ = r == kNotSupported;
    }
  }

  // NVLink data throughput: the growth of the links' KiB counters since the reading
  // before, over the time between them (NaN on the first reading and after a counter
  // went back, a driver reload). Stops being asked for once NVML says not supported.
  void read_nvlink_throughput(TelemetrySample& s) {
    if (nvlink_fields_.empty() || api_.field_values == nullptr || nvlink_rate_unsupported_) {
      return;
    }
    for (FieldValue& f : nvlink_fields_) f.nvml_return = -1;
    const Return r =
        api_.field_values(dev_, static_cast<int>(nvlink_fields_.size()), nvlink_fields_.data());
    double kib[2] = {0, 0};  // tx, rx
    double first[2] = {-1, -1};
    bool same[2] = {true, true};
    for (const FieldValue& f : nvlink_fields_) {
      if (r != kSuccess || f.nvml_return != kSuccess) {
        if (!per_link_ && r == kSuccess) {
          // a driver without the all-links scope: each link's own, from the next reading
          per_link_ = true;
          nvlink_fields_.clear();
          for (const unsigned link : nvlinks_) {
            for (const unsigned field : {kFieldNvLinkTxKib, kFieldNvLinkRxKib}) {
              FieldValue g{};
              g.field_id = field;
              g.scope_id = link;
              nvlink_fields_.push_back(g);
            }
          }
        } else {
          nvlink_rate_unsupported_ = r == kNotSupported || f.nvml_return == kNotSupported;
        }
        nvlink_kib_t_ns_ = INT64_MIN;  // no rate across a failed reading
        return;
      }
      const int i = f.field_id == kFieldNvLinkTxKib ? 0 : 1;
      const double v = field_number(f);
      if (first[i] < 0) first[i] = v;
      same[i] = same[i] && v == first[i];
      kib[i] += v;
    }
    for (int i = 0; i < 2; ++i) {
      // per link, every link answering the same count is the all-links total on each
      if (per_link_ && same[i] && nvlinks_.size() > 1) kib[i] = first[i];
    }
    if (nvlink_kib_t_ns_ != INT64_MIN && s.t_ns > nvlink_kib_t_ns_ && kib[0] >= nvlink_kib_[0] &&
        kib[1] >= nvlink_kib_[1]) {
      const double mb_per_kib_s =
          1024.0 / 1e6 / (static_cast<double>(s.t_ns - nvlink_kib_t_ns_) / 1e9);
      s.nvlink_tx_mb_s = (kib[0] - nvlink_kib_[0]) * mb_per_kib_s;
      s.nvlink_rx_mb_s = (kib[1] - nvlink_kib_[1]) * mb_per_kib_s;
    }
    nvlink_kib_[0] = kib[0];
    nvlink_kib_[1] = kib[1];
    nvlink_kib_t_ns_ = s.t_ns;
  }

  void check_nvlink(const TelemetrySample& s) {
    if (s.nvlink_crc_errors < 0) return;
    if (nvlink_t_ns_ != INT64_MIN && s.t_ns - nvlink_t_ns_ < kNvLinkGrowthGapNs) return;
    if (nvlink_t_ns_ != INT64_MIN && s.nvlink_crc_errors > nvlink_crc_) {
      if (++nvlink_rises_ == kNvLinkGrowthReadings) {
        report({s.t_ns, "nvlink_crc", static_cast<std::uint64_t>(s.nvlink_crc_errors),
                static_cast<std::uint64_t>(s.nvlink_crc_errors - nvlink_crc_base_)});
      }
    } else {
      nvlink_rises_ = 0;  // one alert per growth episode
      nvlink_crc_base_ = s.nvlink_crc_errors;
    }
    nvlink_t_ns_ = s.t_ns;
    nvlink_crc_ = s.nvlink_crc_errors;
  }

  void check_remap(const TelemetrySample& s) {
    if (s.remap_uncorrected < 0) return;
    if (remap_uncorrected_ >= 0 && (s.remap_uncorrected > remap_uncorrected_ ||
                                    (s.remap_failure != 0 && remap_failure_ == 0))) {
      report({s.t_ns, "remapped_rows", static_cast<std::uint64_t>(s.remap_uncorrected),
              static_cast<std::uint64_t>(
                  std::max<std::int64_t>(s.remap_uncorrected - remap_uncorrected_, 0))});
    }
    remap_uncorrected_ = s.remap_uncorrected;
    remap_failure_ = s.remap_failure;
  }

  // The slow figures of the last slow reading, into a fast one.
  void hold_slow(TelemetrySample& s) const {
    s.pcie_tx_mb_s = slow_.pcie_tx_mb_s;
    s.pcie_rx_mb_s = slow_.pcie_rx_mb_s;
    s.nvlink_tx_mb_s = slow_.nvlink_tx_mb_s;
    s.nvlink_rx_mb_s = slow_.nvlink_rx_mb_s;
    s.mem_clock_mhz = slow_.mem_clock_mhz;
    s.mem_temp_c = slow_.mem_temp_c;
    s.nvlink_crc_errors = slow_.nvlink_crc_errors;
    s.nvlink_replay_errors = slow_.nvlink_replay_errors;
    s.remap_corrected = slow_.remap_corrected;
    s.remap_uncorrected = slow_.remap_uncorrected;
    s.remap_pending = slow_.remap_pending;
    s.remap_failure = slow_.remap_failure;
  }

  // XID events at every reading; the counters (NVLink CRC, row remapping, ECC) with the
  // slow ones.
  void check_errors(const TelemetrySample& s, bool counters) {
    const std::int64_t t_ns = s.t_ns;
    if (counters) {
      check_nvlink(s);
      check_remap(s);
    }
    if (events_ != nullptr) {
      EventData data{};
      // timeout 0: only what is pending; the sampler's own wait paces the loop
      while (api_.event_wait(events_, &data, 0) == kSuccess) {
        if ((data.event_type & kEventXidCritical) != 0) {
          report({t_ns, "xid", data.event_data, 1});
        }
      }
    }
    unsigned long long count = 0;
    if (counters && api_.ecc != nullptr && !ecc_unsupported_) {
      const Return r = api_.ecc(dev_, kMemoryErrorUncorrected, kVolatileEcc, &count);
      if (r == kNotSupported) {
        ecc_unsupported_ = true;
      } else if (r == kSuccess) {
        if (ecc_seen_ && count > ecc_count_)
          report({t_ns, "ecc_uncorrected", count, count - ecc_count_});
        ecc_count_ = count;
        ecc_seen_ = true;
      }
    }
  }
  void report(const HardwareError& e) {
    if (on_error_) on_error_(e);
  }
  // Readings on a fixed schedule (start + k x interval): a slow reading delays the next
  // one, not every one after it; ticks missed altogether are skipped, not made up.
  void loop() {
    const auto period = std::chrono::milliseconds(interval_ms_);
    auto next = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      sample();
      next += period;
      const auto now = std::chrono::steady_clock::now();
      if (next < now) next += (now - next) / period * period + period;
      lock.lock();
      wake_.wait_until(lock, next, [this] { return stop_; });
    }
  }

  static constexpr std::size_t kMaxPending = 1 << 16;
  Api api_;
  Device dev_;
  std::string device_;
  const int interval_ms_;
  Clock* clock_;
  const bool mig_;      // the device is a MIG slice; dev_ its board
  bool instant_power_;  // power from NVML_FI_DEV_POWER_INSTANT, else nvmlDeviceGetPowerUsage
  bool reads_memory_ = false;
  std::atomic<std::int64_t> mem_used_{-1};  // the latest reading's device memory
  std::atomic<std::int64_t> mem_total_{-1};
  TelemetrySample slow_;                // the latest slow reading
  std::int64_t slow_t_ns_ = INT64_MIN;  // and its time; INT64_MIN: none yet
  double power_limit_w_ = 0;
  EventSet events_ = nullptr;
  bool ecc_unsupported_ = false;
  bool ecc_seen_ = false;
  unsigned long long ecc_count_ = 0;
  bool pcie_unsupported_ = false;
  bool mem_temp_unsupported_ = false;
  bool remap_unsupported_ = false;
  std::vector<unsigned> nvlinks_;          // the links active at creation
  std::vector<FieldValue> nvlink_fields_;  // their TX and RX throughput counters
  bool nvlink_rate_unsupported_ = false;
  bool per_link_ = false;          // the driver lacks the all-links scope: links' own counters
  double nvlink_kib_[2] = {0, 0};  // the last reading's sums: tx, rx
  std::int64_t nvlink_kib_t_ns_ = INT64_MIN;  // and its time; INT64_MIN: none
  std::int64_t nvlink_t_ns_ = INT64_MIN;      // the last reading compared, and its CRC sum
  std::int64_t nvlink_crc_ = 0;
  std::int64_t nvlink_crc_base_ = 0;  // the sum before the current run of rises
  int nvlink_rises_ = 0;
  std::int64_t remap_uncorrected_ = -1;
  std::int64_t remap_failure_ = 0;
  std::function<void(const HardwareError&)> on_error_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::vector<TelemetrySample> pending_;  // guarded by mu_
  std::string status_;                    // guarded by mu_
  bool stop_ = false;                     // guarded by mu_
  std::thread thread_;
};

// The rank's CUDA device when none is configured, by the rule the counters (CUPTI's
// choose_device) and the Python step hooks follow: $LOCAL_RANK (torchrun) when it is among
// the visible devices, else the current CUDA context's device, else 0. With one GPU per rank
// (CUDA_VISIBLE_DEVICES naming one), every rank but local rank 0 would otherwise ask for a
// device it cannot see.
int rank_device(const CudaDriver& cuda, std::string* how) {
  int rank = -1;
  if (const char* local = std::getenv("LOCAL_RANK"); local != nullptr && *local != '\0') {
    char* end = nullptr;
    const long v = std::strtol(local, &end, 10);
    if (*end == '\0' && v >= 0 && v < 4096) rank = static_cast<int>(v);
  }
  // without the driver, CUDA_VISIBLE_DEVICES' entries are the devices CUDA would show
  int visible = cuda.visible();
  if (visible < 0 && !visible_entries().empty()) {
    visible = static_cast<int>(visible_entries().size());
  }
  std::string note;
  if (rank >= 0) {
    if (visible < 0 || rank < visible) {
      *how = fmt::format("LOCAL_RANK={}", rank);
      return rank;
    }
    note = fmt::format("LOCAL_RANK={} is not among the {} visible devices; ", rank, visible);
  }
  if (const int current = cuda.current(); current >= 0) {
    *how = note + "the current CUDA context's";
    return current;
  }
  *how = note + (rank >= 0 ? "no current CUDA context: the first device" : "default");
  return 0;
}

}  // namespace
}  // namespace detail::nvml

std::unique_ptr<TelemetrySource> make_nvml_telemetry(int device_index, int interval_ms,
                                                     std::string* why_not, Clock* clock) {
  using namespace detail::nvml;
  std::string why;
  Api api;
  if (!load(api, &why)) {
    if (why_not != nullptr) *why_not = why;
    return nullptr;
  }
  const CudaDriver cuda;
  std::string how = "device_index";
  const int cuda_index = device_index >= 0 ? device_index : rank_device(cuda, &how);
  Device dev = nullptr;
  std::string detail = fmt::format("device {} ({}", cuda_index, how);
  bool mig = false;
  why = nvml_device(api, cuda, cuda_index, &dev, &detail, &mig);
  if (!why.empty()) {
    if (why_not != nullptr) *why_not = why;
    return nullptr;
  }
  char name[96] = {};
  if (api.get_name != nullptr && api.get_name(dev, name, sizeof(name)) == kSuccess) {
    detail += fmt::format(", {}", name);
  }
  double w = 0;
  const bool instant = instant_power_w(api, dev, &w) == kSuccess;
  if (!instant) {
    unsigned mw = 0;
    if (const Return r = api.power_usage(dev, &mw); r != kSuccess) {
      if (why_not != nullptr) *why_not = "nvmlDeviceGetPowerUsage failed: " + api.error(r);
      return nullptr;
    }
  }
  detail += instant
                ? ", power: instantaneous (NVML_FI_DEV_POWER_INSTANT))"
                : ", power: nvmlDeviceGetPowerUsage (a 1 s mean on Ampere and newer but GA100))";
  return std::make_unique<NvmlTelemetry>(api, dev, detail, interval_ms, clock, mig, instant);
}

bool sample_nvml_now(TelemetrySource& source) {
  auto* nvml = dynamic_cast<detail::nvml::NvmlTelemetry*>(&source);
  return nvml != nullptr && nvml->sample();
}

}  // namespace steptrace
