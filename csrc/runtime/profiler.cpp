// steptrace::Profiler: a façade that assembles the run's parts (backend_setup, run_manifest,
// step_recorder, watchdog, the record pipeline and sinks), forwards the public API, and
// keeps what spans them: the lifecycle (a close from another thread, a fork, SIGTERM) and
// the order of operations at close.
#include "steptrace/profiler.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>

#include "../backends/host/rss_source.hpp"
#include "../core/alert.hpp"
#include "../core/badput.hpp"
#include "../core/check.hpp"
#include "../core/detection_stage.hpp"
#include "../core/host/heap_sampler.hpp"
#include "../core/lifecycle.hpp"
#include "../core/peak_flops.hpp"
#include "../core/record_json.hpp"
#include "../core/record_pipeline.hpp"
#include "../core/step_record.hpp"
#include "../core/work_accounting.hpp"
#include "../sinks/jsonl_file_sink.hpp"
#include "../sinks/prometheus_sink.hpp"
#include "../sinks/record_tap.hpp"
#include "backend_setup.hpp"
#include "profiler_access.hpp"
#include "profiler_parts.hpp"
#include "run_end_builder.hpp"
#include "run_environment.hpp"
#include "run_lifecycle.hpp"
#include "run_manifest.hpp"
#include "step_recorder.hpp"
#include "steptrace/error.hpp"
#include "watchdog.hpp"

namespace steptrace {
namespace detail {

class ProfilerImpl final : public SignalClosable {
 public:
  ProfilerImpl(Config config, const RunInfo& info, Backends backends) : config_(std::move(config)) {
    config_.validate();
    identity_.job = resolve(config_);
    time_.host = !backends.clock;
    time_.counter = time_.host && tsc_clock_chosen();  // once: run_start says what is read
    time_.clock = backends.clock ? std::move(backends.clock) : make_host_clock();
    devices_.stream_source = std::move(backends.stream_source);
    devices_.timing = make_device_timing(config_, backends, &devices_.timing_unavailable);
    add_default_rss_source(backends.memory_sources, config_.sample_rss);
    if (config_.sample_heap && HeapSampler::available()) host_.heap.emplace(config_);
    host_.sources = std::move(backends.memory_sources);
    host_.split(/*polled=*/host_readings() != nullptr);
    choose_device_stages(devices_, config_, backends, info.external_profiler_active);
    if (info.external_profiler_active && devices_.activity) recorder_.set_activity_yielding(true);
    peak_.choice = choose_peak(config_.peak_tflops, config_.mfu_dtype, devices_.device_name());
    for (const auto& name : config_.phases) names_.intern(name);

    identity_.log = open_log_file(config_, identity_.job);
    const int fd = identity_.log.fd;
    time_.start.start_ns = time_.clock->now_ns();
    time_.start.start_unix_ns = unix_now_ns();
    identity_.process_start_unix_ns = process_start_unix_ns();
    if (config_.detect) {
      watch_.detection =
          std::make_unique<DetectionStage>(config_, names_, alerts_, host_memory_bytes());
    }
    std::vector<RecordSink*> sinks = {&sinks_.tap};
    if (config_.metrics_port >= 0 || !config_.metrics_textfile.empty() ||
        !config_.metrics_pushgateway.empty()) {
      sinks_.metrics = make_metrics_sink(config_, names_, watch_.detection.get(), time_.clock.get(),
                                         &recorder_.inflight(), &watch_.peers);
      sinks_.metrics->registry().start_badput(identity_.process_start_unix_ns);
      sinks.push_back(sinks_.metrics.get());
    }
    writer_ = std::make_unique<RecordPipeline>(
        std::make_unique<JsonlFileSink>(fd), run_start_json(manifest(info)), config_.rank, names_,
        static_cast<std::size_t>(config_.queue_capacity),
        std::chrono::milliseconds(config_.flush_interval_ms), watch_.detection.get(),
        devices_.completer(), std::move(sinks));
    recorder_.bind({&config_, &names_, time_.clock.get(), devices_.stream_source.get(),
                    devices_.timing.get(), devices_.activity.get(), devices_.sampler.get(),
                    devices_.telemetry.get(), watch_.detection.get(), &host_.at_step_end,
                    host_readings(), host_.heap ? &*host_.heap : nullptr, writer_.get(), &alerts_,
                    &watch_.watchdog, time_.start, time_.host, time_.counter});
    recorder_.set_peak_flops(peak_.choice.flops_per_s);
    if (devices_.telemetry) {
      // Sampler thread (after bind: the recorder raises its alerts): a hardware error is
      // written at once, not with the next step.
      devices_.telemetry->set_error_handler(
          [this](const HardwareError& e) { recorder_.raise_hardware_alert(e); });
      devices_.telemetry->start();
    }
    if (config_.detect) {
      watch_.watchdog.start({&config_, &names_, &recorder_.inflight(), watch_.detection.get(),
                             &alerts_, writer_.get(), time_.clock.get(), time_.start,
                             &recorder_.collectives(), host_readings(), &watch_.peers,
                             identity_.log.previous_path});
    }
    lifecycle_.claim();
    register_for_signal(this);
  }

