// Interfaces through which the profiler reaches clocks and memory statistics. The core
// depends only on these; real backends (host clock, process RSS, the LibTorch allocator)
// and their fakes (tests) implement them and come in through Profiler's constructor.
#pragma once

#include <cstdint>
#include <memory>

#include "steptrace/export.hpp"

namespace steptrace {

/// A monotonic clock in nanoseconds. Called on the training thread at every phase
/// boundary: must be cheap and noexcept.
class STEPTRACE_API Clock {
 public:
  virtual ~Clock() = default;
  virtual std::int64_t now_ns() noexcept = 0;
};

/// Memory figures of one step in bytes; a negative value means "not measured".
struct MemorySample {
  std::int64_t allocated_bytes = -1;     // torch allocator: live tensors
  std::int64_t reserved_bytes = -1;      // torch allocator: held from the device
  std::int64_t peak_bytes = -1;          // torch allocator: peak since the last step
  std::int64_t rss_bytes = -1;           // process resident set size
  std::int64_t device_used_bytes = -1;   // device-wide used memory (all processes)
  std::int64_t device_total_bytes = -1;  // device memory size
};

/// A source of memory statistics, sampled once at the end of every step on the training
/// thread. Fills the fields it knows and leaves the others alone. Must be noexcept.
class STEPTRACE_API MemorySource {
 public:
  virtual ~MemorySource() = default;
  /// Short name recorded in run_start ("rss", "torch_cuda_allocator", ...).
  virtual const char* name() const noexcept = 0;
  virtual void sample(MemorySample& out) noexcept = 0;
};

/// The steady host clock (CLOCK_MONOTONIC).
STEPTRACE_API std::unique_ptr<Clock> make_host_clock();
/// Resident set size of this process, read from /proc/self/statm; nullptr where that
/// file cannot be read.
STEPTRACE_API std::unique_ptr<MemorySource> make_rss_source();

}  // namespace steptrace
