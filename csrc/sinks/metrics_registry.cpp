#include "metrics_registry.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>

#include "../core/work_accounting.hpp"

namespace steptrace::detail {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// The counter index (kCounterNames) each ratio reads.
constexpr std::size_t kRatioCounter[] = {0, 1, 2};

// Useful work of one step: its rates (a gauge keeps the last step that knew each figure)
// and its samples and tokens added to the counters.
void observe_work(const StepRecord& r, MetricsRegistry::Values::Work& w) {
  const WorkCount& c = r.work;
  if (!c.any()) return;
  if (c.samples >= 0) {
    w.samples_seen = true;
    w.samples_total += c.samples;
  }
  if (c.tokens >= 0) {
    w.tokens_seen = true;
    w.tokens_total += c.tokens;
  }
  const WorkRates rates = work_rates(r);
  if (std::isfinite(rates.samples_per_s)) w.samples_per_s = rates.samples_per_s;
  if (std::isfinite(rates.tokens_per_s)) w.tokens_per_s = rates.tokens_per_s;
  if (std::isfinite(rates.tflops_per_s)) w.tflops_per_s = rates.tflops_per_s;
  if (std::isfinite(rates.mfu_pct)) w.mfu_ratio = rates.mfu_pct / 100.0;
}

}  // namespace

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (const char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void MetricsRegistry::Histogram::observe(double v) noexcept {
  if (!std::isfinite(v)) return;
  ++count;
  sum += v;
  for (std::size_t i = 0; i < kDurationBuckets.size(); ++i) {
    if (v <= kDurationBuckets[i]) {
      ++counts[i];
      return;
    }
  }
}

MetricsRegistry::MetricsRegistry(MetricLabels labels, const PhaseNames& names, std::string version,
                                 std::function<double()> median_s,
                                 std::function<double()> in_flight_s,
                                 std::function<OpenIntervalProbe()> open_interval)
    : labels_(std::move(labels)),
      names_(names),
      version_(std::move(version)),
      median_s_(std::move(median_s)),
      in_flight_s_(std::move(in_flight_s)),
      open_interval_(std::move(open_interval)) {
  base_labels_ = fmt::format("job=\"{}\",run_id=\"{}\",rank=\"{}\",host=\"{}\"",
                             escape_label_value(labels_.job), escape_label_value(labels_.run_id),
                             labels_.rank, escape_label_value(labels_.host));
  values_.memory_bytes.fill(kNaN);
  values_.ratios.fill(kNaN);
}

void MetricsRegistry::start_badput(std::int64_t process_start_unix_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  badput_ = BadputAccount(process_start_unix_ns);
  values_.badput_s = badput_.seconds();
}

void MetricsRegistry::seed_badput(BadputCause cause, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  badput_.seed(cause, seconds);
  values_.badput_s = badput_.seconds();
  values_.goodput_ratio = badput_.goodput_ratio();
}

void MetricsRegistry::observe_step(const StepRecord& r) {
  std::lock_guard<std::mutex> lock(mu_);
  Values& v = values_;
  ++v.steps;
  if (r.failed) ++v.error_steps;
  v.step.observe(static_cast<double>(r.step_ns) / 1e9);
  for (std::uint16_t i = 0; i < r.phase_count && i < kMaxPhases; ++i) {
    const std::uint16_t id = r.phase_ids[i];
    if (id >= kMaxPhases) continue;
    v.phase_seen[id] = true;
    v.phases[id].observe(static_cast<double>(r.phase_ns[i]) / 1e9);
  }
  v.data_wait_s += static_cast<double>(r.data_ns) / 1e9;
  // The same parts as run_end's goodput: the step less the intervals that ran inside it
  // (they are booked under their own kind), so the kinds add up to the wall clock.
  const BetweenSteps& between = r.between;
  const std::int64_t parts_ns[kTimeKinds.size()] = {
      std::max<std::int64_t>(0, r.host_ns - between.inside_step_ns),
      r.data_ns,
      between.eval_ns(),
      between.checkpoint_ns(),
      between.restore_ns(),
      between.other_ns};
  for (std::size_t k = 0; k < kTimeKinds.size(); ++k) {
    if (parts_ns[k] > 0) v.time_s[k] += static_cast<double>(parts_ns[k]) / 1e9;
  }
  badput_.add_step(r);
  v.badput_s = badput_.seconds();
  v.goodput_ratio = badput_.goodput_ratio();
  if (r.runq_ns >= 0) {
    v.runq_seen = true;
    v.runq_wait_s += static_cast<double>(r.runq_ns) / 1e9;
  }
  v.last_step_unix_s = static_cast<double>(r.start_unix_ns + r.host_ns) / 1e9;
  const std::int64_t memory[] = {r.memory.allocated_bytes, r.memory.reserved_bytes,
                                 r.memory.peak_bytes,      r.memory.rss_bytes,
                                 r.memory.heap_bytes,      r.memory.device_used_bytes};
  for (std::size_t i = 0; i < std::size(memory); ++i) {
    if (memory[i] >= 0) v.memory_bytes[i] = static_cast<double>(memory[i]);
  }
  if (r.counters.present) {
    for (std::size_t i = 0; i < v.ratios.size(); ++i) {
      const double pct = r.counters.values[kRatioCounter[i]];
      if (std::isfinite(pct)) v.ratios[i] = std::clamp(pct, 0.0, 100.0) / 100.0;
    }
  }
  if (r.hw.present) {
    const HwStats& h = r.hw;
    v.hw_seen = true;
    v.power_w = h.avg_power_w;
    v.power_limit_w = h.power_limit_w;
    v.temp_c = h.max_temp_c;
    v.sm_clock_hz = h.sm_clock_mhz * 1e6;
    v.mem_temp_c = h.max_mem_temp_c;
    v.mem_clock_hz = h.mem_clock_mhz * 1e6;
    v.util_ratio = h.util_pct / 100.0;
    v.pcie_tx_bytes_s = h.pcie_tx_mb_s * 1e6;  // NaN stays NaN: not reported
    v.pcie_rx_bytes_s = h.pcie_rx_mb_s * 1e6;
    v.nvlink_tx_bytes_s = h.nvlink_tx_mb_s * 1e6;
    v.nvlink_rx_bytes_s = h.nvlink_rx_mb_s * 1e6;
    if (std::isfinite(h.energy_j) && h.energy_j > 0) v.energy_j += h.energy_j;
    for (std::size_t bit = 0; bit < kThrottleReasonBits; ++bit) {
      if ((h.throttle_reasons >> bit) & 1U) ++v.throttled[bit];
    }
  }
  // The same split as the record's comm object (host-timed collectives), else its kernels.
  if (r.comm.count > 0) {
    const std::int64_t exposed = std::min(r.comm.exposed_ns, r.host_ns);
    v.split_seen = true;
    v.comm_s += static_cast<double>(r.comm.busy_ns) / 1e9;
    v.comm_exposed_s += static_cast<double>(exposed) / 1e9;
    v.compute_s +=
        static_cast<double>(std::max<std::int64_t>(0, r.host_ns - r.comm.exposed_ns)) / 1e9;
    if (r.comm.bytes > 0 && r.comm.busy_ns > 0) {  // as the record's algbw_gbps / busbw_gbps
      const double s = static_cast<double>(r.comm.busy_ns) / 1e9;
      v.comm_sized_seen = true;
      v.comm_bytes += static_cast<double>(r.comm.bytes);
      v.algbw_bytes_s = static_cast<double>(r.comm.bytes) / s;
      v.busbw_bytes_s = static_cast<double>(r.comm.bus_bytes) / s;
    }
  } else if (r.kernels.present) {
    v.split_seen = true;
    v.compute_s += static_cast<double>(r.kernels.compute_ns) / 1e9;
    v.comm_s += static_cast<double>(r.kernels.nccl_ns) / 1e9;
    v.comm_exposed_s += static_cast<double>(r.kernels.exposed_nccl_ns) / 1e9;
  }
  observe_work(r, v.work);
}

namespace {

// A number member of a JSON object divided by `per_unit` (1e3: ms to s), NaN when absent
// or null. Division keeps 23.5 % -> 0.235 exact where a product by 0.01 would not.
double member(const nlohmann::ordered_json& j, const char* key, double per_unit = 1.0) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() / per_unit : kNaN;
}

// The rows of a cluster record, at most kMaxClusterRows: the named stragglers first, then
// the highest scores (a record of a large job already lists only its notable ranks).
std::vector<ClusterRow> cluster_rows(const nlohmann::ordered_json& record) {
  std::vector<ClusterRow> rows;
  const auto ranks = record.find("ranks");
  if (ranks == record.end() || !ranks->is_array()) return rows;
  std::vector<std::int64_t> stragglers;
  if (const auto s = record.find("stragglers"); s != record.end() && s->is_array()) {
    for (const auto& r : *s) {
      if (r.is_number_integer()) stragglers.push_back(r.get<std::int64_t>());
    }
  }
  for (const auto& row : *ranks) {
    if (!row.is_object()) continue;
    const auto rank = row.find("rank");
    if (rank == row.end() || !rank->is_number_integer()) continue;
    ClusterRow out;
    out.rank = rank->get<int>();
    if (const auto h = row.find("host"); h != row.end() && h->is_string()) out.host = *h;
    out.step_s = member(row, "step_ms", 1e3);
    out.step_p95_s = member(row, "step_p95_ms", 1e3);
    out.data_s = member(row, "data_ms", 1e3);
    out.compute_s = member(row, "compute_ms", 1e3);
    out.comm_s = member(row, "comm_ms", 1e3);
    out.wait_s = member(row, "wait_ms", 1e3);
    out.straggler_score = member(row, "straggler_pct", 1e2);
    out.busbw_bytes_s = member(row, "busbw_gbps") * 1e9;  // NaN stays NaN
    out.straggler = std::find(stragglers.begin(), stragglers.end(), out.rank) != stragglers.end();
    rows.push_back(std::move(out));
  }
  if (rows.size() > kMaxClusterRows) {
    const auto key = [](const ClusterRow& r) {
      return std::isnan(r.straggler_score) ? -1e300 : r.straggler_score;
    };
    std::partial_sort(rows.begin(), rows.begin() + kMaxClusterRows, rows.end(),
                      [&](const ClusterRow& a, const ClusterRow& b) {
                        if (a.straggler != b.straggler) return a.straggler;
                        return key(a) > key(b);
                      });
    rows.resize(kMaxClusterRows);
  }
  std::sort(rows.begin(), rows.end(),
            [](const ClusterRow& a, const ClusterRow& b) { return a.rank < b.rank; });
  return rows;
}

}  // namespace

