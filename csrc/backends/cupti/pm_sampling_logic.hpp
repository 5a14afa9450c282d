// The pure parts of the CUPTI counter samplers (PM sampling and the range profiler), kept
// out of the CUPTI calls so that they are tested on any machine: when sampling runs,
// which metric feeds which counter, the hand-off that serializes start/stop (training
// thread) with decoding (decode thread), the queue of decoded samples and the decode
// thread itself.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "steptrace/backend.hpp"
#include "steptrace/ext/background_thread.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/metrics.hpp"

namespace steptrace::detail::cupti {

/// Whether PM sampling should run, from the steps the profiler wants sampled: it starts
/// with the first sampled step and stops at the first step more than kTrailingSteps after
/// the last sampled one, because the device runs a step or two behind the host. Training
/// thread only; no allocation.
class SamplingSchedule {
 public:
  static constexpr std::int64_t kTrailingSteps = 2;

  /// At the start of `step`; returns whether sampling should be running from now on.
  bool begin_step(std::int64_t step, bool sampled) noexcept {
    if (sampled) {
      last_sampled_ = step;
      running_ = true;
    } else if (running_ && step > last_sampled_ + kTrailingSteps) {
      running_ = false;
    }
    return running_;
  }
  bool running() const noexcept { return running_; }

 private:
  bool running_ = false;
  std::int64_t last_sampled_ = 0;
};

/// The selected metrics that feed the step record's counters (kCounterNames), in the
/// order they are configured and evaluated. Selected metrics that feed no counter (the
/// cycle normalisers, PCIe, NVLink) are left out: a subset of a one-pass set is one pass,
/// and every metric configured costs decode time.
struct CounterMap {
  std::vector<std::string> metrics;                    // to configure and evaluate
  std::vector<std::size_t> counter;                    // per metric: its index in kCounterNames
  std::array<std::string, kCounterCount> metric_of{};  // per counter: its metric, "" if none

  /// counter values from `evaluated` (one value per metric, in `metrics` order); NaN for
  /// the counters no metric feeds.
  void to_values(const double* evaluated, double (&values)[kCounterCount]) const noexcept {
    for (double& v : values) v = std::numeric_limits<double>::quiet_NaN();
    for (std::size_t i = 0; i < counter.size(); ++i) values[counter[i]] = evaluated[i];
  }
};

/// Maps the selected metrics of `report` to counters by their MetricCheck::counter name.
inline CounterMap map_counters(const MetricSetReport& report) {
  CounterMap map;
  for (const auto& m : report.metrics) {
    if (!m.selected) continue;
    for (std::size_t c = 0; c < kCounterCount; ++c) {
      if (m.counter != kCounterNames[c] || !map.metric_of[c].empty()) continue;
      map.metrics.push_back(m.name);
      map.counter.push_back(c);
      map.metric_of[c] = m.name;
    }
  }
  return map;
}

/// Serializes the calls on one PM sampling object between the training thread, which
/// must never wait, and background threads (decode, finish), which may. The training
/// thread states whether it wants sampling running (request); whoever is inside the
/// object applies the latest wish when it leaves, so a request made while the decode
/// thread is decoding takes effect as soon as that decode call returns. An atomic flag
/// and a loop, no mutex: the training thread does no blocking and no allocation.
///
/// `Apply` is called as apply(bool run) with the object held, and returns the state the
/// object is in afterwards (it returns !run when the call failed: the request is then not
/// retried until it changes).
class StartStopHandoff {
 public:
  /// Any thread: wants sampling running (true) or stopped (false). Never waits.
  template <class Apply>
  void request(bool run, Apply&& apply) noexcept {
    want_.store(run, std::memory_order_release);
    settle(apply);
  }

  /// Background threads: takes the object, waiting for the training thread to leave it.
  void lock() noexcept {
    while (busy_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
  }
  /// Leaves the object, then applies any request made meanwhile.
  template <class Apply>
  void unlock(Apply&& apply) noexcept {
    busy_.store(false, std::memory_order_release);
    settle(apply);
  }

  /// Whether sampling runs; read with the object held (lock) or from inside apply.
  bool running() const noexcept { return running_; }
  /// With the object held: the holder changed the state itself (a restart that failed).
  void set_running(bool running) noexcept { running_ = running; }
  /// The latest wish (any thread).
  bool wanted() const noexcept { return want_.load(std::memory_order_acquire); }

 private:
  template <class Apply>
  void settle(Apply& apply) noexcept {
    for (;;) {
      if (busy_.exchange(true, std::memory_order_acquire)) return;  // the holder applies it
      const bool want = want_.load(std::memory_order_acquire);
      if (want != running_) running_ = apply(want);
      busy_.store(false, std::memory_order_release);
      // a wish made while we held the object found it busy and left it to us
      if (want_.load(std::memory_order_acquire) == want) return;
    }
  }

  std::atomic<bool> busy_{false};
  std::atomic<bool> want_{false};
  bool running_ = false;  // guarded by busy_
};

/// Decoded samples waiting for CounterSampler::take (writer thread), filled by the decode
/// thread. Beyond `max_pending` (a writer that stopped taking) samples are dropped and
/// counted.
class SampleQueue {
 public:
  explicit SampleQueue(std::size_t max_pending) : max_pending_(max_pending) {}

