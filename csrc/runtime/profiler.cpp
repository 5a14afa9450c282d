#include "steptrace/profiler.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
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
#include "../core/check.hpp"
#include "../core/collective_timer.hpp"
#include "../core/detection_stage.hpp"
#include "../core/detectors.hpp"
#include "../core/device_activity.hpp"
#include "../core/device_timing.hpp"
#include "../core/hardware_alert.hpp"
#include "../core/heap_sampler.hpp"
#include "../core/host_steal.hpp"
#include "../core/lifecycle.hpp"
#include "../core/record_json.hpp"
#include "../core/record_pipeline.hpp"
#include "../core/run_queue.hpp"
#include "../core/stack_dump.hpp"
#include "../core/step_record.hpp"
#include "../core/telemetry.hpp"
#include "../sinks/jsonl_file_sink.hpp"
#include "../sinks/prometheus_sink.hpp"
#include "../sinks/record_tap.hpp"
#include "run_environment.hpp"
#include "steptrace/error.hpp"

#ifndef STEPTRACE_VERSION
#error "STEPTRACE_VERSION must be defined by the build"
#endif

namespace steptrace {
namespace detail {
namespace {

constexpr std::int64_t kUnset = -1;

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
  ProfilerImpl(Config config, RunInfo info, Backends backends)
      : config_(std::move(config)), pid_(getpid()), fork_generation_(fork_generation()) {
    config_.validate();
    resolve(config_);
    clock_ = backends.clock ? std::move(backends.clock) : make_host_clock();
    stream_source_ = std::move(backends.stream_source);
    if (config_.clock != "host") {
      std::unique_ptr<DeviceTimer> timer = std::move(backends.device_timer);
      if (!timer) timer = make_cuda_timer(&device_unavailable_);
      STEPTRACE_CHECK(timer || config_.clock != "cuda", ConfigError,
                      "clock=\"cuda\" but CUDA event timing is unavailable: {}; use "
                      "clock=\"auto\" to fall back to the host clock",
                      device_unavailable_);
      if (timer) {
        device_ = std::make_unique<DeviceTiming>(
            std::move(timer), static_cast<std::size_t>(config_.max_inflight_steps));
      }
    } else {
      device_unavailable_ = "disabled by clock=\"host\"";
    }
    if (backends.memory_sources.empty() && config_.sample_rss) {
      if (auto rss = make_rss_source()) backends.memory_sources.push_back(std::move(rss));
    }
    if (config_.sample_heap && HeapSampler::available()) heap_.emplace(config_);
    memory_sources_ = std::move(backends.memory_sources);
    setup_device_activity(backends, info.external_profiler_active);
    setup_telemetry(backends);
    source_samples_.resize(memory_sources_.size());
    source_sampled_ns_.assign(memory_sources_.size(), INT64_MIN / 2);
    for (const auto& name : config_.phases) names_.intern(name);
    phase_start_ns_.fill(kUnset);
    slot_of_.fill(-1);
    value_slot_.fill(-1);

    const int fd = open_log_file(config_, log_path_);
    start_ns_ = clock_->now_ns();
    start_unix_ns_ = unix_now_ns();
    process_start_unix_ns_ = process_start_unix_ns();
    if (config_.detect)
      detection_ = std::make_unique<DetectionStage>(config_, names_, alerts_, host_memory_bytes());
    std::vector<RecordSink*> sinks = {&tap_};
    if (config_.metrics_port >= 0 || !config_.metrics_textfile.empty() ||
        !config_.metrics_pushgateway.empty()) {
      setup_metrics();
      sinks.push_back(metrics_.get());
    }
    writer_ = std::make_unique<RecordPipeline>(std::make_unique<JsonlFileSink>(fd),
                                               run_start_json(info), config_.rank, names_,
                                               static_cast<std::size_t>(config_.queue_capacity),
                                               std::chrono::milliseconds(config_.flush_interval_ms),
                                               detection_.get(), completer(), std::move(sinks));
    if (telemetry_) {
      // Sampler thread: a hardware error is written at once, not with the next step.
      telemetry_->set_error_handler([this](const HardwareError& e) { report_hardware_error(e); });
      telemetry_->start();
    }
    if (config_.detect) {
      auto steal = std::make_unique<StealReader>();
      if (steal->available()) steal_ = std::move(steal);
      watchdog_ = std::thread([this] { watchdog_loop(); });
    }
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    register_for_signal(this);
  }

  ~ProfilerImpl() override {
    unregister_for_signal(this);  // waits while the SIGTERM watcher uses this profiler
    stop_watchdog();
    if (telemetry_ && !forked()) telemetry_->finish();
  }
  ProfilerImpl(const ProfilerImpl&) = delete;
  ProfilerImpl& operator=(const ProfilerImpl&) = delete;

