// steptrace::Profiler: a façade that assembles the run's parts (backend_setup, run_manifest,
// step_recorder, watchdog, the record pipeline and sinks), forwards the public API, and
// keeps what spans them: the lifecycle (a close from another thread, a fork, SIGTERM) and
// the order of operations at close.
#include "steptrace/profiler.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <system_error>
#include <thread>

#include "../core/alert.hpp"
#include "../core/badput.hpp"
#include "../core/check.hpp"
#include "../core/detection_stage.hpp"
#include "../core/device_activity.hpp"
#include "../core/device_timing.hpp"
#include "../core/hardware_alert.hpp"
#include "../core/host/heap_sampler.hpp"
#include "../core/lifecycle.hpp"
#include "../core/peak_flops.hpp"
#include "../core/record_json.hpp"
#include "../core/record_pipeline.hpp"
#include "../core/stack_dump.hpp"
#include "../core/step_record.hpp"
#include "../core/telemetry.hpp"
#include "../core/this_thread.hpp"
#include "../core/work_accounting.hpp"
#include "../sinks/jsonl_file_sink.hpp"
#include "../sinks/prometheus_sink.hpp"
#include "../sinks/record_tap.hpp"
#include "backend_setup.hpp"
#include "run_environment.hpp"
#include "run_manifest.hpp"
#include "step_recorder.hpp"
#include "steptrace/error.hpp"
#include "watchdog.hpp"

#ifndef STEPTRACE_VERSION
#error "STEPTRACE_VERSION must be defined by the build"
#endif

namespace steptrace {
namespace detail {
namespace {

const char* reason_name(EndReason r) {
  switch (r) {
    case EndReason::kNormal:
      return "normal";
    case EndReason::kException:
      return "exception";
    case EndReason::kSignal:
      return "signal";
    case EndReason::kExit:
      return "exit";
  }
  return "normal";
}

}  // namespace

class ProfilerImpl final : public SignalClosable {
 public:
  ProfilerImpl(Config config, const RunInfo& info, Backends backends)
      : config_(std::move(config)), pid_(getpid()), fork_generation_(fork_generation()) {
    config_.validate();
    job_ = resolve(config_);
    host_clock_ = !backends.clock;
    counter_clock_ = host_clock_ && tsc_clock_chosen();  // once: run_start says what is read
    clock_ = backends.clock ? std::move(backends.clock) : make_host_clock();
    stream_source_ = std::move(backends.stream_source);
    device_ = make_device_timing(config_, backends, &device_unavailable_);
    if (backends.memory_sources.empty() && config_.sample_rss) {
      if (auto rss = make_rss_source()) backends.memory_sources.push_back(std::move(rss));
    }
    if (config_.sample_heap && HeapSampler::available()) heap_.emplace(config_);
    memory_sources_ = std::move(backends.memory_sources);
    for (const auto& source : memory_sources_) {
      if (host_readings() != nullptr && source->any_thread() && source->min_interval_ns() > 0) {
        host_readings_.add_source(source.get());
      } else {
        recorder_sources_.push_back(source.get());
      }
    }
    setup_device_activity(backends, info.external_profiler_active);
    setup_telemetry(backends);
    peak_ = choose_peak(config_.peak_tflops, config_.mfu_dtype, device_name());
    for (const auto& name : config_.phases) names_.intern(name);

    log_ = open_log_file(config_, job_);
    log_path_ = log_.path;
    const int fd = log_.fd;
    start_.start_ns = clock_->now_ns();
    start_.start_unix_ns = unix_now_ns();
    process_start_unix_ns_ = process_start_unix_ns();
    if (config_.detect)
      detection_ = std::make_unique<DetectionStage>(config_, names_, alerts_, host_memory_bytes());
    std::vector<RecordSink*> sinks = {&tap_};
    if (config_.metrics_port >= 0 || !config_.metrics_textfile.empty() ||
        !config_.metrics_pushgateway.empty()) {
      metrics_ = make_metrics_sink(config_, names_, detection_.get(), clock_.get(),
                                   &recorder_.inflight(), &peers_);
      metrics_->registry().start_badput(process_start_unix_ns_);
      sinks.push_back(metrics_.get());
    }
    writer_ = std::make_unique<RecordPipeline>(std::make_unique<JsonlFileSink>(fd),
                                               run_start_json(manifest(info)), config_.rank, names_,
                                               static_cast<std::size_t>(config_.queue_capacity),
                                               std::chrono::milliseconds(config_.flush_interval_ms),
                                               detection_.get(), completer(), std::move(sinks));
    if (telemetry_) {
      // Sampler thread: a hardware error is written at once, not with the next step.
      telemetry_->set_error_handler([this](const HardwareError& e) { report_hardware_error(e); });
      telemetry_->start();
    }
    recorder_.bind({&config_, &names_, clock_.get(), stream_source_.get(), device_.get(),
                    activity_.get(), sampler_.get(), telemetry_.get(), detection_.get(),
                    &recorder_sources_, host_readings(), heap_ ? &*heap_ : nullptr, writer_.get(),
                    &alerts_, &watchdog_, start_, host_clock_, counter_clock_});
    recorder_.set_peak_flops(peak_.flops_per_s);
    if (config_.detect) {
      watchdog_.start({&config_, &names_, &recorder_.inflight(), detection_.get(), &alerts_,
                       writer_.get(), clock_.get(), start_, &recorder_.collectives(),
                       host_readings(), &peers_, log_.previous_path});
    }
    owner_.store(this_thread_token(), std::memory_order_relaxed);
    register_for_signal(this);
  }

