// The C heap's in-use bytes (glibc's mallinfo2: uordblks + hblkhd), the memory_growth
// signal on the CPU: exact to the byte, and it moves with a leak even where the heap
// reuses memory it already holds (RSS does not). mallinfo2 walks every free chunk of
// every arena under its lock, so one call costs about 1 us in a young process, 5 us in
// one that has trained a small torch model, and 100-300 us in one with pandas and
// matplotlib loaded. The sampler therefore reads
//   - at the first step (the first measure of a read's cost), then not during the rest of
//     warmup, whose figures neither the memory_growth detector nor the baseline uses,
//   - every step of the baseline steps after warmup (its own baseline: their peak; the
//     detector's baseline needs them as much),
//   - every step for a burst of kBurstSteps while the last reading is above that
//     baseline by half the memory_growth tolerance (enough points for the trend test at
//     once), after which the burst's peak becomes its baseline,
//   - otherwise sparsely: after the baseline (and after each burst) at gaps of 2, 4, 8,
//     ... steps, so that a leak from the start is seen within a few dozen steps, growing
//     to every k-th step, k keeping the reads under 0.02% of the step interval (issue 30:
//     at 1% a 5 us read on a 0.5 ms step was read at every step, as much as all the rest
//     of steptrace's per-step cost; at 0.1% it still took a fifth of the 5 us goal).
// Training thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {

class HeapSampler {
 public:
  /// A reading of the heap's in-use bytes, -1 where there is none.
  using Reading = std::function<std::int64_t()>;

  /// False where the C library has no mallinfo2.
  static bool available() noexcept;
  /// `clock` and `reading` replace the host clock and mallinfo2 (read()) in tests: the
  /// schedule is a function of the step interval and a reading's cost on that clock.
  explicit HeapSampler(const Config& config, std::unique_ptr<Clock> clock = nullptr,
                       Reading reading = nullptr);

  /// At the end of step `step`: fills out.heap_bytes when it reads this step. Inline: a
  /// step that does not read touches one line of the sampler (issue 30).
  void sample(std::int64_t step, MemorySample& out) noexcept {
    if (step >= dense_until_step_) {
      if (burst_left_ == 0 && ++since_read_ < gap_) return;
    } else if (step > 0 && step < baseline_from_step_) {
      return;  // warmup after its first step
    }
    read_into(step, out);
  }
  /// In-use bytes now, from the sampler's reading (phase attribution).
  std::int64_t read_now() noexcept { return reading_ ? reading_() : read(); }
  /// In-use bytes now, from mallinfo2; -1 without it.
  static std::int64_t read() noexcept;

  int stride() const noexcept { return stride_; }

 private:
  static constexpr double kBudget = 0.0002;  // share of the step interval sparse reads may take
  static constexpr int kBurstSteps = 40;
  static constexpr int kMaxStride = 1 << 20;
  void read_into(std::int64_t step, MemorySample& out) noexcept;

  // what sample() reads at every step, first
  std::int64_t dense_until_step_;  // warmup + baseline steps
  int burst_left_ = 0;
  int since_read_ = 0;
  int gap_ = 1;                      // steps from one sparse read to the next: min(ramp_, stride_)
  std::int64_t baseline_from_step_;  // warmup_steps

  std::unique_ptr<Clock> clock_;
  Reading reading_;       // empty: read()
  double suspect_ratio_;  // 1 + half the tolerance
  double baseline_ = 0;
  std::int64_t last_read_step_ = -1;  // the last read, and when it ended
  std::int64_t last_done_ns_ = 0;
  double interval_ns_ = 0;
  double cost_ns_ = 0;
  int stride_ = 1;  // the budget's gap between sparse reads
  int ramp_ = 1;    // the gap of the ramp up to it (doubles with every sparse read)
  double burst_peak_ = 0;
};

}  // namespace steptrace::detail
