// The watchdog thread: hang and interval-hang detection from what the training thread
// publishes (InflightState), and the host steal counter, sampled off the training thread.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "../core/collective_timer.hpp"
#include "../core/host/host_steal.hpp"
#include "../core/host/host_readings.hpp"
#include "run_environment.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/interval.hpp"

namespace steptrace {
namespace detail {

class AlertLog;
class DetectionStage;
class PhaseNames;
class RecordPipeline;

// What the training thread publishes about the step and interval it is in. Written only by
// the training thread; read by the watchdog and by the Prometheus scrape thread.
struct InflightState {
  std::atomic<std::int64_t> step{-1};
  std::atomic<std::int64_t> start_ns{0};
  std::atomic<std::int64_t> excluded_ns{0};  // intervals and compiles inside the step in flight
  std::atomic<bool> compiling{false};        // the step in flight is compiling (begin_compile)
  // Python's collector runs now (any thread: it stops them all), and the time collections
  // took since the step in flight began: neither is the step hanging.
  std::atomic<bool> collecting{false};
  std::atomic<std::int64_t> gc_ns{0};
  std::atomic<int> phase{-1};
  std::atomic<std::int64_t> last_done_step{-1};  // the last step that ended, and its host time
  std::atomic<std::int64_t> last_done_ns{0};
  std::atomic<int> interval{-1};  // IntervalKind of the open interval, -1: none
  std::atomic<std::int64_t> interval_start_ns{0};
  std::atomic<std::int64_t> interval_step{0};
  std::atomic<std::int64_t> interval_seq{0};
  std::array<std::atomic<std::int64_t>, kIntervalKinds> longest_interval_ns{};  // by kind
};

// What the cross-rank exchange knows of the other ranks: written by its thread
// (Profiler::set_peers_in_interval), read by the watchdog.
struct PeerState {
  // Other ranks now in an evaluation or checkpoint interval: ranks waiting for them in a
  // collective are not hung.
  std::atomic<int> in_interval{0};
  // How long after a peer's interval begins this rank can know of it; 0: no exchange.
  std::atomic<std::int64_t> notice_ns{0};

  void set(int peers, double notice_s) noexcept {
    notice_ns.store(static_cast<std::int64_t>(std::max(notice_s, 0.0) * 1e9),
                    std::memory_order_relaxed);
    in_interval.store(std::max(peers, 0), std::memory_order_relaxed);
  }
};

// The hang limit where the median iteration says nothing, learned from what the watchdog
// saw (HangDetector reads the result as its hang_floor_s and hang_min_s):
//   - the run's first step (no step has ended): hang_threshold x the first step of the
//     job's previous attempt where its log has one (a restart runs the same set-up), at
//     least hang_floor_s; else first_step_hang_s. Nothing of this run is measured, and a
//     first step legitimately sets up what later ones reuse (NCCL communicators, cuDNN
//     autotuning, lazy initialisation): minutes on a large model.
//   - later steps before min_history: hang_threshold x the longest step seen after the
//     first (the first alone while it is the only one), at least hang_floor_s. A loop of
//     28 s steps (LBFGS on a CPU) is not hung at 10 s.
//   - the first step after a gap (no step in flight: an evaluation, a checkpoint, a long
//     data wait) longer than that step's limit: at least hang_floor_s, as for a step of a
//     new run (caches and allocator pools may be cold again).
// A compile inside a step is already left out of its time (InflightState::excluded_ns).
// Watchdog thread only; pure (tested on given clock values).
class HangLimits {
 public:
  explicit HangLimits(const Config& config) : config_(config) {}
  enum class Source { kHistory, kFirstStep, kPreviousAttempt, kEarlierSteps, kFloor, kAfterGap };
  struct Seen {
    std::int64_t now_ns = 0;
    std::int64_t step = -1;  // the step in flight (also while it compiles), or -1
    std::int64_t start_ns = 0;
    std::int64_t last_done_step = -1;
    std::int64_t last_done_ns = 0;  // its host time
    bool history_ok = false;
    double median_ms = 0;
  };
  struct Limits {
    double floor_s = 0;  // HangDetector's limit before history
    double min_s = 0;    // and its least limit with history
    Source source = Source::kHistory;
  };
  Limits observe(const Seen& seen);
  static const char* name(Source source) noexcept;
  // The first step of the job's previous attempt, in seconds (compile time left out); 0: none.
  void set_previous_first_step_s(double s) noexcept { previous_first_s_ = s; }
  double previous_first_step_s() const noexcept { return previous_first_s_; }

 private:
  const Config& config_;
  std::int64_t done_step_ = -1;        // the last ended step seen
  std::int64_t first_done_ns_ = -1;    // the first ended step's time; -1: none yet
  std::int64_t longest_later_ns_ = 0;  // the longest of the later ones seen
  std::int64_t step_ = -1;             // the step in flight at the last poll
  std::int64_t idle_from_ns_ = -1;     // since when no step was seen in flight; -1: one was
  std::int64_t gap_ns_ = 0;            // the gap seen before the step in flight
  double previous_first_s_ = 0;
};

// The first step of a run's log (a previous attempt's), in seconds: its host time less
// its compile time; 0 when the file has no step that ended ok in its first lines.
double first_step_s_of_log(const std::string& path);

class Watchdog {
 public:
  // What the thread reads and writes to; all of it outlives the thread (stop() joins it).
  struct Context {
    const Config* config = nullptr;
    const PhaseNames* names = nullptr;
    const InflightState* inflight = nullptr;
    DetectionStage* detection = nullptr;
    AlertLog* alerts = nullptr;
    RecordPipeline* writer = nullptr;
    Clock* clock = nullptr;
    ClockMapping start;
    const CollectiveTimer* collectives = nullptr;  // a hung step waiting in one says so
    HostReadings* host = nullptr;                  // polled when due (every 10 ms); null: none
    const PeerState* peers = nullptr;              // null: no cross-rank view
    std::string previous_log;  // this rank's log of the job's previous attempt; empty: none
  };

  Watchdog() = default;
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts the thread; it also samples steal where the host reports any.
  void start(const Context& context);
  // The thread makes one more check (a hang resolved just before the close) and ends.
  void request_stop();
  void join();
  // A forked child: the thread is the parent's; leak it rather than join it.
  void abandon() noexcept;

  // Training thread: whether steal is sampled, and the latest total (ns).
  bool samples_steal() const noexcept { return steal_ != nullptr; }
  std::int64_t steal_total_ns() const noexcept {
    return steal_total_ns_.load(std::memory_order_relaxed);
  }
  // Training thread, at the end of an iteration that may be a slow step: reads steal now
  // (the watchdog's figure may be up to StealCadence::kQuietMs old), and the watchdog's own
  // reads. The new total; 0 without steal.
  std::int64_t refresh_steal() noexcept;

 private:
  void loop();

  Context context_;
  std::unique_ptr<StealReader> steal_;           // null: no steal to sample (bare metal)
  std::mutex steal_mu_;                          // one reader at a time: watchdog, training
  std::atomic<std::int64_t> steal_total_ns_{0};  // the latest StealReader::sample
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace detail
}  // namespace steptrace
