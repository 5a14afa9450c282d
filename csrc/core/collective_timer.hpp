// Host timing of collectives (a DDP bucket's all-reduce launched from a communication
// hook and completed on the backend's thread): how long the step had communication
// outstanding, and how long it stayed blocked after its last collective was launched.
// Lock-free: begin/end run on any thread, take() on the training thread once per step.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "step_record.hpp"

namespace steptrace::detail {

class CollectiveTimer {
 public:
  /// A collective is launched at `now_ns` (on the profiler's clock).
  void begin(std::int64_t now_ns) noexcept {
    in_flight_.fetch_add(1, std::memory_order_relaxed);
    store_min(first_begin_ns_, now_ns);
    store_max(last_begin_ns_, now_ns);
  }
  /// The collective launched at `begin_ns` completed at `now_ns`, with phase slot
  /// `phase` (an interned phase id, -1: none) open on the training thread. `host_blocked`
  /// false: the host did not wait for it (its work ran on the device while the host went
  /// on): outstanding time only, never blocked time. `between_steps`: it completed while no
  /// step was in progress; the host's wait for it is the gap's (between_blocked_ns).
  void end(std::int64_t begin_ns, std::int64_t now_ns, int phase, bool host_blocked = true,
           std::int64_t bytes = 0, std::int64_t bus_bytes = 0,
           bool between_steps = false) noexcept {
    busy_sum_ns_.fetch_add(std::max<std::int64_t>(0, now_ns - begin_ns), std::memory_order_relaxed);
    if (host_blocked && between_steps) {
      between_blocked_ns_.fetch_add(std::max<std::int64_t>(0, now_ns - begin_ns),
                                    std::memory_order_relaxed);
    }
    if (bytes > 0) {
      bytes_.fetch_add(bytes, std::memory_order_relaxed);
      bus_bytes_.fetch_add(bus_bytes, std::memory_order_relaxed);
    }
    store_max(last_end_ns_, now_ns);
    if (host_blocked && store_max(last_blocking_end_ns_, now_ns)) {
      end_phase_.store(phase, std::memory_order_relaxed);
    }
    count_.fetch_add(1, std::memory_order_relaxed);
    in_flight_.fetch_sub(1, std::memory_order_relaxed);
  }
  int in_flight() const noexcept { return in_flight_.load(std::memory_order_relaxed); }

  /// The figures of the collectives completed since the last take(), and a reset. A
  /// collective completing during the call may be split between two steps; in the usual
  /// case (DDP waits for its buckets inside backward) none is running then.
  CommStats take() noexcept {
    CommStats s;
    s.count = count_.exchange(0, std::memory_order_relaxed);
    if (s.count == 0) return s;
    const std::int64_t sum = busy_sum_ns_.exchange(0, std::memory_order_relaxed);
    const std::int64_t first = first_begin_ns_.exchange(kNone, std::memory_order_relaxed);
    const std::int64_t last_begin = last_begin_ns_.exchange(-kNone, std::memory_order_relaxed);
    const std::int64_t last_end = last_end_ns_.exchange(-kNone, std::memory_order_relaxed);
    const std::int64_t blocking_end =
        last_blocking_end_ns_.exchange(-kNone, std::memory_order_relaxed);
    s.exposed_phase = end_phase_.exchange(-1, std::memory_order_relaxed);
    s.bytes = bytes_.exchange(0, std::memory_order_relaxed);
    s.bus_bytes = bus_bytes_.exchange(0, std::memory_order_relaxed);
    s.between_blocked_ns = between_blocked_ns_.exchange(0, std::memory_order_relaxed);
    // Overlapping collectives (queued buckets) count once: the outstanding time is at
    // most the span from the first launch to the last completion.
    s.busy_ns = first <= last_end ? std::min(sum, last_end - first) : sum;
    // (compared before subtracting: -kNone, none the host waited for, must not overflow)
    s.exposed_ns = blocking_end > last_begin ? blocking_end - last_begin : 0;
    return s;
  }

 private:
  static constexpr std::int64_t kNone = INT64_MAX;
  static void store_min(std::atomic<std::int64_t>& a, std::int64_t v) noexcept {
    std::int64_t cur = a.load(std::memory_order_relaxed);
    while (v < cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
    }
  }
  static bool store_max(std::atomic<std::int64_t>& a, std::int64_t v) noexcept {
    std::int64_t cur = a.load(std::memory_order_relaxed);
    while (v > cur) {
      if (a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) return true;
    }
    return false;
  }

  std::atomic<int> in_flight_{0};
  std::atomic<std::int64_t> count_{0};
  std::atomic<std::int64_t> busy_sum_ns_{0};
  std::atomic<std::int64_t> first_begin_ns_{kNone};
  std::atomic<std::int64_t> last_begin_ns_{-kNone};
  std::atomic<std::int64_t> last_end_ns_{-kNone};
  std::atomic<std::int64_t> last_blocking_end_ns_{-kNone};  // of those the host waited for
  std::atomic<int> end_phase_{-1};
  std::atomic<std::int64_t> bytes_{0};      // payload of the collectives completed (nccl-tests' S)
  std::atomic<std::int64_t> bus_bytes_{0};  // the same times their bus factors
  std::atomic<std::int64_t> between_blocked_ns_{0};  // host-blocked, completed between steps
};

}  // namespace steptrace::detail
