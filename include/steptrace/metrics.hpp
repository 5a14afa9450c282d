// The hardware-counter metric set steptrace asks CUPTI for, per GPU chip, and a check of
// it with CUPTI's profiler host API (works without a GPU or driver: only libcupti, which
// is loaded at run time). Behind `steptrace metrics --chip GH100`.
#pragma once

#include <string>
#include <vector>

#include "steptrace/export.hpp"

namespace steptrace {

/// One candidate metric for one counter of the step record.
struct MetricCheck {
  std::string counter;    // the step record's counter it feeds ("tensor_active_pct", ...)
  std::string name;       // the CUPTI metric name
  bool required = false;  // the set is unusable without this counter
  bool exists = false;    // CUPTI knows this metric for the chip and mode
  bool selected = false;  // part of the chosen set
  std::string note;       // why it was not selected (a fallback was, or it needs a pass more)
};

/// The metric set chosen for a chip, and what CUPTI said about it.
struct MetricSetReport {
  std::string chip;     // as asked, e.g. "GH100"
  std::string family;   // the table entry used, e.g. "GH100" for GH100, "GA10x" for GA104
  std::string mode;     // "pm_sampling" or "range_profiler"
  std::string trigger;  // PM sampling trigger: "gpu_time_interval" or "gpu_sysclk_interval"
  std::vector<MetricCheck> metrics;  // every candidate considered, in table order
  int passes = -1;                   // passes of the selected set; -1 when not computed
  std::string cupti_library;         // the libcupti file used ("" when none could be loaded)
  int cupti_version = 0;             // cuptiGetVersion
  std::string error;                 // empty when the check ran; otherwise why not, in one line

  /// The names of the selected metrics, in order.
  std::vector<std::string> selected() const {
    std::vector<std::string> out;
    for (const auto& m : metrics) {
      if (m.selected) out.push_back(m.name);
    }
    return out;
  }
};

/// The chip names the table covers (silicon names as cuptiDeviceGetChipName reports them).
STEPTRACE_API std::vector<std::string> supported_chips();

/// Chooses and checks the metric set for `chip` with CUPTI's host API. `mode` is "auto"
/// (PM sampling where the chip and CUPTI have it, else the range profiler),
/// "pm_sampling" or "range_profiler". `library_dirs` are searched for libcupti after the
/// copy already loaded in the process and the usual places. Throws ConfigError for a chip
/// or mode it does not know; CUPTI problems (not found, too old) go to `error`.
STEPTRACE_API MetricSetReport check_metric_set(const std::string& chip,
                                               const std::string& mode = "auto",
                                               const std::vector<std::string>& library_dirs = {});

}  // namespace steptrace
