// Detectors: pure, deterministic functions of the step records (fed in step order on the
// writer thread) that return alerts. Each keeps O(window) memory and does O(log W) work
// per step, except when an alert fires.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "alert.hpp"
#include "episode.hpp"
#include "rolling_median.hpp"
#include "shift_detector.hpp"
#include "step_record.hpp"
#include "steptrace/config.hpp"
#include "telemetry.hpp"

namespace steptrace::detail {

/// step_regression and stall, judged on the iteration time (data + step) against the
/// trailing window (its median m, its noise s = max(1.4826 x MAD, (p90 - m) / 1.2816),
/// its 95th percentile):
///   slow:  it - m > max(min_excess_ms, noise_sigmas x s), and it > regression_threshold x m
///          or the phase that grew most > regression_threshold x its own median
///   stall: slow, it > stall_threshold x m, it - m > max(stall_min_excess_ms,
///          2 x noise_sigmas x s), and it > regression_threshold x p95
///   step_regression: K slow steps in a row, K = max(regression_min_steps,
///          ceil(regression_min_ms / m)) capped at 10 (or regression_min_steps if larger)
/// One alert per episode (a regression may escalate to a stall); later slow steps are
/// folded into it and counted in its resolved event, which comes at the first step that
/// is not slow. Slow steps are held out of the window while their streak or episode
/// lasts (at most a window of them: a lasting slowdown becomes the new normal) and join
/// it afterwards. Names the phase (data included) that grew most against its own median.
/// The iteration is data + other + step, less intervals inside the step (iteration_ns):
/// evaluation and checkpoint intervals are never part of it.
/// host_contention: a slow step whose time lost to the host inside its iteration (run-queue
/// wait, and CPU time the hypervisor stole; at least: the reading spans the time since the
/// previous one) is at least kContentionShare of its excess is the host's doing: it is neither slow
/// for these rules nor a stall; where the step would have alerted (a stall, or the K-th such step
/// in a row) it opens a host_contention episode instead (one alert; resolved after a window of
/// steps without another such step).
/// gc_pause: a slow step whose Python garbage collections in its iteration (the step's `gc`
/// and the gap's, gc_in_iteration_ns) are at least kGcShare of its excess, and which is not
/// slow without them, is the collector's doing: neither slow for these rules nor a stall, whatever
/// else the step met (a collection beside a busy host is still the collection); where the step
/// would have alerted (a stall, or the K-th such step in a row) it opens a gc_pause episode (one
/// alert with the advice; resolved after a window of steps without another such step).
/// The window learns every step without its collections' time, so pauses never become
/// the normal it judges by.
/// A slow step blocked in a collective after its last launch for at least kPeerWaitShare of
/// its excess waited for another rank: it is not slow for these rules (one incident pages
/// once, on the rank that was late, or not at all where that rank was in a marked
/// evaluation or checkpoint), and it is held out of the window like a slow step.
class SlowStepDetector {
 public:
  SlowStepDetector(const Config& config, const PhaseNames& names);
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);
  /// The run ended: resolves an episode still open.
  void finish(std::vector<AlertEvent>& out);
  /// Median iteration time of the window (ms), and how many steps it holds.
  double median_iteration_ms() const { return iteration_.median(); }
  std::size_t history() const { return iteration_.size(); }
  /// Slow steps not alerted as recurring host work between steps (host_work_spike).
  std::int64_t recurring_spikes() const { return recurring_spikes_; }

 private:
  struct Noise {
    double sigma_ms = 0;  // robust standard deviation of the window
    double p95_ms = 0;
  };
  // The phase (data included) that grew most, in ms, against its own median.
  struct Grew {
    const std::string* name = nullptr;
    double ms = 0;
    double median_ms = 0;
  };
  Noise window_noise();
  Grew grew_most(const StepRecord& r, double data_ms, double other_ms) const;
  void contention(const StepRecord& r, double iteration_ms, double median, bool alert,
                  std::vector<AlertEvent>& out);
  AlertEvent contention_end(std::int64_t step);
  void gc_pause(const StepRecord& r, double iteration_ms, double median, double gc_ms, bool alert,
                std::vector<AlertEvent>& out);
  AlertEvent gc_pause_end(std::int64_t step);
  static constexpr double kContentionShare = 0.5;
  static constexpr double kGcShare = 0.5;
  static constexpr double kPeerWaitShare = 0.5;
  // The part of the step's host reading (run-queue wait and steal) that fell inside its
  // iteration, at least (ms): the total, and the run-queue wait's part; total -1 when the
  // step has no reading.
  struct HostWait {
    double total_ms = -1;
    double runq_ms = 0;
  };
  static HostWait host_wait_in_iteration(const StepRecord& r);
  // A lone slow step whose excess is mostly host work between steps (`other`): a new
  // size of it, or one within kSpikeSize of the last new one (the loop's own recurring
  // work: logging, a callback every N steps). See the definition.
  enum class Spike { kNone, kNew, kRecurring };
  Spike host_work_spike(const StepRecord& r, const Grew& grew, double excess);
  // The held stall of a new spike: written once `window` steps passed without it coming
  // again (with its resolved record), or at the end of the run.
  void release_held_spike(std::vector<AlertEvent>& out, const char* why);
  static constexpr double kSpikeShare = 0.5;  // of the excess, at least, in `other`
  static constexpr double kSpikeSize = 2.0;   // within this factor of the earlier one's
  bool long_enough(int steps, double ms) const;
  // A slow step of `ms` (`excess` over the window's median) is stall-sized.
  bool is_stall(double ms, double median, double excess, const Noise& noise) const;
  AlertEvent slow_alert(const StepRecord& r, int level, double iteration_ms, double median,
                        const Grew& grew, const Noise& noise) const;
  AlertEvent episode_end(std::int64_t step, const char* why) const;