void MetricsRegistry::observe_cluster(const nlohmann::ordered_json& record) {
  std::vector<ClusterRow> rows = cluster_rows(record);
  const auto s = record.find("stragglers");
  const double stragglers =
      s != record.end() && s->is_array() ? static_cast<double>(s->size()) : 0.0;
  std::lock_guard<std::mutex> lock(mu_);
  ++values_.cluster_windows;
  values_.world_size = member(record, "world_size");
  values_.ranks_reporting = member(record, "ranks_reporting");
  values_.stragglers = stragglers;
  values_.cluster_rows = std::move(rows);
}

void MetricsRegistry::observe_alert(const AlertEvent& event) {
  if (event.resolved || event.update) return;  // alerts (episodes) only
  std::string t = event.type;
  std::string hw_kind;
  double xid = 0;
  if (t == "hardware_error") {
    const nlohmann::ordered_json& details = event.details;
    if (details.is_object()) {
      const auto k = details.find("kind");
      if (k != details.end() && k->is_string()) hw_kind = k->get<std::string>();
      if (hw_kind == "xid") xid = member(details, "code");
    }
    // The sampler's kinds; anything else is folded into one series.
    if (hw_kind != "xid" && hw_kind != "ecc_uncorrected" && hw_kind != "nvlink_crc" &&
        hw_kind != "remapped_rows") {
      hw_kind = "other";
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Bounded: a run has a few dozen alert types; anything past the bound is folded into one.
  if (values_.alerts.size() >= kMaxAlertTypes && values_.alerts.count(t) == 0) t = "other";
  ++values_.alerts[t];
  if (!hw_kind.empty()) {
    ++values_.hardware_errors[hw_kind];
    if (xid > 0) values_.last_xid = xid;
  }
}

}  // namespace steptrace::detail