  ~ProfilerImpl() override {
    unregister_for_signal(this);  // waits while the SIGTERM watcher uses this profiler
    stop_watchdog();
    if (telemetry_ && !forked()) telemetry_->finish();
  }
  ProfilerImpl(const ProfilerImpl&) = delete;
  ProfilerImpl& operator=(const ProfilerImpl&) = delete;

  // The lifecycle checks (a close from another thread, a fork) are here; the step's own
  // bookkeeping is the recorder's.
  void begin_step() {
    if (may_begin_step()) recorder_.begin_step();
  }
  void begin_step_at(std::int64_t start_ns) {
    if (may_begin_step()) recorder_.begin_step_at(start_ns);
  }
  void add_phase(PhaseId id, std::int64_t begin_ns, std::int64_t end_ns) {
    if (!detached_) recorder_.add_phase(id, begin_ns, end_ns);
  }
  std::int64_t clock_ns() const noexcept { return recorder_.clock_ns(); }

  void end_step(bool failed) {
    if (detached_) return;
    if (fork_generation() != fork_generation_) {  // forked inside the step
      detached_ = true;
      return;
    }
    recorder_.end_step(failed);
    leave_step();
  }

  void begin_phase(PhaseId id) {
    if (detached_) return;
    recorder_.begin_phase(id);
  }
  void end_phase(PhaseId id) {
    if (detached_) return;
    recorder_.end_phase(id);
  }

  void begin_data() {
    if (detached_) return;
    if (close_requested_.load(std::memory_order_relaxed) || fork_generation() != fork_generation_) {
      detached_ = true;
      return;
    }
    recorder_.begin_data();
  }
  void end_data(bool loader_start) {
    if (detached_) return;
    recorder_.end_data(loader_start);
  }

  void begin_compile() {
    if (!detached_) recorder_.begin_compile();
  }
  void end_compile() {
    if (!detached_) recorder_.end_compile();
  }
  // The watchdog's hang clock stops while the collector runs and leaves its time out.
  // On the run's clock, as the steps (any thread reads it).
  void begin_gc(int generation) noexcept {
    recorder_.gc_pauses().begin(generation, clock_->now_ns());
    recorder_.inflight().collecting.store(true, std::memory_order_relaxed);
  }
  void end_gc() noexcept {
    const std::int64_t took = recorder_.gc_pauses().end(clock_->now_ns());
    recorder_.inflight().gc_ns.fetch_add(took, std::memory_order_relaxed);
    // release: a watchdog that sees the collection over sees its time left out too
    recorder_.inflight().collecting.store(false, std::memory_order_release);
  }
  void begin_interval(IntervalKind kind) {
    if (detached_) return;
    check_open();
    recorder_.begin_interval(kind);
  }
  void end_interval(IntervalKind kind) {
    if (detached_) return;
    recorder_.end_interval(kind);
  }
  std::optional<IntervalKind> open_interval() const noexcept { return recorder_.open_interval(); }

  void set_step_memory(const MemorySample& s) { recorder_.set_step_memory(s); }
  StepValueId step_value_id(std::string_view name) { return names_.intern_value(name); }
  void set_step_value(StepValueId id, double value) { recorder_.set_step_value(id, value); }
  void set_progress(std::int64_t progress) noexcept { recorder_.set_progress(progress); }
  void add_earlier_attempts(std::string_view cause, double seconds) {
    const auto c = badput_cause(cause);
    STEPTRACE_CHECK(c.has_value(), UsageError,
                    "add_earlier_attempts: cause {:?} is unknown; allowed: productive, "
                    "slow_steps, wasted_progress, recovery, startup, data, checkpoint, restore, "
                    "eval, compile, host_contention, gc, other",
                    cause);
    STEPTRACE_CHECK(std::isfinite(seconds) && seconds >= 0, UsageError,
                    "add_earlier_attempts: seconds={} for {:?}; allowed: a finite number >= 0",
                    seconds, cause);
    if (metrics_) metrics_->registry().seed_badput(*c, seconds);
  }
  void add_work(double samples, double tokens, double flops, WorkSource source) noexcept {
    if (!detached_) recorder_.add_work(samples, tokens, flops, source);
  }
  bool set_mfu_dtype(std::string_view dtype) {
    STEPTRACE_CHECK(parse_math_dtype(dtype).has_value(), ConfigError,
                    "mfu dtype {:?} is not one of bf16, fp16, tf32, fp32, fp8", dtype);
    if (config_.peak_tflops > 0 || config_.mfu_dtype != "auto") return false;
    PeakChoice peak = choose_peak(0, dtype, device_name());
    recorder_.set_peak_flops(peak.flops_per_s);
    const std::lock_guard<std::mutex> lock(peak_mutex_);
    peak_ = std::move(peak);
    return true;
  }

