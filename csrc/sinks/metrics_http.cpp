#include "metrics_http.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "steptrace/ext/background_thread.hpp"

#if STEPTRACE_HAVE_HTTPLIB
#include <fcntl.h>
#include <httplib.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace steptrace::detail {

#if STEPTRACE_HAVE_HTTPLIB
namespace {

using SteadyClock = std::chrono::steady_clock;

// One client connection. The poller owns it in kIdle, kReading and kReady; a worker in
// kServing. `fd` is closed only under Impl::mu_ and only after it leaves the list, so the
// poller's shutdown() of a served connection never reaches a descriptor reused elsewhere.
struct Connection {
  enum class State { kIdle, kReading, kReady, kServing };
  int fd = -1;
  State state = State::kIdle;
  SteadyClock::time_point since;  // kIdle: idle since; else the request's first byte
  std::string head;               // read, not yet answered (at most max_head_bytes)
  int served = 0;                 // requests answered on it
  bool shut = false;              // shut down (deadline or stop): its worker closes it
  std::string remote_ip, local_ip;
  int remote_port = 0, local_port = 0;
};

// The head of a request has arrived once an empty line ends it.
bool head_complete(const std::string& s) {
  return s.find("\n\r\n") != std::string::npos || s.find("\n\n") != std::string::npos;
}

// Milliseconds until `t` for poll(), rounded up; 0 once it is past.
int ms_until(SteadyClock::time_point t, SteadyClock::time_point now) {
  if (t <= now) return 0;
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(t - now).count();
  return static_cast<int>(std::min<std::int64_t>((us + 999) / 1000, 60'000));
}

// The stream httplib parses and answers a request on: first the head the poller read,
// then the socket, every wait bounded by the request's deadline. Sends never raise
// SIGPIPE.
class RequestStream final : public httplib::Stream {
 public:
  RequestStream(const Connection& c, SteadyClock::time_point deadline)
      : c_(c), deadline_(deadline), start_(SteadyClock::now()) {}

  bool is_readable() const override { return off_ < c_.head.size(); }
  bool wait_readable() const override { return is_readable() || wait(POLLIN); }
  bool wait_writable() const override { return wait(POLLOUT); }
  bool is_peer_alive() const override { return httplib::detail::is_socket_alive(c_.fd); }

  ssize_t read(char* ptr, size_t size) override {
    if (off_ < c_.head.size()) {
      const std::size_t n = std::min(size, c_.head.size() - off_);
      std::memcpy(ptr, c_.head.data() + off_, n);
      off_ += n;
      return static_cast<ssize_t>(n);
    }
    for (;;) {
      if (!wait(POLLIN)) {
        error_ = httplib::Error::Timeout;
        return -1;
      }
      const ssize_t n = ::recv(c_.fd, ptr, size, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n == 0) error_ = httplib::Error::ConnectionClosed;
      if (n < 0) error_ = httplib::Error::Read;
      return n;
    }
  }

  ssize_t write(const char* ptr, size_t size) override {
    std::size_t done = 0;
    while (done < size) {
      if (!wait(POLLOUT)) return -1;
      const ssize_t n = ::send(c_.fd, ptr + done, size - done, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n < 0) return -1;
      done += static_cast<std::size_t>(n);
    }
    return static_cast<ssize_t>(size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = c_.remote_ip;
    port = c_.remote_port;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = c_.local_ip;
    port = c_.local_port;
  }
  socket_t socket() const override { return c_.fd; }
  time_t duration() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - start_)
        .count();
  }
  const char* buffered_data(size_t& size) const override {
    size = c_.head.size() - off_;
    return size > 0 ? c_.head.data() + off_ : nullptr;
  }
  void consume_buffered(size_t size) override { off_ += std::min(size, c_.head.size() - off_); }

  // What the client sent after this request (a pipelined next one).
  std::string unread() const { return c_.head.substr(off_); }

 private:
  bool wait(short events) const {
    for (;;) {
      const int ms = ms_until(deadline_, SteadyClock::now());
      if (ms == 0) return false;
      pollfd p{c_.fd, events, 0};
      const int n = ::poll(&p, 1, ms);
      if (n > 0) return true;  // readiness, or an error or hang-up the next call reports
      if (n == 0) continue;    // rounding: the loop sees the deadline pass
      if (errno != EINTR) return false;
    }
  }

  const Connection& c_;
  std::size_t off_ = 0;
  const SteadyClock::time_point deadline_;
  const SteadyClock::time_point start_;
};

// httplib's request parsing, routing and answer writing (process_request is protected),
// on connections this file accepts and reads itself: httplib's own accept loop gives each
// connection a thread for its whole life, which idle and slow clients then hold.
class RequestHandler final : public httplib::Server {
 public:
  bool answer(httplib::Stream& strm, const Connection& c, bool close_connection,
              bool& connection_closed) {
    // No Range support: the answer is always the whole text (RFC 9110 14.2: a server
    // may ignore Range). A Range header that does not parse is answered 416 by httplib
    // before this runs, with no body.
    return process_request(
        strm, c.remote_ip, c.remote_port, c.local_ip, c.local_port, close_connection,
        connection_closed, [](httplib::Request& req) { req.ranges.clear(); }, nullptr);
  }
  socket_t listen_socket() const { return svr_sock_; }
};

void close_fd(int fd) noexcept {
  if (fd >= 0) ::close(fd);
}

}  // namespace

struct MetricsEndpoint::Impl {
  Impl(std::function<std::string()> render_fn, EndpointLimits l)
      : limits(l), render(std::move(render_fn)) {
    // httplib::Server's constructor sets SIGPIPE to SIG_IGN for the whole process; the
    // trainer's disposition is its own (every send here passes MSG_NOSIGNAL instead).
    ::sigaction(SIGPIPE, &sigpipe_before.action, nullptr);
  }