  void begin_step() {
    if (detached_) return;
    if (close_requested_.load(std::memory_order_relaxed) || fork_generation() != fork_generation_) {
      detached_ = true;  // closed from another thread, or a forked child: record nothing
      return;
    }
    check_open();
    STEPTRACE_CHECK(!in_step_, UsageError,
                    "step begun while step {} is still running; end it before the next begins",
                    current_.step);
    STEPTRACE_CHECK(data_begin_ns_ == kUnset && !data_suspended_, UsageError,
                    "step begun while waiting on the data loader (begin_data without end_data)");
    if (!enter_step()) return;
    if (device_) {
      device_->poll(*writer_);
      report_device_failure();
      DeviceStream stream;
      if (stream_source_ && stream_source_->current(&stream)) {
        device_->set_stream(stream);
      } else if (stream_source_) {
        device_->clear_stream();
      }
    }
    on_device_ = device_ && device_->usable();
    const std::int64_t now = clock_->now_ns();
    current_.step = step_index_++;
    current_.start_unix_ns = unix_ns_at(now);
    if (open_interval_ >= 0) end_open_interval(now);  // a step ends the interval before it
    // The gap since the previous step: the loader's waits (data only when the loader is
    // wrapped), the intervals ended in it, and the rest (other host work).
    current_.data_ns = data_wrapped_ ? data_accum_ns_ : 0;
    current_.between = pending_;
    pending_ = BetweenSteps{};
    const std::int64_t gap = last_step_end_ns_ == kUnset ? 0 : now - last_step_end_ns_;
    current_.between.other_ns = std::max<std::int64_t>(
        0, gap - current_.data_ns - current_.between.eval_ns() - current_.between.checkpoint_ns());
    current_.phase_count = 0;
    current_.memory = MemorySample{};
    current_.failed = false;
    current_.phase_memory = detection_ && detection_->wants_phase_memory();
    if (current_.phase_memory) current_.memory_at_start = attribution_level();
    ended_phases_ = 0;
    step_start_ns_ = now;
    in_step_ = true;
    if (on_device_) device_->begin_step();
    current_.activity_begin_ns = -1;  // no kernels for this step
    if (activity_ && !activity_yielding_.load(std::memory_order_relaxed)) {
      current_.activity_begin_ns = activity_->now_ns();
      activity_->begin_step(current_.step);
    }
    if (sampler_) {
      const bool sampled = current_.step % config_.counter_every < config_.counter_burst;
      sampler_->begin_step(current_.step, sampled);
      current_.counters_sampled = sampled;
      current_.sampler_begin_ns = sampled ? sampler_->now_ns() : -1;
    }
    current_.telemetry_begin_ns = telemetry_ ? telemetry_->now_ns() : -1;
    inflight_start_ns_.store(now, std::memory_order_relaxed);
    inflight_excluded_ns_.store(0, std::memory_order_relaxed);
    inflight_step_.store(current_.step, std::memory_order_release);
  }

  void end_step(bool failed) {
    if (detached_) return;
    if (fork_generation() != fork_generation_) {  // forked inside the step
      detached_ = true;
      return;
    }
    STEPTRACE_CHECK(in_step_, UsageError, "end of a step without its start (no step is running)");
    const std::int64_t now = clock_->now_ns();
    for (std::uint16_t i = 0; i < current_.phase_count; ++i) {  // phases left open end here
      const std::uint16_t id = current_.phase_ids[i];
      if (phase_start_ns_[id] != kUnset) close_phase(id, now);
      slot_of_[id] = -1;
    }
    current_.step_ns = now - step_start_ns_;
    current_.host_ns = current_.step_ns;
    current_.comm = collectives_.take();
    current_.failed = failed;
    current_.rss_fresh = false;
    for (std::size_t i = 0; i < memory_sources_.size(); ++i) {
      if (now - source_sampled_ns_[i] >= memory_sources_[i]->min_interval_ns()) {
        source_samples_[i] = MemorySample{};
        memory_sources_[i]->sample(source_samples_[i]);
        source_sampled_ns_[i] = now;
        current_.rss_fresh = current_.rss_fresh || source_samples_[i].rss_bytes >= 0;
      }
      merge(current_.memory, source_samples_[i]);
    }
    if (heap_) heap_->sample(current_.step, current_.memory);
    current_.runq_ns = -1;
    current_.on_cpu_ns = -1;
    current_.steal_ns = -1;
    // Read at most every 10 ms, and at every iteration much longer than the recent ones, so
    // that a slow step always has the figure that tells contention from the model.
    const std::int64_t iteration =
        last_step_end_ns_ == kUnset ? current_.step_ns : now - last_step_end_ns_;
    const bool long_iteration = iteration_ewma_ns_ > 0 && iteration > 2 * iteration_ewma_ns_;
    // one long iteration moves the average a little, a lasting slowdown becomes its level
    iteration_ewma_ns_ =
        iteration_ewma_ns_ == 0
            ? iteration
            : iteration_ewma_ns_ +
                  (std::min(iteration, 4 * iteration_ewma_ns_) - iteration_ewma_ns_) / 16;
    if (now - runq_read_ns_ >= kRunQueueInterval || long_iteration) {
      const SchedStat sched = run_queue_.read();
      const std::int64_t steal = steal_total_ns_.load(std::memory_order_relaxed);
      if (sched.wait_ns >= 0 && runq_read_ns_ != kUnset) {
        current_.runq_ns = std::max<std::int64_t>(0, sched.wait_ns - runq_sched_.wait_ns);
        current_.runq_span_ns = now - runq_read_ns_;
        current_.on_cpu_ns = std::max<std::int64_t>(0, sched.on_cpu_ns - runq_sched_.on_cpu_ns);
        if (steal_) {  // what the host took can only be time this thread was off a CPU
          const std::int64_t off_cpu = std::max<std::int64_t>(
              0, current_.runq_span_ns - current_.on_cpu_ns - current_.runq_ns);
          current_.steal_ns = std::min(off_cpu, std::max<std::int64_t>(0, steal - runq_steal_ns_));
        }
      }
      runq_sched_ = sched;
      runq_steal_ns_ = steal;
      runq_read_ns_ = now;
    }
    merge(current_.memory, external_memory_);
    external_memory_ = MemorySample{};
    if (telemetry_) {       // device-wide memory at the sampler's latest reading: no driver call;
      MemorySample device;  // fresher than the Python hook's (at most once a second)
      if (telemetry_->device_memory(&device.device_used_bytes, &device.device_total_bytes)) {
        merge(current_.memory, device);
      }
    }
    if (current_.activity_begin_ns >= 0) {
      activity_->end_step(current_.step);
      current_.activity_end_ns = activity_->now_ns();
    }
    if (sampler_) {
      sampler_->end_step(current_.step);
      if (current_.counters_sampled) current_.sampler_end_ns = sampler_->now_ns();
    }
    if (telemetry_) current_.telemetry_end_ns = telemetry_->now_ns();
    if (on_device_) {
      device_->end_step(current_, *writer_);  // written once its events have completed
      report_device_failure();
    } else {
      writer_->push_step_record(current_);
    }
    clear_step_values();  // values set from now on belong to the next step
    // The next step's gap starts where this step ended: the bookkeeping above (memory reads,
    // slow only when preempted) is the next gap's `other`, so every second is accounted.
    last_step_end_ns_ = now;
    data_accum_ns_ = 0;
    data_wrapped_ = false;
    in_step_ = false;
    active_depth_ = 0;
    inflight_phase_.store(-1, std::memory_order_relaxed);
    last_done_ns_.store(current_.host_ns, std::memory_order_relaxed);
    last_done_step_.store(current_.step, std::memory_order_relaxed);
    inflight_step_.store(-1, std::memory_order_release);
    leave_step();
  }