  void set_stream(DeviceStream stream) noexcept {
    if (device_ && !detached_ && !close_requested_.load(std::memory_order_relaxed)) {
      device_->set_stream(stream);
    }
  }
  void clear_stream() noexcept {
    if (device_ && !detached_ && !close_requested_.load(std::memory_order_relaxed)) {
      device_->clear_stream();
    }
  }
  std::size_t steps_in_flight() const noexcept { return device_ ? device_->in_flight() : 0; }
  void set_external_profiler(bool active) noexcept {
    if (!activity_) return;
    recorder_.set_activity_yielding(active);
    activity_->set_yielding(active);
  }

  // From the training thread: ends an open step (failed) and closes. From another thread
  // (a foreign close): asks the training thread to stop recording at its next step
  // boundary, waits (at most close_wait_s) for the step it is in to end, and closes
  // without touching its state; its later steps are not recorded and raise nothing. In a
  // forked child: abandons the run (nothing written).
  void close(EndReason reason, std::string_view error) {
    if (forked()) {
      abandon();
      return;
    }
    if (closed_.load(std::memory_order_acquire)) return;
    const bool foreign = owner_.load(std::memory_order_relaxed) != this_thread_token();
    bool step_left_running = false;
    std::int64_t running_step = -1;
    if (foreign) {
      close_requested_.store(true, std::memory_order_seq_cst);
      std::unique_lock<std::mutex> lock(busy_mu_);
      const auto wait = std::chrono::duration<double>(config_.close_wait_s);
      step_left_running =
          !busy_cv_.wait_for(lock, wait, [&] { return !busy_.load(std::memory_order_seq_cst); });
      if (step_left_running) {
        running_step = recorder_.inflight().step.load(std::memory_order_acquire);
      }
    }
    std::lock_guard<std::mutex> lock(close_mu_);
    if (closed_.load(std::memory_order_acquire)) return;
    if (!foreign && recorder_.in_step()) end_step(/*failed=*/true);
    if (!foreign) recorder_.end_open_interval_now();
    // The device is the training thread's while its step runs: then neither drain it nor
    // finish the device activity here.
    if (device_ && !step_left_running) {
      device_->drain(*writer_);  // the one synchronization of the run
      recorder_.report_device_failure();
    }
    stop_watchdog();
    // After everything that stamps an alert: no record is later than run_end.
    const std::int64_t now = clock_->now_ns();
    RunEnd end;
    end.reason = reason_name(reason);
    end.error = std::string(error);
    if (step_left_running) {
      if (!end.error.empty()) end.error += "; ";
      end.error += fmt::format(
          "closed from another thread while step {} was still running after close_wait_s={}; "
          "that step and the steps waiting for device times are not recorded",
          running_step, config_.close_wait_s);
    }
    end.end_unix_ns = start_.unix_ns_at(now);
    end.wall_s = static_cast<double>(now - start_.start_ns) / 1e9;
    end.data_inside_step = data_inside_step();
    end.process_start_unix_ns = process_start_unix_ns_;
    end.profiler_start_unix_ns = start_.start_unix_ns;
    {
      const std::lock_guard<std::mutex> lock(peak_mutex_);
      end.mfu_dtype = peak_.dtype;
      end.mfu_dtype_assumed = peak_.dtype_assumed;
    }
    if (!foreign) {  // the intervals after the last step are the training thread's
      const BetweenSteps& pending = recorder_.pending();
      end.trailing = pending;
      fmt::memory_buffer lines;
      for (std::uint8_t i = 0; i < pending.listed; ++i) {
        append_interval_json(lines, pending.intervals[i], recorder_.step_index(), config_.rank);
      }
      if (lines.size() > 0) writer_->push_line(fmt::to_string(lines));
    }
    // Before the writer closes: the sampler's closing reading (after the last step) and
    // any hardware error in it still reach the file.
    if (telemetry_) telemetry_->finish();
    writer_->close(end, /*finish_device=*/!step_left_running);
    closed_.store(true, std::memory_order_release);
    alerts_.finish();
  }

