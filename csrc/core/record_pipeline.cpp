#include "record_pipeline.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>

#include "lifecycle.hpp"
#include "steptrace/ext/background_thread.hpp"

namespace steptrace::detail {
namespace {
// Write in chunks of about this size while draining a long backlog.
constexpr std::size_t kWriteChunkBytes = 1 << 16;
}  // namespace

template <typename Fn>
void RecordPipeline::feed(Fn&& fn) noexcept {
  for (SinkState& s : sinks_) {
    if (s.failed) continue;
    const auto start = std::chrono::steady_clock::now();
    try {
      fn(*s.sink);
    } catch (const std::exception& e) {
      s.failed = true;
      s.failure = e.what();
      const std::string what = fmt::format("{}: {}", s.sink->name(), e.what());
      std::fprintf(stderr,
                   "steptrace: the %s sink failed (%s); it is off for the rest of the run, the "
                   "log file and the other sinks carry on\n",
                   std::string(s.sink->name()).c_str(), e.what());
      std::lock_guard<std::mutex> lock(mu_);
      sink_failures_.push_back(what);
      continue;
    } catch (...) {
      s.failed = true;
      s.failure = "unknown exception";
      std::fprintf(stderr, "steptrace: the %s sink failed; it is off for the rest of the run\n",
                   std::string(s.sink->name()).c_str());
      std::lock_guard<std::mutex> lock(mu_);
      sink_failures_.push_back(fmt::format("{}: unknown exception", s.sink->name()));
      continue;
    }
    const auto took = std::chrono::steady_clock::now() - start;
    s.max_call = std::max(s.max_call, took);
    if (took > kSlowSinkCall && s.slow_calls++ == 0) {
      std::fprintf(stderr,
                   "steptrace: the %s sink took %.1f s for one batch; records reach the other "
                   "sinks that much later (the training thread does not wait for it)\n",
                   std::string(s.sink->name()).c_str(),
                   std::chrono::duration<double>(took).count());
    }
  }
}

std::string RecordPipeline::sinks_json() const {
  fmt::memory_buffer out;
  auto it = std::back_inserter(out);
  out.append(std::string_view("\"sinks\":["));
  bool first = true;
  for (const SinkState& s : sinks_) {
    if (!s.sink->listed()) continue;
    const std::string error = s.failed ? s.failure : s.sink->first_error();
    const char* status = !error.empty() ? "failing" : s.slow_calls > 0 ? "slow" : "ok";
    if (!first) out.push_back(',');
    first = false;
    out.append(std::string_view("{\"name\":"));
    append_json_string(out, s.sink->name());
    fmt::format_to(it, ",\"status\":\"{}\"", status);
    if (!error.empty()) {
      out.append(std::string_view(",\"error\":"));
      append_json_string(out, error);
      fmt::format_to(it, ",\"disabled\":{}", s.failed);
    }
    fmt::format_to(it, ",\"slow_calls\":{},\"max_call_ms\":{:.3f}}}", s.slow_calls,
                   std::chrono::duration<double, std::milli>(s.max_call).count());
  }
  out.push_back(']');
  return std::string(out.data(), out.size());
}

std::vector<std::string> RecordPipeline::sink_failures() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sink_failures_;
}

RecordPipeline::RecordPipeline(std::unique_ptr<RecordSink> log, std::string first_line, int rank,
                               const PhaseNames& names, std::size_t capacity,
                               std::chrono::milliseconds flush_interval, StepObserver* observer,
                               StepCompleter* completer, std::vector<RecordSink*> sinks)
    : rank_(rank),
      names_(names),
      flush_interval_(flush_interval),
      log_(std::move(log)),
      observer_(observer),
      completer_(completer),
      ring_(capacity),
      fork_generation_(fork_generation()) {
  sinks_.emplace_back(log_.get());
  for (RecordSink* sink : sinks) {
    if (sink != nullptr) sinks_.emplace_back(sink);
  }
  buf_.append(first_line.data(), first_line.data() + first_line.size());
  write_buffer();  // run_start reaches the file before the constructor returns
  thread_ = start_background_thread([this] { run(); });
}

