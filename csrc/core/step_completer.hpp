// A stage of the writer thread that completes step records with data arriving after
// them (device activity and counters), before the detectors and the file see them.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "step_record.hpp"

namespace steptrace::detail {

class StepCompleter {
 public:
  virtual ~StepCompleter() = default;
  /// r reached the writer (called for every record, in order, before complete).
  virtual void arrived(StepRecord& r) = 0;
  /// False while r's data may still come: r waits, and the records after it too.
  /// `force`: complete r with what is known now.
  virtual bool complete(StepRecord& r, bool force) = 0;
  /// At close, before the last records are completed (with force).
  virtual void finish() noexcept = 0;
  /// Members for the run_end object (`"key":value`, no braces); "" for none.
  virtual std::string run_end_fields() = 0;
};

/// A completer whose data reaches the writer after the step record (kernel activity,
/// counters, telemetry): a record waits until its data is in, or at most kMaxHold after it
/// arrived, so that a backend that stops delivering never holds the file back for long.
class HoldingCompleter : public StepCompleter {
 public:
  /// Longest a step record waits for its data.
  static constexpr std::chrono::milliseconds kMaxHold{2000};

  /// Stamps when r arrived (its hold counts from there), then note_arrival(r).
  void arrived(StepRecord& r) final {
    r.held_since = std::chrono::steady_clock::now();
    note_arrival(r);
  }

 protected:
  /// What the stage notes of r as it arrives (e.g. the deliveries so far); nothing here.
  virtual void note_arrival(StepRecord& /*r*/) {}
  /// Whether r is completed now: its data is in, `force` (close, flush, a full queue), or
  /// it has waited kMaxHold.
  static bool hold_over(const StepRecord& r, bool data_in, bool force) {
    return force || data_in || std::chrono::steady_clock::now() - r.held_since >= kMaxHold;
  }
};

/// Several completers as one, in order: a record is complete once each has completed it.
/// Each completes a record at most once (a record waiting on the second is not given to
/// the first again), so the first's per-record state advances once per record.
class ChainedCompleter final : public StepCompleter {
 public:
  explicit ChainedCompleter(std::vector<StepCompleter*> stages) : stages_(std::move(stages)) {}
  void arrived(StepRecord& r) override {
    for (StepCompleter* s : stages_) s->arrived(r);
    r.completed_stages = 0;
  }
  bool complete(StepRecord& r, bool force) override {
    for (; r.completed_stages < stages_.size(); ++r.completed_stages) {
      if (!stages_[r.completed_stages]->complete(r, force)) return false;
    }
    return true;
  }
  void finish() noexcept override {
    for (StepCompleter* s : stages_) s->finish();
  }
  std::string run_end_fields() override {
    std::string out;
    for (StepCompleter* s : stages_) {
      std::string f = s->run_end_fields();
      if (f.empty()) continue;
      if (!out.empty()) out += ',';
      out += f;
    }
    return out;
  }

 private:
  std::vector<StepCompleter*> stages_;
};

}  // namespace steptrace::detail
