#include "stack_dump.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <mutex>

namespace steptrace::detail {
namespace {

std::mutex g_mu;  // one dump at a time: every profiler's watchdog shares the file
int g_signum = -1;
int g_fd = -1;
pid_t g_pid = -1;
void* g_handler = nullptr;  // what was installed for g_signum when armed

void* handler_of(const struct sigaction& sa) noexcept {
  return (sa.sa_flags & SA_SIGINFO) != 0 ? reinterpret_cast<void*>(sa.sa_sigaction)
                                         : reinterpret_cast<void*>(sa.sa_handler);
}

bool has_handler(int signum, void** handler) noexcept {
  struct sigaction sa {};
  if (sigaction(signum, nullptr, &sa) != 0) return false;
  *handler = handler_of(sa);
  return (sa.sa_flags & SA_SIGINFO) != 0 || (sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN);
}

}  // namespace

bool arm_stack_dump(int signum, int fd) noexcept {
  std::lock_guard<std::mutex> lock(g_mu);
  g_signum = -1;
  void* handler = nullptr;
  if (signum <= 0 || fd < 0 || !has_handler(signum, &handler)) return false;
  g_signum = signum;
  g_fd = fd;
  g_pid = getpid();
  g_handler = handler;
  return true;
}

bool armed_signal_reset() noexcept {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_signum < 0 || getpid() != g_pid) return false;
  struct sigaction sa {};
  return sigaction(g_signum, nullptr, &sa) == 0 && (sa.sa_flags & SA_SIGINFO) == 0 &&
         sa.sa_handler == SIG_DFL;
}

std::string dump_stacks(std::size_t max_bytes) noexcept {
  try {
    std::lock_guard<std::mutex> lock(g_mu);
    void* handler = nullptr;
    if (g_signum < 0 || getpid() != g_pid) return {};
    if (!has_handler(g_signum, &handler) || handler != g_handler) return {};
    if (ftruncate(g_fd, 0) != 0 || lseek(g_fd, 0, SEEK_SET) != 0) return {};
    // Unblocked on this thread only, so the handler runs here, before raise() returns.
    sigset_t set, old;
    sigemptyset(&set);
    sigaddset(&set, g_signum);
    if (pthread_sigmask(SIG_UNBLOCK, &set, &old) != 0) return {};
    raise(g_signum);
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    const off_t end = lseek(g_fd, 0, SEEK_CUR);
    if (end <= 0) return {};
    const std::size_t size = static_cast<std::size_t>(end);
    std::string out(size < max_bytes ? size : max_bytes, '\0');
    std::size_t got = 0;
    while (got < out.size()) {
      const ssize_t n = pread(g_fd, out.data() + got, out.size() - got, static_cast<off_t>(got));
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
    out.resize(got);
    if (size > max_bytes) out += "\n... (stacks cut at " + std::to_string(max_bytes) + " bytes)\n";
    return out;
  } catch (...) {
    return {};
  }
}

int spare_signal() noexcept {
#ifdef SIGRTMIN
  for (int s = SIGRTMAX; s >= SIGRTMIN; --s) {
    struct sigaction sa {};
    if (sigaction(s, nullptr, &sa) != 0) continue;
    if ((sa.sa_flags & SA_SIGINFO) == 0 && sa.sa_handler == SIG_DFL) return s;
  }
#endif
  return -1;
}

}  // namespace steptrace::detail
