// Useful work per step: throughput, FLOP/s and MFU from a step record's WorkCount, and the
// run's totals of them. Shared by the JSON record, the Prometheus sink and run_end.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "step_record.hpp"

namespace steptrace::detail {

/// The wall-clock time of a step's training iteration on the host: the loader's wait, the
/// other host work before it and the step's host time, less the intervals inside it
/// (evaluation and checkpoint intervals between steps are not part of it). On the CUDA
/// clock the host runs ahead and waits for the device somewhere in the loop (at the
/// latest when max_inflight_steps are pending), so over steps this is the device's pace;
/// step_ns there is the device's time of the step alone, and adding it to the host's gap
/// would count the same time twice.
std::int64_t wall_iteration_ns(const StepRecord& r) noexcept;

/// The time a step's work is divided by: its wall_iteration_ns, and on the CUDA clock at
/// least the device's time of the step (step_ns). While the host runs ahead of the device
/// (the first max_inflight_steps steps, or a device that is the bottleneck) the host's
/// iteration is shorter than the device's work of the step, and rates over it would be
/// too high (an MFU above what the device did); a host-bound loop leaves the device idle
/// between steps, and its wall iteration is the longer one. Either way the step's work
/// took at least the longer of the two.
std::int64_t work_ns(const StepRecord& r) noexcept;

/// What a step's work comes to per second of its work_ns. NaN where the figure it needs
/// is unknown.
struct WorkRates {
  static constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();
  double samples_per_s = kUnknown;
  double tokens_per_s = kUnknown;
  double tflops_per_s = kUnknown;
  double mfu_pct = kUnknown;       // achieved FLOP/s / the device's peak (WorkCount's), in %
  double j_per_sample = kUnknown;  // the step's energy (NVML) per unit of work
  double j_per_token = kUnknown;
};
WorkRates work_rates(const StepRecord& r) noexcept;

/// The peak that MFU divides by, resolved once at start: the peak_tflops option, else the
/// datasheet figure for the device and math dtype (peak_flops.hpp). flops_per_s is 0 when
/// there is none, and `why` says why.
struct PeakChoice {
  double flops_per_s = 0;
  std::string dtype;           // "bf16", ...; "" for the option's figure
  bool dtype_assumed = false;  // mfu_dtype "auto" with nothing yet saying what the model runs in
  std::string chip;            // the table's row, or "peak_tflops option"
  std::string source;          // the datasheet, or the option
  std::string why;             // empty when flops_per_s > 0
};
/// `dtype` is "auto" or a math dtype name; `device_name` is the timer's ("" on a CPU).
PeakChoice choose_peak(double peak_tflops_option, std::string_view dtype,
                       std::string_view device_name);

/// The run's work, summed over its steps (writer thread), for run_end.
struct WorkTotals {
  double samples = 0, tokens = 0, flops = 0;
  std::int64_t samples_ns = 0, tokens_ns = 0, flops_ns = 0;  // work_ns of those steps
  double energy_j = 0;          // of steps with both an energy figure and tokens
  double energy_tokens = 0;     // the tokens of those steps
  double peak_flops_per_s = 0;  // the last step's
  bool any() const noexcept { return samples_ns > 0 || tokens_ns > 0 || flops_ns > 0; }
  void add(const StepRecord& r) noexcept;
};

}  // namespace steptrace::detail