  /// Adds a decode pass's samples, plus `lost` samples it could not decode.
  void publish(const std::vector<CounterSample>& batch, std::int64_t lost, bool overflow) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::size_t room = max_pending_ > pending_.size() ? max_pending_ - pending_.size() : 0;
    const std::size_t n = std::min(room, batch.size());
    pending_.insert(pending_.end(), batch.begin(), batch.begin() + static_cast<std::ptrdiff_t>(n));
    dropped_ += lost + static_cast<std::int64_t>(batch.size() - n);
    overflow_ = overflow_ || overflow;
  }

  /// CounterSampler::take's contract.
  void take(std::vector<CounterSample>& out, std::int64_t* dropped, bool* overflow) {
    std::lock_guard<std::mutex> lock(mutex_);
    out.insert(out.end(), pending_.begin(), pending_.end());
    pending_.clear();
    if (dropped != nullptr) *dropped += dropped_;
    dropped_ = 0;
    if (overflow_ && overflow != nullptr) *overflow = true;
    overflow_ = false;
  }

 private:
  const std::size_t max_pending_;
  std::mutex mutex_;
  std::vector<CounterSample> pending_;
  std::int64_t dropped_ = 0;
  bool overflow_ = false;
};

/// The first CUPTI call that failed after setup (any thread), for status(): later
/// failures are consequences of it. When it failed because CUPTI was torn down under the
/// sampler (cuptiFinalize from another tool), its objects are gone: nothing may be called
/// on them any more, not even Disable at close.
class FirstFailure {
 public:
  /// `call` names the failing step (a string literal). True for the first failure.
  bool record(const char* call, int result) noexcept {
    const char* none = nullptr;
    if (!call_.compare_exchange_strong(none, call, std::memory_order_acq_rel)) return false;
    result_.store(result, std::memory_order_release);
    return true;
  }
  /// After the first failure, by whoever recorded it: CUPTI was torn down, and when.
  void set_torn_down(std::int64_t after_step) noexcept {
    after_step_.store(after_step, std::memory_order_relaxed);
    torn_down_.store(true, std::memory_order_release);
  }
  bool failed() const noexcept { return call_.load(std::memory_order_acquire) != nullptr; }
  const char* call() const noexcept { return call_.load(std::memory_order_acquire); }
  int result() const noexcept { return result_.load(std::memory_order_acquire); }
  bool torn_down() const noexcept { return torn_down_.load(std::memory_order_acquire); }
  /// The last step that had begun when CUPTI was found torn down (-1: before any).
  std::int64_t after_step() const noexcept { return after_step_.load(std::memory_order_relaxed); }

 private:
  std::atomic<const char*> call_{nullptr};
  std::atomic<int> result_{0};
  std::atomic<bool> torn_down_{false};
  std::atomic<std::int64_t> after_step_{-1};
};

/// What both CUPTI samplers share: the metric behind each counter, the queue of decoded
/// samples and the count of deliveries (CounterSampler's contract for take, deliveries
/// and metric). The rest of their session is CounterSession (counter_session.hpp).
class QueuedCounterSampler : public CounterSampler {
 public:
  void take(std::vector<CounterSample>& out, std::int64_t* dropped, bool* overflow) override {
    queue_.take(out, dropped, overflow);
  }
  std::uint64_t deliveries() noexcept override {
    return deliveries_.load(std::memory_order_acquire);
  }
  std::string metric(std::size_t counter) const override {
    return counter < kCounterCount ? map_.metric_of[counter] : std::string();
  }

 protected:
  explicit QueuedCounterSampler(std::size_t max_pending) : queue_(max_pending) {}
  /// Decode thread (or finish): a delivery completed.
  void delivered() noexcept { deliveries_.fetch_add(1, std::memory_order_acq_rel); }

  CounterMap map_;  // set up before the decode thread starts
  SampleQueue queue_;

 private:
  std::atomic<std::uint64_t> deliveries_{0};
};

/// The decode thread: runs `pass` every `period`, and soon after wake(); stop() joins it
/// (the caller then runs its final pass itself).
class PeriodicThread {
 public:
  PeriodicThread() = default;
  ~PeriodicThread() { stop(); }
  PeriodicThread(const PeriodicThread&) = delete;
  PeriodicThread& operator=(const PeriodicThread&) = delete;

  void start(std::chrono::milliseconds period, std::function<void()> pass) {
    thread_ = start_background_thread([this, period, pass = std::move(pass)] {
      std::unique_lock<std::mutex> lock(mutex_);
      while (!stop_) {
        wake_.wait_for(lock, period, [this] { return stop_ || woken_; });
        if (stop_) break;
        woken_ = false;
        lock.unlock();
        pass();
        lock.lock();
      }
    });
  }

  /// Any thread, without blocking: run a pass soon. The flag is set without the mutex (the
  /// training thread takes no locks), so a wake racing with the thread's check may wait
  /// for the period instead: never lost for longer than that.
  void wake() noexcept {
    woken_ = true;
    wake_.notify_one();
  }

  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::atomic<bool> woken_{false};
};

}  // namespace steptrace::detail::cupti
