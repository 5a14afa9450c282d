// PM-sampling samples -> per-step counter averages. Pure: the decode thread hands in the
// decoded samples ([start, end) GPU timestamps and one value per metric) and the steps'
// [start, end) boundaries on the same clock; each step gets the time-weighted average of
// every metric over the part of each sample inside it (a sample straddling a boundary is
// split by overlap). Decoder losses (dropped samples, hardware buffer overflow) are
// carried through so the step record can say its counters are partial.
#pragma once

#include <cstdint>
#include <vector>

namespace steptrace::detail {

struct PmSample {
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
  std::vector<double> values;  // one per metric, in the metric set's order; NaN = invalid
};

struct StepWindow {
  std::int64_t step = 0;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
};

/// What the decoder reported for the samples it produced.
struct DecodeLosses {
  std::int64_t dropped_samples = 0;  // samples the decoder could not produce
  bool overflow = false;             // the hardware buffer overflowed: samples are missing
};

struct StepCounters {
  std::int64_t step = 0;
  std::vector<double> values;  // time-weighted average per metric; NaN when no sample covers it
  double coverage_pct = 0;     // share of the step covered by samples (any valid metric)
  int samples = 0;             // samples overlapping the step
};

struct AggregationResult {
  std::vector<StepCounters> steps;     // one per step window, in the order given
  std::int64_t outside_samples = 0;    // samples overlapping no step (between steps: normal)
  std::int64_t malformed_samples = 0;  // end < start, or the wrong number of values
  std::int64_t dropped_samples = 0;    // from DecodeLosses
  bool overflow = false;               // from DecodeLosses
};

/// Aggregates `samples` (any order) into `steps` (non-overlapping, any order) for
/// `num_metrics` metrics. A zero-length sample counts as 1 ns at its timestamp.
AggregationResult aggregate_samples(const std::vector<PmSample>& samples,
                                    const std::vector<StepWindow>& steps, std::size_t num_metrics,
                                    const DecodeLosses& losses = {});

}  // namespace steptrace::detail
