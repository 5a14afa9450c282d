// Serialization of records to JSON lines (schema steptrace/1). Runs on the writer thread.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "step_record.hpp"

namespace steptrace::detail {

/// Totals the writer keeps over the step records it serialized, for run_end's summary.
struct RunTotals {
  std::int64_t steps = 0;
  std::int64_t error_steps = 0;
  std::int64_t step_ns_sum = 0;
  std::int64_t step_ns_max = 0;
  std::int64_t data_ns_sum = 0;
  std::array<std::int64_t, kMaxPhases> phase_ns_sum{};
  std::array<bool, kMaxPhases> phase_seen{};

  void add(const StepRecord& r) noexcept;
};

/// How a run ended, known to the profiler when it closes.
struct RunEnd {
  std::string reason;  // "normal", "exception", "signal", "exit"
  std::string error;   // empty unless the run ended with an exception
  std::int64_t end_unix_ns = 0;
  double wall_s = 0;
  std::int64_t writer_waits = 0;
  std::int64_t dropped_steps = 0;     // step records dropped because the writer was stopping
  std::int64_t write_errors = 0;      // failed writes (e.g. disk full)
  std::string write_error;            // the first one's error text; empty: none
  std::int64_t data_inside_step = 0;  // begin_data calls inside a step (not timed as data)
  std::map<std::string, std::int64_t> alerts;         // alert episodes, by type
  std::map<std::string, std::int64_t> alert_repeats;  // occurrences folded into them
  std::string extra_fields;  // more members (`"key":value,...`), e.g. device activity totals
};

/// Appends `s` as a quoted JSON string.
void append_json_string(fmt::memory_buffer& out, std::string_view s);

/// Appends one step record and a newline.
void append_step_json(fmt::memory_buffer& out, const StepRecord& r, int rank,
                      const PhaseNames& names);

/// Appends the run_end record and a newline.
void append_run_end_json(fmt::memory_buffer& out, const RunEnd& end, const RunTotals& totals,
                         int rank, const PhaseNames& names);

}  // namespace steptrace::detail