  const Config& config_;
  const PhaseNames& names_;
  RollingMedian iteration_;
  RollingMedian work_;     // the steps' work (tokens, else samples) where it is counted
  double work_ratio_ = 1;  // this step's work over the usual, where more (else 1)
  RollingMedian data_;
  RollingMedian other_;                                 // the gap's other host work
  std::vector<std::unique_ptr<RollingMedian>> phases_;  // by phase id, created when first seen
  std::vector<bool> present_;                           // scratch: phases in this step
  std::vector<double> scratch_;                         // scratch: the window's values
  std::vector<double> held_;  // slow steps of the streak or episode, out of the window
  int level_ = 0;             // 0 normal, 1 regression, 2 stall (highest alert of this episode)
  std::int64_t episode_start_ = 0;
  std::int64_t episode_slow_steps_ = 0;
  std::int64_t last_step_ = 0;
  int slow_streak_ = 0;                   // slow steps of the streak (gaps left out)
  double slow_streak_ms_ = 0;             // their iteration time
  int streak_gap_ = 0;                    // steps within the noise since the streak's last slow one
  static constexpr int kStreakGap = 2;    // a streak survives this many in a row
  int streak_gaps_ = 0;                   // all of them in the streak
  static constexpr int kSlowPerGap = 10;  // and one per this many slow steps
  std::int64_t streak_start_ = 0;
  double spike_ms_ = 0;  // `other` of the last new lone host-work spike (0: none yet)
  std::int64_t last_spike_step_ = -2;
  std::int64_t recurring_spikes_ = 0;     // slow steps folded as recurring host work
  std::optional<AlertEvent> held_spike_;  // a new spike's stall, held for `window` steps
  std::int64_t held_spike_until_ = 0;
  bool contention_active_ = false;  // a host_contention episode is open
  std::int64_t contention_start_ = 0;
  std::int64_t contention_last_ = 0;
  std::int64_t contention_steps_ = 0;
  int contention_streak_ = 0;        // consecutive slow steps that waited for a CPU
  double contention_streak_ms_ = 0;  // their iteration time
  bool gc_active_ = false;           // a gc_pause episode is open
  std::int64_t gc_start_ = 0;
  std::int64_t gc_last_ = 0;
  std::int64_t gc_steps_ = 0;
  int gc_streak_ = 0;        // consecutive slow steps that were mostly collection
  double gc_streak_ms_ = 0;  // their iteration time
};

