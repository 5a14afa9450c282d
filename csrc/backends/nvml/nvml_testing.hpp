// A test hook of the NVML backend, not part of the public API: the C++ tests read a sample
// at the moment they choose (deterministic, no sampler thread).
#pragma once

#include "steptrace/export.hpp"
#include "steptrace/ext/telemetry.hpp"

namespace steptrace {

/// Reads one sample now on the calling thread (a source from make_nvml_telemetry with
/// interval_ms = 0); false when `source` is not one, or the read failed.
STEPTRACE_API bool sample_nvml_now(TelemetrySource& source);

}  // namespace steptrace
