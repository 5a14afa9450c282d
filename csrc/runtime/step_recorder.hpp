// The training thread's account of its steps: the step state machine (steps, phases, data
// waits, intervals, step values) that fills one StepRecord per step and hands it to the
// writer, and what it publishes for the watchdog (InflightState). The lifecycle checks
// (closed, detached, forked) are the profiler's; it calls in here only while recording.
// What runs per phase is defined here, in the header, so that it inlines into the
// profiler's entry points as it did before the split.
#pragma once

#include <pthread.h>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../backends/host/monotonic_clock.hpp"
#include "../backends/host/tsc_clock.hpp"
#include "../core/check.hpp"
#include "../core/collective_timer.hpp"
#include "../core/device_timing.hpp"
#include "../core/gc_pauses.hpp"
#include "../core/host/heap_sampler.hpp"
#include "../core/host/run_queue.hpp"
#include "../core/step_record.hpp"
#include "../core/this_thread.hpp"
#include "../core/host/host_readings.hpp"
#include "run_environment.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/error.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/ext/telemetry.hpp"
#include "steptrace/interval.hpp"
#include "steptrace/profiler.hpp"
#include "watchdog.hpp"

namespace steptrace::detail {

class AlertLog;
class DetectionStage;
class RecordPipeline;

class StepRecorder {
 public:
  // What the recorder reads and feeds; the profiler owns all of it, and it outlives the
  // recorder's use (null: that backend is absent).
  struct Parts {
    const Config* config = nullptr;
    const PhaseNames* names = nullptr;
    Clock* clock = nullptr;
    StreamSource* stream_source = nullptr;
    DeviceTiming* device = nullptr;
    KernelActivitySource* activity = nullptr;
    CounterSampler* sampler = nullptr;
    TelemetrySource* telemetry = nullptr;
    DetectionStage* detection = nullptr;
    const std::vector<MemorySource*>* memory_sources = nullptr;  // read here, at a step's end
    HostReadings* host_readings = nullptr;  // the watchdog's readings; null: all read here
    HeapSampler* heap = nullptr;
    RecordPipeline* writer = nullptr;
    AlertLog* alerts = nullptr;
    Watchdog* watchdog = nullptr;  // its steal total (refreshed on a possibly slow step)
    ClockMapping start;
    bool host_clock = false;     // `clock` is the host's monotonic clock: read it inline
    bool counter_clock = false;  // ... from the CPU's counter (tsc_clock.hpp)
  };

  StepRecorder() {
    book_.slot_of.fill(-1);
    book_.start_ns.fill(kUnset);
    value_slot_.fill(-1);
  }
  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;

  // Before the first step, once the writer exists.
  void bind(const Parts& parts);

  // UsageError where a step cannot begin now (checked before the step is entered).
  void check_can_begin() const {
    STEPTRACE_CHECK(!book_.in_step, UsageError,
                    "step begun while step {} is still running; end it before the next begins",
                    current_.step);
    STEPTRACE_CHECK(data_begin_ns_ == kUnset && !data_suspended_, UsageError,
                    "step begun while waiting on the data loader (begin_data without end_data)");
  }
  void begin_step();
  // A step that began at `start_ns` (now_ns()'s clock), for a caller that learns only
  // afterwards that the time since then was training (a forward in eval mode with
  // gradients that a backward follows): clamped to [the previous step's end, now]. The
  // open interval ends there, or is dropped when it began there or later (it held nothing).
  void begin_step_at(std::int64_t start_ns);
  void end_step(bool failed);
  // A phase of the step in progress that ran from begin_ns to end_ns (clamped to the
  // step's start and now), added to the phase's time: the host's, as no device event
  // brackets it. UsageError outside a step or while that phase runs.
  void add_phase(PhaseId id, std::int64_t begin_ns, std::int64_t end_ns);
  // The clock steps and phases are timed with. Training thread.
  std::int64_t clock_ns() const noexcept { return now_ns(); }

