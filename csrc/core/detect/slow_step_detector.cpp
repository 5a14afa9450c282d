#include "slow_step_detector.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "../quantile.hpp"
#include "../work_accounting.hpp"
#include "phase_advice.hpp"

namespace steptrace::detail {
namespace {

constexpr double kNsPerMs = 1e6;
// A run of this many slow steps is long enough whatever its time (a sub-millisecond loop
// would otherwise need thousands); slow steps held out of the window are bounded by it too.
constexpr int kMaxRegressionSteps = 1000;

}  // namespace

SlowStepDetector::SlowStepDetector(const Config& config, const PhaseNames& names)
    : config_(config),
      names_(names),
      iteration_(static_cast<std::size_t>(config.window)),
      work_(static_cast<std::size_t>(config.window)),
      data_(static_cast<std::size_t>(config.window)),
      other_(static_cast<std::size_t>(config.window)) {
  scratch_.reserve(static_cast<std::size_t>(config.window));
  held_.reserve(static_cast<std::size_t>(
      std::max({config.window, config.regression_min_steps, kMaxRegressionSteps})));
}

SlowStepDetector::Grew SlowStepDetector::grew_most(const StepRecord& r, double data_ms,
                                                   double other_ms) const {
  static const std::string kData = "data";
  static const std::string kOther = "other";
  Grew g{&kData, data_ms, data_.median()};
  double best = data_ms - g.median_ms;
  if (other_ms - other_.median() > best) {
    g = {&kOther, other_ms, other_.median()};
    best = other_ms - g.median_ms;
  }
  for (std::uint16_t i = 0; i < r.phase_count; ++i) {
    const auto id = r.phase_ids[i];
    const double ms = static_cast<double>(r.phase_ns[i]) / kNsPerMs;
    const double med = phases_[id] ? phases_[id]->median() : 0.0;
    if (ms - med > best) {
      best = ms - med;
      g = {&names_.name(id), ms, med};
    }
  }
  return g;
}

// The window's noise: the larger of two standard-deviation estimates, 1.4826 x its MAD
// (robust to outliers) and (p90 - p50) / 1.2816 (its upper tail). They agree on steady
// steps; the second is the honest one where steps are bimodal, as when a CPU hog takes
// the core half of the time and the MAD describes only the fast mode.
SlowStepDetector::Noise SlowStepDetector::window_noise() {
  constexpr double kP90ToSigma = 1.2816;  // p90 - p50 of a normal distribution, in sigmas
  Noise n;
  iteration_.copy_to(scratch_);
  n.p95_ms = nearest_rank_quantile(scratch_, 0.95);
  const double p90 = nearest_rank_quantile(scratch_, 0.90);
  const double median = iteration_.median();
  for (double& v : scratch_) v = std::abs(v - median);
  n.sigma_ms = std::max(kMadToSigma * median_of(scratch_), (p90 - median) / kP90ToSigma);
  return n;
}

// Periodic host work between steps (logging every N steps, a callback, a metric computed
// on the side) makes a lone slow iteration each time it runs, of about the same size: as
// stalls they paged at every occurrence (a 50 ms log every 50 steps of a 3 ms loop: 29
// stalls in 1,500 steps). A lone spike of a new size is held (release_held_spike); one
// within kSpikeSize of an earlier one's is the same work again: the held stall is dropped,
// and neither it nor later ones alert. A lasting slowdown of that work is no lone spike (slow steps
// in a row take the usual path).
SlowStepDetector::Spike SlowStepDetector::host_work_spike(const StepRecord& r, const Grew& grew,
                                                          double excess) {
  if (grew.name == nullptr || *grew.name != "other" ||
      grew.ms - grew.median_ms < kSpikeShare * excess) {
    return Spike::kNone;
  }
  // (a slow streak that has not alerted yet may run on beside it: a busy host's)
  const bool lone = r.step - last_spike_step_ > 1 && level_ == 0;
  last_spike_step_ = r.step;
  if (!lone) {
    // the held one began a lasting slowdown of that work, which the usual path judges
    if (held_spike_ && r.step == held_spike_->step + 1) held_spike_.reset();
    return Spike::kNone;
  }
  // Its size in host work: `other`'s growth, and the least of it that was work (less the
  // step's wait for a CPU: beside a busy host the same logging takes two or three times as
  // long, most of it waiting). The same work as the last new spike, which is held, shows
  // that one recurs; the same work as a size seen recurring is that work again.
  const HostWait wait = host_wait_in_iteration(r);
  const SpikeSize size{std::max(0.0, grew.ms - std::max(0.0, wait.total_ms)), grew.ms};
  if (last_new_spike_.ms > 0 && same_work(size, last_new_spike_)) {
    recurring_spikes_ += held_spike_ ? 2 : 1;  // (the held one was the first of them)
    held_spike_.reset();
    recurring_sizes_[recurring_sizes_seen_++ % recurring_sizes_.size()] = last_new_spike_;
    last_new_spike_ = {};
    return Spike::kRecurring;
  }
  for (std::size_t i = 0; i < std::min(recurring_sizes_seen_, recurring_sizes_.size()); ++i) {
    if (same_work(size, recurring_sizes_[i])) {
      ++recurring_spikes_;
      return Spike::kRecurring;
    }
  }
  last_new_spike_ = size;
  return Spike::kNew;
}

bool SlowStepDetector::same_work(SpikeSize a, SpikeSize b) {
  return a.work_ms <= kSpikeSize * b.ms && a.ms * kSpikeSize >= b.work_ms;
}

void SlowStepDetector::adopt_new_normal() {
  if (level_ > 0) return;
  for (double v : held_) iteration_.push(v);
  held_.clear();
  slow_streak_ = 0;
  slow_streak_ms_ = 0;
  streak_gap_ = 0;
  streak_gaps_ = 0;
}

void SlowStepDetector::release_held_spike(std::vector<AlertEvent>& out, const char* why) {
  if (!held_spike_) return;
  last_new_spike_ = {};  // a one-off, paged: the size of no recurring work
  AlertEvent alert = std::move(*held_spike_);
  held_spike_.reset();
  alert.message += fmt::format(
      " (held to see whether host work of this size recurs, as periodic logging does: {})", why);
  AlertEvent done;
  done.resolved = true;
  done.type = alert.type;
  done.step = alert.step;
  done.first_step = alert.step;
  done.message = fmt::format("step {} was a lone stall (1 slow step)", alert.step);
  out.push_back(std::move(alert));
  out.push_back(std::move(done));
}

// A run of slow steps is long enough for an alert once it has regression_min_steps steps
// and regression_min_ms of their own (wall) time, or kMaxRegressionSteps steps.
bool SlowStepDetector::long_enough(int steps, double ms) const {
  if (steps < config_.regression_min_steps) return false;
  return ms >= config_.regression_min_ms || steps >= kMaxRegressionSteps;
}

bool SlowStepDetector::is_stall(double ms, double median, double excess, const Noise& noise) const {
  return ms > config_.stall_threshold * median &&
         excess >
             std::max(config_.stall_min_excess_ms, 2.0 * config_.noise_sigmas * noise.sigma_ms) &&
         ms > config_.regression_threshold * noise.p95_ms;
}

AlertEvent SlowStepDetector::slow_alert(const StepRecord& r, int level, double iteration_ms,
                                        double median, const Grew& grew, const Noise& noise) const {
  const bool stall = level == 2;
  const double ratio_threshold = stall ? config_.stall_threshold : config_.regression_threshold;
  const double min_excess = stall ? config_.stall_min_excess_ms : config_.min_excess_ms;
  const double sigmas = stall ? 2.0 * config_.noise_sigmas : config_.noise_sigmas;
  // The iteration time this step had to exceed: every part of the rule at once (for a
  // regression named by its phase alone, the excess part).
  double limit = std::max(median + min_excess, median + sigmas * noise.sigma_ms);
  if (stall || iteration_ms > config_.regression_threshold * median) {
    limit = std::max(limit, ratio_threshold * median);
  }
  if (stall) limit = std::max(limit, config_.regression_threshold * noise.p95_ms);
  const double ratio = iteration_ms / median;
  const double blocked_ms = static_cast<double>(r.comm.exposed_ns) / kNsPerMs;

  AlertEvent a;
  a.type = stall ? "stall" : "step_regression";
  a.step = r.step;
  a.value = iteration_ms;
  a.baseline = median;
  a.threshold = limit;
  a.phase = *grew.name;
  a.message = fmt::format(
      "step {} took {:.1f}x the trailing median ({:.2f} ms vs {:.2f} ms over {} steps, noise "
      "{:.2f} ms, limit {:.2f} ms){}{}; {} grew most ({:.2f} ms vs its median {:.2f} ms): {}",
      r.step, ratio, iteration_ms, median, iteration_.size(), noise.sigma_ms, limit,
      work_ratio_ > 1 ? fmt::format(", per unit of its work ({:.1f}x the usual)", work_ratio_) : "",
      slow_streak_ > 1 ? fmt::format(", slow since step {}", streak_start_) : "", *grew.name,
      grew.ms, grew.median_ms, phase_advice(*grew.name));
  a.details = {{"ratio", ratio},
               {"ratio_threshold", ratio_threshold},
               {"noise_ms", noise.sigma_ms},
               {"noise_sigmas", sigmas},
               {"min_excess_ms", min_excess},
               {"window_p95_ms", noise.p95_ms},
               {"phase_ms", grew.ms},
               {"phase_median_ms", grew.median_ms},
               {"window_steps", iteration_.size()},
               {"slow_steps_needed", stall ? 1 : slow_streak_},
               {"slow_ms", stall ? iteration_ms : slow_streak_ms_},
               {"slow_ms_needed", stall ? 0.0 : config_.regression_min_ms},
               {"slow_since_step", stall && level_ == 0 ? r.step : streak_start_},
               {"work_ratio", work_ratio_},
               {"comm_blocked_ms",
                r.comm.count > 0 ? nlohmann::ordered_json(blocked_ms) : nlohmann::ordered_json()}};
  return a;
}

AlertEvent SlowStepDetector::episode_end(std::int64_t step, const char* why) const {
  AlertEvent done;
  done.resolved = true;
  done.type = level_ == 2 ? "stall" : "step_regression";
  done.step = step;
  done.first_step = episode_start_;
  done.repeats = std::max<std::int64_t>(episode_slow_steps_ - 1, 0);
  done.message = fmt::format("{} ({} slow step{} from step {})", why, episode_slow_steps_,
                             episode_slow_steps_ == 1 ? "" : "s", episode_start_);
  return done;
}

void SlowStepDetector::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  // Warmup steps, failed (partial) steps and steps under an evidence capture (the profiler's
  // own start and stop are in them) say nothing about steady-state speed.
  if (r.step < config_.warmup_steps || r.failed || r.profiled) return;
  last_step_ = r.step;
  if (held_spike_ && r.step >= held_spike_until_) {
    release_held_spike(out, fmt::format("not in the {} steps after it", config_.window).c_str());
  }
  // A step with more work than usual (a long batch under dynamic padding: its tokens, else
  // its samples, where counted) takes longer for it: it is judged per unit of that work
  // against the usual amount; a step with less work is judged as it is.
  const double work = r.work.tokens > 0 ? r.work.tokens : r.work.samples;
  work_ratio_ = 1;
  if (work > 0) {
    const double usual =
        work_.size() >= static_cast<std::size_t>(config_.min_history) ? work_.median() : 0;
    if (usual > 0 && work > usual) work_ratio_ = work / usual;
    work_.push(work);
  }
  const double iteration_ms = static_cast<double>(iteration_ns(r)) / kNsPerMs / work_ratio_;
  // Python's collections in the iteration (at most all of it), and the iteration without
  // them: what the window learns.
  const double gc_ms =
      std::min(static_cast<double>(gc_in_iteration_ns(r)) / kNsPerMs / work_ratio_, iteration_ms);
  const double window_ms = iteration_ms - gc_ms;
  // the loader's start at an epoch boundary is not part of the iteration (iteration_ns)
  const double data_ms = static_cast<double>(r.data_ns - r.data_start_ns) / kNsPerMs;
  const double other_ms = static_cast<double>(r.between.other_ns) / kNsPerMs;
  if (phases_.size() < names_.size()) phases_.resize(names_.size());