  bool bind(const std::string& host, int port);
  void start();
  void stop() noexcept;

  void poll_loop();
  void work_loop();
  void serve(Connection& c);
  // Under mu_:
  void enforce_deadlines(SteadyClock::time_point now);
  SteadyClock::time_point next_deadline(SteadyClock::time_point now) const;
  void read_some(Connection& c, SteadyClock::time_point now);
  void accept_some(SteadyClock::time_point now);
  bool evict_oldest_unanswered();
  void close_connection(std::list<Connection>::iterator it);
  std::list<Connection>::iterator find(const Connection& c);
  void wake() noexcept;

  struct SavedSigpipe {
    struct sigaction action {};
    SavedSigpipe() { ::sigaction(SIGPIPE, nullptr, &action); }
  };

  const EndpointLimits limits;
  const std::function<std::string()> render;
  SavedSigpipe sigpipe_before;  // before `http`: taken before its constructor runs
  RequestHandler http;
  int port = -1;
  std::string error;
  int listen_fd = -1;
  int wake_fd = -1;

  mutable std::mutex mu;
  std::condition_variable work_cv;
  std::list<Connection> conns;    // guarded by mu; stable addresses for the workers
  std::deque<Connection*> ready;  // guarded by mu: complete heads waiting for a worker
  bool stopping = false;          // guarded by mu
  SteadyClock::time_point accept_paused_until{};  // poller only: after EMFILE and the like