  // A phase boundary touches the phase book's lines, the clock and the watchdog's line,
  // nothing else: after a training step every line is a cache miss (issue 30).
  [[gnu::hot]] void begin_phase(PhaseId id) {
    check_known_phase(id);
    STEPTRACE_CHECK(book_.in_step, UsageError,
                    "phase {:?} started outside a step; start phases inside a step",
                    parts_.names->name(id));
    int slot = book_.slot_of[id];  // NOLINT(bugprone-signed-char-misuse): a slot, -1 for none
    STEPTRACE_CHECK(slot < 0 || book_.start_ns[slot] == kUnset, UsageError,
                    "phase {:?} started while it is already running; a phase cannot be "
                    "nested in itself",
                    parts_.names->name(id));
    const std::int64_t now = now_ns();
    if (slot < 0) slot = new_slot(id);
    book_.active[book_.active_depth++] = static_cast<std::uint8_t>(slot);
    inflight_.phase.store(id, std::memory_order_relaxed);
    book_.start_ns[slot] = now;
    if (book_.on_device) parts_.device->begin_phase(static_cast<std::uint16_t>(slot));
  }

  [[gnu::hot]] void end_phase(PhaseId id) {
    check_known_phase(id);
    const int slot = book_.slot_of[id];  // NOLINT(bugprone-signed-char-misuse): as in begin_phase
    STEPTRACE_CHECK(book_.in_step && slot >= 0 && book_.start_ns[slot] != kUnset, UsageError,
                    "end of phase {:?} without its start", parts_.names->name(id));
    close_phase(slot, now_ns());
  }

  [[gnu::hot]] void begin_data() {
    if (book_.in_step) {
      // The loader advanced inside a step (e.g. a nested next()): that wait is part of the
      // step, not data. Counted in run_end, never thrown into the training loop.
      data_inside_step_.fetch_add(1, std::memory_order_relaxed);
      data_ignored_ = true;
      return;
    }
    if (open_interval_ >= 0) {  // an evaluation's own loader: part of the interval, not data
      data_ignored_ = true;
      return;
    }
    STEPTRACE_CHECK(data_begin_ns_ == kUnset, UsageError,
                    "begin_data called twice without end_data");
    data_begin_ns_ = now_ns();
  }

  [[gnu::hot]] void end_data(bool loader_start) {
    if (data_ignored_) {
      data_ignored_ = false;
      return;
    }
    if (data_suspended_) {  // the wait was cut short by an interval (counted up to it)
      data_suspended_ = false;
      data_wrapped_ = true;
      return;
    }
    STEPTRACE_CHECK(data_begin_ns_ != kUnset, UsageError, "end_data without begin_data");
    const std::int64_t waited = now_ns() - data_begin_ns_;
    data_accum_ns_ += waited;
    if (loader_start) data_start_accum_ns_ += waited;
    data_begin_ns_ = kUnset;
    data_wrapped_ = true;
  }

  // Compiling inside the step in progress (torch.compile's callbacks); nothing outside a
  // step. Its time is the step's and compile_ns; the hang clock stops while it runs.
  void begin_compile() noexcept {
    if (!book_.in_step || compile_begin_ns_ != kUnset) return;
    compile_begin_ns_ = now_ns();
    inflight_.compiling.store(true, std::memory_order_relaxed);
  }
  void end_compile() noexcept {
    if (compile_begin_ns_ == kUnset) return;
    current_.compile_ns += now_ns() - compile_begin_ns_;
    compile_begin_ns_ = kUnset;
    publish_excluded();
    inflight_.compiling.store(false, std::memory_order_relaxed);
  }
  // For the watchdog: the step's time that is not training work so far (intervals and
  // compiles inside it), which its hang clock leaves out.
  void publish_excluded() noexcept {
    inflight_.excluded_ns.store(current_.between.inside_step_ns + current_.compile_ns,
                                std::memory_order_relaxed);
  }

  void begin_interval(IntervalKind kind);
  void end_interval(IntervalKind kind) {
    if (open_interval_ != static_cast<int>(kind)) return;
    end_open_interval(now_ns());
  }

  std::optional<IntervalKind> open_interval() const noexcept {
    if (open_interval_ < 0) return std::nullopt;
    return static_cast<IntervalKind>(open_interval_);
  }

  void set_step_memory(const MemorySample& s) {
    merge_memory_sample(external_memory_, s);
    external_memory_set_ = true;
  }

  // At close: the interval still open ends now.
  void end_open_interval_now() noexcept {
    if (open_interval_ >= 0) end_open_interval(now_ns());
  }

  // The training step the program is at (0-based: the steps it completed before), for the
  // step in progress (between steps: the next one); the steps after it count on by one.
  void set_progress(std::int64_t progress) noexcept {
    if (book_.in_step) {
      current_.progress = progress;
      ++progress;
    }
    next_progress_ = progress;
  }

