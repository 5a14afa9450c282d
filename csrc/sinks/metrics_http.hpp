// The HTTP side of the Prometheus sink: the /metrics endpoint and the Pushgateway push.
// Whatever connects to the endpoint is untrusted (docs/prometheus-grafana.md, "Exposure
// and limits"): it is bounded in size, connections and time, and never holds a stop.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace steptrace::detail {

/// The endpoint's bounds. The defaults are the documented ones; tests shorten the times.
struct EndpointLimits {
  /// Client connections open at once (descriptors the endpoint holds besides its listening
  /// socket and one eventfd). A new connection beyond them closes the oldest one that has
  /// no request being answered.
  std::size_t max_connections = 32;
  /// Threads that answer complete requests. A request is read by the poller thread until
  /// its head is complete, so a slow client never holds one.
  std::size_t workers = 2;
  /// Request line and headers together; beyond it: 431 and the connection closed.
  std::size_t max_head_bytes = std::size_t{16} * 1024;
  /// From a request's first byte to the end of its answer; then the connection is closed.
  std::chrono::milliseconds request_deadline{5000};
  /// A connection with no request in progress is closed after this long.
  std::chrono::milliseconds idle_timeout{5000};
  /// Requests answered on one connection before it is closed.
  int max_requests_per_connection = 100;
};

/// Serves `render()` at GET and HEAD /metrics (and a one-line note at /) on host:port,
/// bound in the constructor (port 0: any free port); port() is the bound port, or -1 with
/// error() saying why. Only GET and HEAD (others 405), no request body (413), Range ignored
/// (the whole text, 200). One poller thread accepts and reads requests; `workers` threads
/// answer them. Thread-safe; render() is called from the workers.
class MetricsEndpoint {
 public:
  MetricsEndpoint(const std::string& host, int port, std::function<std::string()> render,
                  EndpointLimits limits = {});
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  int port() const noexcept;
  const std::string& error() const noexcept;
  /// Client connections open now (tests).
  std::size_t connections() const;
  /// Stops serving: closes every client connection (shuts down those being answered) and
  /// the listening socket, and joins the threads; never waits on a client. Idempotent.
  void stop() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// PUT `body` to `origin` + `path` (origin "http://host:port"), the whole of it (name
/// lookup, connect, send, answer) within `deadline`: "" on a 2xx answer, else what went
/// wrong. Past the deadline it returns and leaves the request to end on its own thread
/// (its socket times out shortly after).
std::string http_put(const std::string& origin, const std::string& path, std::string body,
                     const std::string& content_type, std::chrono::milliseconds deadline);

}  // namespace steptrace::detail
