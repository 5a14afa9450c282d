#include "hang_detector.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "steptrace/interval.hpp"

namespace steptrace::detail {

std::optional<AlertEvent> HangDetector::check(const Poll& p) {
  // Waiting in a collective while a peer evaluates or saves a checkpoint (nanoGPT's rank 0
  // does both alone) is waiting for planned work: counted from when no peer was in one.
  const bool in_collective = p.step >= 0 && p.collectives_in_flight > 0;
  if (in_collective && p.peers_in_interval > 0) {
    peer_step_ = p.step;
    peer_seen_ns_ = p.now_ns;
  }
  const std::int64_t from =
      p.step >= 0 && p.step == peer_step_ ? std::max(p.start_ns, peer_seen_ns_) : p.start_ns;
  const double limit_s =
      (p.history_ok ? std::max(config_.hang_threshold * p.median_ms / 1e3, config_.hang_min_s)
                    : config_.hang_floor_s) +
      (in_collective ? static_cast<double>(p.peer_notice_ns) / 1e9 : 0.0);
  const double elapsed_s = p.step >= 0 ? static_cast<double>(p.now_ns - from) / 1e9 : 0.0;
  if (active_) {
    if (p.step >= 0 && p.step > last_hung_step_ && elapsed_s > limit_s) {
      last_hung_step_ = p.step;  // another step over the limit: the same episode
      ++hung_steps_;
      return std::nullopt;
    }
    const double done_s = static_cast<double>(p.last_done_ns) / 1e9;
    const bool recovered = p.last_done_step > last_hung_step_ && done_s <= limit_s;
    if (!recovered && !p.closing) return std::nullopt;
    AlertEvent done;
    done.resolved = true;
    done.type = "hang";
    done.step = last_hung_step_;
    done.first_step = first_step_;
    done.repeats = hung_steps_ - 1;
    done.message = first_step_ == last_hung_step_
                       ? fmt::format("step {} finished", first_step_)
                       : fmt::format("steps {} to {} ran over the hang limit ({} of them)",
                                     first_step_, last_hung_step_, hung_steps_);
    active_ = false;
    return done;
  }
  if (p.step < 0 || p.step <= last_hung_step_ || elapsed_s <= limit_s) return std::nullopt;
  active_ = true;
  first_step_ = last_hung_step_ = p.step;
  hung_steps_ = 1;
  AlertEvent a;
  a.type = "hang";
  a.step = p.step;
  a.value = elapsed_s * 1e3;
  if (p.history_ok) a.baseline = p.median_ms;
  a.threshold = limit_s * 1e3;
  a.phase = p.phase;
  // A step stuck with a collective outstanding is most often waiting for a peer that stopped:
  // the rank to look at is that one (rank 0's rank_silent names it), not this one's model.
  const std::string waiting =
      p.collectives_in_flight > 0
          ? fmt::format(
                "; {} collective{} outstanding: most likely waiting for another rank "
                "that stopped (the cluster view's rank_silent names it)",
                p.collectives_in_flight, p.collectives_in_flight == 1 ? " is" : "s are")
          : "";
  const double peer_interval_s = static_cast<double>(from - p.start_ns) / 1e9;
  a.message = fmt::format(
      "step {} has been running for {:.1f} s{}{} (limit {:.1f} s{}) and may be hung{}: see "
      "details.stacks for where each thread is",
      p.step, elapsed_s, p.phase.empty() ? "" : fmt::format(" in phase {}", p.phase),
      peer_interval_s > 0 ? fmt::format(" since another rank's evaluation or checkpoint ended "
                                        "({:.1f} s before it not counted)",
                                        peer_interval_s)
                          : "",
      limit_s,
      p.history_ok ? fmt::format(", {}x the median iteration of {:.2f} ms", config_.hang_threshold,
                                 p.median_ms)
                   : " before enough history",
      waiting);
  a.details = {{"elapsed_s", elapsed_s},
               {"limit_s", limit_s},
               {"hang_threshold", config_.hang_threshold},
               {"collectives_in_flight", p.collectives_in_flight},
               {"peer_interval_s", peer_interval_s}};
  return a;
}

std::optional<AlertEvent> IntervalHangDetector::check(const Poll& p) {
  const bool watched = p.kind == static_cast<int>(IntervalKind::kEval) ||
                       p.kind == static_cast<int>(IntervalKind::kCheckpoint);
  if (active_) {
    if (watched && p.seq == seq_ && !p.closing) return std::nullopt;  // still in it
    active_ = false;
    AlertEvent done;
    done.resolved = true;
    done.type = "interval_hang";
    done.step = done.first_step = step_;
    done.message =
        fmt::format("the {} interval ended", interval_name(static_cast<IntervalKind>(kind_)));
    return done;
  }
  if (!watched || p.seq == seq_ || p.closing) return std::nullopt;  // none, or alerted already
  const double longest_s = static_cast<double>(p.longest_earlier_ns) / 1e9;
  const double limit_s = p.longest_earlier_ns > 0
                             ? std::max(config_.hang_threshold * longest_s, config_.hang_min_s)
                             : kFirstLimitS;
  const double elapsed_s = static_cast<double>(p.now_ns - p.start_ns) / 1e9;
  if (elapsed_s <= limit_s) return std::nullopt;
  active_ = true;
  seq_ = p.seq;
  kind_ = p.kind;
  step_ = p.step;
  const std::string_view kind = interval_name(static_cast<IntervalKind>(p.kind));
  AlertEvent a;
  a.type = "interval_hang";
  a.step = p.step;
  a.value = elapsed_s * 1e3;
  if (p.longest_earlier_ns > 0) a.baseline = longest_s * 1e3;
  a.threshold = limit_s * 1e3;
  a.phase = std::string(kind);
  a.message = fmt::format(
      "the {} interval has been running for {:.1f} s (limit {:.1f} s{}) and may be hung: see "
      "details.stacks for where each thread is",
      kind, elapsed_s, limit_s,
      p.longest_earlier_ns > 0 ? fmt::format(", {}x the longest earlier one of {:.2f} s",
                                             config_.hang_threshold, longest_s)
                               : fmt::format(", the first {} of the run", kind));
  a.details = {{"interval", kind}, {"elapsed_s", elapsed_s}, {"limit_s", limit_s}};
  return a;
}

}  // namespace steptrace::detail
