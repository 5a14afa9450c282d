// The extension points through which the profiler reaches clocks, memory statistics and
// device timing. The core depends only on these; real backends (host clock, process RSS,
// the LibTorch allocator, CUDA events) and their fakes (tests) implement them and come in
// through Profiler's constructor. The device-activity and telemetry backends, which
// extend steptrace rather than adapt a framework, are in steptrace/ext/.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

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
  std::int64_t heap_bytes = -1;          // C heap in use (glibc mallinfo2), on steps it was read
  std::int64_t device_used_bytes = -1;   // device-wide used memory (all processes)
  std::int64_t device_total_bytes = -1;  // device memory size
};

/// A source of memory statistics, sampled at the end of a step on the training thread (at
/// most every min_interval_ns), or on steptrace's watchdog thread where any_thread() says it
/// may be (then the steps take its latest figures). Fills the fields it knows and leaves the
/// others alone. Must be noexcept.
class STEPTRACE_API MemorySource {
 public:
  virtual ~MemorySource() = default;
  /// Short name recorded in run_start ("rss", "torch_cuda_allocator", ...).
  virtual const char* name() const noexcept = 0;
  virtual void sample(MemorySample& out) noexcept = 0;
  /// Sample at most this often (steps in between repeat the last figures); 0: every step.
  virtual std::int64_t min_interval_ns() const noexcept { return 0; }
  /// sample() may run on another thread than the training thread (it reads process-wide
  /// figures and keeps no state the training thread touches). With a nonzero
  /// min_interval_ns, the watchdog thread then reads it, and the training thread does no
  /// I/O for it (issue 30: a cold /proc read is ~3.5 us).
  virtual bool any_thread() const noexcept { return false; }
  /// Allocated bytes now, without side effects (sample() may reset a per-step peak), for
  /// attributing memory growth to phases; -1 when this source has no such figure.
  virtual std::int64_t live_bytes() noexcept { return -1; }
};

/// A device stream as the framework names it: the handle (a CUstream / cudaStream_t as an
/// integer; 0 is the legacy default stream, 1 CU_STREAM_LEGACY, 2 CU_STREAM_PER_THREAD) and
/// the CUDA device it belongs to (-1: unknown). The special handles mean "the default
/// stream of the calling thread's current context"; with a device, the default stream of
/// that device's primary context (what torch.cuda.current_stream(device) reports), so that
/// a step on a thread with no current context, or with another device's context current,
/// is timed on the device the framework named.
struct DeviceStream {
  std::uintptr_t handle = 0;
  int device = -1;
  bool operator==(const DeviceStream& o) const noexcept {
    return handle == o.handle && device == o.device;
  }
};

/// Times work on a device with events recorded on a stream and resolved later, so that
/// nothing waits for the device per step (CUDA events; a fake in tests). Used from the
/// training thread only. Handles are small integers from the backend's event pool.
/// Nothing throws: a failure returns kError / false and the profiler falls back to the
/// host clock for the rest of the run, recording why (last_error).
class STEPTRACE_API DeviceTimer {
 public:
  enum class Status { kReady, kPending, kError };
  virtual ~DeviceTimer() = default;
  /// "cuda", "fake", ...
  virtual const char* name() const noexcept = 0;
  /// Records an event on `stream`, in the stream's context whatever context the calling
  /// thread has current. Returns its handle, -1 on failure, or -2 when the stream is
  /// capturing a CUDA graph (no event may be recorded there: the step is host-timed).
  virtual int record(DeviceStream stream) noexcept = 0;
  /// kReady once the device has passed the event (never blocks).
  virtual Status query(int event) noexcept = 0;
  /// Device milliseconds between two completed events.
  virtual bool elapsed_ms(int start, int end, float* ms) noexcept = 0;
  /// Blocks until the event has completed (only when the in-flight bound is reached,
  /// and at close).
  virtual bool synchronize(int event) noexcept = 0;
  /// Returns the event to the pool.
  virtual void release(int event) noexcept = 0;
  /// Events handed out and not yet released (a leak check for tests).
  virtual int live_events() const noexcept = 0;
  /// One line on the last failure.
  virtual std::string last_error() const = 0;
  /// Name and total memory of the device events were last recorded on (before any, the
  /// calling thread's current device), when known.
  virtual std::string device_name() const { return {}; }
  virtual std::int64_t device_memory_bytes() const { return -1; }
};

/// The stream device events go on, asked at the start of every step (the framework's
/// current stream; the LibTorch adapter's is c10's). Training thread; noexcept.
class STEPTRACE_API StreamSource {
 public:
  virtual ~StreamSource() = default;
  /// False when there is no device stream now (the step uses the host clock).
  virtual bool current(DeviceStream* stream) noexcept = 0;
};

/// The CUDA event timer, through the driver API loaded at run time (libcuda.so.1, found
/// via dlopen; entry points from cuGetProcAddress), so that one build runs with CUDA 12
/// or 13 drivers and without any. nullptr when unavailable; `why_not` then says why.
STEPTRACE_API std::unique_ptr<DeviceTimer> make_cuda_timer(std::string* why_not);

/// The steady host clock (CLOCK_MONOTONIC).
STEPTRACE_API std::unique_ptr<Clock> make_host_clock();
/// Resident set size of this process, read from /proc/self/statm (at most every 10 ms:
/// the read is a system call); nullptr where that file cannot be read.
STEPTRACE_API std::unique_ptr<MemorySource> make_rss_source();

}  // namespace steptrace