RecordPipeline::~RecordPipeline() {
  if (abandoned_) return;
  RunEnd end;
  end.reason = "exit";
  close(end);
}

[[gnu::hot]] StepRecord* RecordPipeline::begin_step_record() noexcept {
  // Stopping or closed: nothing drains the ring any more (and a record pushed now could
  // come after run_end), so drop it rather than wait for a slot that never frees.
  if (stopping_.load(std::memory_order_acquire)) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  StepRecord* slot = ring_.begin_push();
  if (slot != nullptr) return slot;
  if (fork_generation() != fork_generation_) {  // a forked child: the writer thread is not here
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  waits_.fetch_add(1, std::memory_order_relaxed);
  request_drain();
  // The writer runs: wait for it (back-pressure), but never past the start of a close.
  while ((slot = ring_.begin_push()) == nullptr) {
    if (stopping_.load(std::memory_order_acquire)) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return nullptr;
    }
    std::this_thread::yield();
  }
  return slot;
}

void RecordPipeline::request_drain() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    drain_requested_.store(true, std::memory_order_relaxed);
  }
  wake_.notify_one();
}

void RecordPipeline::push_line(std::string line) { enqueue({std::move(line), {}}, false); }

void RecordPipeline::push_line_now(std::string line) { enqueue({std::move(line), {}}, true); }

void RecordPipeline::push_alert(AlertEvent event, std::string line, bool now) {
  enqueue({std::move(line), std::move(event)}, now);
}

void RecordPipeline::push_cluster(nlohmann::ordered_json record, std::string line, bool now) {
  enqueue({std::move(line), std::move(record)}, now);
}

void RecordPipeline::enqueue(QueuedLine queued, bool now) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!now) {
      lines_.push_back(std::move(queued));
      return;
    }
    if (closed_ || stop_) return;
    lines_.push_back(std::move(queued));
    // A drain, not a flush: records still waiting for their device data or telemetry
    // keep waiting (a forced drain would write them without it); the line goes out now.
    drain_requested_.store(true, std::memory_order_relaxed);
  }
  wake_.notify_one();
}

void raise_alert(RecordPipeline& writer, AlertLog& alerts, const AlertEvent& event, int rank) {
  const std::string line = alert_json_line(event, rank);
  writer.push_alert(event, line);
  alerts.publish(event, line);
}

bool RecordPipeline::flush(std::chrono::milliseconds wait) {
  if (abandoned_) return true;
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return true;
  const std::uint64_t ticket = ++flush_requested_;
  wake_.notify_one();
  const auto done = [&] { return flush_done_ >= ticket || closed_; };
  if (wait == std::chrono::milliseconds::max()) {
    done_.wait(lock, done);
    return true;
  }
  return done_.wait_for(lock, wait, done);
}

void RecordPipeline::close(const RunEnd& end, bool finish_device, std::chrono::milliseconds wait) {
  if (abandoned_) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    if (stop_) {  // another thread is closing: its close is complete when this returns
      if (wait == std::chrono::milliseconds::max()) {
        done_.wait(lock, [&] { return closed_; });
      } else {
        done_.wait_for(lock, wait, [&] { return closed_; });
      }
      return;
    }
    stop_ = true;
    stopping_.store(true, std::memory_order_release);
  }
  wake_.notify_one();
  thread_.join();
  if (completer_ != nullptr && finish_device) {
    drain(/*force=*/false);
    completer_->finish();  // the device has synchronized: what is left arrives now
  }
  drain(/*force=*/true);
  RunEnd final_end = end;
  if (completer_ != nullptr) final_end.extra_fields = completer_->run_end_fields();
  // The sinks' status as of run_end (what a sink does at on_close, a Pushgateway push, is
  // after it: said on stderr only).
  if (!final_end.extra_fields.empty()) final_end.extra_fields += ',';
  final_end.extra_fields += sinks_json();
  final_end.writer_waits = waits();
  final_end.dropped_steps = dropped();
  final_end.write_errors = write_errors();
  if (const int e = first_errno(); e != 0) final_end.write_error = std::strerror(e);
  if (observer_ != nullptr) {
    observer_->on_finish(*this);
    final_end.alerts = observer_->alert_counts();
    final_end.alert_repeats = observer_->alert_repeats();
  }
  append_run_end_json(buf_, final_end, totals_, rank_, names_);
  write_buffer();
  feed([](RecordSink& s) { s.on_close(); });
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  done_.notify_all();
}