  const bool judged = iteration_.size() >= static_cast<std::size_t>(config_.min_history);
  bool slow = false;
  bool contended = false;    // slow, and mostly the host's doing
  bool peer_waited = false;  // slow, and mostly blocked waiting for another rank
  bool recurring = false;    // slow only by the loop's recurring host work between steps
  bool collected = false;    // slow, and mostly Python's garbage collector
  if (judged) {
    const double median = iteration_.median();
    double judged_ms = iteration_ms;  // the step as judged: less a collection that paused it
    double excess = judged_ms - median;
    bool stall = false;
    Noise noise;
    Grew grew;
    // The cheap part of the rule first: the window's noise only for a step that may be slow.
    if (median > 0 && excess > config_.min_excess_ms) {
      grew = grew_most(r, data_ms, other_ms);
      const bool ratio = iteration_ms > config_.regression_threshold * median ||
                         grew.ms > config_.regression_threshold * grew.median_ms;
      if (ratio) {
        noise = window_noise();
        slow = excess > config_.noise_sigmas * noise.sigma_ms;
      }
      stall = slow && is_stall(iteration_ms, median, excess, noise);
    }
    // Most of the excess spent blocked in a collective (after the rank's last launch in the
    // step, or in one between steps: a barrier after rank 0's checkpoint; on a GPU, NCCL
    // kernels no compute overlapped, which spin until the peers join) is another rank
    // being late (its own alert names it, or nothing does where it was in a marked
    // evaluation or checkpoint), not this rank's model: not slow here.
    const std::int64_t blocked_ns = r.comm.exposed_ns + r.comm.between_blocked_ns +
                                    (r.kernels.present ? r.kernels.exposed_nccl_ns : 0);
    const bool waited_for_peer =
        slow && blocked_ns > 0 &&
        static_cast<double>(blocked_ns) / kNsPerMs >= kPeerWaitShare * excess;
    if (waited_for_peer) {
      slow = stall = false;
      peer_waited = true;
    }
    // Most of the excess spent in Python's garbage collector is a collection pause, not the
    // model (before contention: a collection slowed further by a busy host is still one,
    // and the advice that helps is the collector's). It alerts where the step would have.
    // What is left of the step is judged on its own, as if it had not collected: slow (a
    // regression's step that also collected; a hog's time slice beside the collection) or
    // not, and a stall only if the rest alone is one.
    if (slow && gc_ms > 0 && gc_ms >= kGcShare * excess) {
      ++gc_streak_;
      gc_streak_ms_ += iteration_ms;
      gc_pause(r, iteration_ms, median, gc_ms, stall || long_enough(gc_streak_, gc_streak_ms_),
               out);
      collected = true;
      judged_ms = window_ms;
      excess = judged_ms - median;
      slow = excess > std::max(config_.min_excess_ms, config_.noise_sigmas * noise.sigma_ms) &&
             judged_ms > config_.regression_threshold * median;
      stall = slow && is_stall(judged_ms, median, excess, noise);
    } else {
      gc_streak_ = 0;
      gc_streak_ms_ = 0;
      if (gc_active_ && r.step - gc_last_ > config_.window) out.push_back(gc_pause_end(r.step));
    }
    // Most of the excess spent waiting for a CPU is the host's doing, not the model's.
    // It alerts where the step would have (a stall, or a regression's run of slow steps).
    if (slow && host_wait_in_iteration(r).total_ms >= kContentionShare * excess) {
      ++contention_streak_;
      contention_streak_ms_ += judged_ms;
      const bool alert = stall || long_enough(contention_streak_, contention_streak_ms_);
      slow = stall = false;
      contended = true;
      // host work between steps is seen in its size even where the wait made it contention:
      // the same work with less wait another time is that work again
      host_work_spike(r, grew, excess);
      contention(r, judged_ms, median, alert, out);
    } else {
      contention_streak_ = 0;
      contention_streak_ms_ = 0;
      if (contention_active_ && r.step - contention_last_ > config_.window) {
        out.push_back(contention_end(r.step));
      }
    }
    const Spike spike = slow ? host_work_spike(r, grew, excess) : Spike::kNone;
    const bool hold_stall =
        spike == Spike::kNew && stall;  // it may be the first of a periodic kind
    if (hold_stall) {
      held_spike_ = slow_alert(r, 2, judged_ms, median, grew, noise);
      held_spike_->unix_ns = r.start_unix_ns + r.host_ns;  // when it happened, not when written
      held_spike_until_ = r.step + config_.window;
    }
    if (hold_stall || spike == Spike::kRecurring) {
      slow = stall = false;
      recurring = true;
    }
    if (slow) {
      if (slow_streak_++ == 0) {
        streak_start_ = r.step;
        slow_streak_ms_ = 0;
        streak_gaps_ = 0;
      }
      slow_streak_ms_ += judged_ms;
      streak_gap_ = 0;
    } else if (slow_streak_ > 0 && level_ == 0 && ++streak_gap_ <= kStreakGap &&
               ++streak_gaps_ * kSlowPerGap <= slow_streak_) {
      // A step within the noise does not end a long slow stretch that may yet be a
      // regression: a second of slow steps near the floor has a few. At most one per
      // kSlowPerGap slow steps and kStreakGap in a row, so scattered noisy steps (a
      // preempted step now and then) never chain into a stretch. It adds nothing to the
      // stretch's time; an open episode still resolves at the first one.
    } else {
      slow_streak_ = 0;
      streak_gap_ = 0;
      streak_gaps_ = 0;
    }
    const int level = stall ? 2 : slow && long_enough(slow_streak_, slow_streak_ms_) ? 1 : 0;
    if (level > level_) {  // a new episode, or a regression that became a stall
      out.push_back(slow_alert(r, level, judged_ms, median, grew, noise));
      if (level_ == 0) {
        episode_start_ = level == 2 ? r.step : streak_start_;
        episode_slow_steps_ = level == 2 ? 1 : slow_streak_;
      } else {
        ++episode_slow_steps_;
      }
      level_ = level;
    } else if (level_ > 0 && slow) {
      ++episode_slow_steps_;  // folded into the open episode
    } else if (level_ > 0) {
      out.push_back(episode_end(
          r.step, fmt::format("step {} is back within the slow-step limit", r.step).c_str()));
      level_ = 0;
    }
  }

