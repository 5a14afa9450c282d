#include "run_manifest.hpp"

#include <unistd.h>

#include <nlohmann/json.hpp>
#include <string_view>

#include "../core/device_timing.hpp"
#include "../core/work_accounting.hpp"
#include "../sinks/prometheus_sink.hpp"
#include "run_environment.hpp"

#ifndef STEPTRACE_VERSION
#error "STEPTRACE_VERSION must be defined by the build"
#endif

namespace steptrace::detail {
namespace {

using nlohmann::ordered_json;

ordered_json metrics_json(const RunManifest& m) {
  if (!m.metrics) return nullptr;
  const Config& config = *m.config;
  ordered_json j = {{"host", nullptr}, {"port", nullptr}, {"path", "/metrics"}};
  if (m.metrics->port() >= 0) {
    j["host"] = m.metrics->host();
    j["port"] = m.metrics->port();
  }
  if (!m.metrics->error().empty()) j["error"] = m.metrics->error();
  if (!config.metrics_textfile.empty()) j["textfile"] = config.metrics_textfile;
  if (!config.metrics_pushgateway.empty()) j["pushgateway"] = config.metrics_pushgateway;
  return j;
}

ordered_json telemetry_json(const RunManifest& m) {
  const TelemetrySource* telemetry = m.devices->telemetry.get();
  if (!telemetry) {
    return {{"active", ordered_json::array()},
            {"unavailable", {{"nvml", m.devices->telemetry_unavailable}}}};
  }
  ordered_json j = {{"active", {telemetry->name()}}, {"unavailable", ordered_json::object()}};
  if (std::string device = telemetry->device(); !device.empty()) j["device"] = device;
  if (telemetry->power_limit_w() > 0) j["power_limit_w"] = telemetry->power_limit_w();
  j["interval_ms"] = m.config->nvml_interval_ms;
  std::int64_t used = -1, total = -1;
  if (telemetry->device_memory(&used, &total)) j["device_memory"] = true;
  if (auto board = telemetry->board_wide(); !board.empty()) j["board_wide"] = board;
  return j;
}

// One of the device-activity entries of run_start's "backends".
ordered_json optional_backend_json(const char* active_name, const std::string& unavailable) {
  if (active_name != nullptr) {
    return {{"active", {active_name}}, {"unavailable", ordered_json::object()}};
  }
  return {{"active", ordered_json::array()}, {"unavailable", {{"cupti", unavailable}}}};
}

ordered_json counters_json(const RunManifest& m) {
  const CounterSampler* sampler = m.devices->sampler.get();
  ordered_json j =
      optional_backend_json(sampler ? sampler->name() : nullptr, m.devices->counters_unavailable);
  if (sampler) {
    ordered_json metrics = ordered_json::object();
    for (std::size_t i = 0; i < kCounterCount; ++i) {
      const std::string metric = sampler->metric(i);
      if (!metric.empty()) metrics[kCounterNames[i]] = metric;
    }
    j["metrics"] = metrics;
    if (std::string device = sampler->device(); !device.empty()) j["device"] = device;
  }
  return j;
}

// backends.comm: how the collectives are timed (the Python package says; C++: no entry).
ordered_json comm_json(const RunInfo& info) {
  if (!info.comm_method.empty()) {
    return {{"active", {"completion"}},
            {"unavailable", ordered_json::object()},
            {"method", info.comm_method}};
  }
  return {{"active", ordered_json::array()}, {"unavailable", {{"completion", info.comm_untimed}}}};
}

}  // namespace

const char* host_clock_method(bool counter) noexcept {
  return counter ? "the CPU's time-stamp counter, calibrated against CLOCK_MONOTONIC and "
                   "checked every second"
                 : "CLOCK_MONOTONIC";
}

namespace {

ordered_json timer_json(const RunManifest& m) {
  ordered_json timer =
      m.devices->timing ? ordered_json{{"active", {m.devices->timing->timer().name(), "host"}},
                                       {"unavailable", ordered_json::object()}}
                        : ordered_json{{"active", {"host"}},
                                       {"unavailable", {{"cuda", m.devices->timing_unavailable}}}};
  if (m.host_clock != nullptr) timer["method"] = std::string("host: ") + m.host_clock;
  return timer;
}

ordered_json device_json(const RunManifest& m) {
  if (!m.devices->timing) return nullptr;
  const std::string name = m.devices->timing->timer().device_name();
  if (name.empty()) return nullptr;
  ordered_json d = {{"name", name}};
  const std::int64_t bytes = m.devices->timing->timer().device_memory_bytes();
  if (bytes > 0) d["memory_total_bytes"] = bytes;
  return d;
}

// run_start.config: every option of steptrace/config_options.def, in table order, but
// run_id, rank and world_size (resolved, at the top level of run_start).
ordered_json config_json(const Config& config) {
  ordered_json options = ordered_json::object();
#define STEPTRACE_CONFIG_OPTION(group, type, name, default_value, check, doc)     \
  if (std::string_view(#name) != "run_id" && std::string_view(#name) != "rank" && \
      std::string_view(#name) != "world_size") {                                  \
    options[#name] = config.name;                                                 \
  }
#include "steptrace/config_options.def"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/ext/telemetry.hpp"
  return options;
}

// How the steps' useful work is turned into MFU: the peak it divides by and where that
// comes from, or why there is no MFU.
ordered_json work_json(const Config& config, const PeakChoice& peak) {
  ordered_json w = {{"flops_per_step", config.flops_per_step > 0
                                           ? ordered_json(config.flops_per_step)
                                           : ordered_json(nullptr)}};
  if (peak.flops_per_s > 0) {
    w["peak_tflops"] = peak.flops_per_s * 1e-12;
    w["chip"] = peak.chip;
    w["source"] = peak.source;
  } else {
    w["peak_tflops"] = nullptr;
    w["mfu_unavailable"] = peak.why;
  }
  if (!peak.dtype.empty()) {
    w["mfu_dtype"] = peak.dtype;
    if (peak.dtype_assumed) w["mfu_dtype_assumed"] = true;
  }
  return w;
}

// Which job and attempt this run is (docs/goodput.md): a restart's files sit beside the
// earlier attempts' under the job root.
ordered_json job_json(const Config& config, const RunManifest& m) {
  ordered_json j = {{"id", nullptr},
                    {"source", nullptr},
                    {"attempt", 0},
                    {"previous_attempt", nullptr},
                    {"root", config.log_dir}};
  if (m.job != nullptr && !m.job->id.empty()) {
    j["id"] = m.job->id;
    j["source"] = m.job->source;
  }
  if (m.log != nullptr) {
    j["attempt"] = m.log->attempt;
    if (m.log->previous_attempt >= 0) j["previous_attempt"] = m.log->previous_attempt;
  }
  return j;
}

}  // namespace

std::string run_start_json(const RunManifest& m) {
  const Config& config = *m.config;
  ordered_json versions = {{"steptrace", STEPTRACE_VERSION}};
  for (const auto& [key, value] : m.info->versions) versions[key] = value;
  ordered_json memory_active = ordered_json::array();
  for (const auto& source : *m.memory_sources) memory_active.push_back(source->name());
  if (m.heap) memory_active.push_back("heap");
  ordered_json memory_unavailable = ordered_json::object();
  if (!config.sample_rss) memory_unavailable["rss"] = "disabled by sample_rss=false";
  if (!config.sample_heap) {
    memory_unavailable["heap"] = "disabled by sample_heap=false";
  } else if (!m.heap) {
    memory_unavailable["heap"] = "the C library has no mallinfo2 (not glibc)";
  }
  ordered_json record = {
      {"kind", "run_start"},
      {"schema", "steptrace/1"},
      {"run_id", config.run_id},
      {"rank", config.rank},
      {"world_size", config.world_size},
      {"host", host_name()},
      {"pid", getpid()},
      {"start_unix_ns", m.start_unix_ns},
      {"versions", versions},
      {"job", job_json(config, m)},
      {"device", device_json(m)},
      {"config", config_json(config)},
      {"backends",
       {{"timer", timer_json(m)},
        {"memory", {{"active", memory_active}, {"unavailable", memory_unavailable}}},
        {"kernel_activity",
         optional_backend_json(m.devices->activity ? m.devices->activity->name() : nullptr,
                               m.devices->activity_unavailable)},
        {"counters", counters_json(m)},
        {"telemetry", telemetry_json(m)}}},
  };
  if (m.process_start_unix_ns > 0) record["process_start_unix_ns"] = m.process_start_unix_ns;
  if (!m.info->comm_method.empty() || !m.info->comm_untimed.empty()) {
    record["backends"]["comm"] = comm_json(*m.info);
  }
  if (m.peak) record["work"] = work_json(config, *m.peak);
  if (m.metrics) record["metrics"] = metrics_json(m);
  return record.dump() + "\n";
}

}  // namespace steptrace::detail