  void begin_phase(PhaseId id) {
    if (detached_) return;
    check_phase_id(id);
    STEPTRACE_CHECK(in_step_, UsageError,
                    "phase {:?} started outside a step; start phases inside a step",
                    names_.name(id));
    STEPTRACE_CHECK(phase_start_ns_[id] == kUnset, UsageError,
                    "phase {:?} started while it is already running; a phase cannot be "
                    "nested in itself",
                    names_.name(id));
    const std::int64_t now = clock_->now_ns();
    if (slot_of_[id] < 0) {
      const std::uint16_t slot = current_.phase_count++;
      slot_of_[id] = static_cast<std::int8_t>(slot);
      current_.phase_ids[slot] = id;
      current_.phase_ns[slot] = 0;
      current_.host_phase_ns[slot] = 0;
    }
    active_[active_depth_++] = id;
    inflight_phase_.store(id, std::memory_order_relaxed);
    phase_start_ns_[id] = now;
    if (on_device_) device_->begin_phase(static_cast<std::uint16_t>(slot_of_[id]));
  }

  void end_phase(PhaseId id) {
    if (detached_) return;
    check_phase_id(id);
    STEPTRACE_CHECK(in_step_ && phase_start_ns_[id] != kUnset, UsageError,
                    "end of phase {:?} without its start", names_.name(id));
    close_phase(id, clock_->now_ns());
  }

