#include "watchdog.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "../core/alert.hpp"
#include "../core/detect/hang_detector.hpp"
#include "../core/detection_stage.hpp"
#include "../core/record_pipeline.hpp"
#include "../core/stack_dump.hpp"
#include "../core/step_record.hpp"
#include "steptrace/ext/background_thread.hpp"
#include "steptrace/profiler.hpp"

namespace steptrace::detail {
namespace {

// The flight recorder's state that Python answered (null without a process group, or no
// answer): details.flight_recorder, and its summary at the end of the message.
void add_flight_recorder(AlertEvent& event, nlohmann::ordered_json fr) {
  if (!fr.is_object()) return;  // no answer, or nothing to say
  const auto summary = fr.find("summary");
  if (summary != fr.end() && summary->is_string() && !summary->get<std::string>().empty() &&
      fr.value("recorder", "") == "on") {
    event.message += "; " + summary->get<std::string>();
  }
  event.details["flight_recorder"] = std::move(fr);
}

}  // namespace

HangLimits::Limits HangLimits::observe(const Seen& seen) {
  if (seen.last_done_step > done_step_) {
    // Polled every 100 ms, the watchdog may miss a short step between two others: the
    // longest seen is a lower bound, and the limit is hang_threshold times it.
    done_step_ = seen.last_done_step;
    if (first_done_ns_ < 0) {
      first_done_ns_ = seen.last_done_ns;
    } else {
      longest_later_ns_ = std::max(longest_later_ns_, seen.last_done_ns);
    }
  }
  if (seen.step < 0) {
    if (idle_from_ns_ < 0) idle_from_ns_ = seen.now_ns;
  } else if (seen.step != step_) {
    // A gap shorter than a poll is not seen; one that matters is several polls long.
    gap_ns_ = idle_from_ns_ >= 0 ? std::max<std::int64_t>(0, seen.start_ns - idle_from_ns_) : 0;
    idle_from_ns_ = -1;
  }
  step_ = seen.step;

  Limits out{config_.hang_floor_s, config_.hang_min_s, Source::kHistory};
  if (first_done_ns_ < 0) {
    // The first step: whatever the history says (min_history may be 0), nothing measured.
    if (previous_first_s_ > 0) {
      out.floor_s = out.min_s =
          std::max(config_.hang_floor_s, config_.hang_threshold * previous_first_s_);
      out.source = Source::kPreviousAttempt;
    } else {
      out.floor_s = out.min_s = config_.first_step_hang_s;
      out.source = Source::kFirstStep;
    }
    return out;
  }
  double limit_s = 0;
  if (!seen.history_ok) {
    const std::int64_t known_ns = longest_later_ns_ > 0 ? longest_later_ns_ : first_done_ns_;
    const double learned_s = config_.hang_threshold * static_cast<double>(known_ns) / 1e9;
    out.floor_s = std::max(config_.hang_floor_s, learned_s);
    out.source = learned_s > config_.hang_floor_s ? Source::kEarlierSteps : Source::kFloor;
    limit_s = out.floor_s;
  } else {
    limit_s = std::max(config_.hang_threshold * seen.median_ms / 1e3, config_.hang_min_s);
  }
  if (seen.step >= 0 && static_cast<double>(gap_ns_) / 1e9 > limit_s &&
      limit_s < config_.hang_floor_s) {
    out.floor_s = std::max(out.floor_s, config_.hang_floor_s);
    out.min_s = std::max(out.min_s, config_.hang_floor_s);
    out.source = Source::kAfterGap;
  }
  return out;
}

const char* HangLimits::name(Source source) noexcept {
  switch (source) {
    case Source::kFirstStep:
      return "first_step_hang_s";
    case Source::kPreviousAttempt:
      return "previous_attempt";
    case Source::kEarlierSteps:
      return "earlier_steps";
    case Source::kFloor:
      return "hang_floor_s";
    case Source::kAfterGap:
      return "after_gap";
    case Source::kHistory:
      break;
  }
  return "median";
}

double first_step_s_of_log(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  // The first step comes after run_start and a few records before it (intervals, a
  // restore); a log without one that early gives nothing.
  constexpr int kMaxLines = 10000;
  for (int n = 0; n < kMaxLines && std::getline(in, line); ++n) {
    if (line.find("\"kind\":\"step\"") == std::string::npos) continue;
    const auto r = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!r.is_object() || r.value("kind", "") != "step") continue;
    if (r.value("status", "") != "ok") return 0;
    const double ms = r.value("host_ms", r.value("step_ms", 0.0)) - r.value("compile_ms", 0.0);
    return ms > 0 ? ms / 1e3 : 0;
  }
  return 0;
}

