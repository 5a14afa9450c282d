#include "prometheus_sink.hpp"

#include <cstdio>
#include <utility>

namespace steptrace::detail {

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
  const std::string error = write_textfile_atomically(outputs_.textfile, registry_.render());
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
  const std::string error = push_to_gateway(outputs_.pushgateway, labels_.job, labels_.run_id,
                                            labels_.rank, registry_.render(), kPushDeadline);
  if (error.empty()) return true;
  std::fprintf(stderr, "steptrace: Pushgateway push failed (%s); the log file has everything\n",
               error.c_str());
  return false;
}

void PrometheusSink::stop() noexcept {
  if (endpoint_) endpoint_->stop();  // idempotent, thread-safe, never waits on a client
}

}  // namespace steptrace::detail
