// slow_checkpoint: a checkpoint interval much longer than the run's earlier ones. Pure and
// deterministic: fed the step records in step order (writer thread), returns alerts.
#pragma once

#include <cstddef>
#include <vector>

#include "../alert.hpp"
#include "../step_record.hpp"

namespace steptrace::detail {

/// slow_checkpoint: a checkpoint interval (IntervalKind::kCheckpoint) that took more than
/// kSlowFactor x the median of the run's earlier ones (at least kMinEarlier of them) and
/// at least kMinExcessS longer: the filesystem slowed down (or the checkpoint grew).
/// Intervals listed in step records only (not those after the last step).
class CheckpointDetector {
 public:
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);

  static constexpr double kSlowFactor = 3.0;
  static constexpr std::size_t kMinEarlier = 2;
  static constexpr double kMinExcessS = 1.0;

 private:
  std::vector<double> earlier_s_;  // the run's checkpoint durations so far (the last 100)
};

}  // namespace steptrace::detail
