// NVML's call layer: libnvidia-ml.so.1 loaded at run time (nothing linked, no NVML header:
// the few types and entry points used are declared here, as NVML's ABI defines them;
// checked against nvml.h of nvidia-nvml-dev 12.9.79 and 13.5.37).
#pragma once

#include <cstdint>
#include <string>

#include <fmt/format.h>

namespace steptrace::detail::nvml {

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
// the union member value_type names (NVML_VALUE_TYPE_DOUBLE .. _SIGNED_INT); NaN: unknown
double field_number(const FieldValue& f);
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

// Loads libnvidia-ml.so.1 ($STEPTRACE_NVML_LIBRARY overrides the path), resolves the entry
// points and initializes NVML; false with why otherwise.
bool load(Api& api, std::string* why);

// The power now, W (the instantaneous field where the driver has it); NVML's outcome.
Return instant_power_w(const Api& api, Device dev, double* w);

}  // namespace steptrace::detail::nvml
