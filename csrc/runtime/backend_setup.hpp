// Which backends a run gets: the ones given in Backends as they are, else the defaults
// where the machine has them, and for each missing one the reason run_start gives.
#pragma once

#include <memory>
#include <string>

#include "../core/device_activity_stage.hpp"
#include "../core/device_timing.hpp"
#include "../core/step_completer.hpp"
#include "../core/telemetry_stage.hpp"
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

// The run's device side: the current stream's source, CUDA event timing, kernel activity,
// counters and NVML telemetry, each with why it is missing, and the writer stages that join
// their figures to the step records (declared after the sources they read).
struct DeviceParts {
  std::unique_ptr<StreamSource> stream_source;  // as given in Backends (null: none)
  std::unique_ptr<DeviceTiming> timing;
  std::string timing_unavailable;  // why timing is null
  std::unique_ptr<KernelActivitySource> activity;
  std::unique_ptr<CounterSampler> sampler;
  std::string activity_unavailable;
  std::string counters_unavailable;
  std::unique_ptr<DeviceActivityStage> activity_stage;
  std::unique_ptr<TelemetrySource> telemetry;
  std::string telemetry_unavailable;
  std::unique_ptr<TelemetryStage> telemetry_stage;
  std::unique_ptr<ChainedCompleter> chained_stage;

  /// The writer's stage: the activity's, then the telemetry's; null: neither.
  StepCompleter* completer() const;
  /// NVML reads the device's memory.
  bool device_memory_sampled() const noexcept;
  /// The GPU the steps are timed on ("" without one): MFU's peak is looked up by it.
  std::string device_name() const;
};
// After `d.timing` is chosen: the kernel activity and counters (yielding from the start
// where an external profiler is active), NVML telemetry, and their stages.
void choose_device_stages(DeviceParts& d, const Config& config, Backends& b,
                          bool external_profiler);

// The Prometheus sink, before the writer starts (run_start names its port). Its values
// come from the writer thread; the live gauges read `inflight`, `clock` and `detection`
// (null: no median) from the scrape thread, so all of them must outlive the sink.
std::unique_ptr<PrometheusSink> make_metrics_sink(const Config& config, const PhaseNames& names,
                                                  const DetectionStage* detection, Clock* clock,
                                                  const InflightState* inflight,
                                                  const PeerState* peers);

}  // namespace steptrace::detail
