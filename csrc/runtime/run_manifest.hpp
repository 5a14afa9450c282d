// run_start, the first record of a run's log: its identity, every option, and which
// backends it got (and why each missing one is missing).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend_setup.hpp"
#include "run_environment.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/ext/telemetry.hpp"
#include "steptrace/profiler.hpp"

namespace steptrace::detail {

class PrometheusSink;
struct PeakChoice;

// What run_start is made of; a null backend is one the run does not have.
struct RunManifest {
  const Config* config = nullptr;
  const RunInfo* info = nullptr;
  std::int64_t start_unix_ns = 0;
  std::int64_t process_start_unix_ns = 0;  // 0: unknown
  const JobIdentity* job = nullptr;
  const LogFile* log = nullptr;  // the attempt
  const std::vector<std::unique_ptr<MemorySource>>* memory_sources = nullptr;
  bool heap = false;                     // the C heap is sampled
  const DeviceParts* devices = nullptr;  // the device side and why each part is missing
  const PrometheusSink* metrics = nullptr;
  const PeakChoice* peak = nullptr;  // MFU's divisor
  const char* host_clock = nullptr;  // how the host clock is read; null: a given Clock
};

// How the host clock is read, as run_start says it; `counter`: from the CPU's counter.
const char* host_clock_method(bool counter) noexcept;

// The run_start line (newline-terminated).
std::string run_start_json(const RunManifest& m);

}  // namespace steptrace::detail
