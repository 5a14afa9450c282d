#include "heap_sampler.hpp"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cmath>

namespace steptrace::detail {
namespace {

double smooth(double avg, double x) { return avg > 0 ? 0.8 * avg + 0.2 * x : x; }

}  // namespace

bool HeapSampler::available() noexcept {
#if defined(__GLIBC__)
  return true;
#else
  return false;
#endif
}

HeapSampler::HeapSampler(const Config& config, std::unique_ptr<Clock> clock, Reading reading)
    : dense_until_step_(static_cast<std::int64_t>(config.warmup_steps) + config.min_history),
      baseline_from_step_(config.warmup_steps),
      clock_(clock ? std::move(clock) : make_host_clock()),
      reading_(std::move(reading)),
      suspect_ratio_(1.0 + config.memory_growth_pct / 200.0) {}

std::int64_t HeapSampler::read() noexcept {
#if defined(__GLIBC__)
  const struct mallinfo2 m = mallinfo2();
  return static_cast<std::int64_t>(m.uordblks + m.hblkhd);
#else
  return -1;
#endif
}

void HeapSampler::read_into(std::int64_t step, MemorySample& out) noexcept {
  // Its own host clock: the profiler's may be a test's fake, and the cost of a read is
  // compared with the step interval on one clock. Read only around a reading: the steps
  // between two readings give the interval.
  const std::int64_t now_ns = clock_->now_ns();
  if (last_read_step_ >= 0 && step > last_read_step_) {
    const auto per_step =
        static_cast<double>(now_ns - last_done_ns_) / static_cast<double>(step - last_read_step_);
    // One long gap (an evaluation, a checkpoint) moves the average a little, not to it.
    interval_ns_ =
        smooth(interval_ns_, interval_ns_ > 0 ? std::min(per_step, 4 * interval_ns_) : per_step);
  }
  if (step >= dense_until_step_ && burst_left_ == 0) ramp_ = std::min(2 * ramp_, kMaxStride);
  since_read_ = 0;
  const std::int64_t bytes = read_now();
  const std::int64_t done_ns = clock_->now_ns();
  last_read_step_ = step;
  last_done_ns_ = done_ns;
  if (bytes < 0) return;
  out.heap_bytes = bytes;
  const auto value = static_cast<double>(bytes);
  cost_ns_ = smooth(cost_ns_, static_cast<double>(done_ns - now_ns));
  if (interval_ns_ > 0) {
    const double k = std::ceil(cost_ns_ / (kBudget * interval_ns_));
    stride_ = static_cast<int>(std::clamp(k, 1.0, static_cast<double>(kMaxStride)));
  }
  gap_ = std::min(ramp_, stride_);
  if (step < dense_until_step_) {
    if (step >= baseline_from_step_) baseline_ = std::max(baseline_, value);
    return;
  }
  if (burst_left_ > 0) {
    burst_peak_ = std::max(burst_peak_, value);
    // The burst's peak is the level to watch from now on: a one-off jump then costs one
    // burst, and a leak, which the detector has seen at every step of it, another later.
    if (--burst_left_ == 0) {
      baseline_ = std::max(baseline_, burst_peak_);
      ramp_ = 1;  // a leak that goes on crosses the new level soon: look again early
      gap_ = 1;
    }
    return;
  }
  if (baseline_ > 0 && value > suspect_ratio_ * baseline_) {
    burst_left_ = kBurstSteps;
    burst_peak_ = value;
  }
}

}  // namespace steptrace::detail
