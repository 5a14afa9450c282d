#include "alert.hpp"

#include <chrono>
#include <type_traits>

namespace steptrace::detail {

std::string alert_json_line(const AlertEvent& e, int rank) {
  nlohmann::ordered_json j;
  j["kind"] = e.resolved ? "resolved" : e.update ? "alert_update" : "alert";
  j["rank"] = rank;
  j["type"] = e.type;
  j["step"] = e.step;
  if (e.resolved) {
    j["first_step"] = e.first_step;
    j["repeats"] = e.repeats;
    j["message"] = e.message;
  } else if (e.update) {
    j["alert_step"] = e.first_step;
    j["phase"] = e.phase.empty() ? nullptr : nlohmann::ordered_json(e.phase);
    j["message"] = e.message;
    j["details"] = e.details;
  } else {
    j["value"] = e.value;
    j["baseline"] = e.baseline ? nlohmann::ordered_json(*e.baseline) : nullptr;
    j["threshold"] = e.threshold;
    j["phase"] = e.phase.empty() ? nullptr : nlohmann::ordered_json(e.phase);
    j["message"] = e.message;
    j["unix_ns"] = e.unix_ns;
    j["details"] = e.details;
  }
  // Replace, never throw, on odd bytes (e.g. in Python stacks).
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

namespace {
template <typename T>
void take(const nlohmann::ordered_json& j, const char* key, T& into) {
  const auto it = j.find(key);
  if (it == j.end()) return;
  if constexpr (std::is_same_v<T, std::string>) {
    if (it->is_string()) into = it->template get<std::string>();
  } else if constexpr (std::is_integral_v<T>) {
    if (it->is_number_integer()) into = it->template get<T>();
  } else {
    if (it->is_number()) into = it->template get<T>();
  }
}
}  // namespace

AlertEvent alert_from_json(const nlohmann::ordered_json& j) {
  AlertEvent e;
  std::string kind;
  take(j, "kind", kind);
  e.resolved = kind == "resolved";
  e.update = kind == "alert_update";
  take(j, "type", e.type);
  take(j, "step", e.step);
  take(j, e.update ? "alert_step" : "first_step", e.first_step);
  take(j, "repeats", e.repeats);
  take(j, "unix_ns", e.unix_ns);
  take(j, "value", e.value);
  if (const auto b = j.find("baseline"); b != j.end() && b->is_number()) {
    e.baseline = b->get<double>();
  }
  take(j, "threshold", e.threshold);
  take(j, "phase", e.phase);
  take(j, "message", e.message);
  if (const auto d = j.find("details"); d != j.end()) e.details = *d;
  return e;
}

void AlertLog::publish(const AlertEvent& event, const std::string& json_line) {
  if (event.update) {
    deliver(json_line);
  } else {
    publish_line(event.type, event.resolved, event.repeats, json_line);
  }
}

void AlertLog::publish_line(const std::string& type, bool resolved, std::int64_t repeats,
                            const std::string& json_line) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (resolved) {
      repeats_[type] += repeats;
    } else {
      ++counts_[type];
    }
  }
  deliver(json_line);
}

void AlertLog::deliver(const std::string& json_line) {
  std::function<void(const std::string&)> callback;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (subscribed_) {  // also after close(): the final drain's alerts are delivered
      if (queue_.size() >= kMaxQueued) queue_.pop_front();
      queue_.push_back({SubscriberEvent::kAlert, json_line});
    }
    callback = callback_;
  }
  event_cv_.notify_all();
  if (callback) callback(json_line);
}

std::map<std::string, std::int64_t> AlertLog::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

std::map<std::string, std::int64_t> AlertLog::repeats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return repeats_;
}

void AlertLog::set_callback(std::function<void(const std::string&)> callback) {
  std::lock_guard<std::mutex> lock(mu_);
  callback_ = std::move(callback);
}

void AlertLog::subscribe() {
  std::lock_guard<std::mutex> lock(mu_);
  subscribed_ = true;
}

std::optional<SubscriberEvent> AlertLog::wait_event(int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  event_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                     [&] { return finished_ || !queue_.empty(); });
  if (queue_.empty()) return std::nullopt;
  SubscriberEvent e = std::move(queue_.front());
  queue_.pop_front();
  return e;
}

template <typename T>
T AlertLog::request(Exchange<T>& x, SubscriberEvent::Kind kind, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!subscribed_ || closed_) return T{};
  const std::uint64_t ticket = ++x.requests;
  queue_.push_back({kind, {}});
  event_cv_.notify_all();
  const bool answered = answer_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                                            [&] { return closed_ || x.answers >= ticket; });
  return answered && x.answers >= ticket ? x.answer : T{};
}

template <typename T>
void AlertLog::answer(Exchange<T>& x, T value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    x.answer = std::move(value);
    x.answers = x.requests;
  }
  answer_cv_.notify_all();
}

std::string AlertLog::request_stacks(int timeout_ms) {
  return request(stacks_, SubscriberEvent::kStackRequest, timeout_ms);
}

void AlertLog::answer_stacks(std::string stacks) { answer(stacks_, std::move(stacks)); }

nlohmann::ordered_json AlertLog::request_collectives(int timeout_ms) {
  return request(collectives_, SubscriberEvent::kCollectivesRequest, timeout_ms);
}

void AlertLog::answer_collectives(nlohmann::ordered_json answer_value) {
  // Only an object says something: anything else is no answer's worth (as an empty text).
  if (!answer_value.is_object()) answer_value = nullptr;
  answer(collectives_, std::move(answer_value));
}

void AlertLog::finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
  }
  event_cv_.notify_all();
}

void AlertLog::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  event_cv_.notify_all();
  answer_cv_.notify_all();
}

}  // namespace steptrace::detail
