#include "run_lifecycle.hpp"

#include "../core/check.hpp"
#include "steptrace/error.hpp"

namespace steptrace::detail {

RunLifecycle::RunLifecycle() noexcept : pid_(getpid()), fork_generation_(fork_generation()) {}

void RunLifecycle::check_open() const {
  STEPTRACE_CHECK(!closed(), UsageError, "the profiler is closed; create a new one");
}

bool RunLifecycle::request_close_and_wait(std::chrono::duration<double> wait) {
  close_requested_.store(true, std::memory_order_seq_cst);
  std::unique_lock<std::mutex> lock(busy_mu_);
  return !busy_cv_.wait_for(lock, wait, [&] { return !busy_.load(std::memory_order_seq_cst); });
}

}  // namespace steptrace::detail