  void flush() {
    if (closed_.load(std::memory_order_acquire) || detached_ || forked()) return;
    writer_->flush();
  }

  // ---- SIGTERM watcher (its thread) ----
  void flush_for_signal() noexcept override {
    try {
      if (!closed_.load(std::memory_order_acquire)) writer_->flush(std::chrono::milliseconds(2000));
    } catch (...) {
    }
  }
  bool closed_for_signal() const noexcept override {
    return closed_.load(std::memory_order_acquire);
  }
  // The program did not end the run within the grace period (its main thread may be
  // blocked in native code, or in close() on a hung device): write what the writer holds
  // and run_end, with no device call and without touching the training thread's state.
  void close_for_signal() noexcept override {
    try {
      RunEnd end;
      end.reason = "signal";
      end.error =
          "SIGTERM: the program did not end the run within the grace period; closed by "
          "steptrace's signal watcher (a step in progress and steps waiting for device times "
          "are not recorded)";
      end.end_unix_ns = unix_now_ns();
      end.wall_s = static_cast<double>(end.end_unix_ns - start_.start_unix_ns) / 1e9;
      end.data_inside_step = data_inside_step();
      writer_->close(end, /*finish_device=*/false, std::chrono::milliseconds(2000));
      closed_.store(true, std::memory_order_release);
    } catch (...) {
    }
  }

  // A forked child (only the forking thread exists there): forget the run without
  // writing, joining or locking anything of the parent's.
  bool forked() const noexcept { return fork_generation() != fork_generation_ || getpid() != pid_; }
  void abandon() noexcept {
    if (abandoned_) return;
    abandoned_ = true;
    detached_ = true;
    closed_.store(true, std::memory_order_release);
    writer_->abandon();
    watchdog_.abandon();
    // its sampler thread is the parent's: joining it here would never return
    if (telemetry_) telemetry_.release();  // NOLINT: leaked
    if (metrics_) metrics_.release();      // NOLINT: its server thread is the parent's
  }

  PhaseId phase_id(std::string_view name) { return names_.intern(name); }
  const std::string& phase_name(PhaseId id) const {
    recorder_.check_phase_id(id);
    return names_.name(id);
  }

  AlertLog& alerts() noexcept { return alerts_; }
  bool in_step() const noexcept { return recorder_.in_step(); }
  bool in_phase() const noexcept { return recorder_.in_phase(); }
  std::int64_t step_index() const noexcept { return recorder_.step_index(); }
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  bool device_memory_sampled() const noexcept {
    std::int64_t used = -1, total = -1;
    return telemetry_ != nullptr && telemetry_->device_memory(&used, &total);
  }
  std::int64_t write_errors() const noexcept { return writer_->write_errors(); }
  std::function<std::vector<std::string>()> record_reader() {
    std::shared_ptr<RecordTap::Reader> reader = tap_.open();
    return [reader] { return reader->new_lines(); };
  }
  std::int64_t data_inside_step() const noexcept { return recorder_.data_inside_step(); }
  int write_errno() const noexcept { return writer_->first_errno(); }
  const std::string& log_path() const noexcept { return log_path_; }
  int attempt() const noexcept { return log_.attempt; }
  std::int64_t process_start() const noexcept { return process_start_unix_ns_; }
  const Config& config() const noexcept { return config_; }
  int metrics_port() const noexcept { return metrics_ ? metrics_->port() : -1; }

  std::int64_t collective_begin() noexcept {
    const std::int64_t now = clock_->now_ns();
    recorder_.collectives().begin(now);
    return now;
  }
  void collective_end(std::int64_t begin_ns, bool host_blocked, std::int64_t bytes,
                      std::int64_t bus_bytes) noexcept {
    const InflightState& inflight = recorder_.inflight();
    recorder_.collectives().end(begin_ns, clock_->now_ns(),
                                inflight.phase.load(std::memory_order_relaxed), host_blocked, bytes,
                                bus_bytes, inflight.step.load(std::memory_order_relaxed) < 0);
  }
  int collectives_in_flight() const noexcept { return recorder_.collectives().in_flight(); }
  std::string current_phase() const {
    const int phase = recorder_.inflight().phase.load(std::memory_order_relaxed);
    return phase >= 0 ? names_.name(static_cast<PhaseId>(phase)) : std::string();
  }
  std::string current_interval() const {
    const int kind = recorder_.inflight().interval.load(std::memory_order_relaxed);
    return kind >= 0 ? std::string(interval_name(static_cast<IntervalKind>(kind))) : std::string();
  }
  void set_peers_in_interval(int peers, double notice_s) noexcept {
    peers_.notice_ns.store(static_cast<std::int64_t>(std::max(notice_s, 0.0) * 1e9),
                           std::memory_order_relaxed);
    peers_.in_interval.store(std::max(peers, 0), std::memory_order_relaxed);
  }

