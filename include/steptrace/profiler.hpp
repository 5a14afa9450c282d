// The profiler: times steps and their phases on the training thread and hands one record
// per step to a background writer, which appends it to <log_dir>/rank<N>.jsonl.
//
// Thread-safety: one training thread drives a Profiler (steps, phases, data waits).
// flush() and close() may be called from any thread. A close() from another thread only
// asks: it waits (at most Config::close_wait_s) for the step in progress to end, then
// closes; the training thread's later steps and phases are not recorded and throw
// nothing. In a forked child the profiler is abandoned: nothing is written, close() and
// the destructor do nothing, steps are not recorded.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/export.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/ext/telemetry.hpp"
#include "steptrace/interval.hpp"
#include "steptrace/work.hpp"

namespace steptrace {

namespace detail {
class ProfilerImpl;
struct ProfilerAccess;  // the bindings' structured entries (csrc/runtime/profiler_access.hpp)
}  // namespace detail

class Profiler;

/// Index of an interned phase name; cheaper than a name in hot loops.
using PhaseId = std::uint16_t;
/// Index of an interned step-value name (Profiler::set_step_value).
using StepValueId = std::uint16_t;

/// Why a run ended, as written in run_end.
enum class EndReason { kNormal, kException, kSignal, kExit };

/// Facts about the process the core cannot know itself (the Python bindings fill it).
struct RunInfo {
  /// Extra entries of run_start's "versions" (e.g. {"python", "3.11.7"}, {"torch", "2.9.1"}).
  std::vector<std::pair<std::string, std::string>> versions;
  /// Another profiler (torch.profiler) collects device activity as the run starts:
  /// kernel activity starts yielded (see Profiler::set_external_profiler).
  bool external_profiler_active = false;
  /// How the program's collectives are timed, for run_start's backends.comm: where they
  /// are, the method (its "method", active "completion"); else `comm_untimed`, why not.
  /// Both empty: no entry (a C++ program times its own with collective_begin / _end).
  std::string comm_method;
  std::string comm_untimed;
};

/// Backends the profiler uses; a null member means the default one.
struct Backends {
  std::unique_ptr<Clock> clock;                               // default: host clock
  std::vector<std::unique_ptr<MemorySource>> memory_sources;  // default: process RSS
  std::unique_ptr<DeviceTimer> device_timer;    // default: CUDA events when clock != "host"
  std::unique_ptr<StreamSource> stream_source;  // default: none (set_stream decides)
  std::unique_ptr<KernelActivitySource> kernel_activity;  // default: CUPTI, on CUDA clocks
  std::unique_ptr<CounterSampler> counter_sampler;        // default: CUPTI PM sampling
  std::unique_ptr<TelemetrySource> telemetry;             // default: NVML, where it loads
};

/// What Profiler::wait_event returns: an alert or resolved record (JSON), a request for
/// the stacks of the program's threads (answer with Profiler::answer_stacks), or one for
/// its last collectives (answer with Profiler::answer_collectives).
struct ProfilerEvent {
  bool stack_request = false;
  std::string json;
  /// A request for the collectives the process launched last, from a hang (answer with
  /// Profiler::answer_collectives).
  bool collectives_request = false;
};

/// RAII scope of one phase: ends it when destroyed. Move-only.
class STEPTRACE_API Phase {
 public:
  Phase(Phase&& other) noexcept;
  Phase& operator=(Phase&&) = delete;
  Phase(const Phase&) = delete;
  Phase& operator=(const Phase&) = delete;
  ~Phase();

 private:
  friend class Profiler;
  Phase(Profiler* profiler, PhaseId id) noexcept : profiler_(profiler), id_(id) {}
  Profiler* profiler_;
  PhaseId id_;
};

/// RAII scope of one step: ends it when destroyed, with status "error" when destroyed
/// by an exception unwinding through it (or after fail()). Move-only.
class STEPTRACE_API Step {
 public:
  Step(Step&& other) noexcept;
  Step& operator=(Step&&) = delete;
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  ~Step();

  /// Starts a phase of this step; it ends when the returned scope is destroyed.
  [[nodiscard]] Phase phase(std::string_view name);
  [[nodiscard]] Phase phase(PhaseId id);
  /// Marks this step as failed ("status": "error").
  void fail() noexcept { failed_ = true; }

