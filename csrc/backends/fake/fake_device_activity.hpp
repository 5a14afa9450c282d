// Fake twins of the kernel-activity backend and the counter sampler: the test says which
// kernels ran (and samples were taken) when, and when they are delivered; the profiler's
// writer thread takes them as it would CUPTI's. Thread-safe (the test and the training
// thread add, the writer thread takes).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::fake {

/// Shared delivery logic: items the device produced wait in `pending` until deliver().
/// With auto_deliver, every deliveries() call delivers (records never wait long).
/// The fakes' clock: the test's when it sets one, else the steady host clock (so that
/// fake device work lines up with real steps, as in the Python tests).
struct FakeDeviceClock {
  std::int64_t now() const noexcept {
    const std::int64_t t = set_ns.load();
    if (t >= 0) return t;
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void operator=(std::int64_t t) noexcept { set_ns = t; }
  std::atomic<std::int64_t> set_ns{0};  // -1: the host clock
};

template <typename Item>
class FakeDelivery {
 public:
  void add(const Item& item) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(item);
  }
  void deliver() {
    std::lock_guard<std::mutex> lock(mu_);
    delivered_.insert(delivered_.end(), pending_.begin(), pending_.end());
    pending_.clear();
    ++deliveries_;
  }
  std::uint64_t deliveries() {
    if (auto_deliver) deliver();
    std::lock_guard<std::mutex> lock(mu_);
    return deliveries_;
  }
  void take(std::vector<Item>& out) {
    std::lock_guard<std::mutex> lock(mu_);
    out.insert(out.end(), delivered_.begin(), delivered_.end());
    delivered_.clear();
  }
  std::atomic<bool> auto_deliver{false};

 private:
  std::mutex mu_;
  std::vector<Item> pending_;
  std::vector<Item> delivered_;
  std::uint64_t deliveries_ = 0;
};

class FakeKernelActivity final : public KernelActivitySource {
 public:
  const char* name() const noexcept override { return "fake"; }
  std::int64_t now_ns() noexcept override { return clock_ns.now(); }
  void begin_step(std::int64_t step) noexcept override {
    current_step = yielding_.load() ? -1 : step;
  }
  void end_step(std::int64_t) noexcept override { current_step = -1; }

  /// A kernel of `step` (default: the step being launched now) ran over [start, end).
  void add_kernel(const std::string& kernel, KernelWork work, std::int64_t start_ns,
                  std::int64_t end_ns, std::int64_t step = kCurrent) {
    if (yielding_.load()) return;  // the other tool's buffers get it
    KernelRecord k;
    k.step = step == kCurrent ? current_step.load() : step;
    k.start_ns = start_ns;
    k.end_ns = end_ns;
    k.name_id = intern(kernel);
    k.work = work;
    delivery.add(k);
  }
  void drop(std::int64_t n) { dropped_ += n; }

  void take(std::vector<KernelRecord>& out, std::int64_t* dropped) override {
    delivery.take(out);
    *dropped += dropped_.exchange(0);
  }
  std::uint64_t deliveries() noexcept override { return delivery.deliveries(); }
  std::string kernel_name(std::uint32_t id) override {
    std::lock_guard<std::mutex> lock(mu_);
    return names_.at(id);
  }
  void set_yielding(bool yielding) noexcept override { yielding_ = yielding; }
  void finish() noexcept override {
    delivery.deliver();
    ++finish_calls;
  }
  std::string status() const override { return yielding_ ? "yielding to torch.profiler" : ""; }

  static constexpr std::int64_t kCurrent = -2;
  FakeDeviceClock clock_ns;
  std::atomic<std::int64_t> current_step{-1};
  std::atomic<int> finish_calls{0};
  FakeDelivery<KernelRecord> delivery;

 private:
  std::uint32_t intern(const std::string& kernel) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, added] = ids_.emplace(kernel, static_cast<std::uint32_t>(names_.size()));
    if (added) names_.push_back(kernel);
    return it->second;
  }
  std::mutex mu_;
  std::map<std::string, std::uint32_t> ids_;
  std::vector<std::string> names_;
  std::atomic<std::int64_t> dropped_{0};
  std::atomic<bool> yielding_{false};
};

class FakeCounterSampler final : public CounterSampler {
 public:
  const char* name() const noexcept override { return "fake"; }
  std::int64_t now_ns() noexcept override { return clock_ns.now(); }
  void begin_step(std::int64_t step, bool sampled) noexcept override {
    if (sampled) sampled_steps.push_back(step);
  }
  void end_step(std::int64_t) noexcept override {}

  /// A sample over [start, end) with values for the first counters (the rest NaN).
  void add_sample(std::int64_t start_ns, std::int64_t end_ns, std::vector<double> values,
                  std::int64_t step = -1) {
    CounterSample s;
    s.step = step;
    s.start_ns = start_ns;
    s.end_ns = end_ns;
    for (std::size_t i = 0; i < kCounterCount; ++i) {
      s.values[i] = i < values.size() ? values[i] : std::numeric_limits<double>::quiet_NaN();
    }
    delivery.add(s);
  }
  void lose(std::int64_t dropped, bool overflow) {
    dropped_ += dropped;
    overflow_ = overflow_ || overflow;
  }

  void take(std::vector<CounterSample>& out, std::int64_t* dropped, bool* overflow) override {
    delivery.take(out);
    *dropped += dropped_.exchange(0);
    *overflow = overflow_.exchange(false);
  }
  std::uint64_t deliveries() noexcept override { return delivery.deliveries(); }
  std::string metric(std::size_t counter) const override {
    return counter < 3 ? std::string("fake__metric_") + kCounterNames[counter] : "";
  }
  void finish() noexcept override {
    delivery.deliver();
    ++finish_calls;
  }
  std::string status() const override { return ""; }

  FakeDeviceClock clock_ns;
  std::atomic<int> finish_calls{0};
  std::vector<std::int64_t> sampled_steps;  // training thread only
  FakeDelivery<CounterSample> delivery;

 private:
  std::atomic<std::int64_t> dropped_{0};
  std::atomic<bool> overflow_{false};
};

}  // namespace steptrace::fake