  void write_record(std::string_view text) {
    auto j = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
    STEPTRACE_CHECK(j.is_object(), UsageError, "write_record: not a JSON object: {:.80}", text);
    const auto kind_it = j.find("kind");
    const std::string kind =
        kind_it != j.end() && kind_it->is_string() ? kind_it->get<std::string>() : "";
    STEPTRACE_CHECK(kind == "cluster" || kind == "alert" || kind == "resolved", UsageError,
                    "write_record: kind {:?} cannot be written; allowed: cluster, alert, resolved",
                    kind);
    const auto type_it = j.find("type");
    STEPTRACE_CHECK(kind == "cluster" || (type_it != j.end() && type_it->is_string()), UsageError,
                    "write_record: an {} record needs a string \"type\"", kind);
    j["rank"] = config_.rank;  // may move the members: the iterators above are dead now
    if (closed()) return;
    std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    // Parsed once: the sinks get the object (cluster) or its event (alert, resolved).
    if (kind == "cluster") {
      writer_->push_cluster(std::move(j), std::move(line));
      return;
    }
    AlertEvent event = alert_from_json(j);
    alerts_.publish(event, line);
    writer_->push_alert(std::move(event), std::move(line));
  }

 private:
  // False where the step is not recorded (detached); UsageError out of order.
  bool may_begin_step() {
    if (detached_) return false;
    if (close_requested_.load(std::memory_order_relaxed) || fork_generation() != fork_generation_) {
      detached_ = true;  // closed from another thread, or a forked child: record nothing
      return false;
    }
    check_open();
    recorder_.check_can_begin();
    return enter_step();
  }
  // The training thread is inside a step from here to leave_step(): a close from another
  // thread waits for that (Dekker-style: each side stores its flag, then reads the other's).
  // False when such a close was requested first: the step is not recorded.
  bool enter_step() noexcept {
    owner_.store(this_thread_token(), std::memory_order_relaxed);
    busy_.store(true, std::memory_order_seq_cst);
    if (!close_requested_.load(std::memory_order_seq_cst)) return true;
    leave_step();
    detached_ = true;
    return false;
  }
  void leave_step() noexcept {
    busy_.store(false, std::memory_order_seq_cst);
    if (close_requested_.load(std::memory_order_seq_cst)) {
      { std::lock_guard<std::mutex> lock(busy_mu_); }
      busy_cv_.notify_all();
    }
  }

  void check_open() const {
    STEPTRACE_CHECK(!closed_.load(std::memory_order_acquire), UsageError,
                    "the profiler is closed; create a new one");
  }
  // The kernel activity and counter backends, and the stage that joins their figures to
  // the records.
  void setup_device_activity(Backends& b, bool external_profiler) {
    DeviceActivityBackends chosen = choose_device_activity(config_, b, device_ != nullptr,
                                                           device_unavailable_, external_profiler);
    activity_ = std::move(chosen.activity);
    sampler_ = std::move(chosen.sampler);
    activity_unavailable_ = std::move(chosen.activity_unavailable);
    counters_unavailable_ = std::move(chosen.counters_unavailable);
    if (external_profiler) set_external_profiler(true);
    if (activity_ || sampler_) {
      device_stage_ =
          std::make_unique<DeviceActivityStage>(config_, activity_.get(), sampler_.get());
    }
  }

  // NVML telemetry and its stage, chained after the device activity's.
  void setup_telemetry(Backends& b) {
    telemetry_ = choose_telemetry(config_, b, &telemetry_unavailable_);
    if (telemetry_) telemetry_stage_ = std::make_unique<TelemetryStage>(telemetry_.get());
    if (device_stage_ && telemetry_stage_) {
      chained_stage_ = std::make_unique<ChainedCompleter>(
          std::vector<StepCompleter*>{device_stage_.get(), telemetry_stage_.get()});
    }
  }

  // The watchdog's 10 ms readings, where it runs (detect) on the host clock; null: the steps
  // read for themselves (a test's fake clock keeps every reading on the steps' own clock).
  HostReadings* host_readings() noexcept {
    return config_.detect && host_clock_ ? &host_readings_ : nullptr;
  }

  // The GPU the steps are timed on ("" without one): MFU's peak is looked up by it.
  std::string device_name() const { return device_ ? device_->timer().device_name() : ""; }

