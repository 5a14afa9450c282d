#include "device_timing.hpp"

namespace steptrace::detail {

DeviceTiming::DeviceTiming(std::unique_ptr<DeviceTimer> timer, std::size_t max_in_flight)
    : timer_(std::move(timer)), ring_(max_in_flight) {
  open_begin_.fill(-1);
}

int DeviceTiming::record() noexcept {
  if (building_.captured) return -1;
  const int e = timer_->record(step_stream_);
  if (e == kRecordCaptured) {
    enter_capture();
    return -1;
  }
  if (e < 0) step_ok_ = false;
  return e;
}

void DeviceTiming::set_stream(DeviceStream stream) noexcept {
  stream_ = stream;
  stream_set_ = true;
  check_current_stream();
}

void DeviceTiming::check_current_stream() noexcept {
  if (!in_step_ || !stream_set_ || building_.captured || stream_ == step_stream_) return;
  // The timer's only question to a stream is a record; an event it did record is returned
  // unread (nothing waits for it, and a later record of it overwrites it).
  const int e = timer_->record(stream_);
  if (e == kRecordCaptured) {
    enter_capture();
  } else if (e >= 0) {
    timer_->release(e);
  }
  // A failure on that stream is not the step's: its own events decide.
}

void DeviceTiming::enter_capture() noexcept {
  // The events recorded before the capture began are not captured; they are returned
  // unread (a host-timed step needs none of them). The capture may end before the step
  // does: the step stays on the host clock, since its start is unknown to the device.
  building_.captured = true;
  if (building_.begin >= 0) timer_->release(building_.begin);
  building_.begin = -1;
  for (std::size_t i = 0; i < building_.interval_count; ++i) {
    timer_->release(building_.intervals[i].begin);
    timer_->release(building_.intervals[i].end);
  }
  building_.interval_count = 0;
  building_.folded_ns.fill(0);
  for (int& b : open_begin_) {
    if (b >= 0) timer_->release(b);
    b = -1;
  }
}

void DeviceTiming::begin_step() noexcept {
  building_.interval_count = 0;
  building_.folded_ns.fill(0);
  building_.waited = false;
  building_.captured = false;
  building_.clamped = 0;
  building_.host_lead_ns = 0;
  step_stream_ = stream_;
  step_ok_ = true;
  in_step_ = true;
  building_.begin = record();
  building_.end = -1;
}

void DeviceTiming::begin_phase(std::uint16_t slot) noexcept {
  if (!(stream_ == step_stream_)) check_current_stream();
  open_begin_[slot] = step_ok_ ? record() : -1;
}

void DeviceTiming::end_phase(std::uint16_t slot) noexcept {
  if (!(stream_ == step_stream_)) check_current_stream();
  const int begin = open_begin_[slot];
  open_begin_[slot] = -1;
  if (begin < 0) return;
  // A phase repeated very often (micro-batches): make room rather than give up.
  const bool room = step_ok_ && (building_.interval_count < kMaxIntervals || fold(building_));
  const int end = room ? record() : -1;
  if (end < 0) {  // a device error: the begin event is not in the list, so return it here
    timer_->release(begin);
    return;
  }
  building_.intervals[building_.interval_count++] = Interval{slot, begin, end};
}

bool DeviceTiming::fold(Pending& p) noexcept {
  using Status = DeviceTimer::Status;
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < p.interval_count; ++i) {
      const Interval iv = p.intervals[i];
      const Status e = timer_->query(iv.end);
      const Status b = e == Status::kReady ? timer_->query(iv.begin) : e;
      float ms = 0;
      if (e == Status::kError || b == Status::kError ||
          (b == Status::kReady && !timer_->elapsed_ms(iv.begin, iv.end, &ms))) {
        // Keep every unreleased interval listed: end_step releases them exactly once.
        for (std::size_t j = i; j < p.interval_count; ++j) p.intervals[kept++] = p.intervals[j];
        p.interval_count = kept;
        step_ok_ = false;
        return false;
      }
      if (b != Status::kReady) {
        p.intervals[kept++] = iv;
        continue;
      }
      p.folded_ns[iv.slot] += interval_ns(ms, p);
      timer_->release(iv.begin);
      timer_->release(iv.end);
    }
    p.interval_count = kept;
    if (kept < kMaxIntervals) return true;
    // None has completed yet (the host is far ahead): wait for the oldest. The device
    // still has the later intervals queued, so this only bounds how far ahead we get.
    if (!timer_->synchronize(p.intervals[0].begin) || !timer_->synchronize(p.intervals[0].end)) {
      step_ok_ = false;
      return false;
    }
    p.waited = true;
  }
  step_ok_ = false;  // unreachable with a timer whose synchronized events are ready
  return false;
}

void DeviceTiming::end_step(const StepRecord& host_record, StepRecordQueue& writer) noexcept {
  if (!(stream_ == step_stream_)) check_current_stream();
  in_step_ = false;
  building_.record = host_record;
  building_.record.stream = step_stream_;
  if (step_ok_) building_.end = record();
  if (building_.captured) ++captured_steps_;
  if (!step_ok_) {
    // An event failed mid-step: this step and all after it use the host clock.
    release(building_);
    fail(host_record.step, writer);
    write(host_record, writer);
    return;
  }
  if (count_ == ring_.size()) {  // the bound: wait for the oldest step
    Pending& oldest = ring_[head_];
    if (!wait_for(oldest)) {
      release(building_);
      fail(oldest.record.step, writer);
      write(host_record, writer);
      return;
    }
    waited_ = true;
    poll(writer);  // frees the oldest slot
    if (failed_) {
      release(building_);
      write(host_record, writer);
      return;
    }
  }
  ring_[(head_ + count_) % ring_.size()] = building_;
  ++count_;
  poll(writer);
}

