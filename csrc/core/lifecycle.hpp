// Process life around a profiler: fork (a child inherits the profiler, but none of its
// threads) and SIGTERM while the program's threads are blocked in native code.
//
//  - fork_generation() counts the forks this process is a child of (a pthread_atfork
//    child handler increments it): an object that remembers it at construction and sees
//    another value is in a forked child, and must neither write nor join threads.
//  - watch_sigterm() installs a C-level SIGTERM handler (sigaction) that chains to the
//    handler it replaced (Python's, which runs the Python-level handler between
//    bytecodes) and wakes a watcher thread through a self-pipe. The watcher flushes every
//    live profiler at once; in `terminate` mode it then gives the program `grace` to end
//    the run itself, closes what is still open with reason "signal" without any device
//    call, and re-raises SIGTERM with the default action.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace steptrace::detail {

extern std::atomic<std::uint64_t> g_fork_generation;

inline std::uint64_t fork_generation() noexcept {
  return g_fork_generation.load(std::memory_order_relaxed);
}

/// What the SIGTERM watcher needs of a profiler (called on the watcher thread).
class SignalClosable {
 public:
  virtual ~SignalClosable() = default;
  /// Everything handed to the writer so far reaches the file (bounded wait).
  virtual void flush_for_signal() noexcept = 0;
  virtual bool closed_for_signal() const noexcept = 0;
  /// Writes what the writer holds and run_end (reason "signal"); no device call, no
  /// training-thread state touched, bounded in time.
  virtual void close_for_signal() noexcept = 0;
};

/// Registers a live profiler with the SIGTERM watcher / removes it (blocks while the
/// watcher is using it). No-ops in a forked child for objects of the parent.
void register_for_signal(SignalClosable* p);
void unregister_for_signal(SignalClosable* p) noexcept;

/// Installs (or re-arms) the SIGTERM handler and starts the watcher thread once per
/// process. `terminate`: the default disposition was in place (nothing else will end the
/// process): after `grace`, close what is open and die of SIGTERM. Otherwise (the
/// program handles or ignores SIGTERM) the watcher only flushes. Returns false when the
/// handler could not be installed.
bool watch_sigterm(bool terminate, std::chrono::milliseconds grace);

/// Restores the SIGTERM handler watch_sigterm replaced (if ours is still installed).
void unwatch_sigterm() noexcept;

}  // namespace steptrace::detail
