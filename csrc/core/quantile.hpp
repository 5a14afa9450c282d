// Medians and quantiles of a sample, shared by the detectors and the waste account. Two
// quantile conventions, each kept where its figures are relied on: the nearest rank (the
// slow-step rule's p90/p95 of its window) and linear interpolation between neighbours (the
// shift rule's p10/p25/p50). The median is the mean of the middle two for an even count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace steptrace::detail {

/// MAD -> standard deviation, normal distribution.
inline constexpr double kMadToSigma = 1.4826;

/// The median of ascending `sorted`; 0 when empty.
inline double median_of_sorted(const std::vector<double>& sorted) noexcept {
  const std::size_t n = sorted.size();
  if (n == 0) return 0.0;
  return n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
}

/// The median of `v` in any order (a copy is partially sorted); 0 when empty.
inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  const auto mid = static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  double m = v[static_cast<std::size_t>(mid)];
  if (v.size() % 2 == 0) m = 0.5 * (m + *std::max_element(v.begin(), v.begin() + mid));
  return m;
}

/// The q-quantile of ascending `sorted`, interpolated between its neighbours; 0 when empty.
inline double quantile_of_sorted(const std::vector<double>& sorted, double q) noexcept {
  if (sorted.empty()) return 0.0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[hi] - sorted[lo]);
}

/// The nearest-rank q-quantile of `v` (the ceil(q x n)-th smallest); reorders `v`; 0 when empty.
inline double nearest_rank_quantile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  const auto k = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
  const std::size_t idx = std::min(k, v.size() - 1);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(idx), v.end());
  return v[idx];
}

}  // namespace steptrace::detail