  // The window: slow steps (contended ones too) are held outside it while their streak may
  // become an episode (up to kMaxRegressionSteps) and while the episode is open (up to a
  // window of them: a lasting slowdown becomes the new normal), so a slow stretch does not
  // raise its own baseline or noise; they join it when the streak or the episode ends, so
  // the window still samples every step. The parts' windows (data, other, phases) skip the
  // held steps, so a slow phase stays slow against its own median while the streak runs.
  const bool hold = slow || contended || peer_waited || recurring || collected;
  const auto hold_limit = static_cast<std::size_t>(
      level_ > 0 ? config_.window : std::max(config_.window, kMaxRegressionSteps));
  const bool held = hold && held_.size() < hold_limit;
  if (held) {
    held_.push_back(window_ms);
  } else {
    iteration_.push(window_ms);
  }
  if (!hold && slow_streak_ == 0) {
    for (double v : held_) iteration_.push(v);
    held_.clear();
  }
  if (held) return;
  data_.push(data_ms);
  other_.push(other_ms);
  // Every phase seen so far gets a value each step (0 when it did not run).
  std::vector<bool>& present = present_;  // reused: no allocation per step
  present.assign(names_.size(), false);
  for (std::uint16_t i = 0; i < r.phase_count; ++i) {
    const auto id = r.phase_ids[i];
    present[id] = true;
    if (!phases_[id]) {
      phases_[id] = std::make_unique<RollingMedian>(static_cast<std::size_t>(config_.window));
    }
    phases_[id]->push(static_cast<double>(r.phase_ns[i]) / kNsPerMs);
  }
  for (std::size_t id = 0; id < phases_.size(); ++id) {
    if (phases_[id] && !present[id]) phases_[id]->push(0.0);
  }
}

