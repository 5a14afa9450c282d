// The detectors' stage of the record pipeline: runs them on the writer thread right after
// each step record, hands their alerts to the pipeline (line and event), and publishes
// what the training thread and the watchdog need from them (atomics).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "alert.hpp"
#include "detect/record_detectors.hpp"
#include "record_sink.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {

class DetectionStage final : public StepObserver {
 public:
  DetectionStage(const Config& config, const PhaseNames& names, AlertLog& alerts,
                 std::int64_t host_memory_bytes)
      : config_(config), alerts_(alerts), detectors_(config, names, host_memory_bytes) {}

  void on_step(const StepRecord& r, AlertOutput& out) override {
    events_.clear();
    detectors_.observe(r, events_);
    publish(out);
    median_ms_.store(detectors_.slow().median_iteration_ms(), std::memory_order_relaxed);
    history_ok_.store(detectors_.slow().history() >= static_cast<std::size_t>(config_.min_history),
                      std::memory_order_relaxed);
    phase_memory_.store(detectors_.memory().wants_phase_memory(), std::memory_order_relaxed);
  }

  void on_finish(AlertOutput& out) override {
    events_.clear();
    detectors_.finish(events_);
    publish(out);
  }

  std::map<std::string, std::int64_t> alert_counts() const override { return alerts_.counts(); }
  std::map<std::string, std::int64_t> alert_repeats() const override { return alerts_.repeats(); }

  double median_ms() const { return median_ms_.load(std::memory_order_relaxed); }
  bool history_ok() const { return history_ok_.load(std::memory_order_relaxed); }
  bool wants_phase_memory() const { return phase_memory_.load(std::memory_order_relaxed); }

 private:
  void publish(AlertOutput& out) {
    for (const AlertEvent& e : events_) {
      const std::string line = alert_json_line(e, config_.rank);
      out.alert(e, line);
      alerts_.publish(e, line);
    }
  }

  const Config& config_;
  AlertLog& alerts_;
  RecordDetectors detectors_;
  std::vector<AlertEvent> events_;
  std::atomic<double> median_ms_{0.0};
  std::atomic<bool> history_ok_{false};
  std::atomic<bool> phase_memory_{false};
};

}  // namespace steptrace::detail