  std::mutex stop_mu;  // one stop() at a time
  bool stopped = false;
  std::thread poller;
  std::vector<std::thread> workers;
};

bool MetricsEndpoint::Impl::bind(const std::string& host, int requested) {
  // httplib's default socket options set SO_REUSEPORT, with which a second process (or
  // profiler) binds the same port silently and Prometheus gets both runs' series mixed.
  // SO_REUSEADDR only: a restarted job rebinds its port while old connections are in
  // TIME_WAIT, and a port someone listens on stays a clear EADDRINUSE.
  http.set_socket_options([](socket_t sock) {
    const int one = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  });
  int bind_errno = 0;
  http.set_error_logger([&bind_errno](const httplib::Error& e, const httplib::Request*) {
    if (e == httplib::Error::BindIPAddress || e == httplib::Error::Listen) bind_errno = errno;
  });
  // Answers: only what a scraper asks for.
  http.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    if (req.method != "GET" && req.method != "HEAD") {
      res.status = httplib::StatusCode::MethodNotAllowed_405;
      res.set_header("Allow", "GET, HEAD");
      res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (req.has_header("Transfer-Encoding") || req.get_header_value_u64("Content-Length") > 0) {
      res.status = httplib::StatusCode::PayloadTooLarge_413;  // a scrape has no body
      res.set_header("Connection", "close");
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http.set_payload_max_length(1024);
  // What the answers advertise (Keep-Alive: timeout, max): the poller's own bounds.
  http.set_keep_alive_timeout(std::max<time_t>(
      1, std::chrono::duration_cast<std::chrono::seconds>(limits.idle_timeout).count()));
  http.set_keep_alive_max_count(static_cast<std::size_t>(limits.max_requests_per_connection));
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("steptrace: metrics at /metrics\n", "text/plain");
  });

  const int bound = requested == 0 ? http.bind_to_any_port(host)
                                   : (http.bind_to_port(host, requested) ? requested : -1);
  http.set_error_logger(nullptr);  // the logger held a reference to bind_errno
  if (bound <= 0) {
    const std::string where =
        requested == 0 ? fmt::format("{} (any port)", host)
                       : fmt::format(host.find(':') != std::string::npos ? "[{}]:{}" : "{}:{}",
                                     host, requested);
    error = bind_errno != 0 ? fmt::format("could not bind {}: {}", where, std::strerror(bind_errno))
                            : fmt::format("could not bind {} (in use, or not allowed)", where);
    http.stop();  // closes a socket left behind, if any
    return false;
  }
  listen_fd = http.listen_socket();
  ::fcntl(listen_fd, F_SETFL, ::fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
  wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd < 0) {
    error = fmt::format("eventfd: {}", std::strerror(errno));
    http.stop();
    return false;
  }
  port = bound;
  return true;
}

void MetricsEndpoint::Impl::start() {
  try {
    poller = start_background_thread([this] { poll_loop(); });
    for (std::size_t i = 0; i < std::max<std::size_t>(1, limits.workers); ++i) {
      workers.push_back(start_background_thread([this] { work_loop(); }));
    }
  } catch (...) {
    stop();
    throw;
  }
}

void MetricsEndpoint::Impl::wake() noexcept {
  const std::uint64_t one = 1;
  (void)!::write(wake_fd, &one, sizeof(one));
}

std::list<Connection>::iterator MetricsEndpoint::Impl::find(const Connection& c) {
  return std::find_if(conns.begin(), conns.end(), [&c](const Connection& x) { return &x == &c; });
}

void MetricsEndpoint::Impl::close_connection(std::list<Connection>::iterator it) {
  if (it->state == Connection::State::kReady) {
    ready.erase(std::remove(ready.begin(), ready.end(), &*it), ready.end());
  }
  close_fd(it->fd);
  conns.erase(it);
}

bool MetricsEndpoint::Impl::evict_oldest_unanswered() {
  auto oldest = conns.end();
  for (auto it = conns.begin(); it != conns.end(); ++it) {
    if (it->state != Connection::State::kIdle && it->state != Connection::State::kReading) {
      continue;
    }
    if (oldest == conns.end() || it->since < oldest->since) oldest = it;
  }
  if (oldest == conns.end()) return false;
  close_connection(oldest);
  return true;
}

void MetricsEndpoint::Impl::enforce_deadlines(SteadyClock::time_point now) {
  for (auto it = conns.begin(); it != conns.end();) {
    Connection& c = *it;
    const bool idle_expired =
        c.state == Connection::State::kIdle && now - c.since >= limits.idle_timeout;
    const bool request_expired =
        c.state != Connection::State::kIdle && now - c.since >= limits.request_deadline;
    if (c.state == Connection::State::kServing) {
      // Its worker is writing or reading: wake it with an error, it closes the socket.
      if (request_expired && !c.shut) {
        ::shutdown(c.fd, SHUT_RDWR);
        c.shut = true;
      }
      ++it;
    } else if (idle_expired || request_expired) {
      auto next = std::next(it);
      close_connection(it);
      it = next;
    } else {
      ++it;
    }
  }
}

SteadyClock::time_point MetricsEndpoint::Impl::next_deadline(SteadyClock::time_point now) const {
  auto next = SteadyClock::time_point::max();
  for (const Connection& c : conns) {
    if (c.state == Connection::State::kIdle) {
      next = std::min(next, c.since + limits.idle_timeout);
    } else if (!c.shut) {
      next = std::min(next, c.since + limits.request_deadline);
    }
  }
  if (accept_paused_until > now) next = std::min(next, accept_paused_until);
  return next;
}

void MetricsEndpoint::Impl::read_some(Connection& c, SteadyClock::time_point now) {
  char buf[4096];
  const std::size_t room = limits.max_head_bytes - std::min(limits.max_head_bytes, c.head.size());
  const ssize_t n = ::recv(c.fd, buf, std::min(room, sizeof(buf)), MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) {  // the client left (or room is 0, which head_complete rules out below)
    close_connection(find(c));
    return;
  }
  if (c.state == Connection::State::kIdle) {
    c.state = Connection::State::kReading;
    c.since = now;
  }
  c.head.append(buf, static_cast<std::size_t>(n));
  if (head_complete(c.head)) {
    c.state = Connection::State::kReady;
    ready.push_back(&c);
    work_cv.notify_one();
  } else if (c.head.size() >= limits.max_head_bytes) {
    static constexpr char kTooLarge[] =
        "HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
        "Connection: close\r\n\r\n";
    (void)!::send(c.fd, kTooLarge, sizeof(kTooLarge) - 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    close_connection(find(c));
  }
}

void MetricsEndpoint::Impl::accept_some(SteadyClock::time_point now) {
  for (int i = 0; i < 64; ++i) {
    // At the cap, a new client takes the place of the oldest one not being answered (an
    // idle or slow one): descriptors never exceed the cap, and a scraper always gets in.
    if (conns.size() >= limits.max_connections && !evict_oldest_unanswered()) return;
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        // EMFILE, ENFILE, ENOBUFS, ENOMEM: the process or the system is out of something
        // the trainer needs more; try again later rather than spin on the backlog.
        accept_paused_until = now + std::chrono::milliseconds(100);
      }
      return;
    }
    Connection c;
    c.fd = fd;
    c.since = now;
    httplib::detail::get_remote_ip_and_port(fd, c.remote_ip, c.remote_port);
    httplib::detail::get_local_ip_and_port(fd, c.local_ip, c.local_port);
    conns.push_back(std::move(c));
  }
}

