#include "memory_growth_detector.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "../quantile.hpp"

namespace steptrace::detail {
namespace {

std::string mib(double bytes) { return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024.0)); }

}  // namespace

MemoryGrowthDetector::MemoryGrowthDetector(const Config& config, const PhaseNames& names,
                                           std::int64_t host_limit_bytes)
    : config_(config),
      names_(names),
      host_limit_bytes_(host_limit_bytes),
      window_(static_cast<std::size_t>(config.window)) {}

std::vector<MemoryGrowthDetector::Point> MemoryGrowthDetector::ordered_window() const {
  std::vector<Point> ordered(count_);
  const std::size_t start = count_ < window_.size() ? 0 : next_;
  for (std::size_t i = 0; i < count_; ++i) ordered[i] = window_[(start + i) % window_.size()];
  return ordered;
}

// Rising: the medians of the points' four quarters each clearly above the one before,
// "clearly" meaning by more than 3 standard errors estimated from the quarters' own
// spread (MAD), and steadily: the smallest of the three rises is at least a quarter of
// the largest. A linear or periodic leak passes even when tiny; a single jump (two
// plateaus), a jump followed by a slow creep, a cache warming up and noise do not.
bool MemoryGrowthDetector::rising(const std::vector<Point>& points) {
  if (points.size() < kMinTrendPoints) return false;
  const std::size_t q = points.size() / 4;
  const std::size_t first = points.size() - 4 * q;  // the newest 4q points
  constexpr double kMedianSe = 1.2533;              // s.e. of a median / (sigma / sqrt(n))
  double prev_median = 0, prev_se = 0;
  double smallest_rise = INFINITY, largest_rise = 0;
  std::vector<double> quarter(q);
  for (std::size_t k = 0; k < 4; ++k) {
    for (std::size_t i = 0; i < q; ++i) quarter[i] = points[first + k * q + i].value;
    const double m = median_of(quarter);
    for (double& v : quarter) v = std::abs(v - m);
    const double se =
        kMedianSe * kMadToSigma * median_of(quarter) / std::sqrt(static_cast<double>(q));
    if (k > 0) {
      const double rise = m - prev_median;
      if (!(rise > 3.0 * std::sqrt(se * se + prev_se * prev_se) && rise > 0)) return false;
      smallest_rise = std::min(smallest_rise, rise);
      largest_rise = std::max(largest_rise, rise);
    }
    prev_median = m;
    prev_se = se;
  }
  return smallest_rise >= 0.25 * largest_rise;
}

double MemoryGrowthDetector::theil_sen_slope(const std::vector<Point>& ordered) {
  std::vector<double> slopes;
  slopes.reserve(ordered.size() * (ordered.size() - 1) / 2);
  for (std::size_t i = 0; i < ordered.size(); ++i) {
    for (std::size_t j = i + 1; j < ordered.size(); ++j) {
      const auto steps = static_cast<double>(ordered[j].step - ordered[i].step);
      if (steps > 0) slopes.push_back((ordered[j].value - ordered[i].value) / steps);
    }
  }
  return median_of(std::move(slopes));
}

void MemoryGrowthDetector::reset(Metric metric) {
  metric_ = metric;
  baseline_points_ = 0;
  baseline_ = 0;
  next_ = count_ = 0;
  active_ = attributing_ = false;
}

// After the alert: sums what each phase retained over kAttributedSteps measured steps,
// then names the phase that retained most in an update event.
void MemoryGrowthDetector::attribute(const StepRecord& r, std::vector<AlertEvent>& out) {
  if (r.phase_memory) {
    if (phase_growth_.size() < names_.size()) phase_growth_.resize(names_.size(), 0.0);
    const auto retained = retained_by_phase(r);
    for (std::uint16_t i = 0; i < r.phase_count; ++i) {
      phase_growth_[r.phase_ids[i]] += static_cast<double>(retained[i]);
    }
    ++attributed_steps_;
  }
  if (attributed_steps_ < kAttributedSteps) {
    if (r.step - attribution_start_ > kMaxAttributionWait) attributing_ = false;  // none came
    return;
  }
  attributing_ = false;
  std::string phase;
  double phase_bytes = 0, total_bytes = 0;
  for (std::size_t id = 0; id < phase_growth_.size(); ++id) {
    total_bytes += std::max(phase_growth_[id], 0.0);
    if (phase_growth_[id] > phase_bytes) {
      phase_bytes = phase_growth_[id];
      phase = names_.name(static_cast<std::uint16_t>(id));
    }
  }
  AlertEvent u;
  u.update = true;
  u.type = "memory_growth";
  u.step = r.step;
  u.first_step = episode_start_;
  u.phase = phase;
  u.message = phase.empty()
                  ? fmt::format(
                        "no phase kept memory over {} measured steps: the growth is outside "
                        "the phases (between steps, or in other threads)",
                        attributed_steps_)
                  : fmt::format(
                        "memory grows in phase {}: it kept {} per step over {} measured steps "
                        "({:.0f}% of what the phases kept)",
                        phase, mib(phase_bytes / attributed_steps_), attributed_steps_,
                        total_bytes > 0 ? 100.0 * phase_bytes / total_bytes : 0.0);
  u.details = {{"measured_steps", attributed_steps_},
               {"phase_bytes_per_step", phase_bytes / attributed_steps_}};
  out.push_back(std::move(u));
}

