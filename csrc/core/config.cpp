#include "steptrace/config.hpp"

#include <set>
#include <utility>

#include "check.hpp"
#include "steptrace/error.hpp"

namespace steptrace {

void validate_phase_name(const std::string& name) {
  STEPTRACE_CHECK(!name.empty(), ConfigError,
                  "phase name is empty; a phase needs a non-empty name such as \"forward\"");
  STEPTRACE_CHECK(name.size() <= kMaxPhaseNameBytes, ConfigError,
                  "phase name \"{}...\" is {} bytes long; at most {} bytes are allowed",
                  name.substr(0, 16), name.size(), kMaxPhaseNameBytes);
  for (const char c : name) {
    STEPTRACE_CHECK(static_cast<unsigned char>(c) >= 0x20 && c != 0x7f, ConfigError,
                    "phase name {:?} contains a control character; use printable characters", name);
  }
  STEPTRACE_CHECK(name != "data", ConfigError,
                  "phase name \"data\" is reserved for the loader wait (data_ms); "
                  "choose another name");
}

void Config::validate() const {
  STEPTRACE_CHECK(!log_dir.empty(), ConfigError,
                  "log_dir is empty; give the folder the run's logs go to");
  STEPTRACE_CHECK(rank >= -1, ConfigError, "rank={} is negative; use rank >= 0 (or -1 for auto)",
                  rank);
  STEPTRACE_CHECK(world_size == -1 || world_size >= 1, ConfigError,
                  "world_size={} is invalid; use world_size >= 1 (or -1 for auto)", world_size);
  STEPTRACE_CHECK(rank < 0 || world_size < 0 || rank < world_size, ConfigError,
                  "rank={} is not below world_size={}; ranks are 0..world_size-1", rank,
                  world_size);
  STEPTRACE_CHECK(flush_interval_ms >= 1 && flush_interval_ms <= 60000, ConfigError,
                  "flush_interval_ms={} is out of range; allowed: 1..60000", flush_interval_ms);
  STEPTRACE_CHECK(queue_capacity >= 16 && queue_capacity <= (1 << 20), ConfigError,
                  "queue_capacity={} is out of range; allowed: 16..1048576", queue_capacity);
  STEPTRACE_CHECK(clock == "auto" || clock == "host" || clock == "cuda", ConfigError,
                  "clock={:?} is unknown; allowed: \"auto\", \"host\", \"cuda\"", clock);
  STEPTRACE_CHECK(max_inflight_steps >= 1 && max_inflight_steps <= 1024, ConfigError,
                  "max_inflight_steps={} is out of range; allowed: 1..1024", max_inflight_steps);
  STEPTRACE_CHECK(window >= 2, ConfigError,
                  "window={} is too small; the trailing window needs at least 2 steps", window);
  STEPTRACE_CHECK(warmup_steps >= 0, ConfigError, "warmup_steps={} is negative; allowed: 0 or more",
                  warmup_steps);
  // NaN fails these comparisons too, which is what we want.
  STEPTRACE_CHECK(regression_threshold > 1.0, ConfigError,
                  "regression_threshold={} must be greater than 1 (a ratio to the trailing "
                  "median, e.g. 1.5)",
                  regression_threshold);
  STEPTRACE_CHECK(stall_threshold > 1.0, ConfigError,
                  "stall_threshold={} must be greater than 1 (a ratio to the trailing "
                  "median, e.g. 5)",
                  stall_threshold);
  STEPTRACE_CHECK(regression_min_steps >= 1 && regression_min_steps <= window, ConfigError,
                  "regression_min_steps={} is out of range; allowed: 1..window ({})",
                  regression_min_steps, window);
  STEPTRACE_CHECK(min_history >= 2 && min_history <= window, ConfigError,
                  "min_history={} is out of range; allowed: 2..window ({})", min_history, window);
  for (const auto& [name, value] : {std::pair<const char*, double>{"min_excess_ms", min_excess_ms},
                                    {"stall_min_excess_ms", stall_min_excess_ms},
                                    {"noise_sigmas", noise_sigmas},
                                    {"regression_min_ms", regression_min_ms}}) {
    STEPTRACE_CHECK(value >= 0.0 && value < 1e9, ConfigError,
                    "{}={} is out of range; allowed: 0 or more (0 turns this part of the noise "
                    "rule off)",
                    name, value);
  }
  STEPTRACE_CHECK(hang_threshold > 1.0, ConfigError,
                  "hang_threshold={} must be greater than 1 (a ratio to the median iteration)",
                  hang_threshold);
  STEPTRACE_CHECK(hang_min_s > 0.0, ConfigError, "hang_min_s={} must be positive (seconds)",
                  hang_min_s);
  STEPTRACE_CHECK(hang_floor_s > 0.0, ConfigError, "hang_floor_s={} must be positive (seconds)",
                  hang_floor_s);
  STEPTRACE_CHECK(close_wait_s > 0.0 && close_wait_s <= 86400.0, ConfigError,
                  "close_wait_s={} is out of range; allowed: above 0, at most 86400 (seconds)",
                  close_wait_s);
  STEPTRACE_CHECK(metrics_port >= -1 && metrics_port <= 65535, ConfigError,
                  "metrics_port={} is out of range; allowed: -1 (off), 0 (any free port), "
                  "1..65535",
                  metrics_port);
  STEPTRACE_CHECK(metrics_pushgateway.empty() || metrics_pushgateway.rfind("http://", 0) == 0 ||
                      metrics_pushgateway.rfind("https://", 0) == 0,
                  ConfigError,
                  "metrics_pushgateway={:?} is not an http:// or https:// URL (e.g. "
                  "\"http://pushgateway:9091\")",
                  metrics_pushgateway);
  for (const char c : job) {
    STEPTRACE_CHECK(static_cast<unsigned char>(c) >= 0x20 && c != 0x7f, ConfigError,
                    "job={:?} contains a control character; use printable characters", job);
  }
  STEPTRACE_CHECK(memory_growth_pct > 0.0 && memory_growth_pct < 1000.0, ConfigError,
                  "memory_growth_pct={} is out of range; allowed: above 0 and below 1000",
                  memory_growth_pct);
  STEPTRACE_CHECK(kernel_activity == "auto" || kernel_activity == "off", ConfigError,
                  "kernel_activity={:?} is unknown; allowed: \"auto\", \"off\"", kernel_activity);
  STEPTRACE_CHECK(counters == "auto" || counters == "off", ConfigError,
                  "counters={:?} is unknown; allowed: \"auto\", \"off\"", counters);
  STEPTRACE_CHECK(counter_every >= 1 && counter_every <= 1000000, ConfigError,
                  "counter_every={} is out of range; allowed: 1..1000000", counter_every);
  STEPTRACE_CHECK(counter_burst >= 1 && counter_burst <= counter_every, ConfigError,
                  "counter_burst={} is out of range; allowed: 1..counter_every ({})", counter_burst,
                  counter_every);
  STEPTRACE_CHECK(device_index >= -1, ConfigError,
                  "device_index={} is invalid; use a CUDA device index >= 0 (or -1 for the "
                  "current device)",
                  device_index);
  STEPTRACE_CHECK(top_kernels >= 0 && top_kernels <= 1000, ConfigError,
                  "top_kernels={} is out of range; allowed: 0..1000", top_kernels);
  for (const auto& [name, value] :
       {std::pair<const char*, double>{"tensor_core_min_pct", tensor_core_min_pct},
        {"matmul_dominated_pct", matmul_dominated_pct},
        {"occupancy_min_pct", occupancy_min_pct},
        {"dram_bound_pct", dram_bound_pct},
        {"comm_bound_pct", comm_bound_pct},
        {"power_low_sm_pct", power_low_sm_pct},
        {"power_low_data_pct", power_low_data_pct}}) {
    STEPTRACE_CHECK(value > 0.0 && value <= 100.0, ConfigError,
                    "{}={} is out of range; allowed: above 0 and at most 100 (a percentage)", name,
                    value);
  }
  STEPTRACE_CHECK(nvml == "auto" || nvml == "off", ConfigError,
                  "nvml={:?} is unknown; allowed: \"auto\", \"off\"", nvml);
  STEPTRACE_CHECK(nvml_interval_ms >= 1 && nvml_interval_ms <= 60000, ConfigError,
                  "nvml_interval_ms={} is out of range; allowed: 1..60000", nvml_interval_ms);
  STEPTRACE_CHECK(power_low_fraction > 0.0 && power_low_fraction <= 1.0, ConfigError,
                  "power_low_fraction={} is out of range; allowed: above 0, at most 1 (a "
                  "fraction of the power limit)",
                  power_low_fraction);
  STEPTRACE_CHECK(power_drop_fraction > 0.0 && power_drop_fraction <= 1.0, ConfigError,
                  "power_drop_fraction={} is out of range; allowed: above 0, at most 1 (a "
                  "fraction of the power limit)",
                  power_drop_fraction);
  for (const auto& [name, value] :
       {std::pair<const char*, double>{"power_low_min_s", power_low_min_s},
        {"temp_rise_c_per_min", temp_rise_c_per_min},
        {"power_drop_w", power_drop_w}}) {
    STEPTRACE_CHECK(value > 0.0 && value < 1e9, ConfigError,
                    "{}={} is out of range; allowed: above 0", name, value);
  }
  STEPTRACE_CHECK(phases.size() <= kMaxPhases, ConfigError,
                  "phases lists {} names; at most {} distinct phases are allowed", phases.size(),
                  kMaxPhases);
  std::set<std::string> seen;
  for (const auto& name : phases) {
    validate_phase_name(name);
    STEPTRACE_CHECK(seen.insert(name).second, ConfigError,
                    "phases lists {:?} twice; each phase name once", name);
  }
}

}  // namespace steptrace
