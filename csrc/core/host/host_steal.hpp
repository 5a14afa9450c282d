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

#include "proc_file.hpp"

namespace steptrace::detail {

/// Samples /proc/stat's per-CPU steal column (proc(5): "steal: stolen time, which is the
/// time spent in other operating systems when running in a virtualized environment", in
/// USER_HZ ticks). Off the training thread: the file grows with the CPU count.
class StealReader {
 public:
  explicit StealReader(const std::string& path = "/proc/stat");
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

  ProcFile file_;
  std::vector<char> buf_;
  std::vector<std::int64_t> ticks_;  // this read, per CPU
  std::vector<std::int64_t> last_;   // the read before
  std::int64_t ns_per_tick_;
  std::int64_t total_ns_ = 0;
  bool available_ = false;
};

/// How often the watchdog reads steal (StealReader::sample, ~12 us of CPU on a 2-CPU VM,
/// more with more CPUs). Every 10 ms (the tick of the steal column at USER_HZ 100) while
/// steal moves, and for a quiet second after it last moved; every 100 ms otherwise, so an
/// idle or never-stolen-from profiler costs a tenth of the wake-ups. The first stolen step
/// after a quiet spell is not left without its figure: the step that ends a long iteration
/// reads steal itself (Watchdog::refresh_steal), so a slow step is attributed as it was at
/// 10 ms. Pure: the watchdog feeds it each read's outcome.
class StealCadence {
 public:
  static constexpr int kActiveMs = 10;
  static constexpr int kQuietMs = 100;
  static constexpr int kQuietAfterMs = 1000;  // without movement, back to kQuietMs

  /// The wait before the next read.
  int period_ms() const noexcept { return active_ ? kActiveMs : kQuietMs; }
  bool active() const noexcept { return active_; }
  /// After a read `elapsed_ms` after the one before: whether the total moved in between.
  void on_read(bool moved, int elapsed_ms) noexcept {
    if (moved) {
      active_ = true;
      quiet_ms_ = 0;
    } else if (active_ && (quiet_ms_ += elapsed_ms) >= kQuietAfterMs) {
      active_ = false;
    }
  }

 private:
  bool active_ = false;
  int quiet_ms_ = 0;  // since the total last moved, while active
};

/// Parses the per-CPU lines ("cpuN user nice system idle iowait irq softirq steal ...") of a
/// /proc/stat text into their steal ticks, in CPU order; stops at `max`. The count read, -1
/// when a cpuN line is malformed.
int parse_proc_stat_steal(const char* text, std::size_t size, std::int64_t* steal,
                          int max) noexcept;

}  // namespace steptrace::detail
