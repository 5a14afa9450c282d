#include "run_queue.hpp"

#include <cstdio>
#include <ctime>
#include <utility>

namespace steptrace::detail {
namespace {
// A decimal field at text[i], advancing i past it; -1 when there is none.
std::int64_t field(const char* text, std::size_t size, std::size_t& i) noexcept {
  const std::size_t start = i;
  std::int64_t v = 0;
  for (; i < size && text[i] >= '0' && text[i] <= '9'; ++i) v = v * 10 + (text[i] - '0');
  return i > start ? v : -1;
}
}  // namespace

SchedStat parse_schedstat(const char* text, std::size_t size) noexcept {
  // "<on-cpu ns> <run-queue wait ns> <timeslices>\n"
  std::size_t i = 0;
  const std::int64_t on_cpu = field(text, size, i);
  if (on_cpu < 0 || i >= size || text[i] != ' ') return {};
  ++i;
  const std::int64_t wait = field(text, size, i);
  return wait < 0 ? SchedStat{} : SchedStat{on_cpu, wait};
}

bool RunQueueReader::watch(long tid, clockid_t cpu_clock) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/task/%ld/schedstat", tid);
  ProcFile file(path);
  if (!file.is_open()) return false;
  file_ = std::move(file);
  failed_ = false;
  cpu_clock_ = cpu_clock;
  return true;
}

SchedStat RunQueueReader::read() noexcept {
  if (failed_) return {};
  if (!file_.is_open()) {
    file_ = ProcFile("/proc/thread-self/schedstat");
    if (!file_.is_open()) {
      failed_ = true;
      return {};
    }
  }
  char buf[96];
  const long n = file_.read(buf, sizeof buf);
  SchedStat s = n > 0 ? parse_schedstat(buf, static_cast<std::size_t>(n)) : SchedStat{};
  if (s.wait_ns < 0) {
    failed_ = true;
    return s;
  }
  // schedstat's on-CPU field is the runtime as of the last tick or switch (up to a tick
  // old for a thread that keeps running); the thread's CPU clock brings it up to date.
  timespec cpu{};
  if (::clock_gettime(cpu_clock_, &cpu) == 0) {
    s.on_cpu_ns = static_cast<std::int64_t>(cpu.tv_sec) * 1'000'000'000 + cpu.tv_nsec;
  }
  return s;
}

}  // namespace steptrace::detail
