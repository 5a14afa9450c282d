#include "lifecycle.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <thread>
#include <vector>

#include "steptrace/ext/background_thread.hpp"

namespace steptrace::detail {

std::atomic<std::uint64_t> g_fork_generation{0};

namespace {

// Live profilers and the watcher's state. Leaked on purpose: usable during static
// destruction, and replaced (not unlocked) in a forked child, where its mutex may have
// been copied while held.
struct State {
  std::mutex mu;
  std::vector<SignalClosable*> live;  // guarded by mu
  pid_t watcher_pid = 0;              // guarded by mu: the process the watcher runs in
  int pipe_read = -1;                 // guarded by mu
};
State* g_state = new State;

// Read by the signal handler (async-signal-safe: lock-free atomics and a plain struct
// written before the handler is installed).
std::atomic<int> g_pipe_write{-1};
std::atomic<bool> g_terminate{false};
std::atomic<std::int64_t> g_grace_ms{0};
struct sigaction g_previous {};  // the handler ours replaced, called after ours

void on_sigterm(int signum, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  const int fd = g_pipe_write.load(std::memory_order_relaxed);
  if (fd >= 0) {
    const char byte = 1;
    (void)!::write(fd, &byte, 1);  // non-blocking: a full pipe already has the wake-up
  }
  errno = saved_errno;
  if ((g_previous.sa_flags & SA_SIGINFO) != 0) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(signum, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
             g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(signum);  // Python's: its handler runs between bytecodes
  }
}

bool ours_installed() {
  struct sigaction current {};
  if (::sigaction(SIGTERM, nullptr, &current) != 0) return false;
  return (current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == on_sigterm;
}

void after_fork_in_child() noexcept {
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);
  // No watcher thread here, and the pipe is the parent's: a SIGTERM of the child must not
  // wake the parent's watcher. The parent's profilers are abandoned in the child.
  const int fd = g_pipe_write.exchange(-1, std::memory_order_relaxed);
  if (fd >= 0) ::close(fd);
  if (g_state->pipe_read >= 0) ::close(g_state->pipe_read);
  // An allocation failure here ends the child (noexcept), as it would at its next one.
  g_state = new State;  // NOLINT(bugprone-unhandled-exception-at-new)
}

[[maybe_unused]] const int g_atfork_registered =
    ::pthread_atfork(nullptr, nullptr, after_fork_in_child);

void die_of_sigterm() {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGTERM, &dfl, nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(SIGTERM);  // the default action ends the process
}

void on_signal_received(State* state) {
  {
    std::lock_guard<std::mutex> lock(state->mu);
    for (SignalClosable* p : state->live) p->flush_for_signal();
  }
  if (!g_terminate.load(std::memory_order_relaxed)) return;  // the program decides
  // The program's own path (Python's handler: close, then die of SIGTERM) is lossless;
  // give it the grace period, then end what is open here and die.
  std::this_thread::sleep_for(
      std::chrono::milliseconds(g_grace_ms.load(std::memory_order_relaxed)));
  {
    std::lock_guard<std::mutex> lock(state->mu);
    for (SignalClosable* p : state->live) {
      if (!p->closed_for_signal()) p->close_for_signal();
    }
  }
  die_of_sigterm();
}

void watcher_loop(State* state, int fd) {
  char buf[64];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // closed (a forked child replaced the state)
    on_signal_received(state);
  }
}

// Starts the watcher thread with the asynchronous signals blocked in it (the handler never
// runs on it). Under state->mu.
bool start_watcher(State* state) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return false;
  ::fcntl(fds[1], F_SETFL, ::fcntl(fds[1], F_GETFL) | O_NONBLOCK);
  try {
    start_background_thread([state, fd = fds[0]] { watcher_loop(state, fd); }).detach();
  } catch (...) {
    ::close(fds[0]);
    ::close(fds[1]);
    return false;
  }
  state->pipe_read = fds[0];
  state->watcher_pid = ::getpid();
  g_pipe_write.store(fds[1], std::memory_order_relaxed);
  return true;
}

}  // namespace

void register_for_signal(SignalClosable* p) {
  State* state = g_state;
  std::lock_guard<std::mutex> lock(state->mu);
  state->live.push_back(p);
}

void unregister_for_signal(SignalClosable* p) noexcept {
  State* state = g_state;
  std::lock_guard<std::mutex> lock(state->mu);
  state->live.erase(std::remove(state->live.begin(), state->live.end(), p), state->live.end());
}

bool watch_sigterm(bool terminate, std::chrono::milliseconds grace) {
  State* state = g_state;
  std::lock_guard<std::mutex> lock(state->mu);
  g_terminate.store(terminate, std::memory_order_relaxed);
  g_grace_ms.store(std::max<std::int64_t>(0, grace.count()), std::memory_order_relaxed);
  if (state->watcher_pid != ::getpid() && !start_watcher(state)) return false;
  if (ours_installed()) return true;
  struct sigaction previous {};
  if (::sigaction(SIGTERM, nullptr, &previous) != 0) return false;
  g_previous = previous;  // before ours is installed: the handler reads it
  struct sigaction act {};
  act.sa_sigaction = on_sigterm;
  sigemptyset(&act.sa_mask);
  // Keep the replaced handler's restart behaviour: Python's does not restart system calls
  // (it runs its handlers when they fail with EINTR).
  act.sa_flags = SA_SIGINFO | SA_ONSTACK | (previous.sa_flags & SA_RESTART);
  return ::sigaction(SIGTERM, &act, nullptr) == 0;
}

void unwatch_sigterm() noexcept {
  State* state = g_state;
  std::lock_guard<std::mutex> lock(state->mu);
  if (ours_installed()) ::sigaction(SIGTERM, &g_previous, nullptr);
}

}  // namespace steptrace::detail
