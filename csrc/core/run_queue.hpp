// The training thread's run-queue wait: time it was runnable but not running (another
// process or thread had the CPU), from Linux schedstat. A slow step whose excess is this
// wait is host contention, not the model.
#pragma once

#include <cstdint>

namespace steptrace::detail {

/// Reads /proc/thread-self/schedstat, whose second field is the calling thread's
/// cumulative run-queue delay in nanoseconds (kernel Documentation/scheduler/sched-stats:
/// "time spent waiting on a runqueue"). The file is opened on the first read by the thread
/// that reads (it names that thread) and re-read with pread. Training thread only.
class RunQueueReader {
 public:
  RunQueueReader() = default;
  ~RunQueueReader();
  RunQueueReader(const RunQueueReader&) = delete;
  RunQueueReader& operator=(const RunQueueReader&) = delete;

  /// The thread's total run-queue wait in ns, or -1 where schedstat is unavailable (then
  /// every later call returns -1 at once).
  std::int64_t read() noexcept;

 private:
  int fd_ = -1;
  bool failed_ = false;
};

/// Parses the wait (the second field) out of a schedstat line; -1 when malformed.
std::int64_t parse_schedstat_wait(const char* text, std::size_t size) noexcept;

}  // namespace steptrace::detail