bool DeviceTiming::ready(const Pending& p) noexcept {
  if (p.captured) return true;  // no events
  // Every event is checked, last ones first (a timer may complete them out of order).
  if (timer_->query(p.end) != DeviceTimer::Status::kReady) return false;
  for (std::size_t i = p.interval_count; i-- > 0;) {
    if (timer_->query(p.intervals[i].end) != DeviceTimer::Status::kReady) return false;
    if (timer_->query(p.intervals[i].begin) != DeviceTimer::Status::kReady) return false;
  }
  return timer_->query(p.begin) == DeviceTimer::Status::kReady;
}

void DeviceTiming::poll(StepRecordQueue& writer) noexcept {
  while (count_ > 0 && !failed_) {
    Pending& p = ring_[head_];
    if (!ready(p)) {
      // A query error is a device error, not "not yet".
      if (timer_->query(p.end) == DeviceTimer::Status::kError) fail(p.record.step, writer);
      return;
    }
    if (!resolve(p, writer)) return;
    head_ = (head_ + 1) % ring_.size();
    --count_;
  }
}

bool DeviceTiming::resolve(Pending& p, StepRecordQueue& writer) noexcept {
  StepRecord& r = p.record;
  if (p.captured) {  // the host record as it came, in its place in step order
    r.device_clock = false;
    r.captured = true;
    r.waited = waited_ || p.waited;
    waited_ = false;
    write(r, writer);
    return true;
  }
  float ms = 0;
  if (!timer_->elapsed_ms(p.begin, p.end, &ms)) {
    fail(r.step, writer);
    return false;
  }
  r.step_ns = interval_ns(ms, p) + p.host_lead_ns;
  for (std::uint16_t i = 0; i < r.phase_count; ++i) r.phase_ns[i] = p.folded_ns[i];
  for (std::size_t i = 0; i < p.interval_count; ++i) {
    const Interval& iv = p.intervals[i];
    if (!timer_->elapsed_ms(iv.begin, iv.end, &ms)) {
      for (std::uint16_t k = 0; k < r.phase_count; ++k) r.phase_ns[k] = r.host_phase_ns[k];
      r.step_ns = r.host_ns;
      fail(r.step, writer);
      return false;
    }
    r.phase_ns[iv.slot] += interval_ns(ms, p);
  }
  r.device_clock = true;
  r.clamped_intervals = p.clamped;
  r.waited = waited_ || p.waited;
  waited_ = false;
  release(p);
  write(r, writer);
  return true;
}

void DeviceTiming::drain(StepRecordQueue& writer) noexcept {
  while (count_ > 0 && !failed_) {
    Pending& p = ring_[head_];
    if (!wait_for(p)) {
      fail(p.record.step, writer);
      return;
    }
    if (!resolve(p, writer)) return;
    head_ = (head_ + 1) % ring_.size();
    --count_;
  }
}

bool DeviceTiming::wait_for(const Pending& p) noexcept {
  if (p.captured) return true;
  // Every event (a timer may complete them out of order).
  bool ok = timer_->synchronize(p.begin);
  for (std::size_t i = 0; ok && i < p.interval_count; ++i) {
    ok = timer_->synchronize(p.intervals[i].begin) && timer_->synchronize(p.intervals[i].end);
  }
  return ok && timer_->synchronize(p.end);
}

void DeviceTiming::release(Pending& p) noexcept {
  if (p.begin >= 0) timer_->release(p.begin);
  if (p.end >= 0) timer_->release(p.end);
  for (std::size_t i = 0; i < p.interval_count; ++i) {
    if (p.intervals[i].begin >= 0) timer_->release(p.intervals[i].begin);
    if (p.intervals[i].end >= 0) timer_->release(p.intervals[i].end);
  }
  p.begin = p.end = -1;
  p.interval_count = 0;
}

void DeviceTiming::fail(std::int64_t step, StepRecordQueue& writer) noexcept {
  if (failed_) return;
  failed_ = true;
  failed_at_step_ = step;
  try {
    failure_ = timer_->last_error();
    if (failure_.empty()) failure_ = "device timer error";
  } catch (...) {
  }
  // The steps in flight are written with their host times: their events may never
  // complete. A record being resolved was restored to host times by the caller.
  while (count_ > 0) {
    Pending& p = ring_[head_];
    release(p);
    p.record.device_clock = false;
    write(p.record, writer);
    head_ = (head_ + 1) % ring_.size();
    --count_;
  }
}

std::int64_t DeviceTiming::interval_ns(float ms, Pending& p) noexcept {
  if (ms >= 0) return static_cast<std::int64_t>(static_cast<double>(ms) * 1e6);
  ++p.clamped;
  ++clamped_intervals_;
  return 0;
}

void DeviceTiming::write(const StepRecord& r, StepRecordQueue& writer) noexcept {
  writer.push_step_record(r);
}

}  // namespace steptrace::detail