  void begin_data() {
    if (detached_) return;
    if (close_requested_.load(std::memory_order_relaxed) || fork_generation() != fork_generation_) {
      detached_ = true;
      return;
    }
    if (in_step_) {
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
    data_begin_ns_ = clock_->now_ns();
  }

  void end_data() {
    if (detached_) return;
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
    data_accum_ns_ += clock_->now_ns() - data_begin_ns_;
    data_begin_ns_ = kUnset;
    data_wrapped_ = true;
  }

  void begin_interval(IntervalKind kind) {
    if (detached_) return;
    check_open();
    const std::int64_t now = clock_->now_ns();
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
    interval_in_step_ = in_step_;
    // for the watchdog (interval_hang): everything else before the kind, which publishes
    inflight_interval_start_ns_.store(now, std::memory_order_relaxed);
    inflight_interval_step_.store(step_index_, std::memory_order_relaxed);
    inflight_interval_seq_.fetch_add(1, std::memory_order_relaxed);
    inflight_interval_.store(open_interval_, std::memory_order_release);
  }

  void end_interval(IntervalKind kind) {
    if (detached_ || open_interval_ != static_cast<int>(kind)) return;
    end_open_interval(clock_->now_ns());
  }

  std::optional<IntervalKind> open_interval() const noexcept {
    if (open_interval_ < 0) return std::nullopt;
    return static_cast<IntervalKind>(open_interval_);
  }

  void set_step_memory(const MemorySample& s) { merge(external_memory_, s); }

  StepValueId step_value_id(std::string_view name) { return names_.intern_value(name); }
  void set_step_value(StepValueId id, double value) {
    STEPTRACE_CHECK(id < names_.value_count(), UsageError, "step value id {} was never interned",
                    id);
    std::int8_t& slot = value_slot_[id];
    if (slot < 0) {  // one slot per interned name: a step cannot run out of them
      slot = static_cast<std::int8_t>(current_.value_count++);
      current_.value_ids[static_cast<std::size_t>(slot)] = id;
    }
    current_.values[static_cast<std::size_t>(slot)] = value;
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
    activity_yielding_.store(active, std::memory_order_relaxed);
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
    const bool foreign = owner_.load(std::memory_order_relaxed) != std::this_thread::get_id();
    bool step_left_running = false;
    std::int64_t running_step = -1;
    if (foreign) {
      close_requested_.store(true, std::memory_order_seq_cst);
      std::unique_lock<std::mutex> lock(busy_mu_);
      const auto wait = std::chrono::duration<double>(config_.close_wait_s);
      step_left_running =
          !busy_cv_.wait_for(lock, wait, [&] { return !busy_.load(std::memory_order_seq_cst); });
      if (step_left_running) running_step = inflight_step_.load(std::memory_order_acquire);
    }
    std::lock_guard<std::mutex> lock(close_mu_);
    if (closed_.load(std::memory_order_acquire)) return;
    if (!foreign && in_step_) end_step(/*failed=*/true);
    if (!foreign && open_interval_ >= 0) end_open_interval(clock_->now_ns());
    // The device is the training thread's while its step runs: then neither drain it nor
    // finish the device activity here.
    if (device_ && !step_left_running) {
      device_->drain(*writer_);  // the one synchronization of the run
      report_device_failure();
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
    end.end_unix_ns = unix_ns_at(now);
    end.wall_s = static_cast<double>(now - start_ns_) / 1e9;
    end.data_inside_step = data_inside_step();
    end.process_start_unix_ns = process_start_unix_ns_;
    end.profiler_start_unix_ns = start_unix_ns_;
    if (!foreign) {  // the intervals after the last step are the training thread's
      end.trailing = pending_;
      fmt::memory_buffer lines;
      for (std::uint8_t i = 0; i < pending_.listed; ++i) {
        append_interval_json(lines, pending_.intervals[i], step_index_, config_.rank);
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
      end.wall_s = static_cast<double>(end.end_unix_ns - start_unix_ns_) / 1e9;
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
    if (watchdog_.joinable()) new std::thread(std::move(watchdog_));  // NOLINT: leaked
    // its sampler thread is the parent's: joining it here would never return
    if (telemetry_) telemetry_.release();  // NOLINT: leaked
    if (metrics_) metrics_.release();      // NOLINT: its server thread is the parent's
  }

  PhaseId phase_id(std::string_view name) { return names_.intern(name); }
  const std::string& phase_name(PhaseId id) const {
    check_phase_id(id);
    return names_.name(id);
  }

  AlertLog& alerts() noexcept { return alerts_; }
  bool in_step() const noexcept { return in_step_; }
  bool in_phase() const noexcept { return active_depth_ > 0; }
  std::int64_t step_index() const noexcept { return step_index_; }
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
  std::int64_t data_inside_step() const noexcept {
    return data_inside_step_.load(std::memory_order_relaxed);
  }
  int write_errno() const noexcept { return writer_->first_errno(); }
  const std::string& log_path() const noexcept { return log_path_; }
  const Config& config() const noexcept { return config_; }
  int metrics_port() const noexcept { return metrics_ ? metrics_->port() : -1; }

  std::int64_t collective_begin() noexcept {
    const std::int64_t now = clock_->now_ns();
    collectives_.begin(now);
    return now;
  }
  void collective_end(std::int64_t begin_ns, bool host_blocked) noexcept {
    collectives_.end(begin_ns, clock_->now_ns(), inflight_phase_.load(std::memory_order_relaxed),
                     host_blocked);
  }
  int collectives_in_flight() const noexcept { return collectives_.in_flight(); }
  std::string current_phase() const {
    const int phase = inflight_phase_.load(std::memory_order_relaxed);
    return phase >= 0 ? names_.name(static_cast<PhaseId>(phase)) : std::string();
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
    const std::string type = kind == "cluster" ? "" : type_it->get<std::string>();
    const auto repeats_it = j.find("repeats");
    const std::int64_t repeats = repeats_it != j.end() && repeats_it->is_number_integer()
                                     ? repeats_it->get<std::int64_t>()
                                     : 0;
    j["rank"] = config_.rank;  // may move the members: the iterators above are dead now
    if (closed()) return;
    std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    if (kind != "cluster") alerts_.publish_line(type, kind == "resolved", repeats, line);
    writer_->push_line_now(std::move(line));
  }

 private:
  // Unix time of a reading of clock_, on the run's one mapping (set at the start).
  std::int64_t unix_ns_at(std::int64_t clock_ns) const noexcept {
    return start_unix_ns_ + (clock_ns - start_ns_);
  }

  // The training thread is inside a step from here to leave_step(): a close from another
  // thread waits for that (Dekker-style: each side stores its flag, then reads the other's).
  // False when such a close was requested first: the step is not recorded.
  bool enter_step() noexcept {
    owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
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
  void clear_step_values() noexcept {
    for (std::uint8_t i = 0; i < current_.value_count; ++i) value_slot_[current_.value_ids[i]] = -1;
    current_.value_count = 0;
  }
  void check_phase_id(PhaseId id) const {
    STEPTRACE_CHECK(id < names_.size(), UsageError, "phase id {} was never interned", id);
  }

  // Ends the open interval at `now`: into the step in progress when it began inside it,
  // else into the next step's account of the gap (pending_).
  void end_open_interval(std::int64_t now) noexcept {
    const auto kind = static_cast<IntervalKind>(open_interval_);
    open_interval_ = -1;
    inflight_interval_.store(-1, std::memory_order_release);
    if (data_suspended_) {  // the data wait the interval paused goes on
      data_suspended_ = false;
      data_begin_ns_ = now;
    }
    const bool inside = interval_in_step_ && in_step_;
    BetweenSteps& into = inside ? current_.between : pending_;
    const std::int64_t duration = now - interval_start_ns_;
    auto& longest = longest_interval_ns_[static_cast<std::size_t>(kind)];
    if (duration > longest.load(std::memory_order_relaxed)) {
      longest.store(duration, std::memory_order_relaxed);
    }
    into.interval_ns[static_cast<std::size_t>(kind)] += duration;
    if (inside && kind != IntervalKind::kOther) {  // other host work inside a step is the step's
      into.inside_step_ns += duration;
      inflight_excluded_ns_.store(into.inside_step_ns, std::memory_order_relaxed);
    }
    if (into.listed < kMaxStepIntervals) {
      into.intervals[into.listed++] =
          IntervalEntry{kind, inside, unix_ns_at(interval_start_ns_), duration};
    } else {
      ++into.unlisted;
    }
  }

  void close_phase(PhaseId id, std::int64_t now) noexcept {
    const std::int64_t elapsed = now - phase_start_ns_[id];
    const int slot = slot_of_[id];
    current_.phase_ns[slot] += elapsed;
    current_.host_phase_ns[slot] += elapsed;
    phase_start_ns_[id] = kUnset;
    if (on_device_) device_->end_phase(static_cast<std::uint16_t>(slot));
    if (current_.phase_memory) {
      // A phase that runs again ends later: keep its last level and place.
      current_.phase_memory_end[slot] = attribution_level();
      current_.phase_end_order[slot] = static_cast<std::uint8_t>(ended_phases_++);
    }
    // Phases usually end innermost first; the explicit API may end them in any order.
    for (std::size_t i = active_depth_; i-- > 0;) {
      if (active_[i] == id) {
        for (std::size_t j = i; j + 1 < active_depth_; ++j) active_[j] = active_[j + 1];
        --active_depth_;
        break;
      }
    }
    inflight_phase_.store(active_depth_ > 0 ? active_[active_depth_ - 1] : -1,
                          std::memory_order_relaxed);
  }

  // The kernel activity and counter backends: given ones are used as they are; the
  // CUPTI ones only where steps are timed with CUDA events (there is a GPU and a driver).
  void setup_device_activity(Backends& b, bool external_profiler) {
    const std::string no_device =
        "needs a CUDA device with CUDA event timing, which is unavailable (" + device_unavailable_ +
        ")";
    if (config_.kernel_activity == "off") {
      activity_unavailable_ = "disabled by kernel_activity=\"off\"";
    } else if (b.kernel_activity) {
      activity_ = std::move(b.kernel_activity);
    } else if (!device_) {
      activity_unavailable_ = no_device;
    } else {
      activity_ = make_cupti_activity(&activity_unavailable_, external_profiler);
    }
    if (config_.counters == "off") {
      counters_unavailable_ = "disabled by counters=\"off\"";
    } else if (b.counter_sampler) {
      sampler_ = std::move(b.counter_sampler);
    } else if (!device_) {
      counters_unavailable_ = no_device;
    } else {
      sampler_ = make_cupti_counter_sampler(config_.device_index, &counters_unavailable_);
    }
    if (external_profiler) set_external_profiler(true);
    if (activity_ || sampler_) {
      device_stage_ =
          std::make_unique<DeviceActivityStage>(config_, activity_.get(), sampler_.get());
    }
  }

  // The Prometheus endpoint (before the writer starts: run_start names its port). Its
  // values come from the writer thread; the live gauges are read at each scrape.
  void setup_metrics() {
    int port = config_.metrics_port;
    if (port > 0) port += env_int("LOCAL_RANK", 0);  // a port range: one per rank on a host
    MetricLabels labels;
    labels.job = config_.job;
    labels.run_id = config_.run_id;
    labels.rank = config_.rank;
    labels.host = host_name();
    std::function<double()> median;
    if (detection_) median = [this] { return detection_->median_ms() / 1e3; };
    auto in_flight = [this]() -> double {
      if (inflight_step_.load(std::memory_order_acquire) < 0) return 0.0;
      const std::int64_t age =
          clock_->now_ns() - inflight_start_ns_.load(std::memory_order_relaxed);
      return age > 0 ? static_cast<double>(age) / 1e9 : 0.0;
    };
    auto open_interval = [this]() -> OpenIntervalProbe {
      OpenIntervalProbe probe;
      const int kind = inflight_interval_.load(std::memory_order_acquire);
      if (kind < 0) return probe;
      probe.kind = static_cast<IntervalKind>(kind);
      const std::int64_t age =
          clock_->now_ns() - inflight_interval_start_ns_.load(std::memory_order_relaxed);
      probe.age_s = age > 0 ? static_cast<double>(age) / 1e9 : 0.0;
      return probe;
    };
    MetricsOutputs outputs;
    outputs.port = port > 65535 ? -1 : port;
    outputs.textfile = config_.metrics_textfile;
    outputs.pushgateway = config_.metrics_pushgateway;
    metrics_ = std::make_unique<PrometheusSink>(std::move(outputs), std::move(labels), names_,
                                                STEPTRACE_VERSION, std::move(median),
                                                std::move(in_flight), std::move(open_interval));
    if (config_.metrics_port >= 0 && metrics_->port() < 0) {
      std::fprintf(stderr, "steptrace: no Prometheus endpoint: %s; the run goes on without it\n",
                   metrics_->error().c_str());
    }
  }

  nlohmann::ordered_json metrics_json() const {
    if (!metrics_) return nullptr;
    nlohmann::ordered_json j = {{"port", nullptr}, {"path", "/metrics"}};
    if (metrics_->port() >= 0) j["port"] = metrics_->port();
    if (!metrics_->error().empty()) j["error"] = metrics_->error();
    if (!config_.metrics_textfile.empty()) j["textfile"] = config_.metrics_textfile;
    if (!config_.metrics_pushgateway.empty()) j["pushgateway"] = config_.metrics_pushgateway;
    return j;
  }

  // NVML telemetry: a given source as it is; else NVML where it loads and sees the device.
  void setup_telemetry(Backends& b) {
    if (config_.nvml == "off") {
      telemetry_unavailable_ = "disabled by nvml=\"off\"";
    } else if (b.telemetry) {
      telemetry_ = std::move(b.telemetry);
    } else {
      telemetry_ = make_nvml_telemetry(config_.device_index, config_.nvml_interval_ms,
                                       &telemetry_unavailable_);
    }
    if (telemetry_) telemetry_stage_ = std::make_unique<TelemetryStage>(telemetry_.get());
    if (device_stage_ && telemetry_stage_) {
      chained_stage_ = std::make_unique<ChainedCompleter>(
          std::vector<StepCompleter*>{device_stage_.get(), telemetry_stage_.get()});
    }
  }

  StepCompleter* completer() const {
    if (chained_stage_) return chained_stage_.get();
    if (device_stage_) return device_stage_.get();
    return telemetry_stage_.get();
  }

  nlohmann::ordered_json telemetry_json() const {
    using nlohmann::ordered_json;
    if (!telemetry_) {
      return {{"active", ordered_json::array()},
              {"unavailable", {{"nvml", telemetry_unavailable_}}}};
    }
    ordered_json j = {{"active", {telemetry_->name()}}, {"unavailable", ordered_json::object()}};
    if (std::string device = telemetry_->device(); !device.empty()) j["device"] = device;
    if (telemetry_->power_limit_w() > 0) j["power_limit_w"] = telemetry_->power_limit_w();
    j["interval_ms"] = config_.nvml_interval_ms;
    std::int64_t used = -1, total = -1;
    if (telemetry_->device_memory(&used, &total)) j["device_memory"] = true;
    if (auto board = telemetry_->board_wide(); !board.empty()) j["board_wide"] = board;
    return j;
  }

  // Sampler thread: an XID or a new uncorrectable ECC error is page-worthy.
  void report_hardware_error(const HardwareError& e) {
    try {
      AlertEvent a = hardware_alert(e, telemetry_->device());
      a.step = std::max<std::int64_t>(last_done_step_.load(std::memory_order_relaxed), 0);
      a.unix_ns = unix_ns_at(clock_->now_ns());
      const std::string line = alert_json_line(a, config_.rank);
      writer_->push_line_now(line);
      alerts_.publish(a, line);
    } catch (...) {  // never into NVML's or the sampler's stack
    }
  }

  // One of the device-activity entries of run_start's "backends".
  static nlohmann::ordered_json optional_backend_json(const char* active_name,
                                                      const std::string& unavailable) {
    using nlohmann::ordered_json;
    if (active_name != nullptr) {
      return {{"active", {active_name}}, {"unavailable", ordered_json::object()}};
    }
    return {{"active", ordered_json::array()}, {"unavailable", {{"cupti", unavailable}}}};
  }

  nlohmann::ordered_json counters_json() const {
    nlohmann::ordered_json j =
        optional_backend_json(sampler_ ? sampler_->name() : nullptr, counters_unavailable_);
    if (sampler_) {
      nlohmann::ordered_json metrics = nlohmann::ordered_json::object();
      for (std::size_t i = 0; i < kCounterCount; ++i) {
        const std::string m = sampler_->metric(i);
        if (!m.empty()) metrics[kCounterNames[i]] = m;
      }
      j["metrics"] = metrics;
      if (std::string device = sampler_->device(); !device.empty()) j["device"] = device;
    }
    return j;
  }

  // Once: the device timer failed, so say so in the log and carry on with the host clock.
  void report_device_failure() {
    if (device_failure_reported_ || device_->failure().empty()) return;
    device_failure_reported_ = true;
    AlertEvent a;
    a.type = "timer_fallback";
    a.step = std::max<std::int64_t>(device_->failed_at_step(), 0);
    a.value = 0;
    a.threshold = 0;
    a.message = fmt::format(
        "CUDA event timing stopped at step {} ({}); this step and the ones after it use "
        "the host clock",
        a.step, device_->failure());
    a.details = {{"reason", device_->failure()}};
    a.unix_ns = unix_ns_at(clock_->now_ns());
    const std::string line = alert_json_line(a, config_.rank);
    writer_->push_line_now(line);
    alerts_.publish(a, line);
  }

  // The level phase attribution follows (only for a few steps after a memory_growth
  // alert): the first source's live bytes, the torch allocator's before the C heap's.
  // RSS would not do: the heap rarely gives memory back, so RSS rises where the
  // high-water mark is crossed, not where a leak is.
  std::int64_t attribution_level() noexcept {
    for (auto& source : memory_sources_) {
      const std::int64_t live = source->live_bytes();
      if (live >= 0) return live;
    }
    if (heap_) return HeapSampler::read();
    return 0;  // no live figure: every phase retains nothing
  }

  void watchdog_loop() {
    HangDetector hang(config_);
    IntervalHangDetector interval_hang(config_);
    std::unique_lock<std::mutex> lock(watchdog_mu_);
    // Steal is sampled every 10 ms (its ticks are 10 ms at USER_HZ 100), hangs every 100.
    const auto period = std::chrono::milliseconds(steal_ ? 10 : 100);
    const int wakes_per_check = steal_ ? 10 : 1;
    for (int wake = 0, last = 0; !last; ++wake) {
      watchdog_cv_.wait_for(lock, period, [&] { return watchdog_stop_; });
      last = watchdog_stop_ ? 1 : 0;  // one more check at close: a hang resolved just before it
      lock.unlock();
      if (steal_) steal_total_ns_.store(steal_->sample(), std::memory_order_relaxed);
      if (!last && wake % wakes_per_check != 0) {
        lock.lock();
        continue;
      }
      HangDetector::Poll poll;
      poll.step = inflight_step_.load(std::memory_order_acquire);
      poll.start_ns = inflight_start_ns_.load(std::memory_order_relaxed);
      const int phase = inflight_phase_.load(std::memory_order_relaxed);
      if (phase >= 0) poll.phase = names_.name(static_cast<PhaseId>(phase));
      poll.last_done_step = last_done_step_.load(std::memory_order_relaxed);
      poll.last_done_ns = last_done_ns_.load(std::memory_order_relaxed);
      poll.median_ms = detection_->median_ms();
      poll.history_ok = detection_->history_ok();
      poll.closing = last;
      poll.now_ns = clock_->now_ns();
      IntervalHangDetector::Poll in_interval;
      in_interval.now_ns = poll.now_ns;
      in_interval.kind = inflight_interval_.load(std::memory_order_acquire);
      if (in_interval.kind >= 0) {
        in_interval.start_ns = inflight_interval_start_ns_.load(std::memory_order_relaxed);
        in_interval.step = inflight_interval_step_.load(std::memory_order_relaxed);
        in_interval.seq = inflight_interval_seq_.load(std::memory_order_relaxed);
        in_interval.longest_earlier_ns =
            longest_interval_ns_[static_cast<std::size_t>(in_interval.kind)].load(
                std::memory_order_relaxed);
      }
      in_interval.closing = last;
      // An interval inside the step in flight is not training work: the step's hang clock
      // stops while it runs (interval_hang watches it) and leaves its time out afterwards.
      if (in_interval.kind >= 0) poll.step = -1;
      poll.start_ns += inflight_excluded_ns_.load(std::memory_order_relaxed);
      for (auto event : {hang.check(poll), interval_hang.check(in_interval)}) {
        if (!event) continue;
        event->unix_ns = unix_ns_at(poll.now_ns);
        if (!event->resolved) {
          // Where every thread is: from the armed signal handler (faulthandler; no GIL, so
          // also while the hung thread holds it), else from Python if it answers in 2 s.
          std::string stacks = dump_stacks();
          const char* source = "faulthandler";
          if (stacks.empty()) {
            stacks = alerts_.request_stacks(2000);
            source = "python";
          }
          event->details["stacks"] =
              stacks.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(stacks);
          event->details["stacks_source"] =
              stacks.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(source);
        }
        const std::string line = alert_json_line(*event, config_.rank);
        writer_->push_line_now(line);
        alerts_.publish(*event, line);
      }
      lock.lock();
    }
  }

  void stop_watchdog() {
    {
      std::lock_guard<std::mutex> lock(watchdog_mu_);
      watchdog_stop_ = true;
    }
    watchdog_cv_.notify_all();
    alerts_.close();
    if (watchdog_.joinable()) watchdog_.join();
  }

  static void merge(MemorySample& into, const MemorySample& from) noexcept {
    auto take = [](std::int64_t& a, std::int64_t b) {
      if (b >= 0) a = b;
    };
    take(into.allocated_bytes, from.allocated_bytes);
    take(into.reserved_bytes, from.reserved_bytes);
    take(into.peak_bytes, from.peak_bytes);
    take(into.rss_bytes, from.rss_bytes);
    take(into.heap_bytes, from.heap_bytes);
    take(into.device_used_bytes, from.device_used_bytes);
    take(into.device_total_bytes, from.device_total_bytes);
  }

  nlohmann::ordered_json timer_json() const {
    using nlohmann::ordered_json;
    if (device_) {
      return {{"active", {device_->timer().name(), "host"}},
              {"unavailable", ordered_json::object()}};
    }
    return {{"active", {"host"}}, {"unavailable", {{"cuda", device_unavailable_}}}};
  }

  nlohmann::ordered_json device_json() const {
    if (!device_) return nullptr;
    const std::string name = device_->timer().device_name();
    if (name.empty()) return nullptr;
    nlohmann::ordered_json d = {{"name", name}};
    const std::int64_t bytes = device_->timer().device_memory_bytes();
    if (bytes > 0) d["memory_total_bytes"] = bytes;
    return d;
  }

  // run_start.config: every option of steptrace/config_options.def, in table order, but
  // run_id, rank and world_size (resolved, at the top level of run_start).
  nlohmann::ordered_json config_json() const {
    nlohmann::ordered_json options = nlohmann::ordered_json::object();
#define STEPTRACE_CONFIG_OPTION(group, type, name, default_value, check, doc)     \
  if (std::string_view(#name) != "run_id" && std::string_view(#name) != "rank" && \
      std::string_view(#name) != "world_size") {                                  \
    options[#name] = config_.name;                                                \
  }
#include "steptrace/config_options.def"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/ext/telemetry.hpp"
    return options;
  }

  std::string run_start_json(const RunInfo& info) const {
    using nlohmann::ordered_json;
    ordered_json versions = {{"steptrace", STEPTRACE_VERSION}};
    for (const auto& [key, value] : info.versions) versions[key] = value;
    ordered_json memory_active = ordered_json::array();
    for (const auto& source : memory_sources_) memory_active.push_back(source->name());
    if (heap_) memory_active.push_back("heap");
    ordered_json memory_unavailable = ordered_json::object();
    if (!config_.sample_rss) memory_unavailable["rss"] = "disabled by sample_rss=false";
    if (!config_.sample_heap) {
      memory_unavailable["heap"] = "disabled by sample_heap=false";
    } else if (!heap_) {
      memory_unavailable["heap"] = "the C library has no mallinfo2 (not glibc)";
    }
    const ordered_json record = {
        {"kind", "run_start"},
        {"schema", "steptrace/1"},
        {"run_id", config_.run_id},
        {"rank", config_.rank},
        {"world_size", config_.world_size},
        {"host", host_name()},
        {"pid", getpid()},
        {"start_unix_ns", start_unix_ns_},
        {"versions", versions},
        {"device", device_json()},
        {"config", config_json()},
        {"backends",
         {{"timer", timer_json()},
          {"memory", {{"active", memory_active}, {"unavailable", memory_unavailable}}},
          {"kernel_activity",
           optional_backend_json(activity_ ? activity_->name() : nullptr, activity_unavailable_)},
          {"counters", counters_json()},
          {"telemetry", telemetry_json()}}},
    };
    if (metrics_) {
      nlohmann::ordered_json with_metrics = record;
      with_metrics["metrics"] = metrics_json();
      return with_metrics.dump() + "\n";
    }
    return record.dump() + "\n";
  }

  Config config_;
  std::unique_ptr<Clock> clock_;
  std::vector<std::unique_ptr<MemorySource>> memory_sources_;
  std::optional<HeapSampler> heap_;              // the C heap, when sample_heap
  std::vector<MemorySample> source_samples_;     // each source's last figures
  std::vector<std::int64_t> source_sampled_ns_;  // and when they were taken
  PhaseNames names_;
  std::string log_path_;
  std::int64_t start_ns_ = 0;
  std::int64_t start_unix_ns_ = 0;
  std::int64_t process_start_unix_ns_ = 0;  // 0: unknown

  // Training-thread state of the step in progress.
  StepRecord current_;
  MemorySample external_memory_;
  std::array<std::int64_t, kMaxPhases> phase_start_ns_{};  // kUnset: not running
  std::array<std::int8_t, kMaxPhases> slot_of_{};          // -1: not in current_
  std::array<std::int8_t, kMaxStepValues> value_slot_{};   // -1: not set for current_
  std::int64_t step_index_ = 0;
  std::int64_t step_start_ns_ = 0;
  std::int64_t last_step_end_ns_ = kUnset;
  std::int64_t data_begin_ns_ = kUnset;
  std::int64_t data_accum_ns_ = 0;
  bool data_wrapped_ = false;
  BetweenSteps pending_;    // intervals ended since the last step ended
  int open_interval_ = -1;  // IntervalKind of the open interval, -1: none
  std::int64_t interval_start_ns_ = 0;
  bool interval_in_step_ = false;  // the open interval began inside a step
  bool data_suspended_ = false;    // a data wait was open when the interval began
  static constexpr std::int64_t kRunQueueInterval = 10'000'000;  // ns between schedstat reads
  RunQueueReader run_queue_;
  std::int64_t runq_read_ns_ = kUnset;  // when it was last read, and the figures then
  SchedStat runq_sched_;
  std::int64_t runq_steal_ns_ = 0;
  std::int64_t iteration_ewma_ns_ = 0;  // recent iterations (the gap and the step), smoothed
  bool data_ignored_ = false;  // begin_data came inside a step: its end_data is ignored too
  std::atomic<std::int64_t> data_inside_step_{0};  // read by close() on any thread
  bool in_step_ = false;
  std::atomic<bool> closed_{false};
  std::size_t ended_phases_ = 0;              // phases ended in this step, for phase_end_order
  std::array<PhaseId, kMaxPhases> active_{};  // running phases, innermost last
  std::size_t active_depth_ = 0;

  // Read by the watchdog thread.
  std::atomic<std::int64_t> inflight_step_{-1};
  std::atomic<std::int64_t> inflight_start_ns_{0};
  std::atomic<std::int64_t> inflight_excluded_ns_{0};  // intervals inside the step in flight
  std::atomic<int> inflight_phase_{-1};
  std::atomic<std::int64_t> last_done_step_{-1};  // the last step that ended, and its host time
  std::atomic<std::int64_t> last_done_ns_{0};
  std::atomic<int> inflight_interval_{-1};  // IntervalKind of the open interval, -1: none
  std::atomic<std::int64_t> inflight_interval_start_ns_{0};
  std::atomic<std::int64_t> inflight_interval_step_{0};
  std::atomic<std::int64_t> inflight_interval_seq_{0};
  std::array<std::atomic<std::int64_t>, kIntervalKinds> longest_interval_ns_{};  // by kind
  CollectiveTimer collectives_;  // any thread: collectives timed from the host

  std::unique_ptr<StreamSource> stream_source_;
  std::unique_ptr<DeviceTiming> device_;
  std::string device_unavailable_;  // why device_ is null
  bool on_device_ = false;          // the step in progress records device events
  bool device_failure_reported_ = false;

  // Kernel activity and counters; the stage that joins them to the records runs on the
  // writer thread (declared before writer_, so it outlives it).
  std::unique_ptr<KernelActivitySource> activity_;
  std::unique_ptr<CounterSampler> sampler_;
  std::atomic<bool> activity_yielding_{false};  // another profiler has the activity records
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
  std::unique_ptr<StealReader> steal_;           // null: no steal to sample (bare metal)
  std::atomic<std::int64_t> steal_total_ns_{0};  // the watchdog's latest StealReader::sample
  std::mutex watchdog_mu_;
  std::condition_variable watchdog_cv_;
  bool watchdog_stop_ = false;  // guarded by watchdog_mu_
  std::thread watchdog_;

  // Lifecycle: closes from other threads, forks (see close()).
  const pid_t pid_;
  const std::uint64_t fork_generation_;
  std::atomic<std::thread::id> owner_{};      // the training thread: the last to begin a step
  std::atomic<bool> busy_{false};             // the training thread is inside a step
  std::atomic<bool> close_requested_{false};  // by a close from another thread
  bool detached_ = false;  // training thread: record nothing more (foreign close, fork)
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
void Profiler::begin_step() { impl_->begin_step(); }
void Profiler::end_step(bool failed) { impl_->end_step(failed); }
void Profiler::begin_phase(PhaseId id) { impl_->begin_phase(id); }
void Profiler::end_phase(PhaseId id) { impl_->end_phase(id); }
void Profiler::begin_data() { impl_->begin_data(); }
Interval Profiler::interval(IntervalKind kind) {
  impl_->begin_interval(kind);
  return Interval(this, kind);
}
void Profiler::begin_interval(IntervalKind kind) { impl_->begin_interval(kind); }
void Profiler::end_interval(IntervalKind kind) { impl_->end_interval(kind); }
std::optional<IntervalKind> Profiler::open_interval() const noexcept {
  return impl_->open_interval();
}
void Profiler::end_data() { impl_->end_data(); }
void Profiler::set_step_memory(const MemorySample& sample) { impl_->set_step_memory(sample); }
void Profiler::set_step_value(StepValueId id, double value) { impl_->set_step_value(id, value); }
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
std::int64_t Profiler::data_inside_step() const noexcept { return impl_->data_inside_step(); }
std::string Profiler::write_error() const {
  const int e = impl_->write_errno();
  return e == 0 ? std::string() : std::string(std::strerror(e));
}
const std::string& Profiler::log_path() const noexcept { return impl_->log_path(); }
int Profiler::metrics_port() const noexcept { return impl_->metrics_port(); }
const Config& Profiler::config() const noexcept { return impl_->config(); }
std::int64_t Profiler::collective_begin() noexcept { return impl_->collective_begin(); }
void Profiler::collective_end(std::int64_t begin_token, bool host_blocked) noexcept {
  impl_->collective_end(begin_token, host_blocked);
}
int Profiler::collectives_in_flight() const noexcept { return impl_->collectives_in_flight(); }
std::string Profiler::current_phase() const { return impl_->current_phase(); }
void Profiler::write_record(std::string_view json_object) { impl_->write_record(json_object); }

void Profiler::set_alert_callback(std::function<void(const std::string&)> callback) {
  impl_->alerts().set_callback(std::move(callback));
}
void Profiler::subscribe_events() { impl_->alerts().subscribe(); }
std::optional<ProfilerEvent> Profiler::wait_event(int timeout_ms) {
  auto e = impl_->alerts().wait_event(timeout_ms);
  if (!e) return std::nullopt;
  return ProfilerEvent{e->kind == detail::SubscriberEvent::kStackRequest, std::move(e->json)};
}
void Profiler::answer_stacks(std::string stacks) {
  impl_->alerts().answer_stacks(std::move(stacks));
}

bool install_sigterm_handler(bool terminate, double grace_s) {
  const double ms = std::clamp(grace_s, 0.0, 86400.0) * 1000.0;
  return detail::watch_sigterm(terminate, std::chrono::milliseconds(static_cast<std::int64_t>(ms)));
}
void remove_sigterm_handler() noexcept { detail::unwatch_sigterm(); }

bool set_stack_dump_signal(int signum, int fd) noexcept {
  return detail::arm_stack_dump(signum, fd);
}
int spare_signal() noexcept { return detail::spare_signal(); }

const char* version() noexcept { return STEPTRACE_VERSION; }

}  // namespace steptrace
