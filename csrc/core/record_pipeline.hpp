// The record pipeline: a background thread that drains step records from a bounded ring,
// completes them (device data), runs the detectors over them, serializes each once and
// hands the batch to every sink, the log first, at most one flush interval behind. The
// training thread only copies a fixed-size record into the ring. Sinks (csrc/sinks/) are
// given to it; it knows them only as RecordSink.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include <memory>

#include "alert.hpp"
#include "record_json.hpp"
#include "record_sink.hpp"
#include "spsc_ring.hpp"
#include "step_completer.hpp"
#include "step_record.hpp"

namespace steptrace::detail {

/// The writer thread: drains the record queue and feeds every sink, the log first. Each
/// sink gets the step records, alerts and cluster records typed (on_step, on_alert,
/// on_cluster) in record order, each before the write() of the batch that has its line.
class RecordPipeline final : public StepRecordQueue, private AlertOutput {
 public:
  /// `log` is the run's log (the JSONL file sink), owned, fed first; its failed writes
  /// are run_end's write_errors. `first_line` (run_start, with its newline) is the first
  /// thing written, to the log and to each of `sinks` (not owned; they must outlive the
  /// pipeline).
  RecordPipeline(std::unique_ptr<RecordSink> log, std::string first_line, int rank,
                 const PhaseNames& names, std::size_t capacity,
                 std::chrono::milliseconds flush_interval, StepObserver* observer = nullptr,
                 StepCompleter* completer = nullptr, std::vector<RecordSink*> sinks = {});
  ~RecordPipeline();
  RecordPipeline(const RecordPipeline&) = delete;
  RecordPipeline& operator=(const RecordPipeline&) = delete;

  /// Training thread: the slot to fill with the next step record. When the ring is full
  /// it wakes the writer and waits for a free slot (counted in waits()) while the writer
  /// runs. Null once the writer is stopping, closed or abandoned, or in a forked child
  /// (a full ring then never waits: the record is dropped and counted in dropped()).
  StepRecord* begin_step_record() noexcept override;
  /// Training thread: hands the filled slot to the writer; wakes it early when the ring
  /// is half full, so that a burst of short steps does not fill it.
  [[gnu::hot]] void commit_step_record() noexcept override {
    ring_.commit_push();
    prefetch_step_record(ring_.next_slot());
    if (ring_.at_least_half_full() && !drain_requested_.load(std::memory_order_relaxed)) {
      request_drain();
    }
  }

  /// Any thread: queues a complete JSON line (with its newline) after the records so far.
  void push_line(std::string line);
  /// Like push_line, and wakes the writer to write it now (a hang alert must reach the
  /// file while the step is still hung). Step records waiting for data (device times,
  /// telemetry) keep waiting: the line may come before them.
  void push_line_now(std::string line);
  /// Any thread: queues an alert (or resolved) record, its `line` (with its newline) for
  /// the log and its event for the sinks' on_alert, both in the place of the line among
  /// the records. `now`: as push_line_now (dropped once closing), else as push_line.
  void push_alert(AlertEvent event, std::string line, bool now = true);
  /// The same for a cluster record: its parsed object goes to the sinks' on_cluster.
  void push_cluster(nlohmann::ordered_json record, std::string line, bool now = true);

  /// Blocks until everything handed over before the call is written to the file (or
  /// `wait` passed: then false).
  bool flush(std::chrono::milliseconds wait = std::chrono::milliseconds::max());
  /// Writes everything, then the run_end record, and closes the file. Idempotent; a
  /// second caller waits (at most `wait`) for the first one's close to complete.
  /// `finish_device` false (a signal): the completer's finish() (device calls) is skipped
  /// and the records waiting for device data are written with what is known.
  void close(const RunEnd& end, bool finish_device = true,
             std::chrono::milliseconds wait = std::chrono::milliseconds::max());
  /// In a forked child: forgets the writer without writing, flushing or joining (its
  /// thread does not exist there) and without locking (a lock may have been copied
  /// held). The destructor and close() do nothing afterwards.
  void abandon() noexcept;