  ~ProfilerImpl() override {
    unregister_for_signal(this);  // waits while the SIGTERM watcher uses this profiler
    stop_watchdog();
    if (devices_.telemetry && !forked()) devices_.telemetry->finish();
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
    if (!lifecycle_.detached()) recorder_.add_phase(id, begin_ns, end_ns);
  }
  std::int64_t clock_ns() const noexcept { return recorder_.clock_ns(); }

  void end_step(bool failed) {
    if (lifecycle_.detached() || !lifecycle_.same_process()) return;  // forked inside the step
    recorder_.end_step(failed);
    lifecycle_.leave_step();
  }

  void begin_phase(PhaseId id) {
    if (!lifecycle_.detached()) recorder_.begin_phase(id);
  }
  void end_phase(PhaseId id) {
    if (!lifecycle_.detached()) recorder_.end_phase(id);
  }

  void begin_data() {
    if (!lifecycle_.stay_attached()) return;
    recorder_.begin_data();
  }
  void end_data(bool loader_start) {
    if (!lifecycle_.detached()) recorder_.end_data(loader_start);
  }

  void begin_compile() {
    if (!lifecycle_.detached()) recorder_.begin_compile();
  }
  void end_compile() {
    if (!lifecycle_.detached()) recorder_.end_compile();
  }
  void begin_gc(int generation) noexcept { recorder_.begin_gc(generation); }
  void end_gc() noexcept { recorder_.end_gc(); }
  void begin_interval(IntervalKind kind) {
    if (lifecycle_.detached()) return;
    lifecycle_.check_open();
    recorder_.begin_interval(kind);
  }
  void end_interval(IntervalKind kind) {
    if (!lifecycle_.detached()) recorder_.end_interval(kind);
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
    if (sinks_.metrics) sinks_.metrics->registry().seed_badput(*c, seconds);
  }
  void add_work(double samples, double tokens, double flops, WorkSource source) noexcept {
    if (!lifecycle_.detached()) recorder_.add_work(samples, tokens, flops, source);
  }
  bool set_mfu_dtype(std::string_view dtype) {
    STEPTRACE_CHECK(parse_math_dtype(dtype).has_value(), ConfigError,
                    "mfu dtype {:?} is not one of bf16, fp16, tf32, fp32, fp8", dtype);
    if (config_.peak_tflops > 0 || config_.mfu_dtype != "auto") return false;
    PeakChoice peak = choose_peak(0, dtype, devices_.device_name());
    recorder_.set_peak_flops(peak.flops_per_s);
    const std::lock_guard<std::mutex> lock(peak_.mutex);
    peak_.choice = std::move(peak);
    return true;
  }

