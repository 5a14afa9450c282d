// GPU hardware telemetry joined to the step records, and the diagnoses made from it.
// TelemetryStage runs on the writer thread: a step record waits (at most kMaxHold) until
// a sample taken after its end has arrived, then gets its `hw` figures from the samples
// that overlap its host span (each sample holds its value until the next one).
// TelemetryDetector is pure: it takes the completed records and returns alerts.
#pragma once

#include <chrono>
#include <climits>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "alert.hpp"
#include "detect/episode.hpp"
#include "step_completer.hpp"
#include "step_record.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/ext/telemetry.hpp"

namespace steptrace::detail {

/// NVML clock event (throttle) reason bits and their names in the step record.
inline constexpr std::uint64_t kThrottleSwPowerCap = 0x4;
inline constexpr std::uint64_t kThrottleHwSlowdown = 0x8;
inline constexpr std::uint64_t kThrottleSwThermal = 0x20;
inline constexpr std::uint64_t kThrottleHwThermal = 0x40;
inline constexpr std::uint64_t kThrottleHwPowerBrake = 0x80;
inline constexpr std::uint64_t kThermalThrottle = kThrottleSwThermal | kThrottleHwThermal;
inline constexpr std::uint64_t kPowerThrottle = kThrottleSwPowerCap | kThrottleHwPowerBrake;
/// Names of the set bits, in bit order ("sw_power_cap", "hw_thermal_slowdown", ...).
std::vector<std::string> throttle_reason_names(std::uint64_t reasons);
/// The reason bits with a name (0x1 .. 0x400); higher bits are not named.
inline constexpr std::size_t kThrottleReasonBits = 11;
/// The name of bit `bit` (< kThrottleReasonBits), as in throttle_reason_names.
const char* throttle_reason_name(std::size_t bit) noexcept;

/// The hw figures of the window [begin_ns, end_ns] from `samples` (sorted by time; a
/// reading stands for the period since the one before). max_drop_w looks at consecutive
/// pairs whose later reading is after drop_after_ns. Not present when no reading is after
/// begin_ns. Energy from the counter, interpolated at the window's ends. Pure.
HwStats hw_stats(const std::vector<TelemetrySample>& samples, std::int64_t begin_ns,
                 std::int64_t end_ns, std::int64_t drop_after_ns, double power_limit_w);

/// Completes step records with the telemetry source's samples. Writer thread only.
class TelemetryStage final : public HoldingCompleter {
 public:
  /// `source` outlives the stage.
  explicit TelemetryStage(TelemetrySource* source) : source_(source) {}
  bool complete(StepRecord& r, bool force) override;
  void finish() noexcept override;
  /// run_end's "hw": total energy, energy per 1,000 steps, sample count, and the NVLink
  /// and row-remap counters at the last reading.
  std::string run_end_fields() override;

 private:
  void take();

  TelemetrySource* source_;
  std::vector<TelemetrySample> incoming_;
  std::vector<TelemetrySample> samples_;  // sorted; the last one before the next step first
  std::int64_t last_end_ns_ = INT64_MIN;  // the previous step's end, for drops between steps
  std::int64_t sample_count_ = 0;
  std::int64_t steps_with_hw_ = 0;
  double step_energy_j_ = 0;
  double first_energy_j_ = -1;  // the counter at the first and last samples of the run
  double last_energy_j_ = -1;
  TelemetrySample last_;  // the latest reading: run_end's error counters
};

/// power_low, temperature_rising, power_drop, thermal_throttle, power_throttle from the
/// records' hw figures (hardware_error comes from the sampler directly). Pure.
class TelemetryDetector {
 public:
  explicit TelemetryDetector(const Config& config) : config_(config) {}
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);

 private:
  // One alert per episode (it opens at the first step with its condition and resolves at
  // the first without); `make_alert` builds the alert only when one opens.
  template <typename MakeAlert>
  void episode(Episode& e, const char* type, bool now, const StepRecord& r,
               std::vector<AlertEvent>& out, MakeAlert make_alert);

  const Config& config_;
  std::int64_t steps_ = 0;
  Episode power_low_, temp_rising_, power_drop_, thermal_, power_cap_;
  std::int64_t low_since_ns_ = -1;  // the first step of the current run of low-power steps
  struct TempPoint {
    std::int64_t t_ns;
    double temp_c;
  };
  std::deque<TempPoint> temps_;     // the last minute of steps' max temperatures
  double unthrottled_step_ms_ = 0;  // mean step time of the steps without throttling
  std::int64_t unthrottled_steps_ = 0;
};

}  // namespace steptrace::detail
