#include "telemetry_stage.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "sample_aggregation.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/ext/telemetry.hpp"

namespace steptrace::detail {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kNsPerS = 1e9;
// A temperature trend needs this much history: over shorter spans the sensor's 1 C
// steps alone read as several C per minute.
constexpr std::int64_t kMinTempSpanNs = 30'000'000'000;
constexpr std::int64_t kTempWindowNs = 60'000'000'000;
// The counter power_low reads for SM activity.
constexpr std::size_t kSmThroughputCounter = 3;
static_assert(std::string_view(kCounterNames[kSmThroughputCounter]) == "sm_throughput_pct");

constexpr const char* kReasonNames[] = {"gpu_idle",
                                        "applications_clocks_setting",
                                        "sw_power_cap",
                                        "hw_slowdown",
                                        "sync_boost",
                                        "sw_thermal_slowdown",
                                        "hw_thermal_slowdown",
                                        "hw_power_brake_slowdown",
                                        "display_clock_setting",
                                        "board_limit",
                                        "reliability"};

// The energy counter at t, linear between the samples around it (clamped at the ends).
double energy_at(const std::vector<TelemetrySample>& s, std::int64_t t) {
  if (t <= s.front().t_ns) return s.front().energy_j;
  if (t >= s.back().t_ns) return s.back().energy_j;
  const auto it = std::upper_bound(s.begin(), s.end(), t,
                                   [](std::int64_t v, const auto& x) { return v < x.t_ns; });
  const TelemetrySample& b = *it;
  const TelemetrySample& a = *(it - 1);
  const double f = static_cast<double>(t - a.t_ns) / static_cast<double>(b.t_ns - a.t_ns);
  return a.energy_j + f * (b.energy_j - a.energy_j);
}

std::string watts(double w) { return fmt::format("{:.0f} W", w); }

}  // namespace

static_assert(std::size(kReasonNames) == kThrottleReasonBits);

const char* throttle_reason_name(std::size_t bit) noexcept {
  return bit < kThrottleReasonBits ? kReasonNames[bit] : "other";
}

std::vector<std::string> throttle_reason_names(std::uint64_t reasons) {
  std::vector<std::string> out;
  for (std::size_t bit = 0; bit < 64; ++bit) {
    if ((reasons & (std::uint64_t{1} << bit)) == 0) continue;
    out.push_back(bit < std::size(kReasonNames) ? kReasonNames[bit]
                                                : fmt::format("reason_0x{:x}", 1ULL << bit));
  }
  return out;
}

