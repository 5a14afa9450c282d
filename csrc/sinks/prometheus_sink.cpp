#include "prometheus_sink.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "../core/work_accounting.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/ext/background_thread.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr const char* kMemoryKinds[] = {"allocated", "reserved", "peak",
                                        "rss",       "heap",     "device_used"};
constexpr const char* kRatioNames[] = {"steptrace_tensor_active_ratio",
                                       "steptrace_dram_throughput_ratio",
                                       "steptrace_sm_occupancy_ratio"};
constexpr const char* kRatioHelp[] = {
    "Share of the step's device time the tensor cores were active (0..1).",
    "DRAM throughput over the step as a share of peak (0..1).",
    "Achieved SM occupancy over the step (0..1)."};
// The counter index (kCounterNames) each ratio reads.
constexpr std::size_t kRatioCounter[] = {0, 1, 2};

// A sample value as the text format wants it.
std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", v);
}

void header(fmt::memory_buffer& out, const char* name, const char* type, const char* help) {
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void sample(fmt::memory_buffer& out, std::string_view name, std::string_view labels, double v) {
  fmt::format_to(std::back_inserter(out), "{}{{{}}} {}\n", name, labels, number(v));
}

void histogram(fmt::memory_buffer& out, const char* name, const std::string& labels,
               const MetricsRegistry::Histogram& h) {
  auto it = std::back_inserter(out);
  std::int64_t cumulative = 0;
  for (std::size_t i = 0; i < kDurationBuckets.size(); ++i) {
    cumulative += h.counts[i];
    fmt::format_to(it, "{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, number(kDurationBuckets[i]),
                   cumulative);
  }
  fmt::format_to(it, "{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, h.count);
  fmt::format_to(it, "{}_sum{{{}}} {}\n", name, labels, number(h.sum));
  fmt::format_to(it, "{}_count{{{}}} {}\n", name, labels, h.count);
}

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
  // Bounded: a run has a few dozen alert types; anything past 256 is folded into one.
  if (values_.alerts.size() >= 256 && values_.alerts.count(t) == 0) t = "other";
  ++values_.alerts[t];
  if (!hw_kind.empty()) {
    ++values_.hardware_errors[hw_kind];
    if (xid > 0) values_.last_xid = xid;
  }
}

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

  header(out, "steptrace_info", "gauge", "steptrace version of the training process.");
  sample(out, "steptrace_info", fmt::format("{},version=\"{}\"", l, escape_label_value(version_)),
         1);
  header(out, "steptrace_steps_total", "counter", "Steps completed and written.");
  sample(out, "steptrace_steps_total", l, static_cast<double>(v.steps));
  header(out, "steptrace_error_steps_total", "counter",
         "Steps that ended with an exception (failed).");
  sample(out, "steptrace_error_steps_total", l, static_cast<double>(v.error_steps));
  header(out, "steptrace_step_duration_seconds", "histogram",
         "Step time (without the data wait), on the record's clock.");
  histogram(out, "steptrace_step_duration_seconds", l, v.step);
  bool phase_header = false;
  for (std::size_t id = 0; id < kMaxPhases && id < names_.size(); ++id) {
    if (!v.phase_seen[id]) continue;
    if (!phase_header) {
      header(out, "steptrace_phase_duration_seconds", "histogram",
             "Time of each phase within a step (summed when a phase runs several times).");
      phase_header = true;
    }
    histogram(out, "steptrace_phase_duration_seconds",
              fmt::format("{},phase=\"{}\"", l,
                          escape_label_value(names_.name(static_cast<std::uint16_t>(id)))),
              v.phases[id]);
  }
  header(out, "steptrace_data_wait_seconds_total", "counter",
         "Time spent waiting on the data loader between steps (also steptrace_time_seconds_total"
         "{kind=\"data\"}).");
  sample(out, "steptrace_data_wait_seconds_total", l, v.data_wait_s);
  // Every kind from the first scrape on (0 until seen), so a share of the wall clock never
  // lacks a term.
  header(out, "steptrace_time_seconds_total", "counter",
         "Wall clock by kind: step (training steps, less evaluation / checkpoint / restore "
         "intervals inside them), data (loader waits), eval, checkpoint, restore, other (the "
         "rest of the time between steps). Booked when the step after it ends.");
  for (std::size_t k = 0; k < kTimeKinds.size(); ++k) {
    sample(out, "steptrace_time_seconds_total", fmt::format("{},kind=\"{}\"", l, kTimeKinds[k]),
           v.time_s[k]);
  }
  // Every cause from the first scrape on (0 until seen), as the time kinds.
  header(out, "steptrace_badput_seconds_total", "counter",
         "The job's lost wall clock by cause (docs/goodput.md): slow_steps (above the ideal "
         "step time), wasted_progress and recovery (earlier attempts, seeded at start), "
         "startup, data, checkpoint, restore, eval, compile, host_contention, gc, other.");
  for (std::size_t c = 1; c < kBadputCauseNames.size(); ++c) {  // 0 is productive
    sample(out, "steptrace_badput_seconds_total",
           fmt::format("{},cause=\"{}\"", l, kBadputCauseNames[c]), v.badput_s[c]);
  }
  if (std::isfinite(v.goodput_ratio)) {
    header(out, "steptrace_job_goodput_ratio", "gauge",
           "The job's goodput: productive training time (at the ideal step time) over all the "
           "wall clock accounted, earlier attempts included.");
    sample(out, "steptrace_job_goodput_ratio", l, v.goodput_ratio);
  }
  if (v.runq_seen) {
    header(out, "steptrace_runq_wait_seconds_total", "counter",
           "Time the training thread was runnable but waiting for a CPU (Linux schedstat).");
    sample(out, "steptrace_runq_wait_seconds_total", l, v.runq_wait_s);
  }
  if (open_interval_) {
    const OpenIntervalProbe open = open_interval_();
    header(out, "steptrace_interval_in_flight_seconds", "gauge",
           "Age of the interval (eval, checkpoint, other, restore) now open; 0 for the kinds "
           "not open.");
    for (std::size_t k = 0; k < kIntervalKinds; ++k) {
      const auto kind = static_cast<IntervalKind>(k);
      const double age = open.kind == kind && open.age_s > 0 ? open.age_s : 0.0;
      sample(out, "steptrace_interval_in_flight_seconds",
             fmt::format("{},kind=\"{}\"", l, interval_name(kind)), age);
    }
    if (open.peers_in_interval >= 0) {
      header(out, "steptrace_peers_in_interval", "gauge",
             "Other ranks in an evaluation or checkpoint interval, as the cross-rank exchange "
             "last told this rank (read while it waits for them in a collective): its step's "
             "wait is planned, not a stall.");
      sample(out, "steptrace_peers_in_interval", l, open.peers_in_interval);
    }
  }
  if (median > 0 && std::isfinite(median)) {
    header(out, "steptrace_step_median_seconds", "gauge",
           "Trailing median training iteration (data wait + other host work + step, without "
           "evaluation and checkpoints) the detectors compare with.");
    sample(out, "steptrace_step_median_seconds", l, median);
  }
  if (v.steps > 0) {
    header(out, "steptrace_last_step_timestamp_seconds", "gauge",
           "Unix time the last written step ended.");
    sample(out, "steptrace_last_step_timestamp_seconds", l, v.last_step_unix_s);
  }
  header(out, "steptrace_step_in_flight_seconds", "gauge",
         "Age of the step now running; 0 between steps.");
  sample(out, "steptrace_step_in_flight_seconds", l, in_flight);
  bool memory_header = false;
  for (std::size_t i = 0; i < v.memory_bytes.size(); ++i) {
    if (std::isnan(v.memory_bytes[i])) continue;
    if (!memory_header) {
      header(out, "steptrace_memory_bytes", "gauge", "Memory at the end of the last step.");
      memory_header = true;
    }
    sample(out, "steptrace_memory_bytes", fmt::format("{},kind=\"{}\"", l, kMemoryKinds[i]),
           v.memory_bytes[i]);
  }
  if (!v.alerts.empty()) {
    header(out, "steptrace_alerts_total", "counter", "Alerts written, by type.");
    for (const auto& [type, count] : v.alerts) {
      sample(out, "steptrace_alerts_total",
             fmt::format("{},type=\"{}\"", l, escape_label_value(type)),
             static_cast<double>(count));
    }
  }
  for (std::size_t i = 0; i < v.ratios.size(); ++i) {
    if (std::isnan(v.ratios[i])) continue;
    header(out, kRatioNames[i], "gauge", kRatioHelp[i]);
    sample(out, kRatioNames[i], l, v.ratios[i]);
  }
  if (v.split_seen) {
    header(out, "steptrace_compute_seconds_total", "counter",
           "Compute time of the steps (not blocked on communication).");
    sample(out, "steptrace_compute_seconds_total", l, v.compute_s);
    header(out, "steptrace_comm_seconds_total", "counter", "Communication (collective) time.");
    sample(out, "steptrace_comm_seconds_total", l, v.comm_s);
    header(out, "steptrace_comm_exposed_seconds_total", "counter",
           "Communication not overlapped by compute.");
    sample(out, "steptrace_comm_exposed_seconds_total", l, v.comm_exposed_s);
  }
  if (v.comm_sized_seen) {  // collectives with known sizes (nccl-tests' figures)
    static constexpr std::array<std::array<const char*, 3>, 3> kBandwidth = {{
        {"steptrace_comm_bytes_total", "counter",
         "Payload of the collectives whose sizes are known (nccl-tests' S)."},
        {"steptrace_comm_algbw_bytes_per_second", "gauge",
         "Algorithm bandwidth of the collectives of the last step with known sizes: payload "
         "over the time a collective was outstanding."},
        {"steptrace_comm_busbw_bytes_per_second", "gauge",
         "Bus bandwidth of the collectives of the last step with known sizes: the algorithm "
         "bandwidth times each collective's bus factor."},
    }};
    const std::array<double, 3> values = {v.comm_bytes, v.algbw_bytes_s, v.busbw_bytes_s};
    for (std::size_t i = 0; i < kBandwidth.size(); ++i) {
      header(out, kBandwidth[i][0], kBandwidth[i][1], kBandwidth[i][2]);
      sample(out, kBandwidth[i][0], l, values[i]);
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
  const auto gauge = [&](const char* name, const char* help, double value) {
    if (std::isnan(value)) return;
    header(out, name, "gauge", help);
    sample(out, name, l, value);
  };
  gauge("steptrace_samples_per_second",
        "Samples per second of the last step's training iteration that counted samples.",
        w.samples_per_s);
  gauge("steptrace_tokens_per_second",
        "Tokens per second of the last step's training iteration that counted tokens.",
        w.tokens_per_s);
  gauge("steptrace_model_tflops_per_second",
        "Model TFLOP/s (forward and backward) of the last step that counted FLOPs.",
        w.tflops_per_s);
  gauge("steptrace_mfu_ratio",
        "Model FLOPs utilization of the last step: achieved FLOP/s over the device's peak "
        "(0..1; run_start.work says which peak).",
        w.mfu_ratio);
  if (w.samples_seen) {
    header(out, "steptrace_samples_total", "counter", "Samples of the steps that counted them.");
    sample(out, "steptrace_samples_total", l, w.samples_total);
  }
  if (w.tokens_seen) {
    header(out, "steptrace_tokens_total", "counter", "Tokens of the steps that counted them.");
    sample(out, "steptrace_tokens_total", l, w.tokens_total);
  }
}

void MetricsRegistry::render_hardware(fmt::memory_buffer& out, const Values& v) const {
  const std::string& l = base_labels_;
  if (v.hw_seen) {
    // A gauge only where the device reports the figure (NaN: not reported).
    const auto gauge = [&](const char* name, const char* help, double value) {
      if (std::isnan(value)) return;
      header(out, name, "gauge", help);
      sample(out, name, l, value);
    };
    gauge("steptrace_gpu_power_watts", "GPU board power, time-weighted mean over the last step.",
          v.power_w);
    if (v.power_limit_w > 0) {
      gauge("steptrace_gpu_power_limit_watts", "The GPU's enforced power limit.", v.power_limit_w);
    }
    header(out, "steptrace_gpu_energy_joules_total", "counter",
           "GPU energy during the steps, from the device's energy counter.");
    sample(out, "steptrace_gpu_energy_joules_total", l, v.energy_j);
    gauge("steptrace_gpu_temperature_celsius", "Hottest GPU temperature during the last step.",
          v.temp_c);
    gauge("steptrace_gpu_memory_temperature_celsius",
          "Hottest GPU memory (HBM) temperature during the last step.", v.mem_temp_c);
    gauge("steptrace_gpu_sm_clock_hertz", "SM clock, time-weighted mean over the last step.",
          v.sm_clock_hz);
    gauge("steptrace_gpu_memory_clock_hertz", "Memory clock over the last step.", v.mem_clock_hz);
    gauge("steptrace_gpu_utilization_ratio",
          "Share of the last step during which a kernel ran (NVML utilization), 0..1.",
          v.util_ratio);
    // a gauge by direction, the series of a direction the device does not report left out
    auto by_direction = [&](const char* name, const char* help, double tx, double rx) {
      if (std::isnan(tx) && std::isnan(rx)) return;
      header(out, name, "gauge", help);
      if (!std::isnan(tx)) sample(out, name, fmt::format("{},direction=\"tx\"", l), tx);
      if (!std::isnan(rx)) sample(out, name, fmt::format("{},direction=\"rx\"", l), rx);
    };
    by_direction("steptrace_gpu_pcie_bytes_per_second",
                 "PCIe throughput over the last step, by direction.", v.pcie_tx_bytes_s,
                 v.pcie_rx_bytes_s);
    by_direction("steptrace_gpu_nvlink_bytes_per_second",
                 "NVLink data throughput over the last step, all links, by direction.",
                 v.nvlink_tx_bytes_s, v.nvlink_rx_bytes_s);
    bool throttle_header = false;
    for (std::size_t bit = 0; bit < kThrottleReasonBits; ++bit) {
      if (v.throttled[bit] == 0) continue;
      if (!throttle_header) {
        header(out, "steptrace_gpu_throttled_steps_total", "counter",
               "Steps during which the GPU's clocks were held down, by NVML clock event reason.");
        throttle_header = true;
      }
      sample(out, "steptrace_gpu_throttled_steps_total",
             fmt::format("{},reason=\"{}\"", l, throttle_reason_name(bit)),
             static_cast<double>(v.throttled[bit]));
    }
  }
  if (!v.hardware_errors.empty()) {
    header(out, "steptrace_gpu_hardware_errors_total", "counter",
           "Hardware errors the sampler found, by kind (xid, ecc_uncorrected, nvlink_crc, "
           "remapped_rows).");
    for (const auto& [kind, count] : v.hardware_errors) {
      sample(out, "steptrace_gpu_hardware_errors_total", fmt::format("{},kind=\"{}\"", l, kind),
             static_cast<double>(count));
    }
  }
  if (v.last_xid > 0) {
    header(out, "steptrace_gpu_last_xid", "gauge", "The last critical XID the GPU reported.");
    sample(out, "steptrace_gpu_last_xid", l, v.last_xid);
  }
}

void MetricsRegistry::render_cluster(fmt::memory_buffer& out, const Values& v) const {
  if (v.cluster_windows == 0) return;
  const std::string& l = base_labels_;
  header(out, "steptrace_cluster_windows_total", "counter",
         "Cross-rank windows aggregated (this process aggregates: rank 0).");
  sample(out, "steptrace_cluster_windows_total", l, static_cast<double>(v.cluster_windows));
  header(out, "steptrace_cluster_ranks_reporting", "gauge",
         "Ranks that reported in the last cross-rank window.");
  sample(out, "steptrace_cluster_ranks_reporting", l, v.ranks_reporting);
  if (!std::isnan(v.world_size)) {
    header(out, "steptrace_cluster_world_size", "gauge", "World size of the job.");
    sample(out, "steptrace_cluster_world_size", l, v.world_size);
  }
  header(out, "steptrace_cluster_stragglers", "gauge",
         "Ranks over the straggler threshold in the last cross-rank window.");
  sample(out, "steptrace_cluster_stragglers", l, v.stragglers);
  if (v.cluster_rows.empty()) return;
  // Per-rank series carry the rank they describe (and its host), not the aggregator's.
  std::vector<std::string> labels;
  labels.reserve(v.cluster_rows.size());
  for (const ClusterRow& row : v.cluster_rows) {
    labels.push_back(fmt::format(
        "job=\"{}\",run_id=\"{}\",rank=\"{}\",host=\"{}\"", escape_label_value(labels_.job),
        escape_label_value(labels_.run_id), row.rank, escape_label_value(row.host)));
  }
  const auto per_rank = [&](const char* name, const char* help, double ClusterRow::*field) {
    bool any = false;
    for (std::size_t i = 0; i < v.cluster_rows.size(); ++i) {
      const double value = v.cluster_rows[i].*field;
      if (std::isnan(value)) continue;
      if (!any) header(out, name, "gauge", help);
      any = true;
      sample(out, name, labels[i], value);
    }
  };
  per_rank("steptrace_rank_straggler_score",
           "Own work (compute + data) over the other ranks' median, minus 1 (0.3: 30% slower), "
           "in the last cross-rank window.",
           &ClusterRow::straggler_score);
  per_rank("steptrace_rank_step_median_seconds",
           "Median step time of the rank in the last cross-rank window.", &ClusterRow::step_s);
  per_rank("steptrace_rank_step_p95_seconds",
           "95th percentile step time of the rank in the last cross-rank window.",
           &ClusterRow::step_p95_s);
  per_rank("steptrace_rank_busbw_bytes_per_second",
           "Bus bandwidth of the rank's collectives (median over its steps, waiting included) in "
           "the last cross-rank window.",
           &ClusterRow::busbw_bytes_s);
  static constexpr std::pair<const char*, double ClusterRow::*> kParts[] = {
      {"compute", &ClusterRow::compute_s},
      {"comm", &ClusterRow::comm_s},
      {"wait", &ClusterRow::wait_s},
      {"data", &ClusterRow::data_s}};
  header(out, "steptrace_rank_split_seconds", "gauge",
         "Median time per step of the rank in the last cross-rank window, by part: compute, "
         "comm (net of waiting), wait (blocked on slower ranks), data (loader).");
  for (std::size_t i = 0; i < v.cluster_rows.size(); ++i) {
    for (const auto& [part, field] : kParts) {
      const double value = v.cluster_rows[i].*field;
      if (std::isnan(value)) continue;
      sample(out, "steptrace_rank_split_seconds", fmt::format("{},part=\"{}\"", labels[i], part),
             value);
    }
  }
  header(out, "steptrace_rank_straggler", "gauge",
         "1 for a rank over the straggler threshold in the last cross-rank window, else 0.");
  for (std::size_t i = 0; i < v.cluster_rows.size(); ++i) {
    sample(out, "steptrace_rank_straggler", labels[i], v.cluster_rows[i].straggler ? 1.0 : 0.0);
  }
}

std::string base64url(std::string_view v) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  std::size_t i = 0;
  for (; i + 3 <= v.size(); i += 3) {
    const auto n = (static_cast<std::uint32_t>(static_cast<unsigned char>(v[i])) << 16) |
                   (static_cast<std::uint32_t>(static_cast<unsigned char>(v[i + 1])) << 8) |
                   static_cast<unsigned char>(v[i + 2]);
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += kAlphabet[(n >> 6) & 63];
    out += kAlphabet[n & 63];
  }
  if (const std::size_t left = v.size() - i; left > 0) {
    std::uint32_t n = static_cast<std::uint32_t>(static_cast<unsigned char>(v[i])) << 16;
    if (left == 2) n |= static_cast<std::uint32_t>(static_cast<unsigned char>(v[i + 1])) << 8;
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += left == 2 ? kAlphabet[(n >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

PrometheusSink::PrometheusSink(MetricsOutputs outputs, MetricLabels labels, const PhaseNames& names,
                               std::string version, std::function<double()> median_s,
                               std::function<double()> in_flight_s,
                               std::function<OpenIntervalProbe()> open_interval)
    : outputs_(std::move(outputs)),
      labels_(labels),
      registry_(std::move(labels), names, std::move(version), std::move(median_s),
                std::move(in_flight_s), std::move(open_interval)) {
  if (outputs_.port < 0) return;
  endpoint_ = std::make_unique<MetricsEndpoint>(outputs_.host, outputs_.port,
                                                [this] { return registry_.render(); });
  port_ = endpoint_->port();
  if (port_ < 0) {
    error_ = endpoint_->error();
    endpoint_.reset();
  }
}

PrometheusSink::~PrometheusSink() { stop(); }

void PrometheusSink::write(std::string_view /*lines*/) {
  // The values came typed (on_step, on_alert, on_cluster); a batch is a moment to
  // rewrite the textfile.
  if (outputs_.textfile.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - textfile_written_ < std::chrono::seconds(1)) return;
  textfile_written_ = now;
  write_textfile();
}

void PrometheusSink::on_close() {
  stop();
  if (!outputs_.textfile.empty()) write_textfile();  // the final values
  if (!outputs_.pushgateway.empty()) push();
}

std::string PrometheusSink::first_error() const {
  if (!error_.empty()) return "endpoint: " + error_;
  return textfile_error_;
}

bool PrometheusSink::write_textfile() {
  // node_exporter reads *.prom files: write a temporary name it ignores, then rename it
  // over the old one, so a scrape never sees half a file. The temporary is created anew
  // under a random name (O_EXCL, no link followed): a name planted in a shared textfile
  // folder (a symlink to a victim file) is never opened, only skipped.
  const std::string text = registry_.render();
  std::string error;
  std::string tmp;
  int fd = -1;
  std::random_device random;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    tmp = fmt::format("{}.{:08x}{:08x}.tmp", outputs_.textfile, random(), random());
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd >= 0) {
    const char* p = text.data();
    std::size_t left = text.size();
    while (left > 0 && error.empty()) {
      const ssize_t n = ::write(fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        error = fmt::format("writing {}: {}", tmp, std::strerror(errno));
      } else {
        p += n;
        left -= static_cast<std::size_t>(n);
      }
    }
    if (::close(fd) != 0 && error.empty()) {
      error = fmt::format("writing {}: {}", tmp, std::strerror(errno));
    }
    if (error.empty() && std::rename(tmp.c_str(), outputs_.textfile.c_str()) != 0) {
      error = fmt::format("renaming {} to {}: {}", tmp, outputs_.textfile, std::strerror(errno));
    }
    if (!error.empty()) ::unlink(tmp.c_str());
  } else {
    error = fmt::format("creating {}: {}", tmp, std::strerror(errno));
  }
  if (error.empty()) return true;
  if (!textfile_reported_) {
    textfile_reported_ = true;
    textfile_error_ = "textfile: " + error;
    std::fprintf(stderr, "steptrace: metrics textfile not written (%s); retrying each second\n",
                 error.c_str());
  }
  return false;
}

bool PrometheusSink::push() {
  // "http://host:port/prefix" -> origin "http://host:port", path "/prefix/metrics/..."
  const std::string& url = outputs_.pushgateway;
  const std::size_t scheme = url.find("://");
  const std::size_t slash = url.find('/', scheme == std::string::npos ? 0 : scheme + 3);
  const std::string origin = url.substr(0, slash);
  std::string prefix = slash == std::string::npos ? "" : url.substr(slash);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  const std::string path =
      fmt::format("{}/metrics/job@base64/{}/run_id@base64/{}/rank/{}", prefix,
                  base64url(labels_.job), base64url(labels_.run_id), labels_.rank);
  const std::string error = http_put(origin, path, registry_.render(),
                                     "text/plain; version=0.0.4; charset=utf-8", kPushDeadline);
  if (error.empty()) return true;
  std::fprintf(stderr, "steptrace: Pushgateway push failed (%s); the log file has everything\n",
               error.c_str());
  return false;
}

void PrometheusSink::stop() noexcept {
  if (endpoint_) endpoint_->stop();  // idempotent, thread-safe, never waits on a client
}

}  // namespace steptrace::detail
