// The metric values of one run: a registry the writer thread updates from each record
// (metrics_registry.cpp) and renders as the Prometheus text format (metrics_render.cpp),
// family by family through the metrics table (metrics.def). The transports that carry the
// text (HTTP endpoint, textfile, Pushgateway) are PrometheusSink's (prometheus_sink.hpp).
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "../core/alert.hpp"
#include "../core/badput.hpp"
#include "../core/step_record.hpp"
#include "../core/telemetry_stage.hpp"
#include "metric_table.hpp"
#include "steptrace/interval.hpp"

namespace steptrace::detail {
/// The labels every series carries.
struct MetricLabels {
  std::string job = "steptrace";
  std::string run_id;
  int rank = 0;
  std::string host;
};

/// One rank's figures in the last cross-rank window (medians per step, in seconds; NaN
/// where the record has null).
struct ClusterRow {
  int rank = 0;
  std::string host;
  double step_s = 0, step_p95_s = 0, data_s = 0, compute_s = 0, comm_s = 0, wait_s = 0;
  double straggler_score = 0;  // own work over the other ranks' median, minus 1
  double busbw_bytes_s = 0;    // bus bandwidth of its collectives (NaN: sizes unknown)
  bool straggler = false;
};

/// Where the wall clock went, by kind (steptrace_time_seconds_total{kind}): the step less
/// the intervals inside it, the loader's waits, evaluation, checkpoint saves and restores,
/// and other host work between steps. Each step record adds its parts; together they cover
/// the time from the first step's start to the last step's end.
inline constexpr std::array<const char*, 6> kTimeKinds = {"step",       "data",    "eval",
                                                          "checkpoint", "restore", "other"};

/// The interval open now (Profiler::begin_interval), as a live probe reports it for the
/// steptrace_interval_in_flight_seconds gauge: its kind and age in seconds; no kind when
/// none is open. With it, the other ranks in an evaluation or checkpoint as the cross-rank
/// exchange last told this rank (steptrace_peers_in_interval), -1 without an exchange. The
/// probe is called from the scraping thread.
struct OpenIntervalProbe {
  std::optional<IntervalKind> kind;
  double age_s = 0;
  int peers_in_interval = -1;
};

/// The metric values of one run. observe_*() from the writer thread; render() from any
/// thread (it copies the values under a short lock and formats outside it).
class MetricsRegistry {
 public:
  /// `names` resolves phase ids (read without a lock, see PhaseNames). `median_s`,
  /// `in_flight_s` and `open_interval` are read at each render (any thread); any may be
  /// empty (no open_interval: no steptrace_interval_in_flight_seconds series).
  MetricsRegistry(MetricLabels labels, const PhaseNames& names, std::string version,
                  std::function<double()> median_s = {}, std::function<double()> in_flight_s = {},
                  std::function<OpenIntervalProbe()> open_interval = {});

  void observe_step(const StepRecord& r);
  /// Counts an alert by type (hardware errors by kind too); resolved events and updates
  /// are not alerts of their own.
  void observe_alert(const AlertEvent& event);
  /// Takes the figures and per-rank rows of a cluster record (the last one's are shown).
  void observe_cluster(const nlohmann::ordered_json& record);
  /// The exposition, text format 0.0.4.
  std::string render() const;
  /// Where the job's wall clock starts for its waste account: this process's start (unix
  /// ns; 0: unknown). Before the first step.
  void start_badput(std::int64_t process_start_unix_ns);
  /// Seconds an earlier attempt of the job lost, by cause (Profiler::add_earlier_badput).
  void seed_badput(BadputCause cause, double seconds);

  struct Histogram {
    std::array<std::int64_t, kDurationBuckets.size()> counts{};  // not cumulative
    std::int64_t count = 0;
    double sum = 0;
    void observe(double v) noexcept;
  };
  struct Values {
    Histogram step;
    std::array<Histogram, kMaxPhases> phases;
    std::array<bool, kMaxPhases> phase_seen{};
    std::int64_t steps = 0;
    std::int64_t error_steps = 0;
    double data_wait_s = 0;
    std::array<double, kTimeKinds.size()> time_s{};  // by kTimeKinds
    // The job's waste account (BadputAccount's seconds by cause, earlier attempts seeded).
    std::array<double, kBadputCauseNames.size()> badput_s{};
    double goodput_ratio = std::numeric_limits<double>::quiet_NaN();
    bool runq_seen = false;  // a step had a run-queue reading
    double runq_wait_s = 0;  // summed over the readings
    double last_step_unix_s = 0;
    // allocated, reserved, peak, rss, heap, device_used; NaN: never seen
    std::array<double, 6> memory_bytes{};
    std::array<double, 3> ratios{};  // tensor_active, dram_throughput, sm_occupancy; NaN: none
    bool split_seen = false;
    double compute_s = 0, comm_s = 0, comm_exposed_s = 0;
    // Collectives with known sizes: their payload, and the bandwidth of the last step that
    // had them (nccl-tests' algorithm and bus bandwidth); NaN: none yet.
    bool comm_sized_seen = false;
    double comm_bytes = 0, algbw_bytes_s = 0, busbw_bytes_s = 0;
    std::map<std::string, std::int64_t> alerts;  // by type
    // GPU hardware (NVML) figures of the last step that had them; NaN: not reported.
    bool hw_seen = false;
    double power_w = 0, power_limit_w = 0, temp_c = 0, sm_clock_hz = 0;
    double mem_temp_c = 0, mem_clock_hz = 0, pcie_tx_bytes_s = 0, pcie_rx_bytes_s = 0;
    double nvlink_tx_bytes_s = 0, nvlink_rx_bytes_s = 0, util_ratio = 0;
    double energy_j = 0;                                        // summed over the steps
    std::array<std::int64_t, kThrottleReasonBits> throttled{};  // steps per reason bit
    std::map<std::string, std::int64_t> hardware_errors;        // by kind (bounded)
    double last_xid = 0;                                        // 0: none seen
    // The cross-rank view: the last cluster record (aggregating rank only).
    std::int64_t cluster_windows = 0;
    double world_size = 0, ranks_reporting = 0, stragglers = 0;
    std::vector<ClusterRow> cluster_rows;  // at most kMaxClusterRows
    // Useful work (work.hpp): the last step's rates, NaN until a step knew them, and the
    // samples and tokens summed over the steps that counted them.
    struct Work {
      double samples_per_s = std::numeric_limits<double>::quiet_NaN();
      double tokens_per_s = std::numeric_limits<double>::quiet_NaN();
      double tflops_per_s = std::numeric_limits<double>::quiet_NaN();
      double mfu_ratio = std::numeric_limits<double>::quiet_NaN();
      double samples_total = 0, tokens_total = 0;
      bool samples_seen = false, tokens_seen = false;
    } work;
  };

 private:
  void render_hardware(fmt::memory_buffer& out, const Values& v) const;
  void render_cluster(fmt::memory_buffer& out, const Values& v) const;
  void render_work(fmt::memory_buffer& out, const Values& v) const;

  const MetricLabels labels_;
  const PhaseNames& names_;
  const std::string version_;
  const std::function<double()> median_s_;
  const std::function<double()> in_flight_s_;
  const std::function<OpenIntervalProbe()> open_interval_;
  std::string base_labels_;  // job="...",run_id="...",rank="...",host="..."
  mutable std::mutex mu_;
  Values values_;            // guarded by mu_
  BadputAccount badput_{0};  // guarded by mu_; its figures copied into values_ per step
};

/// Escapes a label value for the text format (backslash, double quote, newline).
std::string escape_label_value(std::string_view v);

}  // namespace steptrace::detail
