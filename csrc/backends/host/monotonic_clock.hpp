// The host's monotonic clock, inline: the host Clock reads it, and so do the training
// thread's phase boundaries directly, where a virtual call through a cold Clock object
// would cost two more cache misses per boundary (issue 30).
#pragma once

#include <ctime>

#include <cstdint>

namespace steptrace {

inline std::int64_t monotonic_now_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);  // vDSO: no system call
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace steptrace