 private:
  friend class Profiler;
  explicit Step(Profiler* profiler) noexcept;
  Profiler* profiler_;
  int uncaught_at_start_;
  bool failed_ = false;
};

/// RAII scope of one interval (Profiler::interval): ends it when destroyed. Move-only.
class STEPTRACE_API Interval {
 public:
  Interval(Interval&& other) noexcept;
  Interval& operator=(Interval&&) = delete;
  Interval(const Interval&) = delete;
  Interval& operator=(const Interval&) = delete;
  ~Interval();

 private:
  friend class Profiler;
  Interval(Profiler* profiler, IntervalKind kind) noexcept : profiler_(profiler), kind_(kind) {}
  Profiler* profiler_;
  IntervalKind kind_;
};

class STEPTRACE_API Profiler {
 public:
  /// Validates the config (ConfigError), creates log_dir and the rank's log file, and
  /// writes run_start. Nothing is created when validation fails.
  explicit Profiler(Config config, RunInfo info = {}, Backends backends = {});
  /// Closes with reason kException while an exception unwinds, else kNormal.
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  /// Begins a step; it ends when the returned scope is destroyed.
  [[nodiscard]] Step step();
  /// Starts a phase of the current step by name (see validate_phase_name).
  [[nodiscard]] Phase phase(std::string_view name) { return phase(phase_id(name)); }
  [[nodiscard]] Phase phase(PhaseId id);

  /// Interns a phase name (ConfigError for a bad name or more than kMaxPhases names).
  PhaseId phase_id(std::string_view name);
  /// Name of an interned phase.
  const std::string& phase_name(PhaseId id) const;

  // Explicit calls for loops that cannot nest scopes. All throw UsageError when out of
  // order (but see begin_data) and leave the profiler as it was.
  void begin_step();
  void end_step(bool failed = false);
  void begin_phase(PhaseId id);
  void end_phase(PhaseId id);
  /// For hooks that learn only afterwards that the time since a moment was training (a
  /// forward in eval mode with gradients enabled, which a backward then follows): the
  /// profiler's clock (monotonic nanoseconds, as steps and phases are timed), a step
  /// begun at such a reading (clamped to [the previous step's end, now]; the open interval
  /// ends there, or is dropped when it began there or later), and a phase of the step in
  /// progress that ran between two readings (clamped to the step's start and now; its
  /// time is the host's, as no device event brackets it). Training thread; the UsageErrors
  /// of begin_step, and of begin_phase for a phase that is running.
  std::int64_t clock_ns() const noexcept;
  void begin_step_at(std::int64_t start_ns);
  void add_phase(PhaseId id, std::int64_t begin_ns, std::int64_t end_ns);
  /// Brackets a wait on the data loader between steps; the waits add up to the next
  /// step's data_ms. Without them, data_ms is the gap since the previous step ended.
  /// Inside a step they do not throw: the wait stays part of the step, and the call is
  /// counted (data_inside_step(), run_end's "data_inside_step"). `loader_start`: the
  /// wait started or ended the loader's iterator (an epoch boundary: its workers stopped
  /// or started, or the first batch of a new iterator); it is data_ms and data_start_ms,
  /// which the slow-step, stall and hang rules leave out of the training iteration.
  void begin_data();
  void end_data(bool loader_start = false);
  /// Time outside training work: evaluation, checkpoint saving, other named host work.
  /// An interval's time is its own kind in the next step's record ("between") and in
  /// run_end's goodput, never data, and the slow-step, stall and hang rules leave it out
  /// of the training iteration (also when it runs inside a step; an "other" interval inside
  /// a step stays part of it: host work of the iteration). Each interval is
  /// written as an `interval` record. Intervals do not nest: beginning one while another
  /// is open ends that one; a step beginning ends the open one; end_interval(kind) ends
  /// the open interval when it is of `kind` and does nothing otherwise. Training thread.
  /// Compiling inside the step in progress (a JIT: torch.compile's graph for a new shape,
  /// its lazily compiled backward): part of step_ms and the step's compile_ms, which the
  /// slow-step and stall rules leave out of the training iteration; the hang clock stops
  /// while it runs. Nested calls count once; outside a step they do nothing. Training
  /// thread.
  void begin_compile();
  void end_compile();
  /// Python's garbage collector (gc.callbacks' start and stop) ran a collection of
  /// `generation` (0-2) from now until end_gc: its time is the step's record's `gc` (or
  /// that of the gap before the next step), which the slow-step and stall rules judge as
  /// gc_pause and the waste account as the gc cause. Any thread (a collection stops every
  /// Python thread); collections do not overlap. No allocation, no lock.
  void begin_gc(int generation) noexcept;
  void end_gc() noexcept;
  [[nodiscard]] Interval interval(IntervalKind kind);
  void begin_interval(IntervalKind kind);
  void end_interval(IntervalKind kind);
  /// The kind of the open interval, if any. Training thread.
  std::optional<IntervalKind> open_interval() const noexcept;

