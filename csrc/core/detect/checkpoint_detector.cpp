#include "checkpoint_detector.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "../quantile.hpp"

namespace steptrace::detail {

void CheckpointDetector::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  constexpr std::size_t kKept = 100;
  for (std::uint8_t i = 0; i < r.between.listed; ++i) {
    const IntervalEntry& e = r.between.intervals[i];
    if (e.kind != IntervalKind::kCheckpoint) continue;
    const double seconds = static_cast<double>(e.duration_ns) / 1e9;
    if (earlier_s_.size() >= kMinEarlier) {
      const double median = median_of(earlier_s_);
      if (seconds > kSlowFactor * median && seconds - median >= kMinExcessS) {
        AlertEvent a;
        a.type = "slow_checkpoint";
        a.step = r.step;
        a.value = seconds;
        a.baseline = median;
        a.threshold = std::max(kSlowFactor * median, median + kMinExcessS);
        a.message = fmt::format(
            "the checkpoint before step {} took {:.2f} s, {:.1f}x the run's earlier ones "
            "(median {:.2f} s over {}): the filesystem is slower than it was (or the checkpoint "
            "grew); check the storage's load and quota",
            r.step, seconds, seconds / median, median, earlier_s_.size());
        a.details = {{"checkpoint_s", seconds},
                     {"median_s", median},
                     {"earlier", earlier_s_.size()},
                     {"start_unix_ns", e.start_unix_ns}};
        out.push_back(std::move(a));
      }
    }
    if (earlier_s_.size() == kKept) earlier_s_.erase(earlier_s_.begin());
    earlier_s_.push_back(seconds);
  }
}

}  // namespace steptrace::detail