HwStats hw_stats(const std::vector<TelemetrySample>& samples, std::int64_t begin_ns,
                 std::int64_t end_ns, std::int64_t drop_after_ns, double power_limit_w) {
  HwStats h;
  h.power_limit_w = power_limit_w;
  end_ns = std::max(end_ns, begin_ns + 1);
  // A reading stands for the time since the one before (NVML's instantaneous power, read
  // at each sample; GetPowerUsage's 1 s mean only where the field is missing): [lo, hi] are
  // the readings whose period overlaps the window.
  auto after = [](std::int64_t v, const TelemetrySample& x) { return v < x.t_ns; };
  auto before = [](const TelemetrySample& x, std::int64_t v) { return x.t_ns < v; };
  const std::size_t lo = static_cast<std::size_t>(
      std::upper_bound(samples.begin(), samples.end(), begin_ns, after) - samples.begin());
  if (lo == samples.size()) return h;
  std::size_t hi = static_cast<std::size_t>(
      std::lower_bound(samples.begin(), samples.end(), end_ns, before) - samples.begin());
  hi = std::min(hi, samples.size() - 1);
  const std::size_t drop_from = static_cast<std::size_t>(
      std::upper_bound(samples.begin(), samples.end(), drop_after_ns, after) - samples.begin());

  // Time-weighted means by the counter-sample aggregation.
  std::vector<PmSample> periods;
  periods.reserve(hi - lo + 1);
  h.min_power_w = std::numeric_limits<double>::infinity();
  h.max_temp_c = -std::numeric_limits<double>::infinity();
  double max_mem_temp_c = -std::numeric_limits<double>::infinity();
  bool energy_ok = true;
  for (std::size_t i = lo; i <= hi; ++i) {
    const TelemetrySample& s = samples[i];
    const std::int64_t from = i > 0 ? samples[i - 1].t_ns : s.t_ns - 1;
    periods.push_back({from,
                       s.t_ns,
                       {s.power_w, s.sm_clock_mhz, s.pcie_tx_mb_s, s.pcie_rx_mb_s, s.mem_clock_mhz,
                        s.nvlink_tx_mb_s, s.nvlink_rx_mb_s, s.util_pct}});
    h.min_power_w = std::min(h.min_power_w, s.power_w);
    if (std::isfinite(s.temp_c)) h.max_temp_c = std::max(h.max_temp_c, s.temp_c);
    if (std::isfinite(s.mem_temp_c)) max_mem_temp_c = std::max(max_mem_temp_c, s.mem_temp_c);
    h.throttle_reasons |= s.throttle_reasons;
    energy_ok = energy_ok && std::isfinite(s.energy_j);
  }
  for (std::size_t i = std::max<std::size_t>(drop_from, 1); i <= hi; ++i) {
    h.max_drop_w = std::max(h.max_drop_w, samples[i - 1].power_w - samples[i].power_w);
  }
  if (!std::isfinite(h.max_temp_c)) h.max_temp_c = kNaN;
  if (std::isfinite(max_mem_temp_c)) h.max_mem_temp_c = max_mem_temp_c;
  const AggregationResult agg = aggregate_samples(periods, {{0, begin_ns, end_ns}}, 8);
  const StepCounters& c = agg.steps.front();
  h.avg_power_w = c.values[0];
  h.sm_clock_mhz = c.values[1];
  h.pcie_tx_mb_s = c.values[2];
  h.pcie_rx_mb_s = c.values[3];
  h.mem_clock_mhz = c.values[4];
  h.nvlink_tx_mb_s = c.values[5];
  h.nvlink_rx_mb_s = c.values[6];
  h.util_pct = c.values[7];
  h.samples = static_cast<int>(hi - lo + 1);
  if (!std::isfinite(h.avg_power_w)) {  // a reading right at the window's edge only
    h.avg_power_w = samples[hi].power_w;
    h.sm_clock_mhz = samples[hi].sm_clock_mhz;
    h.pcie_tx_mb_s = samples[hi].pcie_tx_mb_s;
    h.pcie_rx_mb_s = samples[hi].pcie_rx_mb_s;
    h.mem_clock_mhz = samples[hi].mem_clock_mhz;
    h.nvlink_tx_mb_s = samples[hi].nvlink_tx_mb_s;
    h.nvlink_rx_mb_s = samples[hi].nvlink_rx_mb_s;
    h.util_pct = samples[hi].util_pct;
  }
  const double span_s = static_cast<double>(end_ns - begin_ns) / kNsPerS;
  if (energy_ok && lo > 0) {
    h.energy_j = energy_at(samples, end_ns) - energy_at(samples, begin_ns);
    if (samples.back().t_ns < end_ns) {
      // no reading after the end yet (a forced record): the rest at the average power
      h.energy_j += h.avg_power_w *
                    static_cast<double>(end_ns - std::max(begin_ns, samples.back().t_ns)) / kNsPerS;
    }
  } else {
    h.energy_j = h.avg_power_w * span_s;  // no counter (older GPUs), or none before the step
  }
  h.present = std::isfinite(h.avg_power_w);
  return h;
}

void TelemetryStage::take() {
  incoming_.clear();
  source_->take(incoming_);
  sample_count_ += static_cast<std::int64_t>(incoming_.size());
  for (const TelemetrySample& s : incoming_) {
    if (!samples_.empty() && s.t_ns < samples_.back().t_ns) continue;  // out of order: skip
    if (std::isfinite(s.energy_j)) {
      if (first_energy_j_ < 0) first_energy_j_ = s.energy_j;
      last_energy_j_ = s.energy_j;
    }
    samples_.push_back(s);
    last_ = s;
  }
}

bool TelemetryStage::complete(StepRecord& r, bool force) {
  if (r.telemetry_begin_ns < 0) return true;
  take();
  // A reading taken after the step's end closes its window (the sampler's next tick).
  const bool in = !samples_.empty() && samples_.back().t_ns >= r.telemetry_end_ns;
  if (!hold_over(r, in, force)) return false;
  // drops in the wait since the previous step count too: steps continue around them
  r.hw = hw_stats(samples_, r.telemetry_begin_ns, r.telemetry_end_ns,
                  last_end_ns_ == INT64_MIN ? r.telemetry_begin_ns : last_end_ns_,
                  source_->power_limit_w());
  last_end_ns_ = r.telemetry_end_ns;
  if (r.hw.present) {
    ++steps_with_hw_;
    step_energy_j_ += r.hw.energy_j;
  }
  // Keep from the reading before the first at or after the end: the next step's period
  // starts there.
  const auto keep =
      std::lower_bound(samples_.begin(), samples_.end(), r.telemetry_end_ns,
                       [](const TelemetrySample& x, std::int64_t v) { return x.t_ns < v; });
  if (keep - samples_.begin() > 1) samples_.erase(samples_.begin(), keep - 1);
  return true;
}