  void set_step_value(StepValueId id, double value) {
    STEPTRACE_CHECK(id < parts_.names->value_count(), UsageError,
                    "step value id {} was never interned", id);
    std::int8_t& slot = value_slot_[id];
    if (slot < 0) {  // one slot per interned name: a step cannot run out of them
      slot = static_cast<std::int8_t>(current_.value_count++);
      current_.value_ids[static_cast<std::size_t>(slot)] = id;
    }
    current_.values[static_cast<std::size_t>(slot)] = value;
  }

  // Work of the step in progress (between steps: of the next one); see WorkCount.
  void add_work(double samples, double tokens, double flops, WorkSource from) noexcept {
    current_.work.add(samples, tokens, flops, from);
  }
  // The peak MFU divides by, from the next step on (0: none). Any thread.
  void set_peak_flops(double flops_per_s) noexcept {
    peak_flops_per_s_.store(flops_per_s, std::memory_order_relaxed);
  }

  void set_activity_yielding(bool yielding) noexcept {
    activity_yielding_.store(yielding, std::memory_order_relaxed);
  }
  // Once: the device timer failed, so say so in the log and carry on with the host clock.
  void report_device_failure();

  // UsageError for an id the phase names never gave out.
  void check_phase_id(PhaseId id) const {
    STEPTRACE_CHECK(id < parts_.names->size(), UsageError, "phase id {} was never interned", id);
  }
  bool in_step() const noexcept { return book_.in_step; }
  /// The step in progress runs under an evidence capture (Profiler::mark_step_profiled).
  void mark_profiled() noexcept {
    if (book_.in_step) current_.profiled = true;
  }
  bool in_phase() const noexcept { return book_.active_depth > 0; }
  std::int64_t step_index() const noexcept { return step_index_; }
  // Intervals ended since the last step (run_end's trailing ones).
  const BetweenSteps& pending() const noexcept { return pending_; }
  std::int64_t data_inside_step() const noexcept {
    return data_inside_step_.load(std::memory_order_relaxed);
  }
  // Python's garbage collections (gc.callbacks): any thread, under the GIL.
  GcPauses& gc_pauses() noexcept { return gc_; }
  InflightState& inflight() noexcept { return inflight_; }
  const InflightState& inflight() const noexcept { return inflight_; }
  CollectiveTimer& collectives() noexcept { return collectives_; }
  const CollectiveTimer& collectives() const noexcept { return collectives_; }

  // ---- from any thread (Python's comm hooks and watchers), on the run's clock ----
  // A collective's begin (its token) and end, placed in the phase and step in flight.
  std::int64_t collective_begin() noexcept;
  void collective_end(std::int64_t begin_ns, bool host_blocked, std::int64_t bytes,
                      std::int64_t bus_bytes) noexcept;
  // Python's collections (gc.callbacks, under the GIL): the watchdog's hang clock stops
  // while the collector runs and leaves its time out.
  void begin_gc(int generation) noexcept;
  void end_gc() noexcept;
  // NVML's sampler thread: an XID or a new uncorrectable ECC error is page-worthy, raised
  // at once with the last finished step; never throws (into NVML's or the sampler's stack).
  void raise_hardware_alert(const HardwareError& e) noexcept;
  // The phase / interval in flight ("" : none).
  std::string current_phase() const;
  std::string current_interval() const;

 private:
  static constexpr std::int64_t kUnset = -1;

