// Offline detection: the record detectors (step_regression, stall, memory_growth and the
// device diagnoses; not the hang watchdog, which needs a live step) run over steps read
// back from a log or made up by a test, with any configuration. The same code as in a
// live run, so a replay with the run's config gives the run's alerts.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/export.hpp"

namespace steptrace {

/// One step as the detectors see it.
struct ReplayStep {
  std::int64_t step = 0;
  std::int64_t start_unix_ns = 0;
  double data_ms = 0;
  double data_start_ms = 0;  // of data_ms: the loader's iterator started or ended
  double compile_ms = 0;     // of step_ms: compiling inside the step
  double tokens = -1;        // the step's work (work.tokens, work.samples); -1: unknown
  double samples = -1;
  double other_ms = 0;             // the rest of the gap before the step (not data, not intervals)
  double interval_in_step_ms = 0;  // evaluation / checkpoint intervals inside the step
  double runq_ms = -1;             // run-queue wait read at this step; -1: none
  double runq_span_ms = 0;         // the time that reading spans (0: the step's own)
  double steal_ms = -1;            // CPU time the hypervisor took in that span; -1: none
  double step_ms = 0;
  double gc_ms = 0;  // Python's collections in the step (gc.ms), of which generation 2's
  double gc_gen2_ms = 0;
  double gc_between_ms = 0;  // and in the gap before it (gc.between_ms)
  double gc_between_gen2_ms = 0;
  int gc_count = 0;
  bool failed = false;
  /// An evidence capture ran in the step ("profiled": true): the detectors skip it, as live.
  bool profiled = false;
  std::vector<std::pair<std::string, double>> phases_ms;
  MemorySample memory;
  /// rss_bytes was measured at this step (a live run re-reads RSS at most every 10 ms).
  bool rss_fresh = true;
};

/// Runs the detectors over `steps` in order and returns their records (alert,
/// alert_update, resolved) as JSON lines without newlines. Throws ConfigError for a bad
/// config, UsageError for steps out of order or more than kMaxPhases phase names.
STEPTRACE_API std::vector<std::string> replay_detectors(const Config& config,
                                                        const std::vector<ReplayStep>& steps);

}  // namespace steptrace