  void set_stream(DeviceStream stream) noexcept {
    if (devices_.timing && !lifecycle_.detached() && !lifecycle_.close_requested()) {
      devices_.timing->set_stream(stream);
    }
  }
  void clear_stream() noexcept {
    if (devices_.timing && !lifecycle_.detached() && !lifecycle_.close_requested()) {
      devices_.timing->clear_stream();
    }
  }
  std::size_t steps_in_flight() const noexcept {
    return devices_.timing ? devices_.timing->in_flight() : 0;
  }
  void set_external_profiler(bool active) noexcept {
    if (!devices_.activity) return;
    recorder_.set_activity_yielding(active);
    devices_.activity->set_yielding(active);
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
    if (lifecycle_.closed()) return;
    const bool foreign = lifecycle_.foreign();
    bool step_left_running = false;
    std::int64_t running_step = -1;
    if (foreign) {
      step_left_running =
          lifecycle_.request_close_and_wait(std::chrono::duration<double>(config_.close_wait_s));
      if (step_left_running) {
        running_step = recorder_.inflight().step.load(std::memory_order_acquire);
      }
    }
    std::lock_guard<std::mutex> lock(lifecycle_.close_mutex());
    if (lifecycle_.closed()) return;
    if (!foreign && recorder_.in_step()) end_step(/*failed=*/true);
    if (!foreign) recorder_.end_open_interval_now();
    // The device is the training thread's while its step runs: then neither drain it nor
    // finish the device activity here.
    if (devices_.timing && !step_left_running) {
      devices_.timing->drain(*writer_);  // the one synchronization of the run
      recorder_.report_device_failure();
    }
    stop_watchdog();
    // After everything that stamps an alert: no record is later than run_end.
    RunEndFacts facts;
    facts.reason = reason;
    facts.error = error;
    facts.step_left_running = step_left_running;
    facts.running_step = running_step;
    facts.close_wait_s = config_.close_wait_s;
    facts.start = time_.start;
    facts.now_ns = time_.clock->now_ns();
    facts.data_inside_step = data_inside_step();
    facts.process_start_unix_ns = identity_.process_start_unix_ns;
    {
      const std::lock_guard<std::mutex> lock(peak_.mutex);
      facts.mfu_dtype = peak_.choice.dtype;
      facts.mfu_dtype_assumed = peak_.choice.dtype_assumed;
    }
    // The intervals after the last step are the training thread's.
    if (!foreign) facts.trailing = &recorder_.pending();
    const RunEnd end = build_run_end(facts);
    if (!foreign) {
      std::string lines =
          trailing_interval_lines(recorder_.pending(), recorder_.step_index(), config_.rank);
      if (!lines.empty()) writer_->push_line(std::move(lines));
    }
    // Before the writer closes: the sampler's closing reading (after the last step) and
    // any hardware error in it still reach the file.
    if (devices_.telemetry) devices_.telemetry->finish();
    writer_->close(end, /*finish_device=*/!step_left_running);
    lifecycle_.mark_closed();
    alerts_.finish();
  }

  void flush() {
    if (lifecycle_.closed() || lifecycle_.detached() || forked()) return;
    writer_->flush();
  }

  // ---- SIGTERM watcher (its thread) ----
  void flush_for_signal() noexcept override {
    try {
      if (!lifecycle_.closed()) writer_->flush(std::chrono::milliseconds(2000));
    } catch (...) {
    }
  }
  bool closed_for_signal() const noexcept override { return lifecycle_.closed(); }
  // The program did not end the run within the grace period (its main thread may be
  // blocked in native code, or in close() on a hung device): write what the writer holds
  // and run_end, with no device call and without touching the training thread's state.
  void close_for_signal() noexcept override {
    try {
      const RunEnd end = signal_run_end(time_.start, data_inside_step());
      writer_->close(end, /*finish_device=*/false, std::chrono::milliseconds(2000));
      lifecycle_.mark_closed();
    } catch (...) {
    }
  }