  std::int64_t unix_ns_at(std::int64_t clock_ns) const noexcept {
    return parts_.start.unix_ns_at(clock_ns);
  }
  void clear_step_values() noexcept {
    for (std::uint8_t i = 0; i < current_.value_count; ++i) value_slot_[current_.value_ids[i]] = -1;
    current_.value_count = 0;
    current_.work = WorkCount{};
  }
  // Ends the open interval at `now`: into the step in progress when it began inside it,
  // else into the next step's account of the gap (pending_).
  void end_open_interval(std::int64_t now) noexcept;
  // Out of the step's straight line (see begin_step): every 10 ms, or never on the CPU.
  [[gnu::cold, gnu::noinline]] void read_memory_sources(std::int64_t now) noexcept;
  [[gnu::cold, gnu::noinline]] void read_run_queue(std::int64_t now, bool may_be_slow,
                                                   double excess_ns) noexcept;
  // A run-queue reading taken at `at` (here or by the watchdog) into the step's figures.
  void use_run_queue_reading(std::int64_t at, const SchedStat& sched, bool may_be_slow,
                             double excess_ns) noexcept;
  // The watchdog's readings at a step's end (HostReadings): one line checked, read only
  // when a new one was published (every 10 ms).
  void take_host_readings(bool run_queue) noexcept {
    HostReadings& host = *parts_.host_readings;
    if (STEPTRACE_UNLIKELY(host.has_memory_since(host_memory_seen_))) take_host_memory();
    if (STEPTRACE_UNLIKELY(run_queue && host.has_run_queue_since(host_runq_seen_))) {
      take_host_run_queue();
    }
  }
  [[gnu::cold, gnu::noinline]] void take_host_memory() noexcept;
  [[gnu::cold, gnu::noinline]] void take_host_run_queue() noexcept;
  // The watchdog reads the run queue of the thread that runs the steps: told at the first
  // step, and again when the steps move to another thread.
  [[gnu::cold, gnu::noinline]] void watch_this_thread() noexcept;
  // sources_sample_ from each source's last figures and the watchdog's.
  void merge_sources() noexcept;
  [[gnu::noinline]] void prepare_backends_step();
  [[gnu::noinline]] void begin_backends_step() noexcept;
  [[gnu::noinline]] void end_backends_step() noexcept;
  // check_phase_id on the training thread: interned names only grow, so a count cached in
  // the phase book spares the names' lines at every boundary.
  void check_known_phase(PhaseId id) {
    if (id < book_.known_phases) return;
    check_phase_id(id);
    book_.known_phases = static_cast<std::uint16_t>(parts_.names->size());
  }
  std::int64_t now_ns() const noexcept {
    if (STEPTRACE_LIKELY(book_.tsc.calibrated())) return book_.tsc.at(read_tsc());
    return book_.clock != nullptr ? book_.clock->now_ns() : monotonic_now_ns(book_.read_clock);
  }
  // A (counter, kernel clock) pair for the TSC map: its first rate, then its check every
  // second (at a step's end, after the step's own readings).
  [[gnu::cold, gnu::noinline]] void anchor_tsc() noexcept;
  // begin_step's body; `at` kUnset: now (begin_step_at's start otherwise).
  inline void start_step(std::int64_t at);
  void drop_open_interval() noexcept;
  int new_slot(PhaseId id) noexcept {
    const int slot = book_.phase_count++;
    book_.slot_of[id] = static_cast<std::int8_t>(slot);
    book_.id_of[slot] = id;
    book_.elapsed_ns[slot] = 0;
    return slot;
  }
  void note_phase_memory(int slot) noexcept {
    // A phase that runs again ends later: keep its last level and place.
    current_.phase_memory_end[slot] = attribution_level();
    current_.phase_end_order[slot] = static_cast<std::uint8_t>(ended_phases_++);
  }
  void close_phase(int slot, std::int64_t now) noexcept {
    book_.elapsed_ns[slot] += now - book_.start_ns[slot];
    book_.start_ns[slot] = kUnset;
    if (book_.on_device) parts_.device->end_phase(static_cast<std::uint16_t>(slot));
    if (book_.phase_memory) note_phase_memory(slot);
    // Phases usually end innermost first; the explicit API may end them in any order.
    for (std::size_t i = book_.active_depth; i-- > 0;) {
      if (book_.active[i] == slot) {
        for (std::size_t j = i; j + 1 < book_.active_depth; ++j) {
          book_.active[j] = book_.active[j + 1];
        }
        --book_.active_depth;
        break;
      }
    }
    inflight_.phase.store(
        book_.active_depth > 0 ? book_.id_of[book_.active[book_.active_depth - 1]] : -1,
        std::memory_order_relaxed);
  }

  // The level phase attribution follows (only for a few steps after a memory_growth
  // alert); see the definition.
  std::int64_t attribution_level() noexcept;