  RunManifest manifest(const RunInfo& info) const {
    RunManifest m;
    m.config = &config_;
    m.info = &info;
    m.start_unix_ns = start_.start_unix_ns;
    m.process_start_unix_ns = process_start_unix_ns_;
    m.job = &job_;
    m.log = &log_;
    m.memory_sources = &memory_sources_;
    m.heap = heap_.has_value();
    m.device = device_.get();
    m.device_unavailable = &device_unavailable_;
    m.activity = activity_.get();
    m.activity_unavailable = &activity_unavailable_;
    m.sampler = sampler_.get();
    m.counters_unavailable = &counters_unavailable_;
    m.telemetry = telemetry_.get();
    m.telemetry_unavailable = &telemetry_unavailable_;
    m.metrics = metrics_.get();
    m.peak = &peak_;  // before any step: the training thread has not changed it yet
    if (host_clock_) {
      m.host_clock = counter_clock_ ? "the CPU's time-stamp counter, calibrated against "
                                      "CLOCK_MONOTONIC and checked every second"
                                    : "CLOCK_MONOTONIC";
    }
    return m;
  }

  StepCompleter* completer() const {
    if (chained_stage_) return chained_stage_.get();
    if (device_stage_) return device_stage_.get();
    return telemetry_stage_.get();
  }

  // Sampler thread: an XID or a new uncorrectable ECC error is page-worthy.
  void report_hardware_error(const HardwareError& e) {
    try {
      AlertEvent a = hardware_alert(e, telemetry_->device());
      a.step = std::max<std::int64_t>(
          recorder_.inflight().last_done_step.load(std::memory_order_relaxed), 0);
      a.unix_ns = start_.unix_ns_at(clock_->now_ns());
      raise_alert(*writer_, alerts_, a, config_.rank);
    } catch (...) {  // never into NVML's or the sampler's stack
    }
  }

  void stop_watchdog() {
    watchdog_.request_stop();
    alerts_.close();  // wakes the watchdog if it waits on Python for stacks
    watchdog_.join();
  }

  Config config_;
  std::unique_ptr<Clock> clock_;
  bool host_clock_ = false;     // clock_ is make_host_clock()'s
  bool counter_clock_ = false;  // the training thread reads it from the CPU's counter
  std::vector<std::unique_ptr<MemorySource>> memory_sources_;  // all (run_start lists them)
  std::vector<MemorySource*> recorder_sources_;                // read at a step's end
  HostReadings host_readings_;       // the watchdog's: the others, and the steps' run queue
  std::optional<HeapSampler> heap_;  // the C heap, when sample_heap
  PhaseNames names_;
  std::string log_path_;
  JobIdentity job_;
  LogFile log_;                             // which attempt of the job this run is
  ClockMapping start_;                      // unix time of a reading of clock_
  std::int64_t process_start_unix_ns_ = 0;  // 0: unknown

  // The training thread's steps; it publishes the in-flight state the watchdog and the
  // Prometheus scrape read.
  StepRecorder recorder_;

  std::unique_ptr<StreamSource> stream_source_;
  std::unique_ptr<DeviceTiming> device_;
  std::string device_unavailable_;  // why device_ is null
  PeakChoice peak_;                 // MFU's divisor (set_mfu_dtype may change it)
  mutable std::mutex peak_mutex_;   // peak_'s strings: set_mfu_dtype against close

  // Kernel activity and counters; the stage that joins them to the records runs on the
  // writer thread (declared before writer_, so it outlives it).
  std::unique_ptr<KernelActivitySource> activity_;
  std::unique_ptr<CounterSampler> sampler_;
  std::string activity_unavailable_;
  std::string counters_unavailable_;
  std::unique_ptr<DeviceActivityStage> device_stage_;
  // NVML telemetry and its writer stage (before writer_ too); the sampler thread is
  // stopped in close() and the destructor, before the writer goes.
  std::unique_ptr<TelemetrySource> telemetry_;
  std::string telemetry_unavailable_;
  std::unique_ptr<TelemetryStage> telemetry_stage_;
  std::unique_ptr<ChainedCompleter> chained_stage_;

  AlertLog alerts_;
  std::unique_ptr<DetectionStage> detection_;
  PeerState peers_;  // read by watchdog_ and metrics_, declared before them
  Watchdog watchdog_;

  // Lifecycle: closes from other threads, forks (see close()).
  const pid_t pid_;
  const std::uint64_t fork_generation_;
  std::atomic<const void*> owner_{nullptr};   // the training thread: the last to begin a step
  std::atomic<bool> busy_{false};             // the training thread is inside a step
  std::atomic<bool> close_requested_{false};  // by a close from another thread
  bool detached_ = false;            // training thread: record nothing more (foreign close, fork)
  std::atomic<bool> closed_{false};  // beside what a step's begin reads: one line for all
  bool abandoned_ = false;
  std::mutex busy_mu_;
  std::condition_variable busy_cv_;
  std::mutex close_mu_;  // one close() at a time

  // The Prometheus sink: fed by the writer, so it outlives it; its server thread reads
  // names_, detection_ and the in-flight atomics, all declared before it.
  std::unique_ptr<PrometheusSink> metrics_;

