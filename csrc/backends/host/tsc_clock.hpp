// CLOCK_MONOTONIC read from the CPU's time-stamp counter, for the training thread's step
// and phase boundaries. The kernel's vDSO reads the same counter, but behind an ordering
// fence (rdtscp) and through its data page, a cache line that is cold after the model's
// work: ~45 ns a read after a training step against ~10 for the bare counter, and a step
// reads the clock ~14 times (issue 30).
//
// The map from counter to nanoseconds is the kernel's clock measured, not assumed: a first
// rate from two (counter, CLOCK_MONOTONIC) pairs 100 ms apart, then every second a new
// pair that checks the prediction and re-measures the rate, so NTP's slewing (at most
// 500 ppm) is followed within a second. A prediction off by more than kMaxPpm means the
// counter is not the clock (it stopped, jumped, or differs between CPUs): the map is
// dropped for good and the kernel's clock read again. Used only where the kernel itself
// keeps time with the counter (clocksource "tsc") and the CPU says it is invariant.
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace steptrace {

// 128-bit products: a counter span times a rate in 2^32 fixed point (a GCC/Clang extension).
__extension__ typedef __int128 TscWide;            // NOLINT(modernize-use-using)
__extension__ typedef unsigned __int128 TscUwide;  // NOLINT(modernize-use-using)

// Counter -> nanoseconds: ns = base_ns + (tsc - base_tsc) x mult / 2^32. Pure: fed
// (counter, kernel ns) pairs by its owner.
class TscMap {
 public:
  static constexpr std::int64_t kCalibrateNs = 100'000'000;   // the first rate's span
  static constexpr std::int64_t kReanchorNs = 1'000'000'000;  // then a pair every second
  // A prediction this far off the kernel's clock (parts per million of the span since the
  // last pair, plus kSlackNs for the pairs' own spread) is not slewing: the counter is
  // not a clock here.
  static constexpr std::int64_t kMaxPpm = 1000;
  static constexpr std::int64_t kSlackNs = 20'000;

  // Whether at() may be used: a rate has been measured and no check has failed.
  bool calibrated() const noexcept { return mult_ != 0; }
  bool failed() const noexcept { return failed_; }

  std::int64_t at(std::uint64_t tsc) const noexcept {
    // signed: a counter read on another CPU may be a few cycles behind the anchor
    const auto cycles = static_cast<std::int64_t>(tsc - base_tsc_);
    return base_ns_ + static_cast<std::int64_t>((static_cast<TscWide>(cycles) * mult_) >> 32);
  }

  // A counter reading and the kernel's clock read together. The first pair only starts
  // the span; each later one measures the rate over the span since the one before and,
  // once calibrated, checks the prediction. False: the counter disagreed with the clock
  // (the map is dropped; calibrated() stays false).
  bool anchor(std::uint64_t tsc, std::int64_t ns) noexcept;

  // When the owner should take its next pair (kernel ns): never until start(), then at
  // once until the first pair is taken.
  std::int64_t next_anchor_ns() const noexcept { return next_anchor_ns_; }
  void start() noexcept {
    if (ref_ns_ < 0 && !failed_) next_anchor_ns_ = INT64_MIN;
  }

 private:
  std::uint64_t base_tsc_ = 0;
  std::int64_t base_ns_ = 0;
  std::uint64_t mult_ = 0;  // ns per cycle x 2^32; 0: not calibrated
  std::uint64_t ref_tsc_ = 0;
  std::int64_t ref_ns_ = -1;                 // the last pair: the next rate's span starts there
  std::int64_t next_anchor_ns_ = INT64_MAX;  // never, until start()
  bool failed_ = false;
};

// Whether this machine's counter may stand for CLOCK_MONOTONIC here: x86-64, an invariant
// counter (CPUID 0x80000007 EDX bit 8: it runs at a constant rate in every P-, C- and
// T-state), rdtsc allowed in this process (prctl PR_GET_TSC), and the kernel keeps time
// with it (clocksource "tsc": it found the counter
// synchronized across CPUs and stable). Checked once.
bool tsc_usable() noexcept;
// tsc_usable(), unless $STEPTRACE_HOST_CLOCK is "monotonic" (the kernel's clock itself, for
// a machine where the counter misleads the checks above). Read at each profiler's start.
bool tsc_clock_chosen() noexcept;

// One (counter, CLOCK_MONOTONIC) pair, the counter's reading the midpoint of two around
// the clock's; false when no pair came out tight (the thread was preempted in each try).
bool read_tsc_pair(std::uint64_t* tsc, std::int64_t* ns) noexcept;

inline std::uint64_t read_tsc() noexcept {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return 0;
#endif
}

}  // namespace steptrace
