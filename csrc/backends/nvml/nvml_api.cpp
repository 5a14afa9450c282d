#include "nvml_api.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <limits>
#include <type_traits>

namespace steptrace::detail::nvml {

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

}  // namespace steptrace::detail::nvml