  // Last: destroyed first, so the writer thread stops before the names it reads go.
  RecordTap tap_;  // before the pipeline, which feeds it until it is destroyed
  std::unique_ptr<RecordPipeline> writer_;
};

}  // namespace detail

// ---- Phase and Step scopes ----

Phase::Phase(Phase&& other) noexcept : profiler_(other.profiler_), id_(other.id_) {
  other.profiler_ = nullptr;
}

Phase::~Phase() {
  if (profiler_ == nullptr) return;
  try {
    profiler_->end_phase(id_);
  } catch (const Error&) {
    // The step already ended (and closed this phase): nothing left to do.
  }
}

Step::Step(Profiler* profiler) noexcept
    : profiler_(profiler), uncaught_at_start_(std::uncaught_exceptions()) {}

Step::Step(Step&& other) noexcept
    : profiler_(other.profiler_),
      uncaught_at_start_(other.uncaught_at_start_),
      failed_(other.failed_) {
  other.profiler_ = nullptr;
}

Interval::Interval(Interval&& other) noexcept : profiler_(other.profiler_), kind_(other.kind_) {
  other.profiler_ = nullptr;
}

Interval::~Interval() {
  if (profiler_ != nullptr) profiler_->end_interval(kind_);  // never throws
}

Step::~Step() {
  if (profiler_ == nullptr) return;
  try {
    profiler_->end_step(failed_ || std::uncaught_exceptions() > uncaught_at_start_);
  } catch (const Error&) {
    // The profiler was closed while the step ran; close() recorded it as failed.
  }
}

Phase Step::phase(std::string_view name) { return profiler_->phase(name); }
Phase Step::phase(PhaseId id) { return profiler_->phase(id); }

// ---- Profiler ----

Profiler::Profiler(Config config, RunInfo info, Backends backends)
    : impl_(std::make_unique<detail::ProfilerImpl>(std::move(config), std::move(info),
                                                   std::move(backends))) {}

Profiler::~Profiler() {
  if (impl_ && impl_->forked()) {
    // A forked child: its members name threads and locks of the parent; destroying them
    // could block for ever. Leak it (the child's copy of the parent's memory).
    impl_->abandon();
    (void)impl_.release();
    return;
  }
  if (impl_ && !impl_->closed()) {
    impl_->close(std::uncaught_exceptions() > 0 ? EndReason::kException : EndReason::kNormal, {});
  }
}

Step Profiler::step() {
  impl_->begin_step();
  return Step(this);
}

Phase Profiler::phase(PhaseId id) {
  impl_->begin_phase(id);
  return Phase(this, id);
}

PhaseId Profiler::phase_id(std::string_view name) { return impl_->phase_id(name); }
const std::string& Profiler::phase_name(PhaseId id) const { return impl_->phase_name(id); }
// [[gnu::hot]]: the functions of a step's path are laid out together (.text.hot) with the
// recorder's and the Python module's, so a cold step touches fewer code lines and pages.
[[gnu::hot]] void Profiler::begin_step() { impl_->begin_step(); }
[[gnu::hot]] void Profiler::end_step(bool failed) { impl_->end_step(failed); }
void Profiler::begin_step_at(std::int64_t start_ns) { impl_->begin_step_at(start_ns); }
void Profiler::add_phase(PhaseId id, std::int64_t begin_ns, std::int64_t end_ns) {
  impl_->add_phase(id, begin_ns, end_ns);
}
std::int64_t Profiler::clock_ns() const noexcept { return impl_->clock_ns(); }
[[gnu::hot]] void Profiler::begin_phase(PhaseId id) { impl_->begin_phase(id); }
[[gnu::hot]] void Profiler::end_phase(PhaseId id) { impl_->end_phase(id); }
[[gnu::hot]] void Profiler::begin_data() { impl_->begin_data(); }
Interval Profiler::interval(IntervalKind kind) {
  impl_->begin_interval(kind);
  return Interval(this, kind);
}
void Profiler::begin_interval(IntervalKind kind) { impl_->begin_interval(kind); }
void Profiler::begin_compile() { impl_->begin_compile(); }
void Profiler::end_compile() { impl_->end_compile(); }
void Profiler::begin_gc(int generation) noexcept { impl_->begin_gc(generation); }
void Profiler::end_gc() noexcept { impl_->end_gc(); }
void Profiler::end_interval(IntervalKind kind) { impl_->end_interval(kind); }
std::optional<IntervalKind> Profiler::open_interval() const noexcept {
  return impl_->open_interval();
}
[[gnu::hot]] void Profiler::end_data(bool loader_start) { impl_->end_data(loader_start); }
void Profiler::set_step_memory(const MemorySample& sample) { impl_->set_step_memory(sample); }
void Profiler::set_step_value(StepValueId id, double value) { impl_->set_step_value(id, value); }
void Profiler::add_earlier_attempts(std::string_view cause, double seconds) {
  impl_->add_earlier_attempts(cause, seconds);
}
void Profiler::set_progress(std::int64_t progress) {
  STEPTRACE_CHECK(progress >= 0, UsageError,
                  "set_progress({}): the training step is 0-based; allowed: 0 or more", progress);
  impl_->set_progress(progress);
}
[[gnu::hot]] void Profiler::add_work(double samples, double tokens, double flops,
                                     WorkSource source) noexcept {
  impl_->add_work(samples, tokens, flops, source);
}
bool Profiler::set_mfu_dtype(std::string_view dtype) { return impl_->set_mfu_dtype(dtype); }
StepValueId Profiler::step_value_id(std::string_view name) { return impl_->step_value_id(name); }
void Profiler::set_stream(std::uintptr_t stream, int device) noexcept {
  impl_->set_stream(DeviceStream{stream, device});
}
void Profiler::clear_stream() noexcept { impl_->clear_stream(); }
std::size_t Profiler::steps_in_flight() const noexcept { return impl_->steps_in_flight(); }
void Profiler::set_external_profiler(bool active) noexcept { impl_->set_external_profiler(active); }
bool Profiler::in_step() const noexcept { return impl_->in_step(); }
bool Profiler::in_phase() const noexcept { return impl_->in_phase(); }
std::int64_t Profiler::step_index() const noexcept { return impl_->step_index(); }
void Profiler::flush() { impl_->flush(); }
void Profiler::close(EndReason reason, std::string_view error) { impl_->close(reason, error); }
bool Profiler::closed() const noexcept { return impl_->closed(); }
bool Profiler::device_memory_sampled() const noexcept { return impl_->device_memory_sampled(); }
std::int64_t Profiler::write_errors() const noexcept { return impl_->write_errors(); }
std::function<std::vector<std::string>()> Profiler::record_reader() {
  return impl_->record_reader();
}
[[gnu::hot]] std::int64_t Profiler::data_inside_step() const noexcept {
  return impl_->data_inside_step();
}
std::string Profiler::write_error() const {
  const int e = impl_->write_errno();
  return e == 0 ? std::string() : std::string(std::strerror(e));
}
const std::string& Profiler::log_path() const noexcept { return impl_->log_path(); }
int Profiler::attempt() const noexcept { return impl_->attempt(); }
std::int64_t Profiler::process_start_unix_ns() const noexcept { return impl_->process_start(); }
int Profiler::metrics_port() const noexcept { return impl_->metrics_port(); }
const Config& Profiler::config() const noexcept { return impl_->config(); }
std::int64_t Profiler::collective_begin() noexcept { return impl_->collective_begin(); }
void Profiler::collective_end(std::int64_t begin_token, bool host_blocked, std::int64_t bytes,
                              std::int64_t bus_bytes) noexcept {
  impl_->collective_end(begin_token, host_blocked, bytes, bus_bytes);
}
int Profiler::collectives_in_flight() const noexcept { return impl_->collectives_in_flight(); }
std::string Profiler::current_phase() const { return impl_->current_phase(); }
std::string Profiler::current_interval() const { return impl_->current_interval(); }
void Profiler::set_peers_in_interval(int peers, double notice_s) noexcept {
  impl_->set_peers_in_interval(peers, notice_s);
}
void Profiler::write_record(std::string_view json_object) { impl_->write_record(json_object); }

void Profiler::set_alert_callback(std::function<void(const std::string&)> callback) {
  impl_->alerts().set_callback(std::move(callback));
}
void Profiler::subscribe_events() { impl_->alerts().subscribe(); }
std::optional<ProfilerEvent> Profiler::wait_event(int timeout_ms) {
  auto e = impl_->alerts().wait_event(timeout_ms);
  if (!e) return std::nullopt;
  return ProfilerEvent{e->kind == detail::SubscriberEvent::kStackRequest, std::move(e->json),
                       e->kind == detail::SubscriberEvent::kCollectivesRequest};
}
void Profiler::answer_stacks(std::string stacks) {
  impl_->alerts().answer_stacks(std::move(stacks));
}
void Profiler::answer_collectives(std::string json) {
  impl_->alerts().answer_collectives(std::move(json));
}

bool install_sigterm_handler(bool terminate, double grace_s) {
  const double ms = std::clamp(grace_s, 0.0, 86400.0) * 1000.0;
  return detail::watch_sigterm(terminate, std::chrono::milliseconds(static_cast<std::int64_t>(ms)));
}
void remove_sigterm_handler() noexcept { detail::unwatch_sigterm(); }

bool set_stack_dump_signal(int signum, int fd) noexcept {
  return detail::arm_stack_dump(signum, fd);
}
bool stack_dump_signal_reset() noexcept { return detail::armed_signal_reset(); }
int spare_signal() noexcept { return detail::spare_signal(); }

const char* version() noexcept { return STEPTRACE_VERSION; }

}  // namespace steptrace
