// A lasting slowdown found by how the distribution of iteration times moved, not by single
// slow steps. Beside a busy host single steps vary by the scheduler's slices (a CPU hog per
// core: 4 ms), so no step of a ~1 ms loop clears the per-step rules' noise floor and a
// regression of the work goes unreported while the window's median quietly becomes the new
// normal. A lasting regression moves the whole distribution, its fastest steps included;
// contention moves its slow tail (the fastest steps still run unpreempted) and the time the
// thread waited for a CPU grows with it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "../alert.hpp"
#include "../step_record.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {

/// step_regression by distribution shift. The baseline is the distribution of the first
/// `window` judged steps (after warmup_steps; failed steps left out); the recent window the
/// latest `window` steps. Every kEvaluateEvery steps, with a full recent window:
///   shifted: the recent window's 10th, 25th and 50th percentiles each above
///            (2 x regression_threshold - 1) x the baseline's (2x by default: twice the
///            per-step rules' margin, as a shared VM can itself run 1.7x slower for over a
///            second), and its median at least min_excess_ms above the baseline's;
///   the work grew, not the host's part: on the host clock where the thread's CPU time is
///            read, its CPU time per step (its share of the readings' spans x the median)
///            grew by regression_threshold too: contention, however it comes and goes,
///            leaves that put. Else (device time, no reading) the share of the time the
///            thread lost to the host (run-queue wait and steal) grew by less than explains
///            kHostShare of the median's growth ((share now - before) x median now): on a
///            host saturated all along the share stays put while the work, and the wait with
///            it, grows; a hog that arrives raises the share;
///   lasting: shifted at kLastingEvaluations evaluations in a row, and for regression_min_ms
///            of wall time since the window it was first seen in began (a shared VM slows
///            down for stretches of a quarter of a second with the thread on its CPU: the
///            per-step rules' reason for that floor holds here too).
/// One alert per episode, naming the part (a phase, data or other) whose median grew most.
/// The episode is resolved when the recent median is back within half the threshold of the
/// baseline's, or after kNewNormalEvaluations more evaluations, when the slower
/// distribution becomes the baseline (a further slowdown is then found against it). A
/// shift the per-step rules already alerted on (`reported_elsewhere`) becomes the baseline
/// without an alert of its own. Iteration times are per unit of work where the steps count
/// it (tokens, else samples), against the baseline's median work.
class ShiftDetector {
 public:
  ShiftDetector(const Config& config, const PhaseNames& names);
  void observe(const StepRecord& r, bool reported_elsewhere, std::vector<AlertEvent>& out);
  /// An episode is open (the per-step rules' step_regression for the same slowdown is
  /// folded into it).
  bool episode_open() const noexcept { return open_; }
  /// The step of the latest alert (-1: none).
  std::int64_t last_alert_step() const noexcept { return last_alert_step_; }

  static constexpr int kEvaluateEvery = 10;
  static constexpr int kLastingEvaluations = 2;
  static constexpr int kNewNormalEvaluations = 20;
  static constexpr double kHostShare = 0.5;

 private:
  // The per-step values of a window: the iteration, each part (data, other, then the
  // phases), and the host readings; a ring once full.
  struct Window {
    std::vector<double> iteration;
    std::vector<std::vector<double>> part;
    std::vector<double> host_wait, on_cpu, span;
    std::vector<std::int64_t> start_ns;                   // each step's start (unix ns)
    double host_wait_ms = 0, on_cpu_ms = 0, span_ms = 0;  // their sums
    std::size_t count = 0, next = 0;
  };
  struct Summary {
    double p10 = 0, p25 = 0, p50 = 0;
    double host_share = 0;  // of the time, lost to the host
    double cpu_share = -1;  // of the time, on a CPU (-1: not read)
    std::vector<double> part_median;
  };
  void push(Window& w, const StepRecord& r, double iteration_ms);
  Summary summarize(const Window& w);
  void evaluate(const StepRecord& r, bool reported_elsewhere, std::vector<AlertEvent>& out);
  AlertEvent shift_alert(const StepRecord& r, const Summary& now) const;
  AlertEvent episode_end(std::int64_t step, const char* why) const;
  // data and other first, then the phases by id (a phase first seen later is added last)
  std::size_t parts() const { return names_.size() + 2; }
  std::string part_name(std::size_t id) const;

  const Config& config_;
  const PhaseNames& names_;
  std::size_t size_;  // steps per window
  Window base_window_, recent_;
  bool have_base_ = false;
  Summary base_;
  std::vector<double> work_;  // the baseline's steps' work (0: none), until its median is taken
  double base_work_ = 0;
  int since_eval_ = 0;
  int shifted_evals_ = 0;
  std::int64_t shifted_since_ns_ = 0;  // the start of the window the shift was first seen in
  bool open_ = false;
  int open_evals_ = 0;
  std::int64_t open_step_ = 0;
  std::int64_t last_alert_step_ = -1;
  std::vector<double> scratch_;
};

}  // namespace steptrace::detail
