// The Profiler's entries that take a JSON value rather than JSON text, for the Python
// bindings (csrc/python/record_bindings.cpp): a dict converted there is handed over as it
// is, never printed to text and parsed again. The public header stays free of nlohmann;
// C++ users have the text overloads, which go through the same entries.
#pragma once

#include <nlohmann/json.hpp>

#include "steptrace/profiler.hpp"

namespace steptrace::detail {

struct ProfilerAccess {
  /// Profiler::write_record for a record as a value: the same validation (an object whose
  /// kind is cluster, alert or resolved; an alert or resolved has a string "type"), the
  /// same UsageErrors, the same line.
  static void write_record(Profiler& profiler, nlohmann::ordered_json record);
  /// Profiler::answer_collectives for the flight recorder's state as a value: an object,
  /// or null for nothing (anything else is nothing too).
  static void answer_collectives(Profiler& profiler, nlohmann::ordered_json answer);
};

}  // namespace steptrace::detail
