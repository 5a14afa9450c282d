// Device timing of steps and phases with events that are resolved later: a step's events
// are recorded on the current stream as it runs, the step waits in a bounded ring until
// its events have completed (usually a step or two), and is then handed to the writer
// with device times. Nothing synchronizes the device unless the ring is full (the record
// then says "waited") or at close. A device error ends device timing for the run: the
// steps in flight are written with host times and failure() says why. A step with more
// phase intervals than its list holds (micro-batches under gradient accumulation) folds
// its completed intervals into per-slot sums as it goes, waiting for the oldest when none
// has completed (that record then says "waited"); that is not a device error.
// A step during which the stream is capturing a CUDA graph (the timer records nothing on
// a capturing stream: kRecordCaptured) is timed on the host clock: the events it had
// already are returned, and its record keeps its place in step order (captured_steps()
// counts them). A step's events all go on the stream set when it began (set_stream
// during a step applies from the next one): events on one stream complete in order, so
// no interval comes out negative; one that does anyway (a timer's rounding) is clamped
// to 0 and counted (clamped_intervals()). Training thread only.
//
// A capture on another stream than the step's: torch.cuda.graph captures on a stream of
// its own (a new pool stream, made current for the capture), so a step that began on the
// default stream and wraps a capture sees its own stream idle while the capture runs. The
// legacy default stream does not show it: torch's pool streams are non-blocking
// (cudaStreamNonBlocking), and only a capturing *blocking* stream makes the legacy stream
// report CUDA_ERROR_STREAM_CAPTURE_IMPLICIT (cuStreamIsCapturing) or refuse an event; with
// a non-blocking one, "work running in the created stream may run concurrently with work
// in stream 0" and nothing on stream 0 fails or waits (cuStreamCreate,
// CU_STREAM_NON_BLOCKING). Only the current stream tells: a stream set during a step
// (set_stream; the framework's current stream when it differs from the step's) is asked
// whether it captures at once, at every later phase boundary and at the step's end, and
// if it does the step is a captured step like any other (host-timed). Asking is the
// timer's record(): kRecordCaptured, or an event that is returned unread at once.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "record_sink.hpp"
#include "step_record.hpp"
#include "steptrace/backend.hpp"

namespace steptrace::detail {

/// DeviceTimer::record's answer when the stream is capturing a CUDA graph: no event was
/// recorded, and that is not a failure (CudaTimer's kCapturedStream).
inline constexpr int kRecordCaptured = -2;

class DeviceTiming {
 public:
  DeviceTiming(std::unique_ptr<DeviceTimer> timer, std::size_t max_in_flight);

  /// True while the timer works and a stream is set: the next step is timed on the device.
  bool usable() const noexcept { return !failed_ && stream_set_; }
  /// The stream the next step is timed on. During a step (the framework's current stream
  /// changed) it is also asked whether it captures a CUDA graph (see the top).
  void set_stream(DeviceStream stream) noexcept;
  void clear_stream() noexcept { stream_set_ = false; }
  DeviceStream stream() const noexcept { return stream_; }

  // The step being built (only between begin_step and end_step, only when usable()).
  void begin_step() noexcept;
  void begin_phase(std::uint16_t slot) noexcept;
  void end_phase(std::uint16_t slot) noexcept;
  /// Host time of the step being built that no event brackets, counted into its device
  /// times as it is: the part before begin_step of a step begun late, and a phase added
  /// afterwards (StepRecorder::begin_step_at, add_phase).
  void add_host_step_ns(std::int64_t ns) noexcept { building_.host_lead_ns += ns; }
  void add_host_phase_ns(std::uint16_t slot, std::int64_t ns) noexcept {
    building_.folded_ns[slot] += ns;
  }
  /// Ends the step and queues it with its host record; writes every step whose events
  /// have completed, waiting for the oldest when the ring is full.
  void end_step(const StepRecord& host_record, StepRecordQueue& writer) noexcept;
  /// Writes the steps whose events have completed, in step order, without waiting.
  void poll(StepRecordQueue& writer) noexcept;
  /// Waits for every step in flight and writes them (close).
  void drain(StepRecordQueue& writer) noexcept;

  /// Steps whose device time is still unknown.
  std::size_t in_flight() const noexcept { return count_; }
  /// Empty while device timing works; else why it stopped, and from which step on.
  const std::string& failure() const noexcept { return failure_; }
  std::int64_t failed_at_step() const noexcept { return failed_at_step_; }
  /// Steps timed on the host because their stream was capturing a CUDA graph.
  std::int64_t captured_steps() const noexcept { return captured_steps_; }
  /// Device intervals that came out negative and were written as 0.
  std::int64_t clamped_intervals() const noexcept { return clamped_intervals_; }
  DeviceTimer& timer() noexcept { return *timer_; }

 private:
  static constexpr std::size_t kMaxIntervals = 2 * kMaxPhases;
  struct Interval {
    std::uint16_t slot;
    int begin;
    int end;
  };
  struct Pending {
    StepRecord record;
    int begin = -1;
    int end = -1;
    bool waited = false;            // the step waited for the device to make room for intervals
    bool captured = false;          // the stream captured a CUDA graph: host times, no events
    std::uint16_t clamped = 0;      // negative intervals written as 0
    std::int64_t host_lead_ns = 0;  // the step's host time before its begin event
    std::size_t interval_count = 0;
    std::array<Interval, kMaxIntervals> intervals;
    std::array<std::int64_t, kMaxPhases> folded_ns{};  // per slot: intervals already resolved
  };

  // One record, or the failure; -1 on failure and once the step is captured.
  int record() noexcept;
  // The stream is capturing: the step in progress returns its events and uses host times.
  void enter_capture() noexcept;
  // During a step whose stream is no longer the current one (set_stream): a capture on the
  // current stream makes the step a captured one.
  void check_current_stream() noexcept;
  bool ready(const Pending& p) noexcept;
  // Makes room in the step's full interval list (see the top); false on a device error.
  bool fold(Pending& p) noexcept;
  // Blocks until all of the step's events have completed; false on a device error.
  bool wait_for(const Pending& p) noexcept;
  // Fills device times, writes, releases the events. False on a device error.
  bool resolve(Pending& p, StepRecordQueue& writer) noexcept;
  void release(Pending& p) noexcept;
  // Ends device timing; writes the steps in flight with host times.
  void fail(std::int64_t step, StepRecordQueue& writer) noexcept;
  static void write(const StepRecord& r, StepRecordQueue& writer) noexcept;
  // Device nanoseconds of a resolved interval, clamped at 0 (counted on the record).
  std::int64_t interval_ns(float ms, Pending& p) noexcept;

  std::unique_ptr<DeviceTimer> timer_;
  std::vector<Pending> ring_;
  std::size_t head_ = 0;                    // oldest step in flight
  std::size_t count_ = 0;                   // steps in flight
  Pending building_;                        // the step in progress
  std::array<int, kMaxPhases> open_begin_;  // per slot: begin event of the open interval
  bool step_ok_ = false;                    // the step in progress has all its events
  bool waited_ = false;                     // the next written record waited for the device
  DeviceStream stream_;                     // set_stream's
  DeviceStream step_stream_;                // the step in progress's: stream_ when it began
  bool stream_set_ = false;
  bool in_step_ = false;  // between begin_step and end_step (on the device)
  bool failed_ = false;
  std::string failure_;
  std::int64_t failed_at_step_ = -1;
  std::int64_t captured_steps_ = 0;
  std::int64_t clamped_intervals_ = 0;
};

}  // namespace steptrace::detail
