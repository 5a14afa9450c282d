#include "hardware_alert.hpp"

#include <fmt/format.h>
#include "steptrace/ext/telemetry.hpp"

namespace steptrace::detail {

AlertEvent hardware_alert(const HardwareError& e, const std::string& device) {
  AlertEvent a;
  a.type = "hardware_error";
  a.value = static_cast<double>(e.code);
  a.threshold = 0;
  if (e.kind == "xid") {
    a.message = fmt::format(
        "GPU reported XID {} ({}): look it up in NVIDIA's XID catalog; the job may need "
        "this GPU drained",
        e.code, device);
  } else if (e.kind == "nvlink_crc") {
    a.message = fmt::format(
        "NVLink CRC errors keep growing (+{} to {} over the active links, {}): a failing "
        "link or cable slows collectives and may drop; drain this GPU's node",
        e.delta, e.code, device);
  } else if (e.kind == "remapped_rows") {
    a.message = fmt::format(
        "GPU memory rows remapped after uncorrectable errors (+{} to {}, or a remap "
        "failed; {}): reset the GPU, replace it if remapping failed",
        e.delta, e.code, device);
  } else {
    a.message = fmt::format(
        "GPU uncorrectable ECC errors rose by {} to {} ({}): the data on this GPU may be "
        "corrupt; drain it and reset",
        e.delta, e.code, device);
  }
  a.details = {{"kind", e.kind}, {"code", e.code}};
  if (e.kind != "xid") a.details["delta"] = e.delta;
  if (e.kind == "nvlink_crc" || e.kind == "remapped_rows") {
    a.details["source"] = e.kind;
    a.details["count"] = e.code;
  }
  return a;
}

}  // namespace steptrace::detail
