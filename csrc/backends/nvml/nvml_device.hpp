// Which NVML device the rank's CUDA device is: CUDA's numbering is the one the user means
// (after CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER and the container's cgroup filter);
// NVML's indices are not, so the device is matched by PCI bus id (UUID where CUDA is not
// loaded), and a MIG instance is read board-wide.
#pragma once

#include <string>

#include "nvml_api.hpp"

namespace steptrace::detail::nvml {

// The NVML device of CUDA device `device_index`, or (< 0) of the rank's by rank_device's
// rule; `*detail` says which and how it was found (an open parenthesis: the caller adds to
// it), `*mig` whether figures are board-wide. Returns why not; empty: found.
std::string choose_device(const Api& api, int device_index, Device* out, std::string* detail,
                          bool* mig);

}  // namespace steptrace::detail::nvml
