// Python's garbage collections, as gc.callbacks reports them (issue 52): a collection's
// start and stop come from whichever thread collected, under the GIL, so they never run
// at the same time as each other; the training thread takes the sums at a step's start
// (the gap before it) and end (the step). No allocation, no lock: a handful of relaxed
// atomics, touched once per collection and read once per step boundary.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "step_record.hpp"

namespace steptrace::detail {

class GcPauses {
 public:
  /// A collection of `generation` began at `now_ns` (any monotonic clock). Any thread.
  void begin(int generation, std::int64_t now_ns) noexcept {
    if (generation < 0 || generation >= static_cast<int>(kGcGenerations)) generation = 2;
    generation_ = generation;
    begin_ns_.store(now_ns, std::memory_order_relaxed);
  }
  /// The collection begun last ended at `now_ns`; nothing when none was begun (the
  /// callback was installed during one). Any thread.
  /// Returns the collection's time (0: none). Any thread.
  std::int64_t end(std::int64_t now_ns) noexcept {
    const std::int64_t began = begin_ns_.exchange(kNone, std::memory_order_relaxed);
    if (began == kNone || now_ns < began) return 0;
    ns_[static_cast<std::size_t>(generation_)].fetch_add(now_ns - began, std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_release);  // after its time: take() sees both
    return now_ns - began;
  }
  /// Whether a collection ended since the last take (one load: the step's usual path).
  bool pending() const noexcept { return count_.load(std::memory_order_relaxed) != 0; }
  /// Moves the sums into `into` (by generation) and adds their count to `count`.
  void take(std::array<std::int64_t, kGcGenerations>& into, std::int32_t& count) noexcept {
    count += count_.exchange(0, std::memory_order_acquire);
    for (std::size_t g = 0; g < kGcGenerations; ++g) {
      into[g] = ns_[g].exchange(0, std::memory_order_relaxed);
    }
  }

 private:
  static constexpr std::int64_t kNone = -1;
  std::atomic<std::int64_t> begin_ns_{kNone};
  int generation_ = 0;  // of the collection in progress (written before begin_ns_)
  std::array<std::atomic<std::int64_t>, kGcGenerations> ns_{};
  std::atomic<std::int32_t> count_{0};
};

}  // namespace steptrace::detail
