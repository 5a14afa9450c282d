#include "work_accounting.hpp"

#include <algorithm>
#include <cmath>

#include "peak_flops.hpp"

namespace steptrace::detail {

std::int64_t wall_iteration_ns(const StepRecord& r) noexcept {
  return r.data_ns + r.between.other_ns + r.host_ns - r.between.inside_step_ns;
}

std::int64_t work_ns(const StepRecord& r) noexcept {
  const std::int64_t wall = wall_iteration_ns(r);
  return r.device_clock ? std::max(wall, r.step_ns) : wall;
}

WorkRates work_rates(const StepRecord& r) noexcept {
  WorkRates w;
  const WorkCount& c = r.work;
  const std::int64_t ns = work_ns(r);
  if (ns <= 0) return w;
  const double s = static_cast<double>(ns) * 1e-9;
  if (c.samples >= 0) w.samples_per_s = c.samples / s;
  if (c.tokens >= 0) w.tokens_per_s = c.tokens / s;
  if (c.flops >= 0) {
    w.tflops_per_s = c.flops / s * 1e-12;
    if (c.peak_flops_per_s > 0) w.mfu_pct = 100.0 * c.flops / s / c.peak_flops_per_s;
  }
  if (r.hw.present && std::isfinite(r.hw.energy_j)) {
    if (c.samples > 0) w.j_per_sample = r.hw.energy_j / c.samples;
    if (c.tokens > 0) w.j_per_token = r.hw.energy_j / c.tokens;
  }
  return w;
}

PeakChoice choose_peak(double peak_tflops_option, std::string_view dtype,
                       std::string_view device_name) {
  PeakChoice p;
  if (peak_tflops_option > 0) {
    p.flops_per_s = peak_tflops_option * 1e12;
    p.chip = "peak_tflops option";
    p.source = "the peak_tflops option";
    return p;
  }
  p.dtype_assumed = dtype == "auto";
  p.dtype = p.dtype_assumed ? "bf16" : std::string(dtype);
  if (device_name.empty()) {
    p.why = "no GPU timed the steps: MFU on a CPU needs the peak_tflops option";
    return p;
  }
  const std::optional<MathDtype> parsed = parse_math_dtype(p.dtype);
  if (!parsed) {
    p.why = "mfu_dtype " + p.dtype + " is not a math dtype";
    return p;
  }
  std::string why;
  if (const auto peak = lookup_peak_flops(device_name, *parsed, &why)) {
    p.flops_per_s = peak->tflops * 1e12;
    p.chip = peak->chip;
    p.source = peak->source;
  } else {
    p.why = why + "; set peak_tflops for MFU";
  }
  return p;
}

void WorkTotals::add(const StepRecord& r) noexcept {
  const WorkCount& c = r.work;
  if (!c.any()) return;
  const std::int64_t ns = work_ns(r);
  if (ns <= 0) return;
  if (c.samples >= 0) {
    samples += c.samples;
    samples_ns += ns;
  }
  if (c.tokens >= 0) {
    tokens += c.tokens;
    tokens_ns += ns;
    if (r.hw.present && std::isfinite(r.hw.energy_j)) {
      energy_j += r.hw.energy_j;
      energy_tokens += c.tokens;
    }
  }
  if (c.flops >= 0) {
    flops += c.flops;
    flops_ns += ns;
    peak_flops_per_s = c.peak_flops_per_s;
  }
}

}  // namespace steptrace::detail
