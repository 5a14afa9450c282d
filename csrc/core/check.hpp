// The one throw macro and the one check macro of steptrace (API boundary only; hot paths
// and vendor callbacks are noexcept and report through records instead).
#pragma once

#include <fmt/format.h>

// Throws `kind` (a steptrace::Error subclass) with a fmt-formatted message.
#define STEPTRACE_THROW(kind, ...) throw kind(fmt::format(__VA_ARGS__))

// Throws `kind` with the message unless `cond` holds.
#define STEPTRACE_CHECK(cond, kind, ...)  \
  do {                                    \
    if (!(cond)) {                        \
      STEPTRACE_THROW(kind, __VA_ARGS__); \
    }                                     \
  } while (false)