// The reading spans the time since the previous one, which may reach before the iteration:
// at least this much of the wait fell inside it (all of the rest may have fallen before).
SlowStepDetector::HostWait SlowStepDetector::host_wait_in_iteration(const StepRecord& r) {
  if (r.runq_ns < 0) return {};
  const std::int64_t host_iteration = wall_iteration_ns(r) - r.data_start_ns;
  const std::int64_t before = std::max<std::int64_t>(0, r.runq_span_ns - host_iteration);
  const std::int64_t wait = r.runq_ns + std::max<std::int64_t>(0, r.steal_ns);
  const std::int64_t inside = std::max<std::int64_t>(0, wait - before);
  return {static_cast<double>(inside) / kNsPerMs,
          static_cast<double>(std::min(inside, r.runq_ns)) / kNsPerMs};
}

void SlowStepDetector::contention(const StepRecord& r, double iteration_ms, double median,
                                  bool alert, std::vector<AlertEvent>& out) {
  const HostWait wait = host_wait_in_iteration(r);
  if (contention_active_) {  // folded into the open episode
    contention_last_ = r.step;
    ++contention_steps_;
    return;
  }
  if (!alert) return;  // one contended step: noise of a busy host, like one slow step
  contention_last_ = r.step;
  contention_active_ = true;
  contention_start_ = r.step;
  contention_steps_ = 1;
  AlertEvent a;
  a.type = "host_contention";
  a.step = r.step;
  const double steal_ms = wait.total_ms - wait.runq_ms;
  a.value = wait.total_ms;
  a.baseline = median;
  a.threshold = kContentionShare * (iteration_ms - median);
  a.message = fmt::format(
      "step {} took {:.2f} ms vs the trailing median {:.2f} ms, and the training thread {}: the "
      "host is oversubscribed, not the model; check other processes on the node, DataLoader "
      "workers and OMP/MKL threads (torch.set_num_threads) against the cores{}",
      r.step, iteration_ms, median,
      steal_ms > 0 ? fmt::format("lost at least {:.2f} ms of it to the host ({:.2f} ms waiting "
                                 "for a CPU, {:.2f} ms of CPU time taken by the hypervisor)",
                                 wait.total_ms, wait.runq_ms, steal_ms)
                   : fmt::format("waited at least {:.2f} ms of it for a CPU (runnable, not "
                                 "running)",
                                 wait.total_ms),
      steal_ms > 0 ? ", and the virtual machine's share of its host (steal)" : "");
  a.details = {
      {"runq_ms", wait.runq_ms},
      {"steal_ms", r.steal_ns >= 0 ? nlohmann::ordered_json(steal_ms) : nlohmann::ordered_json()},
      {"runq_read_ms", static_cast<double>(r.runq_ns) / kNsPerMs},
      {"runq_span_ms", static_cast<double>(r.runq_span_ns) / kNsPerMs},
      {"excess_ms", iteration_ms - median},
      {"iteration_ms", iteration_ms},
      {"share_threshold", kContentionShare}};
  out.push_back(std::move(a));
}

