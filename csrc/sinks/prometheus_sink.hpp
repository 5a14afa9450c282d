// Prometheus exposition of the step records: the sink that feeds a MetricsRegistry
// (metrics_registry.hpp) from the writer thread and carries its text over the configured
// transports: the HTTP endpoint (metrics_http.hpp, on its own threads), a node-exporter
// textfile (metrics_textfile.hpp) and a Pushgateway push at close (metrics_push.hpp).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "../core/record_sink.hpp"
#include "metrics_http.hpp"
#include "metrics_push.hpp"
#include "metrics_registry.hpp"
#include "metrics_textfile.hpp"

namespace steptrace::detail {

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

}  // namespace steptrace::detail
