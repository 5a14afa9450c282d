#include <fmt/format.h>

#include <cmath>
#include <cstddef>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "metrics_registry.hpp"

namespace steptrace::detail {
namespace {

constexpr const char* kMemoryKinds[] = {"allocated", "reserved", "peak",
                                        "rss",       "heap",     "device_used"};
// The gauges of Values::ratios, in its order.
constexpr Metric kRatioMetrics[] = {Metric::tensor_active_ratio, Metric::dram_throughput_ratio,
                                    Metric::sm_occupancy_ratio};

// A sample value as the text format wants it.
std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

// A family's HELP and TYPE lines, from its row of the table.
void header(fmt::memory_buffer& out, Metric m) {
  const MetricDef& d = metric_def(m);
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} {}\n", d.name, d.help, d.name,
                 metric_type_name(d.type));
}

void sample(fmt::memory_buffer& out, Metric m, std::string_view labels, double v) {
  fmt::format_to(std::back_inserter(out), "{}{{{}}} {}\n", metric_def(m).name, labels, number(v));
}

void histogram(fmt::memory_buffer& out, Metric m, const std::string& labels,
               const MetricsRegistry::Histogram& h) {
  const std::string_view name = metric_def(m).name;
  const BucketBounds bounds = metric_buckets(metric_def(m).buckets);
  auto it = std::back_inserter(out);
  std::int64_t cumulative = 0;
  for (std::size_t i = 0; i < bounds.size && i < h.counts.size(); ++i) {
    cumulative += h.counts[i];
    fmt::format_to(it, "{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, number(bounds.data[i]),
                   cumulative);
  }
  fmt::format_to(it, "{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, h.count);
  fmt::format_to(it, "{}_sum{{{}}} {}\n", name, labels, number(h.sum));
  fmt::format_to(it, "{}_count{{{}}} {}\n", name, labels, h.count);
}

}  // namespace

std::string MetricsRegistry::render() const {
  Values v;
  {
    std::lock_guard<std::mutex> lock(mu_);
    v = values_;
  }
  const double median = median_s_ ? median_s_() : 0.0;
  const double in_flight = in_flight_s_ ? in_flight_s_() : 0.0;
  const std::string& l = base_labels_;
  fmt::memory_buffer out;

  header(out, Metric::info);
  sample(out, Metric::info, fmt::format("{},version=\"{}\"", l, escape_label_value(version_)), 1);
  header(out, Metric::steps_total);
  sample(out, Metric::steps_total, l, static_cast<double>(v.steps));
  header(out, Metric::error_steps_total);
  sample(out, Metric::error_steps_total, l, static_cast<double>(v.error_steps));
  header(out, Metric::step_duration_seconds);
  histogram(out, Metric::step_duration_seconds, l, v.step);
  bool phase_header = false;
  for (std::size_t id = 0; id < kMaxPhases && id < names_.size(); ++id) {
    if (!v.phase_seen[id]) continue;
    if (!phase_header) {
      header(out, Metric::phase_duration_seconds);
      phase_header = true;
    }
    histogram(out, Metric::phase_duration_seconds,
              fmt::format("{},phase=\"{}\"", l,
                          escape_label_value(names_.name(static_cast<std::uint16_t>(id)))),
              v.phases[id]);
  }
  header(out, Metric::data_wait_seconds_total);
  sample(out, Metric::data_wait_seconds_total, l, v.data_wait_s);
  // Every kind from the first scrape on (0 until seen), so a share of the wall clock never
  // lacks a term.
  header(out, Metric::time_seconds_total);
  for (std::size_t k = 0; k < kTimeKinds.size(); ++k) {
    sample(out, Metric::time_seconds_total, fmt::format("{},kind=\"{}\"", l, kTimeKinds[k]),
           v.time_s[k]);
  }
  // Every cause from the first scrape on (0 until seen), as the time kinds.
  header(out, Metric::badput_seconds_total);
  for (std::size_t c = 1; c < kBadputCauseNames.size(); ++c) {  // 0 is productive
    sample(out, Metric::badput_seconds_total,
           fmt::format("{},cause=\"{}\"", l, kBadputCauseNames[c]), v.badput_s[c]);
  }
  if (std::isfinite(v.goodput_ratio)) {
    header(out, Metric::job_goodput_ratio);
    sample(out, Metric::job_goodput_ratio, l, v.goodput_ratio);
  }
  if (v.runq_seen) {
    header(out, Metric::runq_wait_seconds_total);
    sample(out, Metric::runq_wait_seconds_total, l, v.runq_wait_s);
  }
  if (open_interval_) {
    const OpenIntervalProbe open = open_interval_();
    header(out, Metric::interval_in_flight_seconds);
    for (std::size_t k = 0; k < kIntervalKinds; ++k) {
      const auto kind = static_cast<IntervalKind>(k);
      const double age = open.kind == kind && open.age_s > 0 ? open.age_s : 0.0;
      sample(out, Metric::interval_in_flight_seconds,
             fmt::format("{},kind=\"{}\"", l, interval_name(kind)), age);
    }
    if (open.peers_in_interval >= 0) {
      header(out, Metric::peers_in_interval);
      sample(out, Metric::peers_in_interval, l, open.peers_in_interval);
    }
  }
  if (median > 0 && std::isfinite(median)) {
    header(out, Metric::step_median_seconds);
    sample(out, Metric::step_median_seconds, l, median);
  }
  if (v.steps > 0) {
    header(out, Metric::last_step_timestamp_seconds);
    sample(out, Metric::last_step_timestamp_seconds, l, v.last_step_unix_s);
  }
  header(out, Metric::step_in_flight_seconds);
  sample(out, Metric::step_in_flight_seconds, l, in_flight);
  bool memory_header = false;
  for (std::size_t i = 0; i < v.memory_bytes.size(); ++i) {
    if (std::isnan(v.memory_bytes[i])) continue;
    if (!memory_header) {
      header(out, Metric::memory_bytes);
      memory_header = true;
    }
    sample(out, Metric::memory_bytes, fmt::format("{},kind=\"{}\"", l, kMemoryKinds[i]),
           v.memory_bytes[i]);
  }
  if (!v.alerts.empty()) {
    header(out, Metric::alerts_total);
    for (const auto& [type, count] : v.alerts) {
      sample(out, Metric::alerts_total, fmt::format("{},type=\"{}\"", l, escape_label_value(type)),
             static_cast<double>(count));
    }
  }
  for (std::size_t i = 0; i < v.ratios.size(); ++i) {
    if (std::isnan(v.ratios[i])) continue;
    header(out, kRatioMetrics[i]);
    sample(out, kRatioMetrics[i], l, v.ratios[i]);
  }
  if (v.split_seen) {
    header(out, Metric::compute_seconds_total);
    sample(out, Metric::compute_seconds_total, l, v.compute_s);
    header(out, Metric::comm_seconds_total);
    sample(out, Metric::comm_seconds_total, l, v.comm_s);
    header(out, Metric::comm_exposed_seconds_total);
    sample(out, Metric::comm_exposed_seconds_total, l, v.comm_exposed_s);
  }
  if (v.comm_sized_seen) {  // collectives with known sizes (nccl-tests' figures)
    const std::pair<Metric, double> bandwidth[] = {
        {Metric::comm_bytes_total, v.comm_bytes},
        {Metric::comm_algbw_bytes_per_second, v.algbw_bytes_s},
        {Metric::comm_busbw_bytes_per_second, v.busbw_bytes_s}};
    for (const auto& [m, value] : bandwidth) {
      header(out, m);
      sample(out, m, l, value);
    }
  }
  render_hardware(out, v);
  render_work(out, v);
  render_cluster(out, v);
  return std::string(out.data(), out.size());
}