  /// Times begin_data was called inside a step (a wrapped loader advanced there). Any thread.
  std::int64_t data_inside_step() const noexcept;

  /// The stream device events are recorded on from the next step on: a CUstream /
  /// cudaStream_t as an integer (torch.cuda.current_stream(device).cuda_stream) and the
  /// CUDA device it belongs to (-1: the training thread's current context decides, which
  /// only matters for the default streams 0, 1 and 2). A step's events all go on the
  /// stream set when it began; work on other streams is in the step's times only where
  /// joined to it. Without a stream, steps use the host clock.
  void set_stream(std::uintptr_t stream, int device = -1) noexcept;
  void clear_stream() noexcept;
  /// Another profiler (torch.profiler / Kineto) starts (true) or stops (false) collecting
  /// device activity: steptrace's kernel activity yields to it meanwhile (CUPTI's
  /// activity buffers are process-wide). Any thread.
  void set_external_profiler(bool active) noexcept;
  /// The step in progress runs under an evidence capture (torch.profiler started and stopped
  /// in it by steptrace.live.evidence_capture): its record says "profiled": true, and the
  /// slow-step, shift and device rules do not judge it. Training thread; outside a step it
  /// does nothing.
  void mark_step_profiled() noexcept;
  /// Steps ended whose device times are not known yet.
  std::size_t steps_in_flight() const noexcept;

  /// Memory figures for the step in progress from a source outside the core (the Python
  /// side's torch allocator statistics). Fields < 0 are ignored.
  void set_step_memory(const MemorySample& sample);
  /// Whether the steps' device-wide memory (device_used_bytes, device_total_bytes) comes
  /// from the telemetry sampler (NVML), so that no step needs a driver call for it.
  bool device_memory_sampled() const noexcept;

  /// Attaches a number to the step in progress (a framework's global step, epoch, learning
  /// rate, loss): the record's "meta" object gets {name: value}. Between steps the value
  /// goes to the next step begun. Setting a name again in the same step replaces its
  /// value; a step records only the values set for it. NaN and infinities are written as
  /// null. Training thread only; no allocation once the name is interned.
  void set_step_value(std::string_view name, double value) {
    set_step_value(step_value_id(name), value);
  }
  /// UsageError for an id step_value_id did not return.
  void set_step_value(StepValueId id, double value);
  /// Interns a step-value name: ConfigError for a bad name (empty, longer than
  /// kMaxPhaseNameBytes bytes, control characters) or more than kMaxStepValues names.
  StepValueId step_value_id(std::string_view name);

  /// The training step the program is at, 0-based (the steps it completed before: a
  /// framework's global step, or where a restored checkpoint left off), for the step in
  /// progress (between steps: the next one); its record gets "progress", and the steps
  /// after it count on by one. Lets the waste report tell steps recomputed after a restart.
  /// Training thread only; UsageError for a negative value.
  void set_progress(std::int64_t progress);
  /// Seconds earlier attempts of the job spent by `cause` (productive, or a
  /// steptrace_badput_seconds_total cause: wasted_progress, recovery, slow_steps, startup,
  /// ...), so the live waste metrics continue across attempts (Python reads the earlier
  /// attempts' logs and adds them at start). UsageError for an unknown cause or seconds
  /// < 0 / NaN; nothing without metrics. Any thread.
  void add_earlier_attempts(std::string_view cause, double seconds);

