#include "tsc_clock.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/prctl.h>
#endif

#include "monotonic_clock.hpp"

namespace steptrace {
namespace {

bool kernel_keeps_time_with_tsc() noexcept {
  std::FILE* f =
      std::fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "re");
  if (f == nullptr) return false;
  char name[32] = {};
  const bool read = std::fgets(name, sizeof(name), f) != nullptr;
  std::fclose(f);
  return read && std::strcmp(name, "tsc\n") == 0;
}

bool check_tsc_usable() noexcept {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0x80000000u, &eax, &ebx, &ecx, &edx) == 0 || eax < 0x80000007u) return false;
  if (__get_cpuid(0x80000007u, &eax, &ebx, &ecx, &edx) == 0) return false;
  constexpr unsigned kInvariantTsc = 1u << 8;  // "Advanced Power Management Information"
  if ((edx & kInvariantTsc) == 0) return false;
  // a process may have made rdtsc fault (prctl(2) PR_SET_TSC, e.g. under a replay tool)
  int tsc_mode = PR_TSC_ENABLE;
  if (prctl(PR_GET_TSC, &tsc_mode, 0, 0, 0) == 0 && tsc_mode != PR_TSC_ENABLE) return false;
  return kernel_keeps_time_with_tsc();
#else
  return false;
#endif
}

}  // namespace

bool TscMap::anchor(std::uint64_t tsc, std::int64_t ns) noexcept {
  if (failed_) return false;
  auto drop = [this] {
    failed_ = true;
    mult_ = 0;
    next_anchor_ns_ = INT64_MAX;
    return false;
  };
  if (ref_ns_ < 0) {  // the first pair: the first rate's span starts here
    ref_tsc_ = tsc;
    ref_ns_ = ns;
    next_anchor_ns_ = ns + kCalibrateNs;
    return true;
  }
  const std::int64_t span_ns = ns - ref_ns_;
  const auto span_tsc = static_cast<std::int64_t>(tsc - ref_tsc_);
  if (span_ns <= 0 || span_tsc <= 0) return drop();  // the counter stood still or went back
  const auto rate = static_cast<std::uint64_t>((static_cast<TscUwide>(span_ns) << 32) /
                                               static_cast<std::uint64_t>(span_tsc));
  if (rate == 0) return drop();
  std::int64_t base_ns = ns;
  std::uint64_t mult = rate;
  if (mult_ != 0) {
    const std::int64_t err = at(tsc) - ns;  // > 0: the map ran ahead of the clock
    const std::int64_t allowed =
        static_cast<std::int64_t>(static_cast<TscWide>(span_ns) * kMaxPpm / 1'000'000) + kSlackNs;
    if (err > allowed || -err > allowed) return drop();
    if (err > 0) {
      // Never back (a boundary after this must not read earlier than one before it): hold
      // the map's reading and run slower by err over the next second, meeting the clock.
      base_ns = ns + err;
      const std::int64_t catch_up = err < kReanchorNs / 2 ? err : kReanchorNs / 2;
      mult = static_cast<std::uint64_t>(static_cast<TscUwide>(rate) *
                                        static_cast<std::uint64_t>(kReanchorNs - catch_up) /
                                        static_cast<std::uint64_t>(kReanchorNs));
    }
  }
  base_tsc_ = tsc;
  base_ns_ = base_ns;
  mult_ = mult;
  ref_tsc_ = tsc;
  ref_ns_ = ns;
  next_anchor_ns_ = ns + kReanchorNs;
  return true;
}

bool tsc_usable() noexcept {
  static const bool usable = check_tsc_usable();
  return usable;
}

bool tsc_clock_chosen() noexcept {
  const char* choice = std::getenv("STEPTRACE_HOST_CLOCK");
  return tsc_usable() && (choice == nullptr || std::strcmp(choice, "monotonic") != 0);
}

bool read_tsc_pair(std::uint64_t* tsc, std::int64_t* ns) noexcept {
#if defined(__x86_64__)
  // A pair is as good as the time between the counter's two readings: at most ~20 us of
  // cycles, or the thread was preempted between them (try again).
  constexpr std::uint64_t kTightCycles = 50'000;
  const ClockGettime read = vdso_clock_gettime();
  for (int attempt = 0; attempt < 4; ++attempt) {
    _mm_lfence();  // ordered: the counter's readings bracket the clock's
    const std::uint64_t before = __rdtsc();
    _mm_lfence();
    const std::int64_t clock_ns = monotonic_now_ns(read);
    _mm_lfence();
    const std::uint64_t after = __rdtsc();
    if (after >= before && after - before <= kTightCycles) {
      *tsc = before + (after - before) / 2;
      *ns = clock_ns;
      return true;
    }
  }
#else
  (void)tsc;
  (void)ns;
#endif
  return false;
}

}  // namespace steptrace
