// step_regression, stall, host_contention and gc_pause: the per-step rules on the iteration
// time against the trailing window. Pure and deterministic: fed the step records in step
// order (writer thread), returns alerts; O(window) memory, O(log W) work per step.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../alert.hpp"
#include "../rolling_median.hpp"
#include "../step_record.hpp"
#include "steptrace/config.hpp"

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
  /// A lasting slowdown was reported elsewhere (the distribution shift): the slow steps
  /// held out of the window while their streak might become an episode join it now, as
  /// the new normal, and the streak ends (no episode may be open: it would have reported).
  void adopt_new_normal();
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
  // size of it, or one within kSpikeSize of an earlier new one's (the loop's own
  // recurring work: logging, a callback every N steps). See the definition.
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
  // Lone host-work spikes' sizes: `other`'s growth, and the part of it that was not
  // waiting for a CPU. The last new one (zero once paged), and the last sizes seen recurring.
  struct SpikeSize {
    double work_ms = 0;
    double ms = 0;
  };
  static bool same_work(SpikeSize a, SpikeSize b);  // within kSpikeSize, either way
  SpikeSize last_new_spike_;
  std::array<SpikeSize, 8> recurring_sizes_{};
  std::size_t recurring_sizes_seen_ = 0;
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

}  // namespace steptrace::detail