  /// Useful work of the step in progress (between steps: of the next one), for the step
  /// record's "work": samples, tokens and model FLOPs (forward and backward), each < 0
  /// when unknown. Calls in one step add up (one per micro-batch, or one per step); a
  /// figure from a more trusted `source` replaces the figures steptrace counted itself
  /// (see WorkSource). Training thread only; no allocation.
  void add_work(double samples, double tokens = -1, double flops = -1,
                WorkSource source = WorkSource::kUser) noexcept;
  /// The math dtype the model runs in ("bf16", "fp16", "tf32", "fp32", "fp8"): MFU divides
  /// by the device's peak for it from the next step on. Only where mfu_dtype is "auto" and
  /// peak_tflops is not set (the options win: then it returns false). ConfigError for
  /// another name.
  bool set_mfu_dtype(std::string_view dtype);

  bool in_step() const noexcept;
  /// Whether a phase of the step in progress is open. Training thread only.
  bool in_phase() const noexcept;
  /// Steps begun so far (the index the next step gets).
  std::int64_t step_index() const noexcept;
  /// Blocks until every record handed over so far is written to the file.
  void flush();
  /// Ends an open step (status "error"), writes run_end, flushes and closes the file.
  /// Idempotent: later calls do nothing.
  void close(EndReason reason = EndReason::kNormal, std::string_view error = {});
  bool closed() const noexcept;
  /// Writes to the log that failed (e.g. disk full: those records are lost; run_end says
  /// how many), and the first failure's error text ("" while there is none). Any thread.
  std::int64_t write_errors() const noexcept;
  std::string write_error() const;
  /// A reader of the records this profiler writes, in this process (nothing reads the log
  /// file back): each call returns the whole lines (without newlines) written since the
  /// previous call, run_start first. `kinds` (e.g. {"step"}): only records of those kinds
  /// (run_start too only where asked for); the others are never queued for this reader.
  /// A reader more than 65536 lines behind loses the oldest. Any thread; the reader may
  /// outlive the profiler.
  std::function<std::vector<std::string>()> record_reader(std::vector<std::string> kinds = {});
  /// Calls `callback` with every alert and resolved record (one JSON line) as it is
  /// written, on the writer or watchdog thread: keep it short and thread-safe.
  void set_alert_callback(std::function<void(const std::string& json_line)> callback);
  /// Queues alert events from now on for wait_event (used by the Python bindings).
  void subscribe_events();
  /// The next queued event, or nothing after timeout_ms (or once closed). Any thread.
  std::optional<ProfilerEvent> wait_event(int timeout_ms);
  /// Answers a stack request: the text goes into the hang alert's details.stacks.
  void answer_stacks(std::string stacks);
  /// Answers a collectives request: a JSON object (PyTorch's flight recorder state, see
  /// python/steptrace/live/flight_recorder.py) for the hang alert's details.flight_recorder; its
  /// "summary" string, where the recorder is on, ends the alert's message. Empty (or not a
  /// JSON object): nothing. The Python bindings hand the object over as a value instead.
  void answer_collectives(std::string json);

