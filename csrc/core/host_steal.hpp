// CPU time the hypervisor took from this virtual machine (steal), from /proc/stat. On a
// cloud VM whose host is oversubscribed the training thread stops while it is "running":
// schedstat shows neither run-queue wait nor on-CPU time for it (under
// CONFIG_PARAVIRT_TIME_ACCOUNTING stolen time is left out of a task's runtime), and the
// step is slow for a reason that is the host's, not the model's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace steptrace::detail {

/// Samples /proc/stat's per-CPU steal column (proc(5): "steal: stolen time, which is the
/// time spent in other operating systems when running in a virtualized environment", in
/// USER_HZ ticks). Off the training thread: the file grows with the CPU count.
class StealReader {
 public:
  explicit StealReader(const std::string& path = "/proc/stat");
  ~StealReader();
  StealReader(const StealReader&) = delete;
  StealReader& operator=(const StealReader&) = delete;

  /// False where the file is unreadable or no CPU has ever had time stolen (bare metal, or a
  /// kernel without a steal clock): there is nothing to sample.
  bool available() const noexcept { return available_; }

  /// Reads the file and returns a running total, in ns: per read, the largest steal any one
  /// CPU saw since the read before. A thread runs on one CPU at a time, so this bounds what
  /// it can have lost. No allocation.
  std::int64_t sample() noexcept;

 private:
  int read_ticks() noexcept;  // into ticks_; the CPU count, -1 on failure

  int fd_ = -1;
  std::vector<char> buf_;
  std::vector<std::int64_t> ticks_;  // this read, per CPU
  std::vector<std::int64_t> last_;   // the read before
  std::int64_t ns_per_tick_;
  std::int64_t total_ns_ = 0;
  bool available_ = false;
};

/// Parses the per-CPU lines ("cpuN user nice system idle iowait irq softirq steal ...") of a
/// /proc/stat text into their steal ticks, in CPU order; stops at `max`. The count read, -1
/// when a cpuN line is malformed.
int parse_proc_stat_steal(const char* text, std::size_t size, std::int64_t* steal,
                          int max) noexcept;

}  // namespace steptrace::detail