void MetricsEndpoint::Impl::poll_loop() {
  std::vector<pollfd> fds;
  std::vector<Connection*> polled;
  for (;;) {
    fds.clear();
    polled.clear();
    int timeout_ms = -1;
    bool listening = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) break;
      const auto now = SteadyClock::now();
      enforce_deadlines(now);
      fds.push_back({wake_fd, POLLIN, 0});
      if (now >= accept_paused_until) {
        fds.push_back({listen_fd, POLLIN, 0});
        listening = true;
      }
      for (Connection& c : conns) {
        if (c.state == Connection::State::kIdle || c.state == Connection::State::kReading) {
          fds.push_back({c.fd, POLLIN, 0});
          polled.push_back(&c);
        }
      }
      const auto next = next_deadline(now);
      if (next != SteadyClock::time_point::max()) timeout_ms = std::max(1, ms_until(next, now));
    }
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // not expected: no spin
      continue;
    }
    if (n <= 0) continue;
    if (fds[0].revents != 0) {
      std::uint64_t count = 0;
      (void)!::read(wake_fd, &count, sizeof(count));
    }
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) break;
    const auto now = SteadyClock::now();
    const std::size_t first = listening ? 2 : 1;
    // Only the poller closes connections it polls, so each `polled` entry is still there.
    for (std::size_t i = 0; i < polled.size(); ++i) {
      if (fds[first + i].revents != 0) read_some(*polled[i], now);
    }
    if (listening && fds[1].revents != 0) accept_some(now);
  }
  // Stopping: nothing waits on a client. Close what no worker answers; wake those that do.
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = conns.begin(); it != conns.end();) {
    auto next = std::next(it);
    if (it->state == Connection::State::kServing) {
      ::shutdown(it->fd, SHUT_RDWR);
      it->shut = true;
    } else {
      close_connection(it);
    }
    it = next;
  }
}

void MetricsEndpoint::Impl::work_loop() {
  for (;;) {
    Connection* c = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu);
      work_cv.wait(lock, [this] { return stopping || !ready.empty(); });
      if (stopping) return;
      c = ready.front();
      ready.pop_front();
      c->state = Connection::State::kServing;
    }
    serve(*c);
  }
}

void MetricsEndpoint::Impl::serve(Connection& c) {
  // Only this worker touches c's head, fd and counters while it is kServing.
  const bool last = ++c.served >= limits.max_requests_per_connection;
  bool closed = false;
  bool ok = false;
  std::string unread;
  {
    RequestStream strm(c, c.since + limits.request_deadline);
    try {
      ok = http.answer(strm, c, last, closed);
    } catch (...) {
      ok = false;  // never out of a background thread
    }
    unread = strm.unread();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    if (ok && !closed && !last && !stopping && !c.shut) {
      c.head = std::move(unread);
      c.since = SteadyClock::now();
      if (head_complete(c.head)) {
        c.state = Connection::State::kReady;
        ready.push_back(&c);
        work_cv.notify_one();
      } else {
        c.state = c.head.empty() ? Connection::State::kIdle : Connection::State::kReading;
      }
      wake();  // the poller watches it again
      return;
    }
  }
  // Closing: a FIN after the answer rather than a reset (unread bytes make close() send
  // RST, and the client may then lose the answer), draining at most 100 ms.
  ::shutdown(c.fd, SHUT_WR);
  const auto until = SteadyClock::now() + std::chrono::milliseconds(100);
  char buf[4096];
  for (std::size_t drained = 0; drained < (1u << 20);) {
    pollfd p{c.fd, POLLIN, 0};
    const int ms = ms_until(until, SteadyClock::now());
    if (ms == 0 || ::poll(&p, 1, ms) <= 0) break;
    const ssize_t n = ::recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n <= 0) break;
    drained += static_cast<std::size_t>(n);
  }
  std::lock_guard<std::mutex> lock(mu);
  close_connection(find(c));
}

