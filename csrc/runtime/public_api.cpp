// The public API's parts that need no ProfilerImpl: the Phase, Step and Interval scopes
// (they call the Profiler back as they end) and the process-wide free functions.
#include <algorithm>
#include <chrono>
#include <exception>

#include "../core/lifecycle.hpp"
#include "../core/stack_dump.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"

#ifndef STEPTRACE_VERSION
#error "STEPTRACE_VERSION must be defined by the build"
#endif

namespace steptrace {

// ---- Phase and Step scopes ----

Phase::Phase(Phase&& other) noexcept : profiler_(other.profiler_), id_(other.id_) {
  other.profiler_ = nullptr;
}

Phase::~Phase() {
  if (profiler_ == nullptr) return;
  try {
    profiler_->end_phase(id_);
  } catch (const Error&) {
    // The step already ended (and closed this phase): nothing left to do.
  }
}

Step::Step(Profiler* profiler) noexcept
    : profiler_(profiler), uncaught_at_start_(std::uncaught_exceptions()) {}

Step::Step(Step&& other) noexcept
    : profiler_(other.profiler_),
      uncaught_at_start_(other.uncaught_at_start_),
      failed_(other.failed_) {
  other.profiler_ = nullptr;
}

Interval::Interval(Interval&& other) noexcept : profiler_(other.profiler_), kind_(other.kind_) {
  other.profiler_ = nullptr;
}

Interval::~Interval() {
  if (profiler_ != nullptr) profiler_->end_interval(kind_);  // never throws
}

Step::~Step() {
  if (profiler_ == nullptr) return;
  try {
    profiler_->end_step(failed_ || std::uncaught_exceptions() > uncaught_at_start_);
  } catch (const Error&) {
    // The profiler was closed while the step ran; close() recorded it as failed.
  }
}

Phase Step::phase(std::string_view name) { return profiler_->phase(name); }
Phase Step::phase(PhaseId id) { return profiler_->phase(id); }

// ---- process-wide ----

bool install_sigterm_handler(bool terminate, double grace_s) {
  const double ms = std::clamp(grace_s, 0.0, 86400.0) * 1000.0;
  return detail::watch_sigterm(terminate, std::chrono::milliseconds(static_cast<std::int64_t>(ms)));
}
void remove_sigterm_handler() noexcept { detail::unwatch_sigterm(); }

bool set_stack_dump_signal(int signum, int fd) noexcept {
  return detail::arm_stack_dump(signum, fd);
}
bool stack_dump_signal_reset() noexcept { return detail::armed_signal_reset(); }
int spare_signal() noexcept { return detail::spare_signal(); }

const char* version() noexcept { return STEPTRACE_VERSION; }

}  // namespace steptrace