/// memory_growth: after warmup, memory (torch allocated bytes, else the C heap's in-use
/// bytes, else RSS; only steps where it was freshly measured) more than
/// memory_growth_pct above the peak of the first min_history measurements, with a
/// steadily rising trend over the newest 20, 50 or `window` measurements (the medians of
/// their four quarters each significantly above the last) that itself adds at least a
/// quarter of the tolerance, is a leak; its rate is the Theil-Sen slope per step. The alert fires
/// at once; the phase it grows in is measured afterwards and named in a follow-up (update) event.
class MemoryGrowthDetector {
 public:
  /// limit_bytes: memory of the host the heap or RSS fills; 0 if unknown.
  MemoryGrowthDetector(const Config& config, const PhaseNames& names,
                       std::int64_t host_limit_bytes);
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);
  /// While true, the training thread measures memory per phase for attribution.
  bool wants_phase_memory() const { return attributing_; }

 private:
  // Memory figures in order of preference; a better one appearing restarts the detector.
  enum Metric { kNone = 0, kRss = 1, kHeap = 2, kAllocated = 3 };
  static constexpr int kAttributedSteps = 5;        // steps measured per phase to name it
  static constexpr int kMaxAttributionWait = 1000;  // steps to wait for them, at most
  static constexpr std::size_t kMinTrendPoints = 20;
  struct Point {
    std::int64_t step;
    double value;
  };
  std::vector<Point> ordered_window() const;  // oldest first
  static bool rising(const std::vector<Point>& points);
  static double theil_sen_slope(const std::vector<Point>& ordered);
  void reset(Metric metric);
  void attribute(const StepRecord& r, std::vector<AlertEvent>& out);

  const Config& config_;
  const PhaseNames& names_;
  std::int64_t host_limit_bytes_;
  Metric metric_ = kNone;
  std::int64_t baseline_points_ = 0;
  double baseline_ = 0;
  std::vector<Point> window_;  // ring of the last `window` measurements
  std::size_t next_ = 0;
  std::size_t count_ = 0;
  bool active_ = false;
  std::int64_t episode_start_ = 0;
  bool attributing_ = false;
  std::int64_t attribution_start_ = 0;
  int attributed_steps_ = 0;
  std::vector<double> phase_growth_;  // bytes by phase id, summed while attributing
};

/// Diagnoses from kernel activity and hardware counters, on the steps that have them
/// (after warmup): low_tensor_core (tensor-core activity below tensor_core_min_pct where
/// matmul kernels take at least matmul_dominated_pct of the compute time), memory_bound
/// (occupancy below occupancy_min_pct with DRAM throughput above dram_bound_pct) and
/// comm_bound (NCCL kernels over comm_bound_pct of the step). Each fires once
/// regression_min_steps observed steps in a row meet it, once per episode, and resolves
/// after as many observed steps in a row without it.
class DeviceDiagnosisDetector {
 public:
  explicit DeviceDiagnosisDetector(const Config& config)
      : config_(config),
        tensor_(config.regression_min_steps, config.regression_min_steps),
        memory_(config.regression_min_steps, config.regression_min_steps),
        comm_(config.regression_min_steps, config.regression_min_steps) {}
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);

 private:
  // The text of an alert, built only when it fires.
  struct Diagnosis {
    std::string message;
    nlohmann::ordered_json details;
  };
  template <typename Explain>
  void update(Episode& e, const char* type, bool condition, const StepRecord& r, double value,
              double threshold, Explain explain, std::vector<AlertEvent>& out);

  const Config& config_;
  Episode tensor_;
  Episode memory_;
  Episode comm_;
};

/// slow_checkpoint: a checkpoint interval (IntervalKind::kCheckpoint) that took more than
/// kSlowFactor x the median of the run's earlier ones (at least kMinEarlier of them) and
/// at least kMinExcessS longer: the filesystem slowed down (or the checkpoint grew).
/// Intervals listed in step records only (not those after the last step).
class CheckpointDetector {
 public:
  void observe(const StepRecord& r, std::vector<AlertEvent>& out);

  static constexpr double kSlowFactor = 3.0;
  static constexpr std::size_t kMinEarlier = 2;
  static constexpr double kMinExcessS = 1.0;

 private:
  std::vector<double> earlier_s_;  // the run's checkpoint durations so far (the last 100)
};

/// hang: a step in flight longer than hang_threshold x the median iteration (at least
/// hang_min_s; hang_floor_s while the history is short). One alert per episode: further
/// steps over the limit are folded into it, and it resolves once a later step finishes
/// within the limit (or the run ends), counting them. A step waiting in a collective waits
/// for the other ranks: while one of them is in an evaluation or checkpoint interval (the
/// cross-rank exchange says so) its time does not count, and its limit is longer by the
/// time the exchange takes to learn of such an interval.
class HangDetector {
 public:
  explicit HangDetector(const Config& config) : config_(config) {}
  /// What the watchdog sees at one poll.
  struct Poll {
    std::int64_t now_ns = 0;
    std::int64_t step = -1;  // the step in flight, or -1
    std::int64_t start_ns = 0;
    std::string phase;                 // its innermost running phase, or empty
    std::int64_t last_done_step = -1;  // the last step that finished, and its host time
    std::int64_t last_done_ns = 0;
    double median_ms = 0;
    bool history_ok = false;
    bool closing = false;             // the run ends: resolve what is open
    int collectives_in_flight = 0;    // launched and not completed (host-timed collectives)
    int peers_in_interval = 0;        // other ranks in an evaluation or checkpoint interval
    std::int64_t peer_notice_ns = 0;  // how late this rank learns of one; 0: no exchange
  };
  std::optional<AlertEvent> check(const Poll& p);

