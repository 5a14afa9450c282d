#include "steptrace/config.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <initializer_list>
#include <set>
#include <type_traits>
#include <utility>

#include "check.hpp"
#include "steptrace/error.hpp"

namespace steptrace {
namespace {

// The `check` column of steptrace/config_options.def: one overload per kind.
struct Unchecked {};
struct IntRange {
  long long lo;
  long long hi;
};
struct Percent {};
struct Fraction {};
struct Positive {};
struct NoiseFloor {};
using OneOf = std::initializer_list<const char*>;

template <class T>
void check_option(const char* /*name*/, const T& /*value*/, Unchecked) {}

template <class T>
void check_option(const char* name, T value, IntRange range) {
  static_assert(std::is_integral_v<T>, "range(lo, hi) is for integer options");
  STEPTRACE_CHECK(value >= range.lo && value <= range.hi, ConfigError,
                  "{}={} is out of range; allowed: {}..{}", name, value, range.lo, range.hi);
}

void check_option(const char* name, const std::string& value, OneOf allowed) {
  std::string list;
  bool ok = false;
  for (const char* a : allowed) {
    ok = ok || value == a;
    list += fmt::format("{}\"{}\"", list.empty() ? "" : ", ", a);
  }
  STEPTRACE_CHECK(ok, ConfigError, "{}={:?} is unknown; allowed: {}", name, value, list);
}

// NaN fails these comparisons too, which is what we want.
void check_option(const char* name, double value, Percent) {
  STEPTRACE_CHECK(value > 0.0 && value <= 100.0, ConfigError,
                  "{}={} is out of range; allowed: above 0 and at most 100 (a percentage)", name,
                  value);
}

void check_option(const char* name, double value, Fraction) {
  STEPTRACE_CHECK(value > 0.0 && value <= 1.0, ConfigError,
                  "{}={} is out of range; allowed: above 0, at most 1 (a fraction of the power "
                  "limit)",
                  name, value);
}

void check_option(const char* name, double value, Positive) {
  STEPTRACE_CHECK(value > 0.0 && value < 1e9, ConfigError,
                  "{}={} is out of range; allowed: above 0", name, value);
}

void check_option(const char* name, double value, NoiseFloor) {
  STEPTRACE_CHECK(value >= 0.0 && value < 1e9, ConfigError,
                  "{}={} is out of range; allowed: 0 or more (0 turns this part of the noise "
                  "rule off)",
                  name, value);
}

}  // namespace

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
  // The generic checks, from the table's `check` column, in table order.
#define STEPTRACE_CONFIG_CHECK_none \
  Unchecked {}
#define STEPTRACE_CONFIG_CHECK_range(lo, hi) \
  IntRange { lo, hi }
#define STEPTRACE_CONFIG_CHECK_one_of(...) \
  OneOf { __VA_ARGS__ }
#define STEPTRACE_CONFIG_CHECK_percent \
  Percent {}
#define STEPTRACE_CONFIG_CHECK_fraction \
  Fraction {}
#define STEPTRACE_CONFIG_CHECK_positive \
  Positive {}
#define STEPTRACE_CONFIG_CHECK_noise_floor \
  NoiseFloor {}
#define STEPTRACE_CONFIG_OPTION(group, type, name, default_value, check, doc) \
  check_option(#name, name, STEPTRACE_CONFIG_CHECK_##check);
#include "steptrace/config_options.def"

  // The checks that need more than one option, or a message of their own.
  STEPTRACE_CHECK(flops_per_step >= 0.0 && flops_per_step < 1e30, ConfigError,
                  "flops_per_step={} is out of range; allowed: 0 (count them) or the model "
                  "FLOPs of one step, below 1e30",
                  flops_per_step);
  STEPTRACE_CHECK(gpu_hour_cost >= 0.0 && gpu_hour_cost < 1e9, ConfigError,
                  "gpu_hour_cost={} is out of range; allowed: 0 (off) or the price of one "
                  "GPU-hour, below 1e9",
                  gpu_hour_cost);
  STEPTRACE_CHECK(peak_tflops >= 0.0 && peak_tflops < 1e6, ConfigError,
                  "peak_tflops={} is out of range; allowed: 0 (the datasheet figure) or the "
                  "device's peak in TFLOP/s, below 1e6",
                  peak_tflops);
  STEPTRACE_CHECK(!log_dir.empty(), ConfigError,
                  "log_dir is empty; give the folder the run's logs go to");
  STEPTRACE_CHECK(rank >= -1, ConfigError, "rank={} is negative; use rank >= 0 (or -1 for auto)",
                  rank);
  STEPTRACE_CHECK(world_size == -1 || world_size >= 1, ConfigError,
                  "world_size={} is invalid; use world_size >= 1 (or -1 for auto)", world_size);
  STEPTRACE_CHECK(rank < 0 || world_size < 0 || rank < world_size, ConfigError,
                  "rank={} is not below world_size={}; ranks are 0..world_size-1", rank,
                  world_size);
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
  // A numeric address only: a host name would be resolved at start (a DNS wait in the
  // trainer) and could name several interfaces.
  {
    unsigned char addr[sizeof(in6_addr)];
    const bool ip = ::inet_pton(AF_INET, metrics_host.c_str(), addr) == 1 ||
                    ::inet_pton(AF_INET6, metrics_host.c_str(), addr) == 1;
    STEPTRACE_CHECK(ip, ConfigError,
                    "metrics_host={:?} is not an IP address; allowed: an IPv4 or IPv6 address "
                    "of this host, e.g. \"127.0.0.1\" (the default: this machine only), "
                    "\"0.0.0.0\" or \"::\" (every interface), \"::1\"",
                    metrics_host);
  }
  // The bundled cpp-httplib is built without TLS (no libssl in the wheel): an https://
  // gateway is refused here rather than failing at close.
  STEPTRACE_CHECK(metrics_pushgateway.rfind("https://", 0) != 0, ConfigError,
                  "metrics_pushgateway={:?}: https:// is not supported (steptrace is built "
                  "without TLS); use an http:// URL, e.g. a gateway or TLS proxy on the node",
                  metrics_pushgateway);
  STEPTRACE_CHECK(metrics_pushgateway.empty() || metrics_pushgateway.rfind("http://", 0) == 0,
                  ConfigError,
                  "metrics_pushgateway={:?} is not an http:// URL (e.g. "
                  "\"http://pushgateway:9091\")",
                  metrics_pushgateway);
  for (const char c : job) {
    STEPTRACE_CHECK(static_cast<unsigned char>(c) >= 0x20 && c != 0x7f, ConfigError,
                    "job={:?} contains a control character; use printable characters", job);
  }
  STEPTRACE_CHECK(memory_growth_pct > 0.0 && memory_growth_pct < 1000.0, ConfigError,
                  "memory_growth_pct={} is out of range; allowed: above 0 and below 1000",
                  memory_growth_pct);
  STEPTRACE_CHECK(counter_burst >= 1 && counter_burst <= counter_every, ConfigError,
                  "counter_burst={} is out of range; allowed: 1..counter_every ({})", counter_burst,
                  counter_every);
  STEPTRACE_CHECK(device_index >= -1, ConfigError,
                  "device_index={} is invalid; use a CUDA device index >= 0 (or -1 for the "
                  "current device)",
                  device_index);
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
