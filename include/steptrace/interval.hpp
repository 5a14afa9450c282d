// Intervals: time outside training work (evaluation, checkpoints, other host work) that
// the profiler accounts for as its own kind instead of calling it part of a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace steptrace {

/// What an interval between (or inside) steps was spent on. The loader's wait is not an
/// interval: it is data (Profiler::begin_data).
enum class IntervalKind : std::uint8_t {
  kEval = 0,        // evaluation / validation / prediction
  kCheckpoint = 1,  // saving a checkpoint
  kOther = 2,       // other host work the program names (logging, callbacks)
  kRestore = 3,     // restoring a checkpoint (resuming a job)
};
inline constexpr std::size_t kIntervalKinds = 4;

/// The kind's name in records and APIs: "eval", "checkpoint", "other".
constexpr std::string_view interval_name(IntervalKind kind) noexcept {
  switch (kind) {
    case IntervalKind::kEval:
      return "eval";
    case IntervalKind::kCheckpoint:
      return "checkpoint";
    case IntervalKind::kOther:
      return "other";
    case IntervalKind::kRestore:
      return "restore";
  }
  return "other";
}

/// The kind named `name`, or nothing.
constexpr std::optional<IntervalKind> interval_kind(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kIntervalKinds; ++i) {
    const auto kind = static_cast<IntervalKind>(i);
    if (interval_name(kind) == name) return kind;
  }
  return std::nullopt;
}

}  // namespace steptrace
