// Alerts: what a detector or the watchdog found, its JSON record, and the thread-safe
// log that counts them per type and hands them to subscribers (the Python alert thread,
// a C++ callback).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace steptrace::detail {

/// One alert; or (resolved = true) the end of an alert's episode; or (update = true) a
/// follow-up that adds what was found after the alert (the phase a leak grows in).
struct AlertEvent {
  bool resolved = false;
  bool update = false;
  std::string type;  // step_regression, stall, hang, memory_growth, ...
  std::int64_t step = 0;
  std::int64_t first_step = 0;  // resolved: the step the episode began at; update: the alert's
  std::int64_t repeats = 0;     // resolved: further occurrences folded into the episode
  std::int64_t unix_ns = 0;     // alert: when it happened (a step's end, the watchdog's poll)
  double value = 0;
  std::optional<double> baseline;
  double threshold = 0;
  std::string phase;  // empty: none
  std::string message;
  nlohmann::ordered_json details = nlohmann::ordered_json::object();
};

/// The record of an event as one JSON line with its newline.
std::string alert_json_line(const AlertEvent& event, int rank);
/// The event of an alert, alert_update or resolved record (the inverse of
/// alert_json_line; what Python writes through write_record): members that are missing
/// or of another type keep their defaults; `details` is taken as it is.
AlertEvent alert_from_json(const nlohmann::ordered_json& record);

/// An event for subscribers: an alert/resolved record, a request for the stacks of all
/// Python threads (answered with answer_stacks), or a request for the collectives the
/// process launched last (PyTorch's flight recorder; answered with answer_collectives).
struct SubscriberEvent {
  enum Kind { kAlert, kStackRequest, kCollectivesRequest } kind;
  std::string json;  // kAlert: the record
};

/// Counts alerts and delivers them. Thread-safe.
class AlertLog {
 public:
  /// Counts the event and queues it for subscribers (when subscribed) and the callback.
  void publish(const AlertEvent& event, const std::string& json_line);
  /// The same for a record made outside the core (alert, or resolved with its repeats).
  void publish_line(const std::string& type, bool resolved, std::int64_t repeats,
                    const std::string& json_line);

  /// Alerts fired so far (episodes), by type.
  std::map<std::string, std::int64_t> counts() const;
  /// Occurrences folded into those episodes (from their resolved events), by type.
  std::map<std::string, std::int64_t> repeats() const;

  void set_callback(std::function<void(const std::string&)> callback);
  /// From now on events are queued for wait_event (bounded: the oldest are dropped).
  void subscribe();
  /// Next event, or nothing after timeout_ms or once closed.
  std::optional<SubscriberEvent> wait_event(int timeout_ms);
  /// Watchdog: asks the subscriber for stacks and waits up to timeout_ms; empty if none.
  std::string request_stacks(int timeout_ms);
  void answer_stacks(std::string stacks);
  /// Watchdog: asks the subscriber for the flight recorder's state (a JSON object) and
  /// waits up to timeout_ms; null if none (no answer, or nothing to say).
  nlohmann::ordered_json request_collectives(int timeout_ms);
  /// The answer as a value (the Python bindings convert a dict; JSON text is parsed by
  /// Profiler::answer_collectives): an object, else nothing to say.
  void answer_collectives(nlohmann::ordered_json value);
  /// No more stack requests: wakes the watchdog if it waits for an answer.
  void close();
  /// No more events at all: wait_event returns at once when the queue is empty.
  void finish();

 private:
  // Queues the line for subscribers and calls the callback.
  void deliver(const std::string& json_line);
  // The requests of one kind and their latest answer. (nlohmann's noexcept null constructor
  // delegates to one that allocates for other types, never for null: clang-tidy cannot tell.)
  template <typename T>
  struct Exchange {  // NOLINT(bugprone-exception-escape)
    std::uint64_t requests = 0;
    std::uint64_t answers = 0;
    T answer;
  };
  // One request of a kind to the subscriber, answered (or not) within timeout_ms; the
  // answer, or T{} without one.
  template <typename T>
  T request(Exchange<T>& x, SubscriberEvent::Kind kind, int timeout_ms);
  template <typename T>
  void answer(Exchange<T>& x, T value);
  static constexpr std::size_t kMaxQueued = 1024;
  mutable std::mutex mu_;
  std::condition_variable event_cv_;
  std::condition_variable answer_cv_;
  std::map<std::string, std::int64_t> counts_;
  std::map<std::string, std::int64_t> repeats_;
  std::function<void(const std::string&)> callback_;
  std::deque<SubscriberEvent> queue_;
  bool subscribed_ = false;
  bool closed_ = false;
  bool finished_ = false;
  Exchange<std::string> stacks_;                  // the text of the threads' stacks
  Exchange<nlohmann::ordered_json> collectives_;  // the flight recorder's state, an object
};

}  // namespace steptrace::detail