  /// Times the training thread found the ring full.
  std::int64_t waits() const noexcept { return waits_.load(std::memory_order_relaxed); }
  std::size_t capacity() const noexcept { return ring_.capacity(); }
  /// Step records dropped because the writer was stopping or gone (never while it runs).
  std::int64_t dropped() const noexcept { return dropped_.load(std::memory_order_relaxed); }
  /// Failed writes (e.g. disk full: the batch is lost, the writer keeps going), and the
  /// first one's errno (0: none).
  std::int64_t write_errors() const noexcept { return log_->write_errors(); }
  int first_errno() const noexcept { return log_->first_errno(); }
  /// The most recent failed write's errno (0: none).
  int last_errno() const noexcept { return log_->last_errno(); }
  /// Sinks disabled after throwing, with what they threw ("name: message"); writer thread
  /// until close, any thread after it.
  std::vector<std::string> sink_failures() const;
  /// A sink call longer than this is slow: reported once on stderr, counted in run_end.
  static constexpr std::chrono::seconds kSlowSinkCall{1};

 private:
  void run();
  // Wakes the writer to drain now (rare: under the lock, so the wake-up is not lost).
  void request_drain() noexcept;
  // Moves everything queued into buf_ and writes it; `force` completes the records that
  // wait for device data with what is known. Writer thread only.
  void drain(bool force);
  void write_step(const StepRecord& r);
  void write_buffer();
  // A line queued by another thread, and what the sinks get with it (nothing: a plain
  // line; an AlertEvent: on_alert; a cluster record: on_cluster).
  struct QueuedLine {
    std::string line;
    std::variant<std::monostate, AlertEvent, nlohmann::ordered_json> typed;
  };
  void enqueue(QueuedLine queued, bool now);
  // Writer thread: the line into the batch, the typed record to the sinks.
  void write_queued(const QueuedLine& queued);
  // AlertOutput (the observer's alerts, writer thread): the same for a detector's alert.
  void alert(const AlertEvent& event, std::string_view line) override;
  // Calls `fn(sink)` for every live sink: a throw disables that sink, a slow call is
  // reported; both once, on stderr.
  template <typename Fn>
  void feed(Fn&& fn) noexcept;

  struct SinkState {
    explicit SinkState(RecordSink* s) : sink(s) {}
    RecordSink* sink;
    bool failed = false;
    std::string failure;  // what it threw
    std::int64_t slow_calls = 0;
    std::chrono::steady_clock::duration max_call{};
  };
  // run_end's `"sinks":[...]`: each sink's status (ok, failing with its first error, slow
  // with the count of slow calls). Closing thread, after the writer thread has stopped.
  std::string sinks_json() const;

  const int rank_;
  const PhaseNames& names_;
  const std::chrono::milliseconds flush_interval_;
  std::unique_ptr<RecordSink> log_;
  std::vector<SinkState> sinks_;            // the log first
  std::vector<std::string> sink_failures_;  // guarded by mu_
  StepObserver* observer_;
  StepCompleter* completer_;
  std::deque<StepRecord> held_;  // records waiting for the completer, in step order
  SpscRing<StepRecord> ring_;
  fmt::memory_buffer buf_;
  RunTotals totals_;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<QueuedLine> lines_;      // guarded by mu_
  std::uint64_t flush_requested_ = 0;  // guarded by mu_
  std::uint64_t flush_done_ = 0;       // guarded by mu_
  bool stop_ = false;                  // guarded by mu_
  bool closed_ = false;                // guarded by mu_
  std::atomic<bool> drain_requested_{false};
  std::atomic<std::int64_t> waits_{0};
  std::atomic<std::int64_t> dropped_{0};
  std::atomic<bool> stopping_{false};    // close() began: records are dropped from now on
  bool abandoned_ = false;               // forked child: never touch the file or the thread
  const std::uint64_t fork_generation_;  // fork_generation() at construction
  std::thread thread_;
};

/// Off the writer thread (the watchdog, the sampler, the training thread): writes an alert
/// now (its line to the log, its event to the sinks) and hands it to the subscribers.
void raise_alert(RecordPipeline& writer, AlertLog& alerts, const AlertEvent& event, int rank);

}  // namespace steptrace::detail
