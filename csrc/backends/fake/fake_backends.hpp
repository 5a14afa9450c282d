// Fake twins of the host backends for tests: a clock that moves only when told, and a
// memory source that reports whatever the test set. Header-only, always available.
#pragma once

#include <atomic>
#include <cstdint>

#include "steptrace/backend.hpp"

namespace steptrace::fake {

/// A clock that stands still until advance() moves it; optionally ticks by a fixed
/// amount on every read so that each phase boundary gets a distinct time.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(std::int64_t tick_ns = 0) : tick_ns_(tick_ns) {}
  std::int64_t now_ns() noexcept override {
    return now_ns_.fetch_add(tick_ns_, std::memory_order_relaxed);
  }
  void advance(std::int64_t ns) noexcept { now_ns_.fetch_add(ns, std::memory_order_relaxed); }

 private:
  std::atomic<std::int64_t> now_ns_{1'000'000'000};
  std::int64_t tick_ns_;
};

/// A memory source whose figures the test sets; every sample also counts.
class FakeMemorySource final : public MemorySource {
 public:
  const char* name() const noexcept override { return "fake"; }
  void sample(MemorySample& out) noexcept override {
    ++samples;
    out.allocated_bytes = allocated_bytes;
    out.rss_bytes = rss_bytes;
  }
  std::int64_t live_bytes() noexcept override { return allocated_bytes; }
  std::int64_t min_interval_ns() const noexcept override { return interval_ns; }
  std::int64_t allocated_bytes = 0;
  std::int64_t rss_bytes = 0;
  std::int64_t interval_ns = 0;  // 0: read at every step
  int samples = 0;
};

}  // namespace steptrace::fake
