// The seam between the core and its outputs: the writer thread hands every record to a
// list of sinks (the JSONL file is one, the Prometheus registry another). The core knows
// these interfaces only; the sinks live in csrc/sinks/ and are put together with the
// pipeline in csrc/runtime/.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "alert.hpp"
#include "step_record.hpp"

namespace steptrace::detail {

/// Where records go. Every call comes from the writer thread, in record order, never from
/// the training thread. A sink that throws is disabled for the rest of the run and the
/// writer says so once (the other sinks carry on); one whose call takes over a second is
/// reported once as slow. A sink that can block for long (network, remote disk) should
/// queue and do its I/O on its own thread.
class RecordSink {
 public:
  virtual ~RecordSink() = default;
  /// A short name for messages ("jsonl", "prometheus").
  virtual std::string_view name() const noexcept = 0;
  /// Whether run_end's `sinks` lists it (an output the user configured; not internal
  /// plumbing such as the in-process tap).
  virtual bool listed() const noexcept { return true; }
  /// A batch of complete JSON lines (each with its newline), exactly as the log has them:
  /// run_start first, run_end last.
  virtual void write(std::string_view /*lines*/) {}
  /// A step record, once complete (device data joined), before its line is written.
  virtual void on_step(const StepRecord& /*record*/) {}
  /// An alert, an alert's follow-up (`update`) or the end of its episode (`resolved`),
  /// whoever raised it (a detector, the watchdog, the sampler, Python): the event of an
  /// alert line, before that line is written. In record order with on_step and
  /// on_cluster.
  virtual void on_alert(const AlertEvent& /*event*/) {}
  /// A cross-rank record (kind "cluster", written by the aggregating rank): the object as
  /// parsed once by Profiler::write_record, before its line is written.
  virtual void on_cluster(const nlohmann::ordered_json& /*record*/) {}
  /// The run ended: run_end was handed to write(). Nothing is fed afterwards.
  virtual void on_close() {}
  /// The first failure the sink handled itself and carried on after (a write that did not
  /// reach its target); "" when none. Read on the closing thread for run_end's `sinks`.
  virtual std::string first_error() const { return {}; }
  /// Writes that did not reach the target (each loses its batch), the first and the most
  /// recent one's errno (0: none): run_end's write_errors for the run's log. Any thread.
  virtual std::int64_t write_errors() const noexcept { return 0; }
  virtual int first_errno() const noexcept { return 0; }
  virtual int last_errno() const noexcept { return 0; }
  /// In a forked child: release the target without flushing or syncing (the parent's).
  virtual void abandon() noexcept {}
};

/// Calls `fn(line)` for each line of a batch (without its newline).
template <typename Fn>
void for_each_line(std::string_view lines, Fn&& fn) {
  std::size_t pos = 0;
  while (pos < lines.size()) {
    std::size_t end = lines.find('\n', pos);
    if (end == std::string_view::npos) end = lines.size();
    fn(lines.substr(pos, end - pos));
    pos = end + 1;
  }
}

/// Where a StepObserver puts the alerts it finds, on the writer thread: the line goes to
/// the log after the step's line, the event to every sink's on_alert, in that order.
class AlertOutput {
 public:
  virtual ~AlertOutput() = default;
  /// `line`: alert_json_line(event), with its newline.
  virtual void alert(const AlertEvent& event, std::string_view line) = 0;
};

/// Sees every step record on the writer thread, in step order, after the sinks' on_step
/// and before its line is written, and may add alerts after it. Also supplies run_end's
/// alert counts.
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  virtual void on_step(const StepRecord& record, AlertOutput& out) = 0;
  /// After the last step record, before run_end: may add alerts (episodes it closes).
  virtual void on_finish(AlertOutput& /*out*/) {}
  virtual std::map<std::string, std::int64_t> alert_counts() const = 0;
  virtual std::map<std::string, std::int64_t> alert_repeats() const { return {}; }
};

/// The training thread's side of the record queue (implemented by the writer).
class StepRecordQueue {
 public:
  virtual ~StepRecordQueue() = default;
  /// The slot to fill with the next step record, or null (the record is dropped).
  virtual StepRecord* begin_step_record() noexcept = 0;
  /// Hands the slot filled since begin_step_record to the writer.
  virtual void commit_step_record() noexcept = 0;
  /// Copies what the training thread filled in of `r` into the queue (copy_step_record),
  /// or drops it (see begin_step_record).
  void push_step_record(const StepRecord& r) noexcept {
    if (StepRecord* slot = begin_step_record()) {
      copy_step_record(*slot, r);
      commit_step_record();
    }
  }
};

}  // namespace steptrace::detail
