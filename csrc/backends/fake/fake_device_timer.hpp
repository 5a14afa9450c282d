// The fake twin of the CUDA event timer: a device whose clock and progress the test
// drives. An event gets the device time current when it is recorded (advance_device
// moves it) and completes only when the test says so, in any order; fail() makes every
// later call fail, like a device that fell off the bus.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "steptrace/backend.hpp"

namespace steptrace::fake {

class FakeDeviceTimer final : public DeviceTimer {
 public:
  const char* name() const noexcept override { return "fake"; }

  int record(DeviceStream stream) noexcept override {
    if (failed_) return -1;
    last_stream = stream.handle;
    last_device = stream.device;
    int h;
    if (!free_.empty()) {
      h = free_.back();
      free_.pop_back();
    } else {
      h = static_cast<int>(events_.size());
      events_.push_back({});
      ++pool_size;
    }
    events_[h] = Event{device_now_ns_, complete_all_, stream.handle};
    ++live_;
    ++records;
    return h;
  }
  Status query(int event) noexcept override {
    ++queries;
    if (fail_at_query_ >= 0 && queries > fail_at_query_) failed_ = true;
    if (failed_) return Status::kError;
    return events_[event].done ? Status::kReady : Status::kPending;
  }
  bool elapsed_ms(int start, int end, float* ms) noexcept override {
    if (failed_ || !events_[start].done || !events_[end].done) return false;
    *ms = static_cast<float>(events_[end].time_ns - events_[start].time_ns) / 1e6f;
    return true;
  }
  bool synchronize(int event) noexcept override {
    ++syncs;
    if (failed_) return false;
    events_[event].done = true;
    return true;
  }
  void release(int event) noexcept override {
    free_.push_back(event);
    --live_;
  }
  int live_events() const noexcept override { return live_; }
  std::string last_error() const override { return failed_ ? "fake device lost" : ""; }
  std::string device_name() const override { return gpu_name; }
  std::int64_t device_memory_bytes() const override { return 80LL << 30; }

  // ---- the test's controls ----
  void advance_device(std::int64_t ns) { device_now_ns_ += ns; }
  /// Completes every event recorded so far; with `from_now_on`, later ones too.
  void complete_all(bool from_now_on = false) {
    for (auto& e : events_) e.done = true;
    complete_all_ = from_now_on;
  }
  /// Completes one event (the handles a step used are in record order).
  void complete(int event) { events_[event].done = true; }
  void fail() { failed_ = true; }
  /// Fails like fail() once `n` more queries have been answered (lost mid-poll).
  void fail_after_queries(int n) { fail_at_query_ = queries + n; }

  std::string gpu_name = "Fake GPU";  // as CUDA would name the device
  std::uintptr_t last_stream = 0;
  int last_device = -1;
  int records = 0, queries = 0, syncs = 0, pool_size = 0;

 private:
  struct Event {
    std::int64_t time_ns = 0;
    bool done = false;
    std::uintptr_t stream = 0;
  };
  std::vector<Event> events_;
  std::vector<int> free_;
  std::int64_t device_now_ns_ = 0;
  int live_ = 0;
  bool complete_all_ = false;
  bool failed_ = false;
  int fail_at_query_ = -1;
};

}  // namespace steptrace::fake