void Watchdog::start(const Context& context) {
  context_ = context;
  // The first readings before the first step (its memory figures), on this thread: the
  // watchdog's polls follow (the thread's start orders them after this one).
  if (context_.host != nullptr) context_.host->poll(context_.clock->now_ns());
  auto steal = std::make_unique<StealReader>();
  if (steal->available()) steal_ = std::move(steal);
  thread_ = start_background_thread([this] { loop(); });
}

void Watchdog::request_stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
}

void Watchdog::join() {
  if (thread_.joinable()) thread_.join();
}

void Watchdog::abandon() noexcept {
  if (thread_.joinable()) new std::thread(std::move(thread_));  // NOLINT: leaked
}

std::int64_t Watchdog::refresh_steal() noexcept {
  if (!steal_) return 0;
  std::lock_guard<std::mutex> guard(steal_mu_);
  const std::int64_t total = steal_->sample();
  steal_total_ns_.store(total, std::memory_order_relaxed);
  return total;
}

void Watchdog::loop() {
  const Config& config = *context_.config;
  const InflightState& inflight = *context_.inflight;
  // HangDetector's floor and least limit, learned per poll (HangLimits): its own copy of the
  // options, read by it on this thread only.
  Config hang_config = config;
  HangDetector hang(hang_config);
  HangLimits limits(config);
  // A restart's first step runs the set-up its previous attempt's did: read here, off the
  // training thread, once.
  if (!context_.previous_log.empty()) {
    limits.set_previous_first_step_s(first_step_s_of_log(context_.previous_log));
  }
  IntervalHangDetector interval_hang(config);
  std::unique_lock<std::mutex> lock(mu_);
  // Hangs are checked every 100 ms; steal is read at StealCadence's pace (every 10 ms while
  // it moves, its ticks being 10 ms at USER_HZ 100; every 100 ms while it does not); the
  // host readings (RSS, the steps' run queue) are taken every 10 ms.
  constexpr int kCheckMs = 100;
  constexpr int kHostMs = 10;
  StealCadence cadence;
  std::int64_t seen_steal_ns = steal_total_ns();
  for (int last = 0, since_check_ms = 0, since_steal_ms = 0; !last;) {
    const int steal_period_ms = steal_ ? cadence.period_ms() : kCheckMs;
    const int period_ms =
        context_.host != nullptr ? std::min(kHostMs, steal_period_ms) : steal_period_ms;
    cv_.wait_for(lock, std::chrono::milliseconds(period_ms), [&] { return stop_; });
    last = stop_ ? 1 : 0;  // one more check at close: a hang resolved just before it
    lock.unlock();
    if (context_.host != nullptr) context_.host->poll(context_.clock->now_ns());
    since_steal_ms += period_ms;
    if (steal_ && since_steal_ms >= steal_period_ms) {
      const std::int64_t total = refresh_steal();
      // a refresh's movement counts too
      cadence.on_read(total != seen_steal_ns, since_steal_ms);
      seen_steal_ns = total;
      since_steal_ms = 0;
    }
    since_check_ms += period_ms;
    if (!last && since_check_ms < kCheckMs) {
      lock.lock();
      continue;
    }
    since_check_ms = 0;
    HangDetector::Poll poll;
    poll.step = inflight.step.load(std::memory_order_acquire);
    const std::int64_t in_flight = poll.step;  // also while it compiles or is in an interval
    poll.start_ns = inflight.start_ns.load(std::memory_order_relaxed);
    const int phase = inflight.phase.load(std::memory_order_relaxed);
    if (phase >= 0) poll.phase = context_.names->name(static_cast<PhaseId>(phase));
    poll.last_done_step = inflight.last_done_step.load(std::memory_order_relaxed);
    poll.last_done_ns = inflight.last_done_ns.load(std::memory_order_relaxed);
    poll.median_ms = context_.detection->median_ms();
    poll.history_ok = context_.detection->history_ok();
    poll.closing = last;
    poll.now_ns = context_.clock->now_ns();
    if (context_.collectives != nullptr)
      poll.collectives_in_flight = context_.collectives->in_flight();
    if (context_.peers != nullptr) {
      poll.peers_in_interval = context_.peers->in_interval.load(std::memory_order_relaxed);
      poll.peer_notice_ns = context_.peers->notice_ns.load(std::memory_order_relaxed);
    }
    IntervalHangDetector::Poll in_interval;
    in_interval.now_ns = poll.now_ns;
    in_interval.kind = inflight.interval.load(std::memory_order_acquire);
    if (in_interval.kind >= 0) {
      in_interval.start_ns = inflight.interval_start_ns.load(std::memory_order_relaxed);
      in_interval.step = inflight.interval_step.load(std::memory_order_relaxed);
      in_interval.seq = inflight.interval_seq.load(std::memory_order_relaxed);
      in_interval.longest_earlier_ns =
          inflight.longest_interval_ns[static_cast<std::size_t>(in_interval.kind)].load(
              std::memory_order_relaxed);
    }
    in_interval.closing = last;
    // An interval inside the step in flight is not training work: the step's hang clock
    // stops while it runs (interval_hang watches it) and leaves its time out afterwards.
    // So does a compile (a new shape's graph: seconds to minutes, not a hang), and Python's
    // collector (a generation-2 collection: up to seconds on a busy host; gc_pause names it).
    if (in_interval.kind >= 0 || inflight.compiling.load(std::memory_order_relaxed) ||
        inflight.collecting.load(std::memory_order_acquire)) {
      poll.step = -1;
    }
    HangLimits::Seen seen;
    seen.now_ns = poll.now_ns;
    seen.step = in_flight;
    seen.start_ns = poll.start_ns;
    seen.last_done_step = poll.last_done_step;
    seen.last_done_ns = poll.last_done_ns;
    seen.history_ok = poll.history_ok;
    seen.median_ms = poll.median_ms;
    const HangLimits::Limits limit = limits.observe(seen);
    hang_config.hang_floor_s = limit.floor_s;
    hang_config.hang_min_s = limit.min_s;
    poll.start_ns += inflight.excluded_ns.load(std::memory_order_relaxed) +
                     inflight.gc_ns.load(std::memory_order_relaxed);
    for (auto event : {hang.check(poll), interval_hang.check(in_interval)}) {
      if (!event) continue;
      if (event->type == "hang" && !event->resolved) {
        event->details["limit_source"] = HangLimits::name(limit.source);
        if (limit.source == HangLimits::Source::kPreviousAttempt) {
          event->message += fmt::format(
              "; the run's first step, whose limit is {}x the first step of the job's previous "
              "attempt ({:.1f} s)",
              config.hang_threshold, limits.previous_first_step_s());
        } else if (limit.source == HangLimits::Source::kFirstStep) {
          event->message +=
              fmt::format("; the run's first step, whose limit is first_step_hang_s ({:g} s)",
                          config.first_step_hang_s);
        } else if (limit.source == HangLimits::Source::kEarlierSteps) {
          event->message +=
              fmt::format("; the limit is {}x the longest step so far", config.hang_threshold);
        } else if (limit.source == HangLimits::Source::kAfterGap) {
          event->message += fmt::format(
              "; the first step after a gap, whose limit is at least hang_floor_s ({:g} s)",
              config.hang_floor_s);
        }
      }
      event->unix_ns = context_.start.unix_ns_at(poll.now_ns);
      if (!event->resolved) {
        // Where every thread is: from the armed signal handler (faulthandler; no GIL, so
        // also while the hung thread holds it), else from Python if it answers in 2 s.
        std::string stacks = dump_stacks();
        const char* source = "faulthandler";
        if (stacks.empty()) {
          stacks = context_.alerts->request_stacks(2000);
          source = "python";
        }
        event->details["stacks"] =
            stacks.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(stacks);
        event->details["stacks_source"] =
            stacks.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(source);
        add_flight_recorder(*event, context_.alerts->request_collectives(1000));
      }
      raise_alert(*context_.writer, *context_.alerts, *event, config.rank);
    }
    lock.lock();
  }
}

}  // namespace steptrace::detail