void MetricsRegistry::render_work(fmt::memory_buffer& out, const Values& v) const {
  const std::string& l = base_labels_;
  const Values::Work& w = v.work;
  // A gauge only once a step knew the figure (a run without token ids has no tokens/s).
  const auto gauge = [&](Metric m, double value) {
    if (std::isnan(value)) return;
    header(out, m);
    sample(out, m, l, value);
  };
  gauge(Metric::samples_per_second, w.samples_per_s);
  gauge(Metric::tokens_per_second, w.tokens_per_s);
  gauge(Metric::model_tflops_per_second, w.tflops_per_s);
  gauge(Metric::mfu_ratio, w.mfu_ratio);
  if (w.samples_seen) {
    header(out, Metric::samples_total);
    sample(out, Metric::samples_total, l, w.samples_total);
  }
  if (w.tokens_seen) {
    header(out, Metric::tokens_total);
    sample(out, Metric::tokens_total, l, w.tokens_total);
  }
}

void MetricsRegistry::render_hardware(fmt::memory_buffer& out, const Values& v) const {
  const std::string& l = base_labels_;
  if (v.hw_seen) {
    // A gauge only where the device reports the figure (NaN: not reported).
    const auto gauge = [&](Metric m, double value) {
      if (std::isnan(value)) return;
      header(out, m);
      sample(out, m, l, value);
    };
    gauge(Metric::gpu_power_watts, v.power_w);
    if (v.power_limit_w > 0) {
      gauge(Metric::gpu_power_limit_watts, v.power_limit_w);
    }
    header(out, Metric::gpu_energy_joules_total);
    sample(out, Metric::gpu_energy_joules_total, l, v.energy_j);
    gauge(Metric::gpu_temperature_celsius, v.temp_c);
    gauge(Metric::gpu_memory_temperature_celsius, v.mem_temp_c);
    gauge(Metric::gpu_sm_clock_hertz, v.sm_clock_hz);
    gauge(Metric::gpu_memory_clock_hertz, v.mem_clock_hz);
    gauge(Metric::gpu_utilization_ratio, v.util_ratio);
    // a gauge by direction, the series of a direction the device does not report left out
    auto by_direction = [&](Metric m, double tx, double rx) {
      if (std::isnan(tx) && std::isnan(rx)) return;
      header(out, m);
      if (!std::isnan(tx)) sample(out, m, fmt::format("{},direction=\"tx\"", l), tx);
      if (!std::isnan(rx)) sample(out, m, fmt::format("{},direction=\"rx\"", l), rx);
    };
    by_direction(Metric::gpu_pcie_bytes_per_second, v.pcie_tx_bytes_s, v.pcie_rx_bytes_s);
    by_direction(Metric::gpu_nvlink_bytes_per_second, v.nvlink_tx_bytes_s, v.nvlink_rx_bytes_s);
    bool throttle_header = false;
    for (std::size_t bit = 0; bit < kThrottleReasonBits; ++bit) {
      if (v.throttled[bit] == 0) continue;
      if (!throttle_header) {
        header(out, Metric::gpu_throttled_steps_total);
        throttle_header = true;
      }
      sample(out, Metric::gpu_throttled_steps_total,
             fmt::format("{},reason=\"{}\"", l, throttle_reason_name(bit)),
             static_cast<double>(v.throttled[bit]));
    }
  }
  if (!v.hardware_errors.empty()) {
    header(out, Metric::gpu_hardware_errors_total);
    for (const auto& [kind, count] : v.hardware_errors) {
      sample(out, Metric::gpu_hardware_errors_total, fmt::format("{},kind=\"{}\"", l, kind),
             static_cast<double>(count));
    }
  }
  if (v.last_xid > 0) {
    header(out, Metric::gpu_last_xid);
    sample(out, Metric::gpu_last_xid, l, v.last_xid);
  }
}