void MemoryGrowthDetector::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  if (r.step < config_.warmup_steps) return;
  // Only figures measured at this step: a repeated (forward-filled) one flattens the trend.
  Metric metric = kNone;
  std::int64_t raw = -1;
  if (r.memory.allocated_bytes >= 0) {
    metric = kAllocated, raw = r.memory.allocated_bytes;
  } else if (r.memory.heap_bytes >= 0) {
    metric = kHeap, raw = r.memory.heap_bytes;
  } else if (r.rss_fresh && r.memory.rss_bytes >= 0) {
    metric = kRss, raw = r.memory.rss_bytes;
  }
  if (attributing_) attribute(r, out);
  if (metric == kNone || metric < metric_) return;
  if (metric > metric_) reset(metric);
  const double value = static_cast<double>(raw);
  if (baseline_points_ < config_.min_history) {  // the peak of the first steps is the baseline
    baseline_ = std::max(baseline_, value);
    ++baseline_points_;
    return;
  }
  window_[next_] = {r.step, value};
  next_ = (next_ + 1) % window_.size();
  count_ = std::min(count_ + 1, window_.size());

  const double limit = baseline_ * (1.0 + config_.memory_growth_pct / 100.0);
  if (active_) {
    if (value <= limit) {
      AlertEvent done;
      done.resolved = true;
      done.type = "memory_growth";
      done.step = r.step;
      done.first_step = episode_start_;
      done.message = fmt::format("memory is back within {}% of the {} baseline",
                                 config_.memory_growth_pct, mib(baseline_));
      out.push_back(std::move(done));
      active_ = false;
    }
    return;
  }
  if (value <= limit) return;
  // The trend over the newest 20 points, 50, and the whole window: a leak that began
  // recently is seen as soon as the short scale shows it. Minimum evidence: the trend adds
  // at least a quarter of the tolerance over the points it was found in.
  const std::vector<Point> window = ordered_window();
  const double tolerance = limit - baseline_;
  double slope = 0;
  std::size_t points = 0;
  for (const std::size_t n : {kMinTrendPoints, std::size_t{50}, window.size()}) {
    if (n > window.size()) break;
    const std::vector<Point> recent(window.end() - static_cast<std::ptrdiff_t>(n), window.end());
    if (!rising(recent)) continue;
    const double s = theil_sen_slope(recent);
    if (s > 0 &&
        s * static_cast<double>(recent.back().step - recent.front().step) >= 0.25 * tolerance) {
      slope = s;
      points = n;
      break;
    }
  }
  if (points == 0) return;
  const auto span = static_cast<double>(window.back().step - window[window.size() - points].step);

  const char* metric_name = metric == kAllocated ? "allocated_bytes"
                            : metric == kHeap    ? "heap_bytes"
                                                 : "rss_bytes";
  const double total = metric == kAllocated && r.memory.device_total_bytes > 0
                           ? static_cast<double>(r.memory.device_total_bytes)
                           : static_cast<double>(host_limit_bytes_);
  const double steps_left = total > value ? (total - value) / slope : -1.0;  // -1: unknown

  AlertEvent a;
  a.type = "memory_growth";
  a.step = r.step;
  a.value = value;
  a.baseline = baseline_;
  a.threshold = limit;
  a.message = fmt::format(
      "memory ({}) grew to {}, {:.1f}% above the {} of the first steps, rising {:.1f} "
      "KiB/step over the last {} measured steps{}: look for tensors kept across steps (e.g. "
      "a loss appended to a list without .item()); the phase follows once measured",
      metric_name, mib(value), 100.0 * (value / baseline_ - 1.0), mib(baseline_), slope / 1024.0,
      points, steps_left >= 0 ? fmt::format("; full in about {:.0f} steps", steps_left) : "");
  a.details = {{"metric", metric_name},
               {"bytes_per_step", slope},
               {"growth_pct_threshold", config_.memory_growth_pct},
               {"trend_points", points},
               {"trend_steps", span},
               {"steps_until_full",
                steps_left >= 0 ? nlohmann::ordered_json(steps_left) : nlohmann::ordered_json()},
               {"limit_bytes", total}};
  out.push_back(std::move(a));
  active_ = true;
  episode_start_ = r.step;
  attributing_ = true;
  attribution_start_ = r.step;
  attributed_steps_ = 0;
  phase_growth_.assign(names_.size(), 0.0);
}

}  // namespace steptrace::detail
