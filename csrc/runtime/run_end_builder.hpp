// The run_end record as the runtime builds it when a run ends: by close() (on the training
// thread, or from another thread that found a step still running), or by the SIGTERM
// watcher after the grace period. The pipeline adds the writer's own totals.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "../core/record_json.hpp"
#include "run_environment.hpp"
#include "steptrace/profiler.hpp"

namespace steptrace::detail {

/// "normal", "exception", "signal", "exit".
const char* end_reason_name(EndReason r) noexcept;

/// What close() knows as it ends the run (after everything that stamps an alert).
struct RunEndFacts {
  EndReason reason = EndReason::kNormal;
  std::string_view error;             // the caller's (an exception's text); empty: none
  bool step_left_running = false;     // a foreign close waited close_wait_s in vain
  std::int64_t running_step = -1;     // and that step
  double close_wait_s = 0;            // the option, quoted in the error
  ClockMapping start;                 // the run's clock against unix time
  std::int64_t now_ns = 0;            // a reading of the run's clock: the end
  std::int64_t data_inside_step = 0;  // begin_data calls inside a step
  std::int64_t process_start_unix_ns = 0;
  std::string mfu_dtype;  // MFU's peak as it is at the end (set_mfu_dtype may change it)
  bool mfu_dtype_assumed = false;
  const BetweenSteps* trailing = nullptr;  // the intervals after the last step; null: none
};

/// run_end as close() writes it.
RunEnd build_run_end(const RunEndFacts& facts);

/// The interval records of `pending` (one line each), written before run_end; `step` is
/// the step they came after. Empty: none.
std::string trailing_interval_lines(const BetweenSteps& pending, std::int64_t step, int rank);

/// run_end as the SIGTERM watcher writes it when the program did not end the run within
/// the grace period: on unix time (no reading of the run's clock), nothing of the steps.
RunEnd signal_run_end(const ClockMapping& start, std::int64_t data_inside_step);

}  // namespace steptrace::detail