void MetricsRegistry::render_cluster(fmt::memory_buffer& out, const Values& v) const {
  if (v.cluster_windows == 0) return;
  const std::string& l = base_labels_;
  header(out, Metric::cluster_windows_total);
  sample(out, Metric::cluster_windows_total, l, static_cast<double>(v.cluster_windows));
  header(out, Metric::cluster_ranks_reporting);
  sample(out, Metric::cluster_ranks_reporting, l, v.ranks_reporting);
  if (!std::isnan(v.world_size)) {
    header(out, Metric::cluster_world_size);
    sample(out, Metric::cluster_world_size, l, v.world_size);
  }
  header(out, Metric::cluster_stragglers);
  sample(out, Metric::cluster_stragglers, l, v.stragglers);
  if (v.cluster_rows.empty()) return;
  // Per-rank series carry the rank they describe (and its host), not the aggregator's.
  std::vector<std::string> labels;
  labels.reserve(v.cluster_rows.size());
  for (const ClusterRow& row : v.cluster_rows) {
    labels.push_back(fmt::format(
        "job=\"{}\",run_id=\"{}\",rank=\"{}\",host=\"{}\"", escape_label_value(labels_.job),
        escape_label_value(labels_.run_id), row.rank, escape_label_value(row.host)));
  }
  const auto per_rank = [&](Metric m, double ClusterRow::*field) {
    bool any = false;
    for (std::size_t i = 0; i < v.cluster_rows.size(); ++i) {
      const double value = v.cluster_rows[i].*field;
      if (std::isnan(value)) continue;
      if (!any) header(out, m);
      any = true;
      sample(out, m, labels[i], value);
    }
  };
  per_rank(Metric::rank_straggler_score, &ClusterRow::straggler_score);
  per_rank(Metric::rank_step_median_seconds, &ClusterRow::step_s);
  per_rank(Metric::rank_step_p95_seconds, &ClusterRow::step_p95_s);
  per_rank(Metric::rank_busbw_bytes_per_second, &ClusterRow::busbw_bytes_s);
  static constexpr std::pair<const char*, double ClusterRow::*> kParts[] = {
      {"compute", &ClusterRow::compute_s},
      {"comm", &ClusterRow::comm_s},
      {"wait", &ClusterRow::wait_s},
      {"data", &ClusterRow::data_s}};
  header(out, Metric::rank_split_seconds);
  for (std::size_t i = 0; i < v.cluster_rows.size(); ++i) {
    for (const auto& [part, field] : kParts) {
      const double value = v.cluster_rows[i].*field;
      if (std::isnan(value)) continue;
      sample(out, Metric::rank_split_seconds, fmt::format("{},part=\"{}\"", labels[i], part),
             value);
    }
  }
  header(out, Metric::rank_straggler);
  for (std::size_t i = 0; i < v.cluster_rows.size(); ++i) {
    sample(out, Metric::rank_straggler, labels[i], v.cluster_rows[i].straggler ? 1.0 : 0.0);
  }
}

}  // namespace steptrace::detail