void TelemetryStage::finish() noexcept { source_->finish(); }

std::string TelemetryStage::run_end_fields() {
  take();
  nlohmann::ordered_json hw = {{"source", source_->name()},
                               {"samples", sample_count_},
                               {"steps_with_hw", steps_with_hw_},
                               {"steps_energy_j", step_energy_j_}};
  if (steps_with_hw_ > 0) {
    hw["energy_j_per_1000_steps"] = step_energy_j_ / static_cast<double>(steps_with_hw_) * 1000.0;
  }
  // the whole run, the waits between steps included
  if (first_energy_j_ >= 0) hw["energy_j"] = last_energy_j_ - first_energy_j_;
  if (source_->power_limit_w() > 0) hw["power_limit_w"] = source_->power_limit_w();
  // the error counters at the last reading, where the device has them
  auto counter = [&](const char* key, std::int64_t v) {
    if (v >= 0) hw[key] = v;
  };
  counter("nvlink_crc_errors", last_.nvlink_crc_errors);
  counter("nvlink_replay_errors", last_.nvlink_replay_errors);
  if (last_.remap_corrected >= 0) {
    hw["remapped_rows"] = {{"corrected", last_.remap_corrected},
                           {"uncorrected", last_.remap_uncorrected},
                           {"pending", last_.remap_pending != 0},
                           {"failure", last_.remap_failure != 0}};
  }
  if (std::string status = source_->status(); !status.empty()) hw["status"] = std::move(status);
  return "\"hw\":" + hw.dump();
}

template <typename MakeAlert>
void TelemetryDetector::episode(Episode& e, const char* type, bool now, const StepRecord& r,
                                std::vector<AlertEvent>& out, MakeAlert make_alert) {
  const Episode::Change change = e.observe(now, r.step);
  if (change == Episode::Change::kOpened) {
    AlertEvent alert = make_alert();
    alert.type = type;
    alert.step = r.step;
    out.push_back(std::move(alert));
  } else if (change == Episode::Change::kResolved) {
    out.push_back(e.resolved(type, r.step, fmt::format("{} cleared at step {}", type, r.step)));
  }
}