 private:
  const Config& config_;
  std::int64_t peer_step_ = -1;    // the step that last waited while a peer was in an interval
  std::int64_t peer_seen_ns_ = 0;  // and when, last
  bool active_ = false;
  std::int64_t first_step_ = -1;
  std::int64_t last_hung_step_ = -1;
  std::int64_t hung_steps_ = 0;
};

/// interval_hang: an evaluation or checkpoint interval still open after hang_threshold x
/// the longest earlier interval of its kind (at least hang_min_s), or after kFirstLimitS
/// when it is the first of its kind (an evaluation's length is not known before it ran
/// once). One alert per interval, resolved when it ends (or the run ends). Other intervals
/// ("other") are not watched.
class IntervalHangDetector {
 public:
  explicit IntervalHangDetector(const Config& config) : config_(config) {}
  struct Poll {
    std::int64_t now_ns = 0;
    int kind = -1;          // IntervalKind of the open interval, -1: none
    std::int64_t seq = 0;   // which interval (one number per interval begun)
    std::int64_t step = 0;  // steps begun before it
    std::int64_t start_ns = 0;
    std::int64_t longest_earlier_ns = 0;  // of the same kind; 0: none before it
    bool closing = false;
  };
  std::optional<AlertEvent> check(const Poll& p);
  static constexpr double kFirstLimitS = 1800.0;

 private:
  const Config& config_;
  bool active_ = false;
  std::int64_t seq_ = -1;
  int kind_ = -1;
  std::int64_t step_ = 0;
};

/// The record detectors together, in the order the writer thread (and an offline
/// replay) runs them on each step record. Events about a step carry its end as unix_ns
/// (a stall held for a while, that of its own step).
class RecordDetectors {
 public:
  RecordDetectors(const Config& config, const PhaseNames& names, std::int64_t host_limit_bytes)
      : slow_(config, names),
        shift_(config, names),
        window_(config.window),
        memory_(config, names, host_limit_bytes),
        device_(config),
        hw_(config) {}
  void observe(const StepRecord& r, std::vector<AlertEvent>& out) {
    const std::size_t first = out.size();
    slow_.observe(r, out);
    fold_into_shift(r, first, out);
    // (two windows: the shift is judged once its window is mostly the slower steps)
    shift_.observe(r, r.step - last_slow_alert_ <= 2 * window_, out);
    memory_.observe(r, out);
    device_.observe(r, out);
    hw_.observe(r, out);
    checkpoints_.observe(r, out);
    for (std::size_t i = first; i < out.size(); ++i) {
      if (out[i].unix_ns == 0)
        out[i].unix_ns = r.start_unix_ns + r.host_ns;  // (a held one has its own)
    }
  }
  /// The run ended: resolves the episodes still open that count repeats.
  void finish(std::vector<AlertEvent>& out) { slow_.finish(out); }
  const SlowStepDetector& slow() const { return slow_; }
  const MemoryGrowthDetector& memory() const { return memory_; }

 private:
  // One slowdown, one alert: a per-step step_regression while a shift episode is open, or
  // for slow steps that began before the shift alert, is folded into it (dropped with its
  // resolved event); one the per-step rules raised first
  // keeps the shift detector quiet for two windows (it takes the slower steps as the norm).
  void fold_into_shift(const StepRecord& r, std::size_t first, std::vector<AlertEvent>& out) {
    for (std::size_t i = first; i < out.size();) {
      const AlertEvent& e = out[i];
      const bool slow_alert = !e.update && (e.type == "step_regression" || e.type == "stall");
      if (slow_alert && !e.resolved && e.type == "step_regression" && shifted_already(e)) {
        folded_ = true;
      } else if (slow_alert && e.resolved && folded_ && e.type == "step_regression") {
        folded_ = false;
      } else {
        if (slow_alert && e.resolved) folded_ = false;  // (it escalated to a stall: kept)
        if (slow_alert && !e.resolved) last_slow_alert_ = r.step;
        ++i;
        continue;
      }
      out.erase(out.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  bool shifted_already(const AlertEvent& e) const {
    if (shift_.episode_open()) return true;
    const auto since = e.details.find("slow_since_step");
    return shift_.last_alert_step() >= 0 && since != e.details.end() &&
           since->is_number_integer() && since->get<std::int64_t>() <= shift_.last_alert_step();
  }

  SlowStepDetector slow_;
  ShiftDetector shift_;
  std::int64_t window_;
  std::int64_t last_slow_alert_ = -(std::int64_t{1} << 40);
  bool folded_ = false;  // a step_regression folded into the shift episode awaits its end
  MemoryGrowthDetector memory_;
  DeviceDiagnosisDetector device_;
  TelemetryDetector hw_;
  CheckpointDetector checkpoints_;
};

}  // namespace steptrace::detail
