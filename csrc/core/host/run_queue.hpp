// The training thread's scheduler figures: time it was runnable but not running (another
// process or thread had the CPU) and time it ran, from Linux schedstat. A slow step whose
// excess is this wait (or CPU time the hypervisor took: host_steal.hpp) is host
// contention, not the model.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ctime>

#include "proc_file.hpp"

namespace steptrace::detail {

/// One /proc/thread-self/schedstat reading (kernel Documentation/scheduler/sched-stats:
/// "time spent on the cpu", "time spent waiting on a runqueue", both in ns). Under
/// CONFIG_PARAVIRT_TIME_ACCOUNTING the on-CPU time leaves out time the hypervisor stole.
struct SchedStat {
  std::int64_t on_cpu_ns = -1;
  std::int64_t wait_ns = -1;  // -1: no reading
};

/// Reads /proc/thread-self/schedstat (and the thread's CPU clock, the same runtime brought up
/// to date). The file is opened on the first read by the thread
/// that reads (it names that thread) and re-read with pread; or, after watch(), another
/// thread's (/proc/self/task/<tid>/schedstat and that thread's CPU clock).
class RunQueueReader {
 public:
  RunQueueReader() = default;
  /// From now on reads thread `tid` of this process, whose CPU clock is `cpu_clock`
  /// (pthread_getcpuclockid, taken on that thread). False where its file cannot be opened.
  bool watch(long tid, clockid_t cpu_clock) noexcept;
  RunQueueReader(const RunQueueReader&) = delete;
  RunQueueReader& operator=(const RunQueueReader&) = delete;

  /// The thread's totals, wait_ns -1 where schedstat is unavailable (then every later
  /// call returns that at once).
  SchedStat read() noexcept;

 private:
  ProcFile file_;
  bool failed_ = false;
  clockid_t cpu_clock_ = CLOCK_THREAD_CPUTIME_ID;  // the read thread's CPU clock
};

/// Parses a schedstat line; wait_ns -1 when malformed.
SchedStat parse_schedstat(const char* text, std::size_t size) noexcept;

}  // namespace steptrace::detail
