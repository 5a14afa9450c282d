// Errors thrown at the steptrace API boundary. Hot paths never throw for vendor faults;
// they disable the backend and record why. The Python bindings map these to
// steptrace.errors (ConfigError -> ValueError, UsageError -> RuntimeError).
#pragma once

#include <stdexcept>
#include <string>

#include "steptrace/export.hpp"

namespace steptrace {

/// Base class of every exception steptrace throws.
class STEPTRACE_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A configuration value out of range or unusable; thrown before any file is created.
class STEPTRACE_API ConfigError : public Error {
 public:
  using Error::Error;
};

/// The profiler used out of order (phase outside a step, step inside a step, a phase
/// nested in itself, an end without a start). The log stays valid.
class STEPTRACE_API UsageError : public Error {
 public:
  using Error::Error;
};

}  // namespace steptrace
