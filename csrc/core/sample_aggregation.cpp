#include "sample_aggregation.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace steptrace::detail {

AggregationResult aggregate_samples(const std::vector<PmSample>& samples,
                                    const std::vector<StepWindow>& steps, std::size_t num_metrics,
                                    const DecodeLosses& losses) {
  AggregationResult out;
  out.dropped_samples = losses.dropped_samples;
  out.overflow = losses.overflow;
  // steps sorted by start (indices, so the output keeps the caller's order)
  std::vector<std::size_t> order(steps.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return steps[a].start_ns < steps[b].start_ns; });
  std::vector<std::int64_t> ends(order.size());
  for (std::size_t i = 0; i < order.size(); ++i) ends[i] = steps[order[i]].end_ns;

  std::vector<std::vector<double>> sum(steps.size(), std::vector<double>(num_metrics, 0.0));
  std::vector<std::vector<double>> weight(steps.size(), std::vector<double>(num_metrics, 0.0));
  std::vector<double> covered(steps.size(), 0.0);
  std::vector<int> count(steps.size(), 0);

  for (const auto& s : samples) {
    if (s.end_ns < s.start_ns || s.values.size() != num_metrics) {
      ++out.malformed_samples;
      continue;
    }
    const std::int64_t s_start = s.start_ns;
    const std::int64_t s_end = s.end_ns == s.start_ns ? s.start_ns + 1 : s.end_ns;
    bool any_valid = false;
    for (double v : s.values) any_valid = any_valid || std::isfinite(v);
    // the first step (by start) whose end is after the sample's start
    std::size_t i = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), s_start) -
                                             ends.begin());
    bool placed = false;
    for (; i < order.size() && steps[order[i]].start_ns < s_end; ++i) {
      const StepWindow& w = steps[order[i]];
      const std::int64_t overlap = std::min(s_end, w.end_ns) - std::max(s_start, w.start_ns);
      if (overlap <= 0) continue;
      const std::size_t k = order[i];
      placed = true;
      ++count[k];
      if (any_valid) covered[k] += static_cast<double>(overlap);
      for (std::size_t m = 0; m < num_metrics; ++m) {
        if (!std::isfinite(s.values[m])) continue;
        sum[k][m] += s.values[m] * static_cast<double>(overlap);
        weight[k][m] += static_cast<double>(overlap);
      }
    }
    if (!placed) ++out.outside_samples;
  }

  out.steps.reserve(steps.size());
  for (std::size_t k = 0; k < steps.size(); ++k) {
    StepCounters c;
    c.step = steps[k].step;
    c.samples = count[k];
    c.values.resize(num_metrics, std::numeric_limits<double>::quiet_NaN());
    for (std::size_t m = 0; m < num_metrics; ++m) {
      if (weight[k][m] > 0) c.values[m] = sum[k][m] / weight[k][m];
    }
    const double len = static_cast<double>(steps[k].end_ns - steps[k].start_ns);
    c.coverage_pct = len > 0 ? std::min(100.0, 100.0 * covered[k] / len) : 0.0;
    out.steps.push_back(std::move(c));
  }
  return out;
}

}  // namespace steptrace::detail
