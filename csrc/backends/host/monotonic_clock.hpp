// The host's monotonic clock, inline: the host Clock reads it, and so do the training
// thread's phase boundaries directly, where a virtual call through a cold Clock object
// would cost two more cache misses per boundary (issue 30).
#pragma once

#include <ctime>

#include <cstdint>

namespace steptrace {

// clock_gettime's signature: the kernel's vDSO function, or libc's.
using ClockGettime = int (*)(clockid_t, timespec*);

// The kernel's own clock_gettime in the vDSO (vdso(7)), looked up once; libc's where the
// process has none. A step's boundaries call it directly: libc's clock_gettime reaches the
// same function through its PLT slot, its wrapper and the loader's pointer to the vDSO,
// lines that are cold after the model's work (0.03% of a 0.5 ms training step's time,
// issue 30). The vDSO function itself falls back to the system call where the clock source
// cannot be read in user space, as it does when reached through libc.
ClockGettime vdso_clock_gettime() noexcept;

inline std::int64_t monotonic_now_ns(ClockGettime read) noexcept {
  timespec ts{};
  read(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

inline std::int64_t monotonic_now_ns() noexcept { return monotonic_now_ns(&::clock_gettime); }

}  // namespace steptrace
