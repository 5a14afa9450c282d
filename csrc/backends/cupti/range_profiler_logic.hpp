// The pure parts of the CUPTI range-profiler fallback, kept out of the CUPTI calls so that
// they are tested on any machine: which PM sampling failures fall back to it, how a
// range's name carries its step, and what the training thread does at a step boundary
// (lazy setup on the first sampled step with a CUDA context, one user range per sampled
// step, passes handed to the decode thread).
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <system_error>
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail::cupti {

/// Why PM sampling could not be set up, as far as choosing a fallback goes.
enum class PmFailure {
  kOther,         // a reason that holds for the range profiler too (no GPU, no privileges, ...)
  kTooOld,        // cuptiPmSampling* missing: a CUPTI older than 12.6
  kNoPmOnChip,    // the chip's row says it has no PM sampling
  kNotSupported,  // a PM sampling call returned CUPTI_ERROR_NOT_SUPPORTED on this device
};

inline constexpr int kCuptiErrorNotSupported = 27;  // CUPTI_ERROR_NOT_SUPPORTED

/// The failure of a PM sampling setup call with CUptiResult `result`.
constexpr PmFailure pm_call_failure(int result) noexcept {
  return result == kCuptiErrorNotSupported ? PmFailure::kNotSupported : PmFailure::kOther;
}

/// Whether the range profiler is worth trying after PM sampling failed so: only where PM
/// sampling itself is what is missing. A CPU-only machine, busy counters or missing
/// privileges stop the range profiler the same way, and one reason says it best.
constexpr bool falls_back_to_range_profiler(PmFailure f) noexcept { return f != PmFailure::kOther; }

/// Room for a step's range name: "-9223372036854775808" and the NUL.
inline constexpr std::size_t kRangeNameSize = 24;

/// Writes `step` in decimal, NUL-terminated, into `out`. No allocation (training thread).
inline void range_name(std::int64_t step, char (&out)[kRangeNameSize]) noexcept {
  const auto r = std::to_chars(out, out + kRangeNameSize - 1, step);
  *r.ptr = '\0';
}

/// The step a decoded range's name stands for; -1 when the name is not a step's (empty,
/// not all digits, negative, out of range), e.g. a range someone else pushed.
inline std::int64_t range_step(std::string_view name) noexcept {
  if (name.empty() || name.front() < '0' || name.front() > '9') return -1;
  std::int64_t step = -1;
  const auto r = std::from_chars(name.data(), name.data() + name.size(), step);
  if (r.ec != std::errc() || r.ptr != name.data() + name.size()) return -1;
  return step;
}

/// The range profiler object's state. The training thread moves it kUnconfigured -> kIdle
/// (setup) -> kRunning (Start) -> kStopped (Stop) and may move any state to kFailed; the
/// decode thread moves kStopped -> kIdle once the pass is decoded and the object set up
/// for the next one. Whoever moved it last owns the object's calls: no locks.
enum class PassState : int { kUnconfigured, kIdle, kRunning, kStopped, kFailed };

/// Why a sampled step got no range.
enum class Skip : int {
  kNone,
  kNoContext,     // no current CUDA context on the training thread (yet)
  kOtherContext,  // the current context is not the profiled one (or not on its device)
  kDecoding,      // the previous pass is still being decoded
  kFailed,        // the range profiler failed earlier
};

/// What the training thread does at the start of a step, in this order.
struct BeginPlan {
  bool stop = false;    // Stop the running pass (its burst is over) for the decode thread
  bool set_up = false;  // Enable on the current context, counter data image, SetConfig
  bool start = false;   // Start a pass
  bool push = false;    // push this step's range
  Skip skip = Skip::kNone;

  friend bool operator==(const BeginPlan& a, const BeginPlan& b) {
    return a.stop == b.stop && a.set_up == b.set_up && a.start == b.start && a.push == b.push &&
           a.skip == b.skip;
  }
};

/// The plan for a step: `sampled` whether counters are wanted for it, `current` the
/// training thread's current CUDA context (null: none), `profiled` the context the range
/// profiler was enabled on (null before setup), `current_on_device` whether `current` is
/// on the device whose chip was chosen. A range is only ever pushed, and the profiler only
/// ever enabled, with a current context: enabling it with none crashes inside libcupti.
constexpr BeginPlan plan_begin_step(bool sampled, PassState state, const void* current,
                                    const void* profiled, bool current_on_device) noexcept {
  BeginPlan p;
  if (state == PassState::kFailed) {
    if (sampled) p.skip = Skip::kFailed;
    return p;
  }
  if (!sampled) {
    // The burst is over: its ranges can be decoded only once the pass stops.
    p.stop = state == PassState::kRunning;
    return p;
  }
  if (current == nullptr) {
    p.skip = Skip::kNoContext;
    return p;
  }
  if (state == PassState::kUnconfigured) {
    if (!current_on_device) {
      p.skip = Skip::kOtherContext;
      return p;
    }
    p.set_up = p.start = p.push = true;
    return p;
  }
  if (current != profiled) {
    p.stop = state == PassState::kRunning;
    p.skip = Skip::kOtherContext;
    return p;
  }
  if (state == PassState::kStopped) {
    p.skip = Skip::kDecoding;
    return p;
  }
  p.start = state == PassState::kIdle;
  p.push = true;
  return p;
}

/// At the end of a step whose range was popped: a pass holding `ranges` stops at
/// `max_ranges` (the counter data image's room), so that its steps are delivered.
constexpr bool pass_full(int ranges, int max_ranges) noexcept { return ranges >= max_ranges; }

/// Whether a decode pass that found the object in `state` completes a delivery
/// (CounterSampler::deliveries). A running pass holds ranges that may have finished on
/// the device but cannot be decoded before its Stop: counting a delivery then would tell
/// the writer those steps' samples had come.
constexpr bool counts_as_delivery(PassState state) noexcept { return state != PassState::kRunning; }

}  // namespace steptrace::detail::cupti
