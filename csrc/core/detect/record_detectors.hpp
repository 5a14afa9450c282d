// The record detectors together: pure, deterministic functions of the step records (fed
// in step order on the writer thread, or by an offline replay) that return alerts. Each
// keeps O(window) memory and does O(log W) work per step, except when an alert fires.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../alert.hpp"
#include "../step_record.hpp"
#include "../telemetry_stage.hpp"
#include "checkpoint_detector.hpp"
#include "device_diagnosis_detector.hpp"
#include "memory_growth_detector.hpp"
#include "shift_detector.hpp"
#include "slow_step_detector.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {

/// The record detectors together, in the order the writer thread (and an offline
/// replay) runs them on each step record. Events about a step carry its end as unix_ns
/// (a stall held for a while, that of its own step).
class RecordDetectors {
 public:
  RecordDetectors(const Config& config, const PhaseNames& names, std::int64_t host_limit_bytes)
      : slow_(config, names),
        shift_(config, names),
        window_(config.window),
        memory_(config, names, host_limit_bytes),
        device_(config),
        hw_(config) {}
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);
  /// The run ended: resolves the episodes still open that count repeats.
  void finish(std::vector<AlertEvent>& out) { slow_.finish(out); }
  const SlowStepDetector& slow() const { return slow_; }
  const MemoryGrowthDetector& memory() const { return memory_; }

 private:
  // One slowdown, one alert: a per-step step_regression while a shift episode is open, or
  // for slow steps that began before the shift alert, is folded into it (dropped with its
  // resolved event); one the per-step rules raised first
  // keeps the shift detector quiet for two windows (it takes the slower steps as the norm).
  void fold_into_shift(const StepRecord& r, std::size_t first, std::vector<AlertEvent>& out);
  bool shifted_already(const AlertEvent& e) const;

  SlowStepDetector slow_;
  ShiftDetector shift_;
  std::int64_t window_;
  std::int64_t last_slow_alert_ = -(std::int64_t{1} << 40);
  bool folded_ = false;  // a step_regression folded into the shift episode awaits its end
  MemoryGrowthDetector memory_;
  DeviceDiagnosisDetector device_;
  TelemetryDetector hw_;
  CheckpointDetector checkpoints_;
};

}  // namespace steptrace::detail