void TelemetryDetector::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  if (!r.hw.present) return;
  const HwStats& h = r.hw;
  const bool warm = ++steps_ > config_.warmup_steps;
  const double limit = h.power_limit_w;
  const std::int64_t t = r.telemetry_end_ns;
  const double step_ms = static_cast<double>(r.step_ns) / 1e6;

  // power_low: below the fraction of the limit for power_low_min_s in a row, with the SMs
  // not busy where the step has counters (busy SMs at low power are working, not waiting)
  const double low_w = config_.power_low_fraction * limit;
  const double sm_pct = r.counters.present ? r.counters.values[kSmThroughputCounter] : kNaN;
  const bool sm_busy = std::isfinite(sm_pct) && sm_pct >= config_.power_low_sm_pct;
  const bool low = warm && limit > 0 && h.avg_power_w < low_w && !sm_busy;
  if (!low) low_since_ns_ = -1;
  if (low && low_since_ns_ < 0) low_since_ns_ = r.telemetry_begin_ns;
  const bool sustained =
      low && static_cast<double>(t - low_since_ns_) >= config_.power_low_min_s * kNsPerS;
  episode(power_low_, "power_low", sustained, r, out, [&] {
    AlertEvent a;
    a.value = h.avg_power_w;
    a.baseline = limit;
    a.threshold = low_w;
    // which part of the step keeps the GPU from drawing power
    const double iteration = static_cast<double>(r.data_ns + r.host_ns);
    const double data_share = iteration > 0 ? static_cast<double>(r.data_ns) / iteration : 0;
    const double comm_ns = r.kernels.present ? static_cast<double>(r.kernels.exposed_nccl_ns)
                                             : static_cast<double>(r.comm.exposed_ns);
    const double comm_share = r.host_ns > 0 ? comm_ns / static_cast<double>(r.host_ns) : 0;
    std::string bound =
        "batch-size bound (kernels too small to load the GPU: a larger batch "
        "or fused kernels)";
    if (data_share > config_.power_low_data_pct / 100.0) {
      bound = fmt::format("data-pipeline bound ({:.0f}% of the iteration waits on the loader)",
                          100 * data_share);
    } else if (comm_share > config_.comm_bound_pct / 100.0) {
      bound = fmt::format("communication bound ({:.0f}% of the step is exposed communication)",
                          100 * comm_share);
    }
    a.message = fmt::format("GPU power {} is below {:.0f}% of its {} limit for {:.0f} s: {}",
                            watts(h.avg_power_w), 100 * config_.power_low_fraction, watts(limit),
                            static_cast<double>(t - low_since_ns_) / kNsPerS, bound);
    a.details = {{"bound", bound.substr(0, bound.find(' '))}};
    if (std::isfinite(sm_pct)) {
      a.message += fmt::format("; SM throughput {:.0f}% of peak", sm_pct);
      a.details["sm_throughput_pct"] = sm_pct;
    }
    return a;
  });

  // temperature_rising: the trend over the last minute of steps
  if (std::isfinite(h.max_temp_c)) {
    temps_.push_back({t, h.max_temp_c});
    while (temps_.size() > 1 && temps_.front().t_ns < t - kTempWindowNs) temps_.pop_front();
    const std::int64_t span = t - temps_.front().t_ns;
    double rate = 0;
    if (span >= kMinTempSpanNs) {
      rate = (h.max_temp_c - temps_.front().temp_c) / (static_cast<double>(span) / 60e9);
    }
    const bool rising = warm && rate > config_.temp_rise_c_per_min;
    episode(temp_rising_, "temperature_rising", rising, r, out, [&] {
      AlertEvent a;
      a.value = rate;
      a.baseline = temps_.front().temp_c;
      a.threshold = config_.temp_rise_c_per_min;
      a.message = fmt::format(
          "GPU temperature rises {:.1f} C/min ({:.0f} -> {:.0f} C): check the cooling (fans, "
          "airflow, coolant) before the GPU throttles",
          rate, temps_.front().temp_c, h.max_temp_c);
      return a;
    });
  }

  // power_drop: a fall between two readings while steps continue; the smaller threshold
  // wins, so a 300 W card (120 W) and a 1,000 W one (300 W) are both covered
  const double drop_w = std::min(config_.power_drop_w, config_.power_drop_fraction * limit);
  episode(power_drop_, "power_drop", h.max_drop_w > drop_w, r, out, [&] {
    AlertEvent a;
    a.value = h.max_drop_w;
    a.threshold = drop_w;
    a.message = fmt::format(
        "GPU power fell by {} between two readings while steps continued (now {} avg): a "
        "power-capping event, a stalled rank or lost work on this GPU",
        watts(h.max_drop_w), watts(h.avg_power_w));
    return a;
  });

  // thermal_throttle / power_throttle, with the step time they cost
  const bool thermal = (h.throttle_reasons & kThermalThrottle) != 0;
  const bool power = (h.throttle_reasons & kPowerThrottle) != 0;
  auto throttle_alert = [&](const char* what) {
    AlertEvent a;
    a.value = step_ms;
    if (unthrottled_steps_ > 0) a.baseline = unthrottled_step_ms_;
    a.threshold = 0;
    const double change =
        unthrottled_steps_ > 0 ? 100.0 * (step_ms / unthrottled_step_ms_ - 1.0) : 0.0;
    nlohmann::ordered_json reasons = throttle_reason_names(h.throttle_reasons);
    a.details = {{"reasons", reasons}, {"sm_clock_mhz", h.sm_clock_mhz}};
    a.message = unthrottled_steps_ > 0
                    ? fmt::format(
                          "GPU clocks {} (SM {:.0f} MHz); step time {:+.0f}% against "
                          "unthrottled steps ({:.1f} ms vs {:.1f} ms)",
                          what, h.sm_clock_mhz, change, step_ms, unthrottled_step_ms_)
                    : fmt::format("GPU clocks {} (SM {:.0f} MHz)", what, h.sm_clock_mhz);
    return a;
  };
  episode(thermal_, "thermal_throttle", warm && thermal, r, out,
          [&] { return throttle_alert("are thermally throttled: the GPU is too hot"); });
  episode(power_cap_, "power_throttle", warm && power, r, out,
          [&] { return throttle_alert("are held down by the power cap"); });
  if (warm && !thermal && !power) {  // warmup steps (compiling, allocating) are no baseline
    ++unthrottled_steps_;
    unthrottled_step_ms_ +=
        (step_ms - unthrottled_step_ms_) / static_cast<double>(unthrottled_steps_);
  }
}

}  // namespace steptrace::detail
