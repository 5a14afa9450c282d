// The one throw macro and the one check macro of steptrace (API boundary only; hot paths
// and vendor callbacks are noexcept and report through records instead).
#pragma once

#include <fmt/format.h>

// Throws `kind` (a steptrace::Error subclass) with a fmt-formatted message.
#define STEPTRACE_THROW(kind, ...) throw kind(fmt::format(__VA_ARGS__))

// A branch the hot path almost never takes: the compiler lays it out of the straight line,
// so the code a step runs stays a few contiguous cache lines.
#if defined(__GNUC__) || defined(__clang__)
#define STEPTRACE_UNLIKELY(cond) __builtin_expect(static_cast<bool>(cond), 0)
#define STEPTRACE_LIKELY(cond) __builtin_expect(static_cast<bool>(cond), 1)
#else
#define STEPTRACE_UNLIKELY(cond) (cond)
#define STEPTRACE_LIKELY(cond) (cond)
#endif

// Throws `kind` with the message unless `cond` holds.
#define STEPTRACE_CHECK(cond, kind, ...)  \
  do {                                    \
    if (STEPTRACE_UNLIKELY(!(cond))) {    \
      STEPTRACE_THROW(kind, __VA_ARGS__); \
    }                                     \
  } while (false)