  // A forked child (only the forking thread exists there): forget the run without
  // writing, joining or locking anything of the parent's.
  bool forked() const noexcept { return lifecycle_.forked(); }
  void abandon() noexcept {
    if (!lifecycle_.abandon()) return;
    writer_->abandon();
    watch_.watchdog.abandon();
    // its sampler thread is the parent's: joining it here would never return
    if (devices_.telemetry) devices_.telemetry.release();  // NOLINT: leaked
    if (sinks_.metrics) sinks_.metrics.release();  // NOLINT: its server thread is the parent's
  }

  PhaseId phase_id(std::string_view name) { return names_.intern(name); }
  const std::string& phase_name(PhaseId id) const {
    recorder_.check_phase_id(id);
    return names_.name(id);
  }

  AlertLog& alerts() noexcept { return alerts_; }
  bool in_step() const noexcept { return recorder_.in_step(); }
  bool in_phase() const noexcept { return recorder_.in_phase(); }
  void mark_step_profiled() noexcept { recorder_.mark_profiled(); }
  std::int64_t step_index() const noexcept { return recorder_.step_index(); }
  bool closed() const noexcept { return lifecycle_.closed(); }
  bool device_memory_sampled() const noexcept { return devices_.device_memory_sampled(); }
  std::int64_t write_errors() const noexcept { return writer_->write_errors(); }
  std::function<std::vector<std::string>()> record_reader(std::vector<std::string> kinds) {
    std::shared_ptr<RecordTap::Reader> reader = sinks_.tap.open(std::move(kinds));
    return [reader] { return reader->new_lines(); };
  }
  std::int64_t data_inside_step() const noexcept { return recorder_.data_inside_step(); }
  int write_errno() const noexcept { return writer_->first_errno(); }
  const std::string& log_path() const noexcept { return identity_.log.path; }
  int attempt() const noexcept { return identity_.log.attempt; }
  std::int64_t process_start() const noexcept { return identity_.process_start_unix_ns; }
  const Config& config() const noexcept { return config_; }
  int metrics_port() const noexcept { return sinks_.metrics ? sinks_.metrics->port() : -1; }

  std::int64_t collective_begin() noexcept { return recorder_.collective_begin(); }
  void collective_end(std::int64_t begin_ns, bool host_blocked, std::int64_t bytes,
                      std::int64_t bus_bytes) noexcept {
    recorder_.collective_end(begin_ns, host_blocked, bytes, bus_bytes);
  }
  int collectives_in_flight() const noexcept { return recorder_.collectives().in_flight(); }
  std::string current_phase() const { return recorder_.current_phase(); }
  std::string current_interval() const { return recorder_.current_interval(); }
  void set_peers_in_interval(int peers, double notice_s) noexcept {
    watch_.peers.set(peers, notice_s);
  }