namespace {
// The end of an episode of slow steps that had a cause other than the model (host_contention,
// gc_pause): a window of steps without another.
AlertEvent cause_episode_end(const char* type, const char* cause, std::int64_t step,
                             std::int64_t first, std::int64_t steps, int window) {
  AlertEvent done;
  done.resolved = true;
  done.type = type;
  done.step = step;
  done.first_step = first;
  done.repeats = std::max<std::int64_t>(steps - 1, 0);
  done.message = fmt::format("no step slowed by {} for {} steps ({} slowed from step {})", cause,
                             window, steps, first);
  return done;
}
}  // namespace

AlertEvent SlowStepDetector::contention_end(std::int64_t step) {
  contention_active_ = false;
  return cause_episode_end("host_contention", "CPU contention", step, contention_start_,
                           contention_steps_, config_.window);
}

void SlowStepDetector::gc_pause(const StepRecord& r, double iteration_ms, double median,
                                double gc_ms, bool alert, std::vector<AlertEvent>& out) {
  if (gc_active_) {  // folded into the open episode
    gc_last_ = r.step;
    ++gc_steps_;
    return;
  }
  if (!alert) return;  // one slow collection below stall level: noise, like one slow step
  gc_last_ = r.step;
  gc_active_ = true;
  gc_start_ = r.step;
  gc_steps_ = 1;
  // the record's own figures (gc_ms is per unit of the step's work, as the iteration)
  const double gen2_ms = static_cast<double>(gc_in_iteration_ns(r, true)) / kNsPerMs;
  const double in_step_ms = static_cast<double>(r.gc_ns[0] + r.gc_ns[1] + r.gc_ns[2]) / kNsPerMs;
  const double between_ms = static_cast<double>(gc_in_iteration_ns(r)) / kNsPerMs - in_step_ms;
  AlertEvent a;
  a.type = "gc_pause";
  a.step = r.step;
  a.value = gc_ms;
  a.baseline = median;
  a.threshold = kGcShare * (iteration_ms - median);
  a.message = fmt::format(
      "step {} took {:.2f} ms vs the trailing median {:.2f} ms, and Python's garbage collector "
      "ran {:.2f} ms of it ({} collection{}, generation 2: {:.2f} ms): a collection pause, not "
      "the model; call gc.freeze() after set-up (objects made so far are never scanned again), "
      "or gc.disable() and gc.collect() every N steps at a point of your choosing (as "
      "Megatron-LM's --manual-gc does; in a distributed job every rank then collects at the "
      "same step)",
      r.step, iteration_ms, median, gc_ms, r.gc_count, r.gc_count == 1 ? "" : "s", gen2_ms);
  a.details = {{"gc_ms", gc_ms},
               {"gc_gen2_ms", gen2_ms},
               {"gc_in_step_ms", in_step_ms},
               {"gc_between_ms", between_ms},
               {"gc_count", r.gc_count},
               {"excess_ms", iteration_ms - median},
               {"iteration_ms", iteration_ms},
               {"share_threshold", kGcShare}};
  out.push_back(std::move(a));
}

AlertEvent SlowStepDetector::gc_pause_end(std::int64_t step) {
  gc_active_ = false;
  return cause_episode_end("gc_pause", "garbage collection", step, gc_start_, gc_steps_,
                           config_.window);
}

void SlowStepDetector::finish(std::vector<AlertEvent>& out) {
  release_held_spike(out, "the run ended first");
  if (gc_active_) out.push_back(gc_pause_end(last_step_));
  if (contention_active_) out.push_back(contention_end(last_step_));
  if (level_ == 0) return;
  out.push_back(episode_end(last_step_, "the run ended during the episode"));
  level_ = 0;
}

}  // namespace steptrace::detail
