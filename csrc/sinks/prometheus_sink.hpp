// Prometheus exposition of the step records: a registry the writer thread updates from
// each record, and a sink that serves it over HTTP (cpp-httplib) on its own thread.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "../core/alert.hpp"
#include "../core/badput.hpp"
#include "../core/record_sink.hpp"
#include "../core/step_record.hpp"
#include "../core/telemetry.hpp"
#include "metrics_http.hpp"
#include "steptrace/interval.hpp"

namespace steptrace::detail {

/// The labels every series carries.
struct MetricLabels {
  std::string job = "steptrace";
  std::string run_id;
  int rank = 0;
  std::string host;
};

/// Upper bounds of the duration histograms, in seconds (roughly x2.5 apart).
inline constexpr std::array<double, 15> kDurationBuckets = {
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0};

/// Ranks exported from a cluster record at most: the stragglers first, then by score.
inline constexpr std::size_t kMaxClusterRows = 64;

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

/// Where the metrics go besides the registry.
struct MetricsOutputs {
  std::string host = "127.0.0.1";  // the endpoint's address (Config::metrics_host)
  int port = -1;                   // HTTP endpoint: -1 none, 0 any free port, N port N
  std::string textfile;            // node-exporter textfile: rewritten atomically (at most 1/s)
  std::string pushgateway;         // Pushgateway base URL: one push (PUT) at close
};

/// Serves a MetricsRegistry at http://<host>:<port>/metrics (MetricsEndpoint: bounded in
/// size, connections and time), writes it to a node-exporter textfile and pushes it to a
/// Pushgateway at close, as configured. Binding happens in the constructor: port() is the
/// bound port, or -1 with error() saying why (the run goes on without the endpoint). The
/// endpoint stops at on_close() or destruction without waiting on any client; the push
/// has one deadline (kPushDeadline) for all of it. Textfile and push failures are said
/// once on stderr, never thrown.
class PrometheusSink final : public RecordSink {
 public:
  PrometheusSink(MetricsOutputs outputs, MetricLabels labels, const PhaseNames& names,
                 std::string version, std::function<double()> median_s,
                 std::function<double()> in_flight_s,
                 std::function<OpenIntervalProbe()> open_interval = {});
  ~PrometheusSink() override;
  PrometheusSink(const PrometheusSink&) = delete;
  PrometheusSink& operator=(const PrometheusSink&) = delete;

  std::string_view name() const noexcept override { return "prometheus"; }
  void write(std::string_view lines) override;
  void on_step(const StepRecord& r) override { registry_.observe_step(r); }
  void on_alert(const AlertEvent& event) override { registry_.observe_alert(event); }
  void on_cluster(const nlohmann::ordered_json& record) override {
    registry_.observe_cluster(record);
  }
  void on_close() override;
  /// The bind failure, else the first textfile write that failed ("" when none).
  std::string first_error() const override;

  int port() const noexcept { return port_; }
  /// The address the endpoint is bound to (meaningful when port() >= 0).
  const std::string& host() const noexcept { return outputs_.host; }
  const std::string& error() const noexcept { return error_; }
  const MetricsRegistry& registry() const noexcept { return registry_; }
  MetricsRegistry& registry() noexcept { return registry_; }
  /// Stops serving (idempotent).
  void stop() noexcept;
  /// Writes the textfile now (tmp file + rename); false on failure (said once).
  bool write_textfile();
  /// Pushes to the Pushgateway now (PUT <url>/metrics/job/<job>/run_id/<id>/rank/<rank>),
  /// all of it (name lookup, connect, send, answer) within kPushDeadline; false on failure
  /// (said once).
  bool push();

  /// The push's one deadline: close() and the SIGTERM path (which closes) wait no longer
  /// on a Pushgateway, however slowly it answers.
  static constexpr std::chrono::milliseconds kPushDeadline{2000};

 private:
  const MetricsOutputs outputs_;
  const MetricLabels labels_;
  std::chrono::steady_clock::time_point textfile_written_{};
  bool textfile_reported_ = false;
  std::string textfile_error_;  // the first failure
  MetricsRegistry registry_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  int port_ = -1;
  std::string error_;
};

/// Escapes a label value for the text format (backslash, double quote, newline).
std::string escape_label_value(std::string_view v);
/// RFC 4648 base64url with padding (Pushgateway's `label@base64/value` path segments).
std::string base64url(std::string_view v);

}  // namespace steptrace::detail