  // A record from outside the core, as a value (the text overload parses it first; the
  // Python bindings convert a dict): one validation for both.
  void write_record(nlohmann::ordered_json j) {
    STEPTRACE_CHECK(j.is_object(), UsageError, "write_record: not a JSON object: {:.80}",
                    j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    const auto kind_it = j.find("kind");
    const std::string kind =
        kind_it != j.end() && kind_it->is_string() ? kind_it->get<std::string>() : "";
    STEPTRACE_CHECK(kind == "cluster" || kind == "alert" || kind == "resolved" ||
                        kind == "alert_update",  // an alert's evidence (issue 54)
                    UsageError,
                    "write_record: kind {:?} cannot be written; allowed: cluster, alert, "
                    "resolved, alert_update",
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
    if (!lifecycle_.stay_attached()) return false;  // closed from another thread, or forked
    lifecycle_.check_open();
    recorder_.check_can_begin();
    return lifecycle_.enter_step();
  }

  // The watchdog's 10 ms readings, where it runs (detect) on the host clock; null: the steps
  // read for themselves (a test's fake clock keeps every reading on the steps' own clock).
  HostReadings* host_readings() noexcept {
    return config_.detect && time_.host ? &host_.readings : nullptr;
  }

  RunManifest manifest(const RunInfo& info) const {
    RunManifest m;
    m.config = &config_;
    m.info = &info;
    m.start_unix_ns = time_.start.start_unix_ns;
    m.process_start_unix_ns = identity_.process_start_unix_ns;
    m.job = &identity_.job;
    m.log = &identity_.log;
    m.memory_sources = &host_.sources;
    m.heap = host_.heap.has_value();
    m.devices = &devices_;
    m.metrics = sinks_.metrics.get();
    m.peak = &peak_.choice;  // before any step: the training thread has not changed it yet
    if (time_.host) m.host_clock = host_clock_method(time_.counter);
    return m;
  }

  void stop_watchdog() {
    watch_.watchdog.request_stop();
    alerts_.close();  // wakes the watchdog if it waits on Python for stacks
    watch_.watchdog.join();
  }

  // The parts (profiler_parts.hpp), in the order they must outlive each other: each is
  // destroyed after everything declared below it.
  Config config_;
  RunClock time_;         // the run's clock and its mapping to unix time
  HostSampling host_;     // memory sources, the watchdog's host readings, the C heap
  PhaseNames names_;      // phase and step-value names (read by the writer and the scrape)
  RunIdentity identity_;  // job, attempt and log file, the process's start

  // The training thread's steps; it publishes the in-flight state the watchdog and the
  // Prometheus scrape read.
  StepRecorder recorder_;

  // The device side and its writer stages (before writer_, so they outlive it); the
  // telemetry's sampler thread is stopped in close() and the destructor, before the writer.
  DeviceParts devices_;
  MfuPeak peak_;  // MFU's divisor (set_mfu_dtype may change it)

  AlertLog alerts_;
  RunWatch watch_;  // detectors, peers, watchdog (peers before the watchdog and the metrics)

  RunLifecycle lifecycle_;  // closes from other threads, forks (see close())

  // Fed by the writer, so they outlive it.
  ExtraSinks sinks_;

  // Last: destroyed first, so the writer thread stops before the names it reads go.
  std::unique_ptr<RecordPipeline> writer_;
};

}  // namespace detail

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
void Profiler::mark_step_profiled() noexcept { impl_->mark_step_profiled(); }
bool Profiler::in_step() const noexcept { return impl_->in_step(); }
bool Profiler::in_phase() const noexcept { return impl_->in_phase(); }
std::int64_t Profiler::step_index() const noexcept { return impl_->step_index(); }
void Profiler::flush() { impl_->flush(); }
void Profiler::close(EndReason reason, std::string_view error) { impl_->close(reason, error); }
bool Profiler::closed() const noexcept { return impl_->closed(); }
bool Profiler::device_memory_sampled() const noexcept { return impl_->device_memory_sampled(); }
std::int64_t Profiler::write_errors() const noexcept { return impl_->write_errors(); }
std::function<std::vector<std::string>()> Profiler::record_reader(std::vector<std::string> kinds) {
  return impl_->record_reader(std::move(kinds));
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
void Profiler::write_record(std::string_view json_object) {
  auto j = nlohmann::ordered_json::parse(json_object, nullptr, /*allow_exceptions=*/false);
  STEPTRACE_CHECK(j.is_object(), UsageError, "write_record: not a JSON object: {:.80}",
                  json_object);
  impl_->write_record(std::move(j));
}
void detail::ProfilerAccess::write_record(Profiler& profiler, nlohmann::ordered_json record) {
  profiler.impl_->write_record(std::move(record));
}

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
  // Not JSON (or empty): discarded, which answers nothing, as any value but an object.
  impl_->alerts().answer_collectives(
      nlohmann::ordered_json::parse(json, nullptr, /*allow_exceptions=*/false));
}
void detail::ProfilerAccess::answer_collectives(Profiler& profiler, nlohmann::ordered_json answer) {
  profiler.impl_->alerts().answer_collectives(std::move(answer));
}

}  // namespace steptrace