  /// Times one collective from the host (e.g. a DDP bucket's all-reduce, from a
  /// communication hook): collective_begin() as it is launched returns a token for
  /// collective_end() when it completes. Any thread, lock-free. The step in progress
  /// gets a "comm" object: the time a collective was outstanding, the time the step
  /// stayed blocked after its last launch (exposed), and the rest (compute).
  /// `host_blocked` false: the host did not wait for this one (a backend whose work
  /// completes on the device while the host goes on, as NCCL's): it counts as outstanding
  /// time, never as blocked. It counts in the step in progress when it completes.
  /// `bytes`: its payload as nccl-tests counts it (the size S of algbw = S / t), and
  /// `bus_bytes` the same times its bus factor (all-reduce 2(n-1)/n; all-gather,
  /// reduce-scatter, all-to-all (n-1)/n; broadcast 1), so the step gets its algorithm and
  /// bus bandwidth; 0 where unknown.
  std::int64_t collective_begin() noexcept;
  void collective_end(std::int64_t begin_token, bool host_blocked = true, std::int64_t bytes = 0,
                      std::int64_t bus_bytes = 0) noexcept;
  /// Collectives begun and not yet ended. Any thread.
  int collectives_in_flight() const noexcept;
  /// The innermost phase in progress ("" outside phases). Any thread.
  std::string current_phase() const;
  /// The kind of the open interval ("eval", "checkpoint", "other"; "" when none). Any thread.
  std::string current_interval() const;
  /// For the cross-rank exchange: `peers` other ranks are now in an evaluation or checkpoint
  /// interval, which this rank learns of at most `notice_s` after it begins. A step waiting in
  /// a collective is not hung while a peer is in one (its time then does not count towards
  /// the hang limit), and its hang limit is `notice_s` longer. Any thread.
  void set_peers_in_interval(int peers, double notice_s) noexcept;
  /// Writes a record from outside the core into the log now: a JSON object whose kind is
  /// cluster, alert or resolved (the cross-rank view and its alerts). Its "rank" is set
  /// to this rank; alerts are counted in run_end and delivered like the core's own.
  /// UsageError for anything else; nothing happens once closed. Any thread. (The Python
  /// bindings hand a dict over as a value, validated and written the same way.)
  void write_record(std::string_view json_object);

  /// Path of this rank's log file.
  const std::string& log_path() const noexcept;
  /// Which attempt of its job this run is (its run_start's job.attempt; 0 without a job id).
  int attempt() const noexcept;
  /// When this process started (unix ns, as run_start says); 0 where unknown.
  std::int64_t process_start_unix_ns() const noexcept;
  /// The port the Prometheus endpoint is bound to (http://<host>:<port>/metrics), or -1
  /// when metrics_port is -1 or binding failed (see run_start.metrics.error).
  int metrics_port() const noexcept;
  /// The validated configuration, with rank, world size and run id resolved.
  const Config& config() const noexcept;

 private:
  friend struct detail::ProfilerAccess;  // write_record, answer_collectives as values
  std::unique_ptr<detail::ProfilerImpl> impl_;
};

/// Installs a C-level SIGTERM handler (sigaction; it chains to the handler it replaces)
/// and a watcher thread it wakes through a self-pipe, so that a SIGTERM is handled even
/// while every program thread is blocked in native code. The watcher flushes every live
/// profiler at once. With `terminate` (the program leaves SIGTERM to its default action),
/// it then waits `grace_s` for the program to end the runs itself, writes run_end (reason
/// "signal") for those still open without any device call, and re-raises SIGTERM with the
/// default action. Without it, the program's own handler decides (the watcher only
/// flushes). Returns false when the handler could not be installed. Once per process is
/// enough; a forked child must call it again.
STEPTRACE_API bool install_sigterm_handler(bool terminate = true, double grace_s = 0.0);
/// Puts back the SIGTERM handler install_sigterm_handler replaced (when ours is in place).
STEPTRACE_API void remove_sigterm_handler() noexcept;

/// Hang alerts take details.stacks from the handler installed for `signum` (Python's
/// faulthandler.register(signum, file=fd, all_threads=True), which needs no GIL): the
/// watchdog raises it on its own thread and reads back what it wrote to `fd`, a regular
/// file. Until then, and whenever that handler has been replaced, stacks come from
/// subscribers (answer_stacks). False when no handler is installed for signum; a negative
/// signum disarms. Process-wide.
STEPTRACE_API bool set_stack_dump_signal(int signum, int fd) noexcept;
/// True when the signal set_stack_dump_signal armed in this process has been put back to
/// its default disposition since (Lightning's Trainer restores every signal to what
/// Python's signal module saw, which for a faulthandler handler is the default): install
/// the handler and arm it again.
STEPTRACE_API bool stack_dump_signal_reset() noexcept;
/// A real-time signal left at its default disposition (unhandled), for
/// set_stack_dump_signal; -1 when there is none.
STEPTRACE_API int spare_signal() noexcept;

/// Version of the steptrace library ("0.1.0").
STEPTRACE_API const char* version() noexcept;

}  // namespace steptrace
