#include "step_recorder.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include "../core/alert.hpp"
#include "../core/detection_stage.hpp"
#include "../core/hardware_alert.hpp"
#include "../core/record_pipeline.hpp"
#include "steptrace/error.hpp"

namespace steptrace::detail {

void StepRecorder::bind(const Parts& parts) {
  parts_ = parts;
  has_backends_ = parts.device || parts.activity || parts.sampler || parts.telemetry;
  flops_per_step_ = parts.config->flops_per_step;
  book_.clock = parts.host_clock ? nullptr : parts.clock;
  book_.read_clock = vdso_clock_gettime();
  if (parts.counter_clock) {
    book_.tsc.start();
    anchor_tsc();  // the first pair; where none came out tight, the first step's end retries
  }
  slow_ratio_ = parts_.config->regression_threshold;
  slow_excess_ns_ = parts_.config->min_excess_ms * 1e6;
  source_samples_.resize(parts_.memory_sources->size());
  source_sampled_ns_.assign(parts_.memory_sources->size(), INT64_MIN / 2);
}

// begin_step and end_step keep to what every step needs; what a CPU-only run never does
// (the device, the activity, counter and telemetry backends), and what runs every 10 ms
// (memory sources, the run queue), is out of line: the code a step runs stays a few
// contiguous lines, and it runs when the caches are cold (issue 30).
// [[gnu::hot]]: laid out with the rest of a step's path (see profiler.cpp).
[[gnu::always_inline]] inline void StepRecorder::start_step(std::int64_t at) {
  if (STEPTRACE_UNLIKELY(has_backends_)) prepare_backends_step();
  if (STEPTRACE_UNLIKELY(parts_.host_readings != nullptr &&
                         stepping_thread_ != this_thread_token())) {
    watch_this_thread();
  }
  const std::int64_t now = now_ns();
  std::int64_t start = now;
  if (at != kUnset) {
    start = std::min(at, now);
    if (last_step_end_ns_ != kUnset) start = std::max(start, last_step_end_ns_);
  }
  current_.step = step_index_++;
  current_.start_unix_ns = unix_ns_at(start);
  if (open_interval_ >= 0) {  // a step ends the interval before it
    if (at != kUnset && interval_start_ns_ >= start) {
      drop_open_interval();
    } else {
      end_open_interval(start);
    }
  }
  // The gap since the previous step: the loader's waits (data only when the loader is
  // wrapped), the intervals ended in it, and the rest (other host work).
  current_.data_ns = data_wrapped_ ? data_accum_ns_ : 0;
  current_.data_start_ns = data_wrapped_ ? data_start_accum_ns_ : 0;
  current_.compile_ns = 0;
  current_.gc_count = 0;
  if (STEPTRACE_UNLIKELY(gc_.pending())) {  // collections in the gap before the step
    gc_.take(current_.gc_between_ns, current_.gc_count);
  } else {
    current_.gc_between_ns = {};
  }
  current_.progress = next_progress_;
  if (next_progress_ >= 0) ++next_progress_;
  if (pending_.listed == 0 && pending_.unlisted == 0) {
    // Nothing ended since the last step (the usual case): reset the sums, and leave the
    // list's entries, which nothing reads past `listed`, untouched (two cold lines fewer).
    current_.between.interval_ns = {};
    current_.between.inside_step_ns = 0;
    current_.between.listed = 0;
    current_.between.unlisted = 0;
  } else {
    current_.between = pending_;
    pending_ = BetweenSteps{};
  }
  const std::int64_t gap = last_step_end_ns_ == kUnset ? 0 : start - last_step_end_ns_;
  current_.between.other_ns =
      std::max<std::int64_t>(0, gap - current_.data_ns - current_.between.own_kinds_ns());
  book_.phase_count = 0;
  current_.failed = false;
  current_.profiled = false;
  current_.phase_memory = parts_.detection && parts_.detection->wants_phase_memory();
  book_.phase_memory = current_.phase_memory;
  if (STEPTRACE_UNLIKELY(current_.phase_memory)) current_.memory_at_start = attribution_level();
  ended_phases_ = 0;
  step_start_ns_ = start;
  book_.in_step = true;
  current_.activity_begin_ns = -1;  // no kernels for this step
  current_.telemetry_begin_ns = -1;
  if (STEPTRACE_UNLIKELY(has_backends_)) {
    begin_backends_step();
    if (at != kUnset && book_.on_device) parts_.device->add_host_step_ns(now - start);
  }
  inflight_.start_ns.store(start, std::memory_order_relaxed);
  inflight_.excluded_ns.store(0, std::memory_order_relaxed);
  inflight_.gc_ns.store(0, std::memory_order_relaxed);
  inflight_.step.store(current_.step, std::memory_order_release);
}

[[gnu::hot]] void StepRecorder::begin_step() { start_step(kUnset); }

void StepRecorder::begin_step_at(std::int64_t start_ns) { start_step(start_ns); }

void StepRecorder::add_phase(PhaseId id, std::int64_t begin_ns, std::int64_t end_ns) {
  check_known_phase(id);
  STEPTRACE_CHECK(book_.in_step, UsageError,
                  "phase {:?} added outside a step; add phases inside a step",
                  parts_.names->name(id));
  int slot = book_.slot_of[id];  // NOLINT(bugprone-signed-char-misuse): as in begin_phase
  STEPTRACE_CHECK(slot < 0 || book_.start_ns[slot] == kUnset, UsageError,
                  "phase {:?} added while it is running", parts_.names->name(id));
  STEPTRACE_CHECK(begin_ns <= end_ns, UsageError,
                  "phase {:?} added with its end ({}) before its begin ({})",
                  parts_.names->name(id), end_ns, begin_ns);
  const std::int64_t now = now_ns();
  const std::int64_t begin = std::clamp(begin_ns, step_start_ns_, now);
  const std::int64_t end = std::clamp(end_ns, begin, now);
  if (slot < 0) slot = new_slot(id);
  book_.elapsed_ns[slot] += end - begin;
  if (book_.on_device) {
    parts_.device->add_host_phase_ns(static_cast<std::uint16_t>(slot), end - begin);
  }
  if (book_.phase_memory) note_phase_memory(slot);
}

void StepRecorder::prepare_backends_step() {
  if (parts_.device) {
    parts_.device->poll(*parts_.writer);
    report_device_failure();
    DeviceStream stream;
    if (parts_.stream_source && parts_.stream_source->current(&stream)) {
      parts_.device->set_stream(stream);
    } else if (parts_.stream_source) {
      parts_.device->clear_stream();
    }
  }
  book_.on_device = parts_.device && parts_.device->usable();
}

void StepRecorder::begin_backends_step() noexcept {
  if (book_.on_device) parts_.device->begin_step();
  if (parts_.activity && !activity_yielding_.load(std::memory_order_relaxed)) {
    current_.activity_begin_ns = parts_.activity->now_ns();
    parts_.activity->begin_step(current_.step);
  }
  if (parts_.sampler) {
    const bool sampled =
        current_.step % parts_.config->counter_every < parts_.config->counter_burst;
    parts_.sampler->begin_step(current_.step, sampled);
    current_.counters_sampled = sampled;
    current_.sampler_begin_ns = sampled ? parts_.sampler->now_ns() : -1;
  }
  if (parts_.telemetry) current_.telemetry_begin_ns = parts_.telemetry->now_ns();
}

[[gnu::hot]] void StepRecorder::end_step(bool failed) {
  STEPTRACE_CHECK(book_.in_step, UsageError,
                  "end of a step without its start (no step is running)");
  if (STEPTRACE_UNLIKELY(compile_begin_ns_ != kUnset)) end_compile();  // (a compile that raised)
  const std::int64_t now = now_ns();
  const std::uint8_t phases = book_.phase_count;
  for (std::uint8_t i = 0; i < phases; ++i) {
    if (book_.start_ns[i] != kUnset) close_phase(i, now);  // phases left open end here
    book_.slot_of[book_.id_of[i]] = -1;
    current_.phase_ids[i] = book_.id_of[i];
    current_.phase_ns[i] = book_.elapsed_ns[i];
    current_.host_phase_ns[i] = book_.elapsed_ns[i];
  }
  current_.phase_count = phases;
  current_.step_ns = now - step_start_ns_;
  current_.host_ns = current_.step_ns;
  current_.comm = collectives_.take();
  if (STEPTRACE_UNLIKELY(gc_.pending())) {  // collections in the step (a whole one, if it ended)
    gc_.take(current_.gc_ns, current_.gc_count);
  } else {
    current_.gc_ns = {};
  }
  current_.failed = failed;
  current_.rss_fresh = false;
  current_.runq_ns = -1;
  current_.on_cpu_ns = -1;
  current_.steal_ns = -1;
  // The run queue is read every 10 ms, and at every iteration much longer than the recent
  // ones, so that a slow step always has the figure that tells contention from the model.
  const std::int64_t iteration =
      last_step_end_ns_ == kUnset ? current_.step_ns : now - last_step_end_ns_;
  // An iteration the slow-step rule may call slow (over regression_threshold x the recent
  // level and min_excess_ms above it).
  const double excess_ns = static_cast<double>(iteration - iteration_ewma_ns_);
  const bool may_be_slow =
      iteration_ewma_ns_ > 0 &&
      static_cast<double>(iteration) > slow_ratio_ * static_cast<double>(iteration_ewma_ns_) &&
      excess_ns >= slow_excess_ns_;
  const bool long_iteration =
      may_be_slow || (iteration_ewma_ns_ > 0 && iteration > 2 * iteration_ewma_ns_);
  // one long iteration moves the average a little, a lasting slowdown becomes its level
  iteration_ewma_ns_ =
      iteration_ewma_ns_ == 0
          ? iteration
          : iteration_ewma_ns_ +
                (std::min(iteration, 4 * iteration_ewma_ns_) - iteration_ewma_ns_) / 16;
  if (STEPTRACE_UNLIKELY(now >= next_source_read_ns_)) read_memory_sources(now);
  if (parts_.host_readings != nullptr) {
    // The watchdog's 10 ms readings; a long iteration reads its own run queue below, up
    // to its end (a reading of the watchdog's from before then is left, older than it).
    take_host_readings(/*run_queue=*/!long_iteration);
  }
  // Only on the host clock: on another (a test's fake clock) the run queue's host time could
  // not be compared with the steps' times, and a real wait would judge a step.
  if (STEPTRACE_UNLIKELY(
          parts_.host_clock &&
          (long_iteration || (parts_.host_readings == nullptr &&
                              now - runq_read_ns_ >= HostReadings::kRunQueueIntervalNs)))) {
    read_run_queue(now, may_be_slow, excess_ns);
  }
  current_.memory = sources_sample_;  // the last figures of each, held between readings
  if (parts_.heap) parts_.heap->sample(current_.step, current_.memory);
  if (STEPTRACE_UNLIKELY(external_memory_set_)) {
    merge_memory_sample(current_.memory, external_memory_);
    external_memory_ = MemorySample{};
    external_memory_set_ = false;
  }
  if (STEPTRACE_UNLIKELY(has_backends_)) end_backends_step();
  if (flops_per_step_ > 0) current_.work.add(-1, -1, flops_per_step_, WorkSource::kOption);
  current_.work.peak_flops_per_s = peak_flops_per_s_.load(std::memory_order_relaxed);
  if (book_.on_device) {
    parts_.device->end_step(current_, *parts_.writer);  // written once its events have completed
    report_device_failure();
  } else {
    parts_.writer->push_step_record(current_);
  }
  clear_step_values();  // values and work from now on belong to the next step
  // The next step's gap starts where this step ended: the bookkeeping above (memory reads,
  // slow only when preempted) is the next gap's `other`, so every second is accounted.
  last_step_end_ns_ = now;
  if (STEPTRACE_UNLIKELY(now >= book_.tsc.next_anchor_ns())) anchor_tsc();
  data_accum_ns_ = 0;
  data_start_accum_ns_ = 0;
  data_wrapped_ = false;
  book_.in_step = false;
  book_.active_depth = 0;
  inflight_.phase.store(-1, std::memory_order_relaxed);
  inflight_.last_done_ns.store(current_.host_ns, std::memory_order_relaxed);
  inflight_.last_done_step.store(current_.step, std::memory_order_relaxed);
  inflight_.step.store(-1, std::memory_order_release);
}

void StepRecorder::anchor_tsc() noexcept {
  std::uint64_t tsc = 0;
  std::int64_t ns = 0;
  // no tight pair (preempted in every try): the next step's end tries again
  if (read_tsc_pair(&tsc, &ns)) book_.tsc.anchor(tsc, ns);
}

// The thread's run-queue wait and CPU time since the last reading (and steal, where the
// host reports it); see end_step for when.
void StepRecorder::read_run_queue(std::int64_t now, bool may_be_slow, double excess_ns) noexcept {
  use_run_queue_reading(now, run_queue_.read(), may_be_slow, excess_ns);
}

void StepRecorder::take_host_memory() noexcept {
  if (!parts_.host_readings->take_memory(&host_memory_seen_, &host_memory_)) return;
  current_.rss_fresh = current_.rss_fresh || host_memory_.rss_bytes >= 0;
  merge_sources();
}

void StepRecorder::take_host_run_queue() noexcept {
  std::int64_t at = 0;
  SchedStat sched;
  if (parts_.host_readings->take_run_queue(&host_runq_seen_, &at, &sched) && at > runq_read_ns_) {
    use_run_queue_reading(at, sched, /*may_be_slow=*/false, 0);
  }
}

void StepRecorder::watch_this_thread() noexcept {
  stepping_thread_ = this_thread_token();
  clockid_t cpu_clock = CLOCK_THREAD_CPUTIME_ID;
  if (pthread_getcpuclockid(pthread_self(), &cpu_clock) != 0) return;
  parts_.host_readings->watch_thread(static_cast<long>(::syscall(SYS_gettid)), cpu_clock);
}

void StepRecorder::use_run_queue_reading(std::int64_t now, const SchedStat& sched, bool may_be_slow,
                                         double excess_ns) noexcept {
  const bool spanned = sched.wait_ns >= 0 && runq_read_ns_ != kUnset;
  std::int64_t off_cpu = 0;  // neither on a CPU nor waiting for one: all steal can be
  if (spanned) {
    current_.runq_ns = std::max<std::int64_t>(0, sched.wait_ns - runq_sched_.wait_ns);
    current_.runq_span_ns = now - runq_read_ns_;
    current_.on_cpu_ns = std::max<std::int64_t>(0, sched.on_cpu_ns - runq_sched_.on_cpu_ns);
    off_cpu =
        std::max<std::int64_t>(0, current_.runq_span_ns - current_.on_cpu_ns - current_.runq_ns);
  }
  // The watchdog reads steal only every 100 ms while it does not move (StealCadence), so
  // a possibly slow step reads it here, at ~12 us next to its >= 2 ms excess: the first
  // stolen step after a quiet spell must not go without its figure. Only where a
  // quarter of the excess was off a CPU: steal is at most that time (stolen time is
  // left out of the thread's CPU time), and a slow step with less is not the host's
  // (host_contention needs half the excess); an iteration that ran other work on the
  // CPU (an evaluation, logging) reads nothing.
  if (may_be_slow && (!spanned || static_cast<double>(off_cpu) >= 0.25 * excess_ns)) {
    parts_.watchdog->refresh_steal();
  }
  const std::int64_t steal = parts_.watchdog->steal_total_ns();
  // what the host took can only be time this thread was off a CPU
  if (spanned && parts_.watchdog->samples_steal()) {
    current_.steal_ns = std::min(off_cpu, std::max<std::int64_t>(0, steal - runq_steal_ns_));
  }
  runq_sched_ = sched;
  runq_steal_ns_ = steal;
  runq_read_ns_ = now;
}

void StepRecorder::end_backends_step() noexcept {
  if (parts_.telemetry) {  // device-wide memory at the sampler's latest reading: no driver call;
    MemorySample device;   // fresher than the Python hook's (at most once a second)
    if (parts_.telemetry->device_memory(&device.device_used_bytes, &device.device_total_bytes)) {
      merge_memory_sample(current_.memory, device);
    }
  }
  if (current_.activity_begin_ns >= 0) {
    parts_.activity->end_step(current_.step);
    current_.activity_end_ns = parts_.activity->now_ns();
  }
  if (parts_.sampler) {
    parts_.sampler->end_step(current_.step);
    if (current_.counters_sampled) current_.sampler_end_ns = parts_.sampler->now_ns();
  }
  if (parts_.telemetry) current_.telemetry_end_ns = parts_.telemetry->now_ns();
}

void StepRecorder::begin_interval(IntervalKind kind) {
  const std::int64_t now = now_ns();
  STEPTRACE_CHECK(open_interval_ != static_cast<int>(kind), UsageError,
                  "interval {:?} begun while it is already open; intervals do not nest",
                  interval_name(kind));
  if (open_interval_ >= 0) end_open_interval(now);  // one interval at a time
  if (data_begin_ns_ != kUnset) {  // a data wait in progress pauses: the interval is not data
    data_accum_ns_ += now - data_begin_ns_;
    data_begin_ns_ = kUnset;
    data_suspended_ = true;
  }
  open_interval_ = static_cast<int>(kind);
  interval_start_ns_ = now;
  interval_in_step_ = book_.in_step;
  // for the watchdog (interval_hang): everything else before the kind, which publishes
  inflight_.interval_start_ns.store(now, std::memory_order_relaxed);
  inflight_.interval_step.store(step_index_, std::memory_order_relaxed);
  inflight_.interval_seq.fetch_add(1, std::memory_order_relaxed);
  inflight_.interval.store(open_interval_, std::memory_order_release);
}

// Reads the memory sources whose interval has passed (RSS: 10 ms), and schedules the
// next read for the earliest of them: the steps in between check one time.
void StepRecorder::read_memory_sources(std::int64_t now) noexcept {
  const auto& sources = *parts_.memory_sources;
  std::int64_t next = INT64_MAX;
  for (std::size_t i = 0; i < sources.size(); ++i) {
    const std::int64_t interval = sources[i]->min_interval_ns();
    if (now - source_sampled_ns_[i] >= interval) {
      source_samples_[i] = MemorySample{};
      sources[i]->sample(source_samples_[i]);
      source_sampled_ns_[i] = now;
      current_.rss_fresh = current_.rss_fresh || source_samples_[i].rss_bytes >= 0;
    }
    next = std::min(next, source_sampled_ns_[i] + interval);
  }
  next_source_read_ns_ = next;
  merge_sources();
}

void StepRecorder::merge_sources() noexcept {
  sources_sample_ = host_memory_;  // the training thread's sources first in the merge
  for (const MemorySample& s : source_samples_) merge_memory_sample(sources_sample_, s);
}

// Forgets the open interval (end_open_interval accounts it first): a step begun at or
// before its start (begin_step_at) makes it empty.
void StepRecorder::drop_open_interval() noexcept {
  open_interval_ = -1;
  inflight_.interval.store(-1, std::memory_order_release);
}

// Ends the open interval at `now`: into the step in progress when it began inside it,
// else into the next step's account of the gap (pending_).
void StepRecorder::end_open_interval(std::int64_t now) noexcept {
  const auto kind = static_cast<IntervalKind>(open_interval_);
  drop_open_interval();
  if (data_suspended_) {  // the data wait the interval paused goes on
    data_suspended_ = false;
    data_begin_ns_ = now;
  }
  const bool inside = interval_in_step_ && book_.in_step;
  BetweenSteps& into = inside ? current_.between : pending_;
  const std::int64_t duration = now - interval_start_ns_;
  auto& longest = inflight_.longest_interval_ns[static_cast<std::size_t>(kind)];
  if (duration > longest.load(std::memory_order_relaxed)) {
    longest.store(duration, std::memory_order_relaxed);
  }
  into.interval_ns[static_cast<std::size_t>(kind)] += duration;
  if (inside && kind != IntervalKind::kOther) {  // other host work inside a step is the step's
    into.inside_step_ns += duration;             // (`into` is the step's own account here)
    publish_excluded();
  }
  if (into.listed < kMaxStepIntervals) {
    into.intervals[into.listed++] =
        IntervalEntry{kind, inside, unix_ns_at(interval_start_ns_), duration};
  } else {
    ++into.unlisted;
  }
}

// Once: the device timer failed, so say so in the log and carry on with the host clock.
void StepRecorder::report_device_failure() {
  if (device_failure_reported_ || parts_.device->failure().empty()) return;
  device_failure_reported_ = true;
  AlertEvent a;
  a.type = "timer_fallback";
  a.step = std::max<std::int64_t>(parts_.device->failed_at_step(), 0);
  a.value = 0;
  a.threshold = 0;
  a.message = fmt::format(
      "CUDA event timing stopped at step {} ({}); this step and the ones after it use "
      "the host clock",
      a.step, parts_.device->failure());
  a.details = {{"reason", parts_.device->failure()}};
  a.unix_ns = unix_ns_at(now_ns());
  raise_alert(*parts_.writer, *parts_.alerts, a, parts_.config->rank);
}

// The level phase attribution follows (only for a few steps after a memory_growth
// alert): the first source's live bytes, the torch allocator's before the C heap's.
// RSS would not do: the heap rarely gives memory back, so RSS rises where the
// high-water mark is crossed, not where a leak is.
std::int64_t StepRecorder::attribution_level() noexcept {
  for (MemorySource* source : *parts_.memory_sources) {
    const std::int64_t live = source->live_bytes();
    if (live >= 0) return live;
  }
  if (parts_.heap) return parts_.heap->read_now();
  return 0;  // no live figure: every phase retains nothing
}

std::int64_t StepRecorder::collective_begin() noexcept {
  const std::int64_t now = parts_.clock->now_ns();
  collectives_.begin(now);
  return now;
}

void StepRecorder::collective_end(std::int64_t begin_ns, bool host_blocked, std::int64_t bytes,
                                  std::int64_t bus_bytes) noexcept {
  collectives_.end(begin_ns, parts_.clock->now_ns(),
                   inflight_.phase.load(std::memory_order_relaxed), host_blocked, bytes, bus_bytes,
                   inflight_.step.load(std::memory_order_relaxed) < 0);
}

void StepRecorder::begin_gc(int generation) noexcept {
  gc_.begin(generation, parts_.clock->now_ns());
  inflight_.collecting.store(true, std::memory_order_relaxed);
}

void StepRecorder::end_gc() noexcept {
  const std::int64_t took = gc_.end(parts_.clock->now_ns());
  inflight_.gc_ns.fetch_add(took, std::memory_order_relaxed);
  // release: a watchdog that sees the collection over sees its time left out too
  inflight_.collecting.store(false, std::memory_order_release);
}

void StepRecorder::raise_hardware_alert(const HardwareError& e) noexcept {
  try {
    AlertEvent a = hardware_alert(e, parts_.telemetry->device());
    a.step = std::max<std::int64_t>(inflight_.last_done_step.load(std::memory_order_relaxed), 0);
    a.unix_ns = unix_ns_at(parts_.clock->now_ns());
    raise_alert(*parts_.writer, *parts_.alerts, a, parts_.config->rank);
  } catch (...) {
  }
}

std::string StepRecorder::current_phase() const {
  const int phase = inflight_.phase.load(std::memory_order_relaxed);
  return phase >= 0 ? parts_.names->name(static_cast<PhaseId>(phase)) : std::string();
}

std::string StepRecorder::current_interval() const {
  const int kind = inflight_.interval.load(std::memory_order_relaxed);
  return kind >= 0 ? std::string(interval_name(static_cast<IntervalKind>(kind))) : std::string();
}

}  // namespace steptrace::detail
