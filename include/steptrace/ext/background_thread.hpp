// Starting a thread of steptrace's own, or of a backend's (a telemetry sampler, an activity
// flusher): it starts with the asynchronous signals blocked, so that a signal sent to the
// process (SIGTERM, SIGINT, ...) goes to one of the program's threads, never to one of
// these. Where it did, ThreadSanitizer held it back until that thread next entered an
// intercepted call, which for the writer, waiting out its flush interval in a
// pthread_cond_clockwait, was up to a minute later. The synchronous fault signals stay
// unblocked: a fault in these threads still reaches the program's handlers (faulthandler).
// Extending steptrace, not adapting a framework: most users never include this.
#pragma once

#include <pthread.h>
#include <signal.h>

#include <thread>
#include <utility>

namespace steptrace {

/// std::thread(function), started with every signal but the faults blocked; the calling
/// thread's mask is as it was when this returns.
template <typename Function>
std::thread start_background_thread(Function&& function) {
  sigset_t blocked;
  sigfillset(&blocked);
  for (const int fault : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS}) {
    sigdelset(&blocked, fault);
  }
  sigset_t previous;
  pthread_sigmask(SIG_BLOCK, &blocked, &previous);  // the new thread inherits the mask
  struct Restore {
    const sigset_t* mask;
    ~Restore() { pthread_sigmask(SIG_SETMASK, mask, nullptr); }
  } restore{&previous};
  return std::thread(std::forward<Function>(function));
}

}  // namespace steptrace