void RecordPipeline::abandon() noexcept {
  if (abandoned_) return;
  abandoned_ = true;
  stopping_.store(true, std::memory_order_release);
  // The std::thread names a thread of the parent: neither join nor destroy it.
  if (thread_.joinable()) new std::thread(std::move(thread_));  // NOLINT: leaked on purpose
  log_->abandon();  // the child's copy only; the parent's file is untouched
}

void RecordPipeline::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    // Woken early by a flush request, a full ring, or close; else once per interval.
    wake_.wait_for(lock, flush_interval_, [&] {
      return stop_ || flush_requested_ > flush_done_ ||
             drain_requested_.load(std::memory_order_relaxed);
    });
    drain_requested_.store(false, std::memory_order_relaxed);
    const std::uint64_t ticket = flush_requested_;
    lock.unlock();
    drain(/*force=*/ticket > flush_done_);  // flush(): write what waits, as it is
    lock.lock();
    if (ticket > flush_done_) {
      flush_done_ = ticket;
      done_.notify_all();
    }
  }
}

void RecordPipeline::drain(bool force) {
  std::vector<QueuedLine> lines;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lines.swap(lines_);
  }
  // Step records first: lines queued now (alerts) are about steps already handed over.
  while (const StepRecord* r = ring_.front()) {
    if (completer_ == nullptr) {
      write_step(*r);
    } else {
      held_.push_back(*r);
      completer_->arrived(held_.back());
    }
    ring_.pop();
  }
  while (!held_.empty()) {
    const bool must = force || held_.size() > ring_.capacity();  // memory stays bounded
    if (!completer_->complete(held_.front(), must)) break;
    write_step(held_.front());
    held_.pop_front();
  }
  for (const QueuedLine& queued : lines) write_queued(queued);
  write_buffer();
}

void RecordPipeline::write_queued(const QueuedLine& queued) {
  buf_.append(queued.line.data(), queued.line.data() + queued.line.size());
  if (const auto* event = std::get_if<AlertEvent>(&queued.typed)) {
    feed([event](RecordSink& s) { s.on_alert(*event); });
  } else if (const auto* record = std::get_if<nlohmann::ordered_json>(&queued.typed)) {
    feed([record](RecordSink& s) { s.on_cluster(*record); });
  }
}

void RecordPipeline::alert(const AlertEvent& event, std::string_view line) {
  buf_.append(line.data(), line.data() + line.size());
  feed([&event](RecordSink& s) { s.on_alert(event); });
}

void RecordPipeline::write_step(const StepRecord& r) {
  totals_.add(r);
  append_step_json(buf_, r, rank_, names_);
  feed([&r](RecordSink& s) { s.on_step(r); });
  if (observer_ != nullptr) observer_->on_step(r, *this);  // its alerts after the step
  if (buf_.size() >= kWriteChunkBytes) write_buffer();
}

void RecordPipeline::write_buffer() {
  if (buf_.size() == 0) return;
  const std::string_view lines(buf_.data(), buf_.size());
  feed([lines](RecordSink& s) { s.write(lines); });
  buf_.clear();
}

}  // namespace steptrace::detail