void MetricsEndpoint::Impl::stop() noexcept {
  std::lock_guard<std::mutex> stop_lock(stop_mu);
  if (stopped) return;
  stopped = true;
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
  }
  if (wake_fd >= 0) wake();
  work_cv.notify_all();
  if (poller.joinable()) poller.join();
  for (std::thread& t : workers) {
    if (t.joinable()) t.join();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    while (!conns.empty()) close_connection(conns.begin());
  }
  http.stop();  // the listening socket
  close_fd(wake_fd);
  wake_fd = -1;
}

MetricsEndpoint::MetricsEndpoint(const std::string& host, int port,
                                 std::function<std::string()> render, EndpointLimits limits)
    : impl_(std::make_unique<Impl>(std::move(render), limits)) {
  if (impl_->bind(host, port)) impl_->start();
}

MetricsEndpoint::~MetricsEndpoint() { stop(); }

int MetricsEndpoint::port() const noexcept { return impl_->port; }
const std::string& MetricsEndpoint::error() const noexcept { return impl_->error; }
std::size_t MetricsEndpoint::connections() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->conns.size();
}
void MetricsEndpoint::stop() noexcept { impl_->stop(); }

std::string http_put(const std::string& origin, const std::string& path, std::string body,
                     const std::string& content_type, std::chrono::milliseconds deadline) {
  // The request runs on its own thread so that the deadline covers every part of it,
  // the name lookup (getaddrinfo cannot be interrupted) included; httplib's timeouts
  // make that thread end on its own soon after.
  struct Outcome {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string error;
  };
  auto outcome = std::make_shared<Outcome>();
  const auto ms = deadline.count();
  std::thread request;
  try {
    request =
        start_background_thread([outcome, origin, path, body = std::move(body), content_type, ms] {
          std::string error;
          try {
            httplib::Client client(origin);
            client.set_connection_timeout(std::chrono::milliseconds(ms));
            client.set_read_timeout(std::chrono::milliseconds(ms));
            client.set_write_timeout(std::chrono::milliseconds(ms));
            client.set_max_timeout(std::chrono::milliseconds(ms));
            client.set_keep_alive(false);
            auto res = client.Put(path, body, content_type);
            if (!res) {
              error = fmt::format("{}{}: {}", origin, path, httplib::to_string(res.error()));
            } else if (res->status / 100 != 2) {
              error = fmt::format("{}{}: HTTP {} {}", origin, path, res->status,
                                  res->body.substr(0, 200));
            }
          } catch (const std::exception& e) {
            error = fmt::format("{}: {}", origin, e.what());
          }
          std::lock_guard<std::mutex> lock(outcome->mu);
          outcome->error = std::move(error);
          outcome->done = true;
          outcome->cv.notify_all();
        });
  } catch (const std::exception& e) {
    return fmt::format("{}: could not start the request: {}", origin, e.what());
  }
  std::unique_lock<std::mutex> lock(outcome->mu);
  if (outcome->cv.wait_for(lock, deadline, [&] { return outcome->done; })) {
    std::string error = outcome->error;
    lock.unlock();
    request.join();
    return error;
  }
  lock.unlock();
  request.detach();  // it holds what it uses (outcome, copies) and ends on its timeouts
  return fmt::format("{}{}: no answer within {} ms (the push's deadline)", origin, path, ms);
}

#else  // built without cpp-httplib

struct MetricsEndpoint::Impl {
  std::string error = "built without cpp-httplib (STEPTRACE_WITH_HTTPLIB=OFF)";
};
MetricsEndpoint::MetricsEndpoint(const std::string&, int, std::function<std::string()>,
                                 EndpointLimits)
    : impl_(std::make_unique<Impl>()) {}
MetricsEndpoint::~MetricsEndpoint() = default;
int MetricsEndpoint::port() const noexcept { return -1; }
const std::string& MetricsEndpoint::error() const noexcept { return impl_->error; }
std::size_t MetricsEndpoint::connections() const { return 0; }
void MetricsEndpoint::stop() noexcept {}

std::string http_put(const std::string&, const std::string&, std::string, const std::string&,
                     std::chrono::milliseconds) {
  return "built without cpp-httplib (STEPTRACE_WITH_HTTPLIB=OFF)";
}

#endif

}  // namespace steptrace::detail
