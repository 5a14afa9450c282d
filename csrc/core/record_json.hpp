// Serialization of records to JSON lines (schema steptrace/1). Runs on the writer thread.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "step_record.hpp"
#include "work_accounting.hpp"

namespace steptrace::detail {

/// Totals the writer keeps over the step records it serialized, for run_end's summary.
struct RunTotals {
  std::int64_t steps = 0;
  std::int64_t error_steps = 0;
  std::int64_t step_ns_sum = 0;
  std::int64_t step_ns_max = 0;
  std::int64_t data_ns_sum = 0;
  // Goodput: where the wall clock went (see append_run_end_json).
  std::int64_t training_ns_sum = 0;  // host time of the steps less intervals inside them
  std::int64_t other_ns_sum = 0;
  std::array<std::int64_t, kIntervalKinds> interval_ns_sum{};  // by IntervalKind
  std::int64_t runq_ns_sum = 0;
  std::int64_t gc_ns_sum = 0;       // Python's collections, in steps and between them
  std::int64_t gc_gen2_ns_sum = 0;  // of which generation 2's
  std::int64_t gc_count = 0;
  std::int64_t steal_ns_sum = -1;        // -1: steal never sampled
  std::int64_t device_clock_steps = 0;   // timed with device events
  std::int64_t captured_steps = 0;       // host-timed: their stream captured a CUDA graph
  std::int64_t clamped_intervals = 0;    // negative device intervals written as 0
  std::int64_t first_start_unix_ns = 0;  // the first step's start
  std::int64_t before_first_ns = 0;      // intervals between the start and the first step
  std::int64_t last_end_unix_ns = 0;     // the last step's end
  std::array<std::int64_t, kMaxPhases> phase_ns_sum{};
  std::array<bool, kMaxPhases> phase_seen{};
  WorkTotals work;  // samples, tokens, FLOPs and energy

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
  std::int64_t process_start_unix_ns = 0;  // 0: unknown (then goodput starts at the profiler)
  std::int64_t profiler_start_unix_ns = 0;
  BetweenSteps trailing;           // intervals after the last step (and those before any step)
  std::string mfu_dtype;           // the math dtype of MFU's peak ("" : the peak_tflops option)
  bool mfu_dtype_assumed = false;  // mfu_dtype "auto" and nothing said what the model runs in
  std::string extra_fields;        // more members (`"key":value,...`), e.g. device activity totals
};

/// Appends `s` as a quoted JSON string.
void append_json_string(fmt::memory_buffer& out, std::string_view s);

/// Appends one interval record and a newline; `step` is the step it came before or inside.
void append_interval_json(fmt::memory_buffer& out, const IntervalEntry& e, std::int64_t step,
                          int rank);

/// Appends one step record and a newline (after the interval records it lists).
void append_step_json(fmt::memory_buffer& out, const StepRecord& r, int rank,
                      const PhaseNames& names);

/// Appends the run_end record and a newline.
void append_run_end_json(fmt::memory_buffer& out, const RunEnd& end, const RunTotals& totals,
                         int rank, const PhaseNames& names);

}  // namespace steptrace::detail
