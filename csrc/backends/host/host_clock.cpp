// Host backends: the monotonic clock and the process resident set size.
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>

#include "monotonic_clock.hpp"
#include "steptrace/backend.hpp"

namespace steptrace {
namespace {

class HostClock final : public Clock {
 public:
  std::int64_t now_ns() noexcept override { return monotonic_now_ns(read_); }

 private:
  ClockGettime read_ = vdso_clock_gettime();
};

// Keeps /proc/self/statm open and re-reads it with pread: one cheap system call per step
// instead of open/read/close.
class RssSource final : public MemorySource {
 public:
  explicit RssSource(int fd) : fd_(fd), page_bytes_(sysconf(_SC_PAGESIZE)) {}
  ~RssSource() override { ::close(fd_); }
  RssSource(const RssSource&) = delete;
  RssSource& operator=(const RssSource&) = delete;

  const char* name() const noexcept override { return "rss"; }
  // A cold read costs several microseconds; RSS moves slowly.
  std::int64_t min_interval_ns() const noexcept override { return 10'000'000; }
  bool any_thread() const noexcept override { return true; }  // process-wide, pread only

  void sample(MemorySample& out) noexcept override {
    char buf[128];
    const ssize_t n = pread(fd_, buf, sizeof(buf) - 1, 0);
    if (n <= 0) return;
    buf[n] = '\0';
    // statm: "size resident shared text lib data dt", in pages.
    char* end = nullptr;
    std::strtoll(buf, &end, 10);
    const long long resident_pages = std::strtoll(end, nullptr, 10);
    out.rss_bytes = resident_pages * page_bytes_;
  }

 private:
  int fd_;
  long page_bytes_;
};

ClockGettime find_vdso_clock_gettime() noexcept {
  // vdso(7): the loader lists the vDSO under its soname; its symbols by architecture.
#if defined(__x86_64__)
  const char* symbol = "__vdso_clock_gettime";
#elif defined(__aarch64__)
  const char* symbol = "__kernel_clock_gettime";
#else
  const char* symbol = nullptr;
#endif
  void* vdso = symbol != nullptr ? dlopen("linux-vdso.so.1", RTLD_LAZY | RTLD_NOLOAD) : nullptr;
  if (vdso == nullptr) return &::clock_gettime;  // none (vdso=0, another libc): libc's
  auto* found = reinterpret_cast<ClockGettime>(dlsym(vdso, symbol));
  dlclose(vdso);  // RTLD_NOLOAD took a reference; the vDSO itself is never unmapped
  timespec probe{};
  if (found == nullptr || found(CLOCK_MONOTONIC, &probe) != 0) return &::clock_gettime;
  return found;
}

}  // namespace

ClockGettime vdso_clock_gettime() noexcept {
  static const ClockGettime found = find_vdso_clock_gettime();
  return found;
}

std::unique_ptr<Clock> make_host_clock() { return std::make_unique<HostClock>(); }

std::unique_ptr<MemorySource> make_rss_source() {
  const int fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  return std::make_unique<RssSource>(fd);
}

}  // namespace steptrace
