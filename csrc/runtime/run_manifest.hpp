// run_start, the first record of a run's log: its identity, every option, and which
// backends it got (and why each missing one is missing).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "run_environment.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/ext/telemetry.hpp"
#include "steptrace/profiler.hpp"

namespace steptrace::detail {

class DeviceTiming;
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
  bool heap = false;  // the C heap is sampled
  DeviceTiming* device = nullptr;
  const std::string* device_unavailable = nullptr;
  const KernelActivitySource* activity = nullptr;
  const std::string* activity_unavailable = nullptr;
  const CounterSampler* sampler = nullptr;
  const std::string* counters_unavailable = nullptr;
  const TelemetrySource* telemetry = nullptr;
  const std::string* telemetry_unavailable = nullptr;
  const PrometheusSink* metrics = nullptr;
  const PeakChoice* peak = nullptr;  // MFU's divisor
  const char* host_clock = nullptr;  // how the host clock is read; null: a given Clock
};

// The run_start line (newline-terminated).
std::string run_start_json(const RunManifest& m);

}  // namespace steptrace::detail
