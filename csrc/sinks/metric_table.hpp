// The metrics table (metrics.def) as C++ values: one Metric id per family, its row (name,
// type, labels, help, buckets), and the OTLP instruments that export some of them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace steptrace::detail {

enum class MetricType : std::uint8_t { counter, gauge, histogram };
enum class MetricBuckets : std::uint8_t { none, duration };

/// Upper bounds of the duration histograms, in seconds (roughly x2.5 apart).
inline constexpr std::array<double, 15> kDurationBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0};

/// Ranks exported from a cluster record at most: the stragglers first, then by score
/// (the Prometheus series and the OTLP gauges both).
inline constexpr std::size_t kMaxClusterRows = 64;

/// Alert types counted apart at most; any further type is counted as "other".
inline constexpr std::size_t kMaxAlertTypes = 256;

/// One family per row of metrics.def, in its order.
enum class Metric : std::uint8_t {
#define STEPTRACE_METRIC(id, type, labels, buckets, help) id,
#include "metrics.def"
};

struct MetricDef {
  std::string_view name;  // steptrace_<id>
  MetricType type;
  std::string_view labels;  // besides job, run_id, rank, host; comma-separated
  MetricBuckets buckets;
  std::string_view help;
};

inline constexpr MetricDef kMetrics[] = {
#define STEPTRACE_METRIC(id, type, labels, buckets, help) \
  {"steptrace_" #id, MetricType::type, labels, MetricBuckets::buckets, help},
#include "metrics.def"
};

constexpr const MetricDef& metric_def(Metric m) noexcept {
  return kMetrics[static_cast<std::size_t>(m)];
}

constexpr std::string_view metric_type_name(MetricType t) noexcept {
  switch (t) {
    case MetricType::counter:
      return "counter";
    case MetricType::gauge:
      return "gauge";
    case MetricType::histogram:
      return "histogram";
  }
  return "untyped";
}

/// The bucket bounds of a histogram family (none: size 0).
struct BucketBounds {
  const double* data = nullptr;
  std::size_t size = 0;
};
constexpr BucketBounds metric_buckets(MetricBuckets b) noexcept {
  if (b == MetricBuckets::duration) return {kDurationBuckets.data(), kDurationBuckets.size()};
  return {};
}

/// An OpenTelemetry instrument exporting one family (the OTLP export builds its instruments
/// from these rows, through steptrace._core.metric_table()).
struct OtlpInstrumentDef {
  Metric metric;
  std::string_view name;
  std::string_view instrument;  // counter, histogram, gauge, observable_gauge
  std::string_view unit;
  std::string_view description;
};

inline constexpr OtlpInstrumentDef kOtlpInstruments[] = {
#define STEPTRACE_METRIC_OTLP(id, name, instrument, unit, description) \
  {Metric::id, name, #instrument, unit, description},
#include "metrics.def"
};

}  // namespace steptrace::detail
