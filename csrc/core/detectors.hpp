// Detectors: pure, deterministic functions of the step records (fed in step order on the
// writer thread) that return alerts. Each keeps O(window) memory and does O(log W) work
// per step, except when an alert fires.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "alert.hpp"
#include "rolling_median.hpp"
#include "step_record.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {

/// step_regression: regression_min_steps consecutive iterations (data + step) over
/// regression_threshold x the trailing median; stall: one iteration over stall_threshold
/// x that median. Names the phase (data included) that grew most against its own median.
/// One alert per episode (a regression may escalate to a stall), and a resolved event
/// when iterations are normal again.
class SlowStepDetector {
 public:
  SlowStepDetector(const Config& config, const PhaseNames& names);
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);
  /// Median iteration time of the window (ms), and how many steps it holds.
  double median_iteration_ms() const { return iteration_.median(); }
  std::size_t history() const { return iteration_.size(); }

 private:
  const Config& config_;
  const PhaseNames& names_;
  RollingMedian iteration_;
  RollingMedian data_;
  std::vector<std::unique_ptr<RollingMedian>> phases_;  // by phase id, created when first seen
  std::vector<bool> present_;                           // scratch: phases in this step
  int level_ = 0;  // 0 normal, 1 regression, 2 stall (highest alert of this episode)
  std::int64_t episode_start_ = 0;
  int slow_streak_ = 0;  // consecutive steps over regression_threshold
  std::int64_t streak_start_ = 0;
};

/// memory_growth: after warmup, memory (torch allocated, else RSS) more than
/// memory_growth_pct above the peak of the first min_history steps, with a rising trend
/// across the window (the medians of its four quarters each significantly above the
/// last), is a leak; its rate is the Theil-Sen slope of the window.
class MemoryGrowthDetector {
 public:
  /// limit_bytes: memory of the device (or host) the metric fills; 0 if unknown.
  MemoryGrowthDetector(const Config& config, const PhaseNames& names,
                       std::int64_t host_limit_bytes);
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);
  /// While true, the training thread measures memory per phase for attribution.
  bool wants_phase_memory() const { return attributing_; }

 private:
  // Steps measured per phase before naming the phase; should none arrive, the alert
  // fires without a phase after kMaxAttributionWait steps over the limit.
  static constexpr int kMinAttributedSteps = 5;
  static constexpr int kMaxAttributionWait = 200;
  static constexpr std::size_t kMinTrendPoints = 20;
  std::vector<double> ordered_window() const;  // oldest first
  bool rising() const;
  double theil_sen_slope() const;

  const Config& config_;
  const PhaseNames& names_;
  std::int64_t host_limit_bytes_;
  std::int64_t baseline_steps_ = 0;
  double baseline_ = 0;
  std::vector<double> window_;  // ring of the last `window` values
  std::size_t next_ = 0;
  std::size_t count_ = 0;
  bool attributing_ = false;
  bool active_ = false;
  std::int64_t episode_start_ = 0;
  int attributed_steps_ = 0;
  int over_steps_ = 0;                // steps above the limit in this suspicion
  std::vector<double> phase_growth_;  // bytes by phase id, summed while attributing
};

/// Diagnoses from kernel activity and hardware counters, on the steps that have them
/// (after warmup): low_tensor_core (tensor-core activity below tensor_core_min_pct where
/// matmul kernels take at least matmul_dominated_pct of the compute time), memory_bound
/// (occupancy below occupancy_min_pct with DRAM throughput above dram_bound_pct) and
/// comm_bound (NCCL kernels over comm_bound_pct of the step). Each fires once
/// regression_min_steps observed steps in a row meet it, once per episode, and resolves
/// after as many observed steps in a row without it.
class DeviceDiagnosisDetector {
 public:
  explicit DeviceDiagnosisDetector(const Config& config) : config_(config) {}
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);

 private:
  struct Episode {
    bool active = false;
    int hits = 0;    // consecutive observed steps meeting the condition
    int misses = 0;  // consecutive observed steps not meeting it, while active
    std::int64_t hits_from = 0;
    std::int64_t start = 0;
  };
  // The text of an alert, built only when it fires.
  struct Diagnosis {
    std::string message;
    nlohmann::ordered_json details;
  };
  template <typename Explain>
  void update(Episode& e, const char* type, bool condition, const StepRecord& r, double value,
              double threshold, Explain explain, std::vector<AlertEvent>& out);

  const Config& config_;
  Episode tensor_;
  Episode memory_;
  Episode comm_;
};

/// hang: a step in flight longer than hang_threshold x the median iteration (at least
/// hang_min_s; hang_floor_s while the history is short). One alert per hung step; a
/// resolved event when that step ends.
class HangDetector {
 public:
  explicit HangDetector(const Config& config) : config_(config) {}
  /// step < 0: no step in flight. phase: the innermost running phase, or empty.
  std::optional<AlertEvent> check(std::int64_t now_ns, std::int64_t step, std::int64_t start_ns,
                                  const std::string& phase, double median_ms, bool history_ok);

 private:
  const Config& config_;
  std::int64_t flagged_step_ = -1;
};

}  // namespace steptrace::detail
