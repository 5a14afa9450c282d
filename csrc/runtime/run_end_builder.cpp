#include "run_end_builder.hpp"

#include <fmt/format.h>

namespace steptrace::detail {

const char* end_reason_name(EndReason r) noexcept {
  switch (r) {
    case EndReason::kNormal:
      return "normal";
    case EndReason::kException:
      return "exception";
    case EndReason::kSignal:
      return "signal";
    case EndReason::kExit:
      return "exit";
  }
  return "normal";
}

RunEnd build_run_end(const RunEndFacts& facts) {
  RunEnd end;
  end.reason = end_reason_name(facts.reason);
  end.error = std::string(facts.error);
  if (facts.step_left_running) {
    if (!end.error.empty()) end.error += "; ";
    end.error += fmt::format(
        "closed from another thread while step {} was still running after close_wait_s={}; "
        "that step and the steps waiting for device times are not recorded",
        facts.running_step, facts.close_wait_s);
  }
  end.end_unix_ns = facts.start.unix_ns_at(facts.now_ns);
  end.wall_s = static_cast<double>(facts.now_ns - facts.start.start_ns) / 1e9;
  end.data_inside_step = facts.data_inside_step;
  end.process_start_unix_ns = facts.process_start_unix_ns;
  end.profiler_start_unix_ns = facts.start.start_unix_ns;
  end.mfu_dtype = facts.mfu_dtype;
  end.mfu_dtype_assumed = facts.mfu_dtype_assumed;
  if (facts.trailing != nullptr) end.trailing = *facts.trailing;
  return end;
}

std::string trailing_interval_lines(const BetweenSteps& pending, std::int64_t step, int rank) {
  fmt::memory_buffer lines;
  for (std::uint8_t i = 0; i < pending.listed; ++i) {
    append_interval_json(lines, pending.intervals[i], step, rank);
  }
  return fmt::to_string(lines);
}

RunEnd signal_run_end(const ClockMapping& start, std::int64_t data_inside_step) {
  RunEnd end;
  end.reason = "signal";
  end.error =
      "SIGTERM: the program did not end the run within the grace period; closed by "
      "steptrace's signal watcher (a step in progress and steps waiting for device times "
      "are not recorded)";
  end.end_unix_ns = unix_now_ns();
  end.wall_s = static_cast<double>(end.end_unix_ns - start.start_unix_ns) / 1e9;
  end.data_inside_step = data_inside_step;
  return end;
}

}  // namespace steptrace::detail
