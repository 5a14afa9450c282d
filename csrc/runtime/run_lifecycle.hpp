// The run's lifecycle as the threads see it (the profiler's state machine):
//
//   attached --(a close from another thread, a fork)--> detached --> closed
//   attached --(close on the training thread)-------------------------> closed
//   any --(a forked child forgets the run)--> abandoned (closed, nothing written)
//
// The training thread owns the run (the last thread to begin a step) and says when it is
// inside a step; a close from another thread asks it to stop at its next step boundary
// and waits (bounded) for the step it is in to end. The step's checks are inline: they
// run on the hot path (no lock, no allocation; the lock is taken only when a foreign
// close waits).
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "../core/lifecycle.hpp"
#include "../core/this_thread.hpp"

namespace steptrace::detail {

class RunLifecycle {
 public:
  RunLifecycle() noexcept;
  RunLifecycle(const RunLifecycle&) = delete;
  RunLifecycle& operator=(const RunLifecycle&) = delete;

  // ---- the training thread ----

  /// Nothing more is recorded (a close from another thread, a fork).
  bool detached() const noexcept { return detached_; }
  /// False, and detached from now on, where a close from another thread was requested or
  /// the process forked since the run began.
  bool stay_attached() noexcept {
    if (detached_) return false;
    if (close_requested_.load(std::memory_order_relaxed) || fork_generation() != fork_generation_) {
      detached_ = true;
      return false;
    }
    return true;
  }
  /// False, and detached from now on, where the process forked (inside the step).
  bool same_process() noexcept {
    if (fork_generation() == fork_generation_) return true;
    detached_ = true;
    return false;
  }
  /// The training thread is inside a step from here to leave_step(): a close from another
  /// thread waits for that (Dekker-style: each side stores its flag, then reads the
  /// other's). False (detached) when such a close was requested first: the step is not
  /// recorded.
  bool enter_step() noexcept {
    claim();
    busy_.store(true, std::memory_order_seq_cst);
    if (!close_requested_.load(std::memory_order_seq_cst)) return true;
    leave_step();
    detached_ = true;
    return false;
  }
  void leave_step() noexcept {
    busy_.store(false, std::memory_order_seq_cst);
    if (close_requested_.load(std::memory_order_seq_cst)) {
      { std::lock_guard<std::mutex> lock(busy_mu_); }
      busy_cv_.notify_all();
    }
  }
  /// This thread trains (the constructor's thread, until another begins a step).
  void claim() noexcept { owner_.store(this_thread_token(), std::memory_order_relaxed); }

  // ---- any thread ----

  bool close_requested() const noexcept { return close_requested_.load(std::memory_order_relaxed); }
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  void mark_closed() noexcept { closed_.store(true, std::memory_order_release); }
  /// UsageError once closed.
  void check_open() const;
  /// The calling thread is not the one training.
  bool foreign() const noexcept {
    return owner_.load(std::memory_order_relaxed) != this_thread_token();
  }
  /// A close from another thread: asks the training thread to stop recording at its next
  /// step boundary and waits at most `wait` for the step it is in to end. True: the step
  /// is still running (its state is the training thread's: leave it alone).
  bool request_close_and_wait(std::chrono::duration<double> wait);
  /// One close() at a time.
  std::mutex& close_mutex() noexcept { return close_mu_; }

  /// A forked child (only the forking thread exists there).
  bool forked() const noexcept { return fork_generation() != fork_generation_ || getpid() != pid_; }
  /// Forgets the run (detached and closed); true the first time only.
  bool abandon() noexcept {
    if (abandoned_) return false;
    abandoned_ = true;
    detached_ = true;
    mark_closed();
    return true;
  }

 private:
  const pid_t pid_;
  const std::uint64_t fork_generation_;
  std::atomic<const void*> owner_{nullptr};   // the training thread: the last to begin a step
  std::atomic<bool> busy_{false};             // the training thread is inside a step
  std::atomic<bool> close_requested_{false};  // by a close from another thread
  bool detached_ = false;            // training thread: record nothing more (foreign close, fork)
  std::atomic<bool> closed_{false};  // beside what a step's begin reads: one line for all
  bool abandoned_ = false;
  std::mutex busy_mu_;
  std::condition_variable busy_cv_;
  std::mutex close_mu_;  // one close() at a time
};

}  // namespace steptrace::detail
