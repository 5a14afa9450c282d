#include "process_stat.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <utility>

#include "proc_file.hpp"
#include "steptrace/backend.hpp"

namespace steptrace {
namespace detail {

std::int64_t process_age_ns() {
  const ProcFile file("/proc/self/stat");
  char buf[1024];
  const long n = file.read(buf, sizeof buf - 1);
  if (n <= 0) return -1;
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces
  if (p == nullptr) return -1;
  unsigned long long start_ticks = 0;
  // fields 3..22 after ") ": state, then 18 numbers, then starttime
  if (std::sscanf(
          p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
          &start_ticks) != 1) {
    return -1;
  }
  const long hz = sysconf(_SC_CLK_TCK);
  timespec boot{};
  if (hz <= 0 || clock_gettime(CLOCK_BOOTTIME, &boot) != 0) return -1;
  const std::int64_t boot_ns =
      static_cast<std::int64_t>(boot.tv_sec) * 1'000'000'000 + boot.tv_nsec;
  const auto start_ns = static_cast<std::int64_t>(start_ticks) * (1'000'000'000 / hz);
  const std::int64_t age = boot_ns - start_ns;
  return age >= 0 ? age : -1;
}

namespace {

// Keeps /proc/self/statm open and re-reads it from its start: one cheap system call per
// reading instead of open/read/close.
class RssSource final : public MemorySource {
 public:
  explicit RssSource(ProcFile file) : file_(std::move(file)), page_bytes_(sysconf(_SC_PAGESIZE)) {}

  const char* name() const noexcept override { return "rss"; }
  // A cold read costs several microseconds; RSS moves slowly.
  std::int64_t min_interval_ns() const noexcept override { return 10'000'000; }
  bool any_thread() const noexcept override { return true; }  // process-wide, pread only

  void sample(MemorySample& out) noexcept override {
    char buf[128];
    const long n = file_.read(buf, sizeof(buf) - 1);
    if (n <= 0) return;
    buf[n] = '\0';
    // statm: "size resident shared text lib data dt", in pages.
    char* end = nullptr;
    std::strtoll(buf, &end, 10);
    const long long resident_pages = std::strtoll(end, nullptr, 10);
    out.rss_bytes = resident_pages * page_bytes_;
  }

 private:
  ProcFile file_;
  long page_bytes_;
};

}  // namespace
}  // namespace detail

std::unique_ptr<MemorySource> make_rss_source() {
  detail::ProcFile file("/proc/self/statm");
  if (!file.is_open()) return nullptr;
  return std::make_unique<detail::RssSource>(std::move(file));
}

}  // namespace steptrace
