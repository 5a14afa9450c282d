// The table of hardware-counter metrics per chip family, and the pure selection logic
// that turns it into a one-pass metric set given what CUPTI says exists and how many
// passes a set needs (cupti_host.cpp asks CUPTI; tests pass fakes).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "steptrace/metrics.hpp"

namespace steptrace::detail::cupti {

enum class ProfilerMode { kPmSampling, kRangeProfiler };

const char* to_string(ProfilerMode m);

/// One counter of the step record and the CUPTI metric names that can provide it, best
/// first: the first one that exists on the chip is used.
struct CounterSpec {
  std::string counter;
  bool required = false;
  std::vector<std::string> candidates;
};

/// A row of the table: chips that share metric names and capabilities.
struct ChipFamily {
  std::string name;
  std::vector<std::string> chips;
  bool pm_sampling = true;            // PM sampling supported (Turing and later)
  bool time_interval_trigger = true;  // GPU_TIME_INTERVAL trigger (not Turing, not GA100)
  bool nvlink = false;                // NVLink counters worth asking for
};

const std::vector<ChipFamily>& chip_families();

/// The family of a chip name (exact silicon name, e.g. "GH100"); nullptr when unknown.
const ChipFamily* find_family(std::string_view chip);

/// Why a chip without a family is unsupported (older than Ampere, or unknown), naming the
/// chips that are; one line, quoting `chip`.
std::string unsupported_chip_reason(std::string_view chip);

/// The counters asked for on `family` in `mode`, required ones first.
std::vector<CounterSpec> counters_for(const ChipFamily& family, ProfilerMode mode);

/// What the selection needs from CUPTI: whether a metric exists; the passes a set of
/// metrics needs (-1 when CUPTI refuses the combination; `why` says how).
struct MetricOracle {
  std::function<bool(const std::string& metric)> exists;
  std::function<int(const std::vector<std::string>& metrics, std::string* why)> passes;
};

/// Picks, per counter, the first existing candidate; keeps every required counter and
/// adds optional ones while the set stays one pass. Fills report.metrics, passes and
/// error (a required counter missing, or the required set over one pass).
void select_metric_set(const std::vector<CounterSpec>& specs, const MetricOracle& oracle,
                       MetricSetReport* report);

}  // namespace steptrace::detail::cupti
