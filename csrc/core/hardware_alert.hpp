// The alert for a hardware error the telemetry sampler saw (XID, uncorrectable ECC,
// growing NVLink CRC errors, remapped rows): what it means and what to do about it.
#pragma once

#include <string>

#include "alert.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/ext/telemetry.hpp"

namespace steptrace::detail {

/// The hardware_error alert for `e` on `device` (its name and bus); step and time unset.
AlertEvent hardware_alert(const HardwareError& e, const std::string& device);

}  // namespace steptrace::detail
