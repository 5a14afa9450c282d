#include "backend_setup.hpp"

#include <cstdio>
#include <functional>

#include "../core/check.hpp"
#include "../core/detection_stage.hpp"
#include "../core/step_record.hpp"
#include "run_environment.hpp"
#include "steptrace/error.hpp"

#ifndef STEPTRACE_VERSION
#error "STEPTRACE_VERSION must be defined by the build"
#endif

namespace steptrace::detail {

std::unique_ptr<DeviceTiming> make_device_timing(const Config& config, Backends& b,
                                                 std::string* why_not) {
  if (config.clock == "host") {
    *why_not = "disabled by clock=\"host\"";
    return nullptr;
  }
  std::unique_ptr<DeviceTimer> timer = std::move(b.device_timer);
  if (!timer) timer = make_cuda_timer(why_not);
  STEPTRACE_CHECK(timer || config.clock != "cuda", ConfigError,
                  "clock=\"cuda\" but CUDA event timing is unavailable: {}; use "
                  "clock=\"auto\" to fall back to the host clock",
                  *why_not);
  if (!timer) return nullptr;
  return std::make_unique<DeviceTiming>(std::move(timer),
                                        static_cast<std::size_t>(config.max_inflight_steps));
}

StepCompleter* DeviceParts::completer() const {
  if (chained_stage) return chained_stage.get();
  if (activity_stage) return activity_stage.get();
  return telemetry_stage.get();
}

std::string DeviceParts::device_name() const { return timing ? timing->timer().device_name() : ""; }

bool DeviceParts::device_memory_sampled() const noexcept {
  std::int64_t used = -1, total = -1;
  return telemetry != nullptr && telemetry->device_memory(&used, &total);
}

void choose_device_stages(DeviceParts& d, const Config& config, Backends& b,
                          bool external_profiler) {
  DeviceActivityBackends chosen = choose_device_activity(config, b, d.timing != nullptr,
                                                         d.timing_unavailable, external_profiler);
  d.activity = std::move(chosen.activity);
  d.sampler = std::move(chosen.sampler);
  d.activity_unavailable = std::move(chosen.activity_unavailable);
  d.counters_unavailable = std::move(chosen.counters_unavailable);
  if (external_profiler && d.activity) d.activity->set_yielding(true);
  if (d.activity || d.sampler) {
    d.activity_stage =
        std::make_unique<DeviceActivityStage>(config, d.activity.get(), d.sampler.get());
  }
  d.telemetry = choose_telemetry(config, b, &d.telemetry_unavailable);
  if (d.telemetry) d.telemetry_stage = std::make_unique<TelemetryStage>(d.telemetry.get());
  if (d.activity_stage && d.telemetry_stage) {
    d.chained_stage = std::make_unique<ChainedCompleter>(
        std::vector<StepCompleter*>{d.activity_stage.get(), d.telemetry_stage.get()});
  }
}

DeviceActivityBackends choose_device_activity(const Config& config, Backends& b, bool has_device,
                                              const std::string& device_unavailable,
                                              bool external_profiler) {
  DeviceActivityBackends chosen;
  const std::string no_device =
      "needs a CUDA device with CUDA event timing, which is unavailable (" + device_unavailable +
      ")";
  if (config.kernel_activity == "off") {
    chosen.activity_unavailable = "disabled by kernel_activity=\"off\"";
  } else if (b.kernel_activity) {
    chosen.activity = std::move(b.kernel_activity);
  } else if (!has_device) {
    chosen.activity_unavailable = no_device;
  } else {
    chosen.activity = make_cupti_activity(&chosen.activity_unavailable, external_profiler);
  }
  if (config.counters == "off") {
    chosen.counters_unavailable = "disabled by counters=\"off\"";
  } else if (b.counter_sampler) {
    chosen.sampler = std::move(b.counter_sampler);
  } else if (!has_device) {
    chosen.counters_unavailable = no_device;
  } else {
    chosen.sampler = make_cupti_counter_sampler(config.device_index, &chosen.counters_unavailable);
  }
  return chosen;
}

std::unique_ptr<TelemetrySource> choose_telemetry(const Config& config, Backends& b,
                                                  std::string* why_not) {
  if (config.nvml == "off") {
    *why_not = "disabled by nvml=\"off\"";
    return nullptr;
  }
  if (b.telemetry) return std::move(b.telemetry);
  return make_nvml_telemetry(config.device_index, config.nvml_interval_ms, why_not);
}

std::unique_ptr<PrometheusSink> make_metrics_sink(const Config& config, const PhaseNames& names,
                                                  const DetectionStage* detection, Clock* clock,
                                                  const InflightState* inflight,
                                                  const PeerState* peers) {
  int port = config.metrics_port;
  if (port > 0) port += env_int("LOCAL_RANK", 0);  // a port range: one per rank on a host
  MetricLabels labels;
  labels.job = config.job;
  labels.run_id = config.run_id;
  labels.rank = config.rank;
  labels.host = host_name();
  std::function<double()> median;
  if (detection) median = [detection] { return detection->median_ms() / 1e3; };
  auto in_flight = [clock, inflight]() -> double {
    if (inflight->step.load(std::memory_order_acquire) < 0) return 0.0;
    const std::int64_t age = clock->now_ns() - inflight->start_ns.load(std::memory_order_relaxed);
    return age > 0 ? static_cast<double>(age) / 1e9 : 0.0;
  };
  auto open_interval = [clock, inflight, peers]() -> OpenIntervalProbe {
    OpenIntervalProbe probe;
    if (peers->notice_ns.load(std::memory_order_relaxed) > 0) {  // the exchange runs
      probe.peers_in_interval = peers->in_interval.load(std::memory_order_relaxed);
    }
    const int kind = inflight->interval.load(std::memory_order_acquire);
    if (kind < 0) return probe;
    probe.kind = static_cast<IntervalKind>(kind);
    const std::int64_t age =
        clock->now_ns() - inflight->interval_start_ns.load(std::memory_order_relaxed);
    probe.age_s = age > 0 ? static_cast<double>(age) / 1e9 : 0.0;
    return probe;
  };
  MetricsOutputs outputs;
  outputs.host = config.metrics_host;
  outputs.port = port > 65535 ? -1 : port;
  outputs.textfile = config.metrics_textfile;
  outputs.pushgateway = config.metrics_pushgateway;
  auto metrics = std::make_unique<PrometheusSink>(std::move(outputs), std::move(labels), names,
                                                  STEPTRACE_VERSION, std::move(median),
                                                  std::move(in_flight), std::move(open_interval));
  if (config.metrics_port >= 0 && metrics->port() < 0) {
    std::fprintf(stderr, "steptrace: no Prometheus endpoint: %s; the run goes on without it\n",
                 metrics->error().c_str());
  }
  return metrics;
}

}  // namespace steptrace::detail