  // What a phase boundary reads and writes, first and together: lines 1-2 and the first
  // line of each by-slot array for up to 8 phases a step.
  struct alignas(64) PhaseBook {
    Clock* clock = nullptr;  // null: the host's monotonic clock, read through read_clock
    ClockGettime read_clock = &::clock_gettime;  // the vDSO's once bound
    bool in_step = false;
    bool on_device = false;     // the step in progress records device events
    bool phase_memory = false;  // current_.phase_memory
    std::uint8_t phase_count = 0;
    std::uint8_t active_depth = 0;
    std::uint16_t known_phases = 0;  // ids below it were interned
    // The host's clock from the CPU's counter once calibrated (tsc_clock.hpp); until then,
    // and where the counter is not the kernel's clock, read_clock.
    TscMap tsc;
    std::array<std::int8_t, kMaxPhases> slot_of{};    // by phase id; -1: not in this step
    std::array<std::uint8_t, kMaxPhases> active{};    // slots of the running phases, innermost last
    std::array<PhaseId, kMaxPhases> id_of{};          // by slot
    std::array<std::int64_t, kMaxPhases> start_ns{};  // by slot; kUnset: not running
    std::array<std::int64_t, kMaxPhases> elapsed_ns{};  // by slot: this step's time in it
  };
  PhaseBook book_;

  Parts parts_;  // set by bind()
  // What a step's begin and end read and write besides the book, together (the 1.7 KB
  // record and the rarely used state come after): fewer cold lines a step (issue 30).
  std::int64_t next_source_read_ns_ = 0;  // the earliest of the sources' next reads
  std::uint64_t host_memory_seen_ = 0;    // the HostReadings publications taken
  std::uint64_t host_runq_seen_ = 0;
  const void* stepping_thread_ = nullptr;  // the thread host_readings reads the run queue of
  bool external_memory_set_ = false;
  bool has_backends_ = false;  // any of device, activity, sampler, telemetry
  double flops_per_step_ = 0;  // Config::flops_per_step
  std::int64_t step_index_ = 0;
  std::int64_t step_start_ns_ = 0;
  std::int64_t last_step_end_ns_ = kUnset;
  std::int64_t data_begin_ns_ = kUnset;
  std::int64_t data_accum_ns_ = 0;
  // of data_accum_ns_: the loader's iterator started or ended
  std::int64_t data_start_accum_ns_ = 0;
  std::int64_t compile_begin_ns_ = kUnset;  // a compile in progress inside the step
  bool data_wrapped_ = false;
  std::int64_t next_progress_ = -1;     // the next step's progress; -1: never set
  int open_interval_ = -1;              // IntervalKind of the open interval, -1: none
  bool data_suspended_ = false;         // a data wait was open when the interval began
  std::int64_t runq_read_ns_ = kUnset;  // when it was last read, and the figures then
  std::int64_t iteration_ewma_ns_ = 0;  // recent iterations (the gap and the step), smoothed
  // The slow-step rule's ratio and floor (regression_threshold, min_excess_ms), kept beside
  // the average: the step end then touches no line of the Config.
  double slow_ratio_ = 0;
  double slow_excess_ns_ = 0;
  std::size_t ended_phases_ = 0;               // phases ended in this step, for phase_end_order
  std::atomic<double> peak_flops_per_s_{0.0};  // set from any thread, read at each end

  std::vector<MemorySample> source_samples_;     // each source's last figures
  std::vector<std::int64_t> source_sampled_ns_;  // and when they were taken
  MemorySample sources_sample_;                  // all sources' last figures, merged
  MemorySample host_memory_;                     // the watchdog's sources' (HostReadings)
  StepRecord current_;
  MemorySample external_memory_;  // set_step_memory's, for the step in progress
  std::array<std::int8_t, kMaxStepValues> value_slot_{};  // -1: not set for current_
  BetweenSteps pending_;  // intervals ended since the last step ended
  std::int64_t interval_start_ns_ = 0;
  bool interval_in_step_ = false;  // the open interval began inside a step
  RunQueueReader run_queue_;
  SchedStat runq_sched_;
  std::int64_t runq_steal_ns_ = 0;
  bool data_ignored_ = false;  // begin_data came inside a step: its end_data is ignored too
  std::atomic<std::int64_t> data_inside_step_{0};  // read by close() on any thread

  GcPauses gc_;                  // collections since the last step boundary
  InflightState inflight_;       // for the watchdog and the Prometheus scrape
  CollectiveTimer collectives_;  // any thread: collectives timed from the host

  bool device_failure_reported_ = false;
  std::atomic<bool> activity_yielding_{false};  // another profiler has the activity records
};

}  // namespace steptrace::detail
