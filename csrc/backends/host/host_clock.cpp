// The host clock (monotonic, read through the vDSO). The process RSS source is a host
// reader: core/host/process_stat.cpp.
#include <dlfcn.h>

#include <ctime>
#include <memory>

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

}  // namespace steptrace
