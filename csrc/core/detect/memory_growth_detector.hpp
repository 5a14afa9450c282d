// memory_growth: a leak, from the trend of the memory measured per step. Pure and
// deterministic: fed the step records in step order (writer thread), returns alerts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../alert.hpp"
#include "../step_record.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {

/// memory_growth: after warmup, memory (torch allocated bytes, else the C heap's in-use
/// bytes, else RSS; only steps where it was freshly measured) more than
/// memory_growth_pct above the peak of the first min_history measurements, with a
/// steadily rising trend over the newest 20, 50 or `window` measurements (the medians of
/// their four quarters each significantly above the last) that itself adds at least a
/// quarter of the tolerance, is a leak; its rate is the Theil-Sen slope per step. The alert fires
/// at once; the phase it grows in is measured afterwards and named in a follow-up (update) event.
class MemoryGrowthDetector {
 public:
  /// limit_bytes: memory of the host the heap or RSS fills; 0 if unknown.
  MemoryGrowthDetector(const Config& config, const PhaseNames& names,
                       std::int64_t host_limit_bytes);
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);
  /// While true, the training thread measures memory per phase for attribution.
  bool wants_phase_memory() const { return attributing_; }

 private:
  // Memory figures in order of preference; a better one appearing restarts the detector.
  enum Metric { kNone = 0, kRss = 1, kHeap = 2, kAllocated = 3 };
  static constexpr int kAttributedSteps = 5;        // steps measured per phase to name it
  static constexpr int kMaxAttributionWait = 1000;  // steps to wait for them, at most
  static constexpr std::size_t kMinTrendPoints = 20;
  struct Point {
    std::int64_t step;
    double value;
  };
  std::vector<Point> ordered_window() const;  // oldest first
  static bool rising(const std::vector<Point>& points);
  static double theil_sen_slope(const std::vector<Point>& ordered);
  void reset(Metric metric);
  void attribute(const StepRecord& r, std::vector<AlertEvent>& out);

  const Config& config_;
  const PhaseNames& names_;
  std::int64_t host_limit_bytes_;
  Metric metric_ = kNone;
  std::int64_t baseline_points_ = 0;
  double baseline_ = 0;
  std::vector<Point> window_;  // ring of the last `window` measurements
  std::size_t next_ = 0;
  std::size_t count_ = 0;
  bool active_ = false;
  std::int64_t episode_start_ = 0;
  bool attributing_ = false;
  std::int64_t attribution_start_ = 0;
  int attributed_steps_ = 0;
  std::vector<double> phase_growth_;  // bytes by phase id, summed while attributing
};

}  // namespace steptrace::detail
