// Which backends a run gets: the ones given in Backends as they are, else the defaults
// where the machine has them, and for each missing one the reason run_start gives.
#pragma once

#include <memory>
#include <string>

#include "../core/device_timing.hpp"
#include "../sinks/prometheus_sink.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/ext/telemetry.hpp"
#include "steptrace/profiler.hpp"
#include "watchdog.hpp"

namespace steptrace::detail {

class DetectionStage;
class PhaseNames;

// CUDA event timing unless clock="host"; null (why in why_not) where it is unavailable,
// ConfigError where clock="cuda" asks for it.
std::unique_ptr<DeviceTiming> make_device_timing(const Config& config, Backends& b,
                                                 std::string* why_not);

struct DeviceActivityBackends {
  std::unique_ptr<KernelActivitySource> activity;
  std::unique_ptr<CounterSampler> sampler;
  std::string activity_unavailable;  // why activity is null
  std::string counters_unavailable;  // why sampler is null
};
// Kernel activity and counters: the CUPTI ones only where steps are timed with CUDA events
// (there is a GPU and a driver).
DeviceActivityBackends choose_device_activity(const Config& config, Backends& b, bool has_device,
                                              const std::string& device_unavailable,
                                              bool external_profiler);

// NVML telemetry where it loads and sees the device; null with why_not otherwise.
std::unique_ptr<TelemetrySource> choose_telemetry(const Config& config, Backends& b,
                                                  std::string* why_not);

// The Prometheus sink, before the writer starts (run_start names its port). Its values
// come from the writer thread; the live gauges read `inflight`, `clock` and `detection`
// (null: no median) from the scrape thread, so all of them must outlive the sink.
std::unique_ptr<PrometheusSink> make_metrics_sink(const Config& config, const PhaseNames& names,
                                                  const DetectionStage* detection, Clock* clock,
                                                  const InflightState* inflight,
                                                  const PeerState* peers);

}  // namespace steptrace::detail
