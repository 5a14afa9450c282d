// hang and interval_hang: what the watchdog thread judges at each poll (a step, or an
// evaluation or checkpoint interval, still open for too long). Pure: the poll carries the
// clock and the state it reads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "../alert.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {

/// hang: a step in flight longer than hang_threshold x the median iteration (at least
/// hang_min_s; hang_floor_s while the history is short). One alert per episode: further
/// steps over the limit are folded into it, and it resolves once a later step finishes
/// within the limit (or the run ends), counting them. A step waiting in a collective waits
/// for the other ranks: while one of them is in an evaluation or checkpoint interval (the
/// cross-rank exchange says so) its time does not count, and its limit is longer by the
/// time the exchange takes to learn of such an interval.
class HangDetector {
 public:
  explicit HangDetector(const Config& config) : config_(config) {}
  /// What the watchdog sees at one poll.
  struct Poll {
    std::int64_t now_ns = 0;
    std::int64_t step = -1;  // the step in flight, or -1
    std::int64_t start_ns = 0;
    std::string phase;                 // its innermost running phase, or empty
    std::int64_t last_done_step = -1;  // the last step that finished, and its host time
    std::int64_t last_done_ns = 0;
    double median_ms = 0;
    bool history_ok = false;
    bool closing = false;             // the run ends: resolve what is open
    int collectives_in_flight = 0;    // launched and not completed (host-timed collectives)
    int peers_in_interval = 0;        // other ranks in an evaluation or checkpoint interval
    std::int64_t peer_notice_ns = 0;  // how late this rank learns of one; 0: no exchange
  };
  std::optional<AlertEvent> check(const Poll& p);

 private:
  const Config& config_;
  std::int64_t peer_step_ = -1;    // the step that last waited while a peer was in an interval
  std::int64_t peer_seen_ns_ = 0;  // and when, last
  bool active_ = false;
  std::int64_t first_step_ = -1;
  std::int64_t last_hung_step_ = -1;
  std::int64_t hung_steps_ = 0;
};

/// interval_hang: an evaluation or checkpoint interval still open after hang_threshold x
/// the longest earlier interval of its kind (at least hang_min_s), or after kFirstLimitS
/// when it is the first of its kind (an evaluation's length is not known before it ran
/// once). One alert per interval, resolved when it ends (or the run ends). Other intervals
/// ("other") are not watched.
class IntervalHangDetector {
 public:
  explicit IntervalHangDetector(const Config& config) : config_(config) {}
  struct Poll {
    std::int64_t now_ns = 0;
    int kind = -1;          // IntervalKind of the open interval, -1: none
    std::int64_t seq = 0;   // which interval (one number per interval begun)
    std::int64_t step = 0;  // steps begun before it
    std::int64_t start_ns = 0;
    std::int64_t longest_earlier_ns = 0;  // of the same kind; 0: none before it
    bool closing = false;
  };
  std::optional<AlertEvent> check(const Poll& p);
  static constexpr double kFirstLimitS = 1800.0;

 private:
  const Config& config_;
  bool active_ = false;
  std::int64_t seq_ = -1;
  int kind_ = -1;
  std::int64_t step_ = 0;
};

}  // namespace steptrace::detail
