// One alert per episode of a per-step condition: the state the detectors whose alerts are
// "a condition held for a while" share (DeviceDiagnosisDetector, TelemetryDetector). An
// episode opens once its condition has held `open_after` observed steps in a row and
// resolves once it has failed `close_after` in a row; the steps it held while open are
// its repeats (folded into the episode, counted in its resolved record).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "../alert.hpp"

namespace steptrace::detail {

class Episode {
 public:
  enum class Change { kNone, kOpened, kResolved };

  explicit Episode(int open_after = 1, int close_after = 1) noexcept
      : open_after_(open_after), close_after_(close_after) {}

  /// The condition at `step`: what it changed.
  Change observe(bool condition, std::int64_t step) noexcept {
    if (condition) {
      misses_ = 0;
      if (hits_++ == 0) hits_from_ = step;
      if (active_) {
        ++repeats_;
        return Change::kNone;
      }
      if (hits_ < open_after_) return Change::kNone;
      active_ = true;
      first_step_ = hits_from_;
      repeats_ = 0;
      return Change::kOpened;
    }
    hits_ = 0;
    if (!active_ || ++misses_ < close_after_) return Change::kNone;
    active_ = false;
    misses_ = 0;
    return Change::kResolved;
  }

  bool active() const noexcept { return active_; }
  /// The first step of the run of steps that opened the (last) episode.
  std::int64_t first_step() const noexcept { return first_step_; }
  /// Steps the condition held while the (last) episode was open, after the opening one.
  std::int64_t repeats() const noexcept { return repeats_; }

  /// The resolved record of the episode that just ended at `step`.
  AlertEvent resolved(const char* type, std::int64_t step, std::string message,
                      bool with_repeats = true) const {
    AlertEvent done;
    done.resolved = true;
    done.type = type;
    done.step = step;
    done.first_step = first_step_;
    done.repeats = with_repeats ? repeats_ : 0;
    done.message = std::move(message);
    return done;
  }

 private:
  int open_after_;
  int close_after_;
  bool active_ = false;
  int hits_ = 0;    // steps in a row with the condition
  int misses_ = 0;  // steps in a row without it, while open
  std::int64_t hits_from_ = 0;
  std::int64_t first_step_ = 0;
  std::int64_t repeats_ = 0;
};

}  // namespace steptrace::detail
