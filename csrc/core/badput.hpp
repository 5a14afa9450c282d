// The live waste account of a job (docs/goodput.md): every second of the wall clock from
// the process's start to the last step, in one cause. The offline report
// (python/steptrace/analysis/goodput.py) is the reference; live, the ideal step time is found over
// the trailing window instead of the whole job, and the causes only an earlier attempt
// has (wasted progress, recovery) come in as seeds.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "step_record.hpp"

namespace steptrace::detail {

enum class BadputCause : std::uint8_t {
  kProductive,
  kSlowSteps,
  kWastedProgress,
  kRecovery,
  kStartup,
  kData,
  kCheckpoint,
  kRestore,
  kEval,
  kCompile,
  kHostContention,
  kGc,
  kOther,
};
// In the order of goodput.CAUSES (the names are the metrics' `cause` label values).
inline constexpr std::array<std::string_view, 13> kBadputCauseNames = {
    "productive", "slow_steps", "wasted_progress", "recovery",
    "startup",    "data",       "checkpoint",      "restore",
    "eval",       "compile",    "host_contention", "gc",
    "other"};

std::optional<BadputCause> badput_cause(std::string_view name) noexcept;
std::string_view badput_cause_name(BadputCause cause) noexcept;

class BadputAccount {
 public:
  // Steps in the window the ideal step time is found over, and the fewest it needs.
  static constexpr std::size_t kWindow = 100;
  static constexpr std::size_t kMinSteps = 10;

  /// `process_start_unix_ns`: where the wall clock starts (0: unknown; then startup is the
  /// time before the first step the record itself accounts for).
  explicit BadputAccount(std::int64_t process_start_unix_ns);

  /// Books one step record: the time before it by kind, its compile, run-queue wait and
  /// Python garbage collections (those inside the step; a collection between steps stays
  /// in the gap's kind), and its training time at the ideal step time (productive) and above it
  /// (slow_steps). Until the window has kMinSteps steps their training time waits, unbooked.
  void add_step(const StepRecord& r);
  /// Seconds from earlier attempts of the job (wasted progress, recovery, and their own
  /// causes), added as they are.
  void seed(BadputCause cause, double seconds) noexcept;

  /// Seconds per cause, by BadputCause (the steps still waiting for an ideal are not in).
  const std::array<double, kBadputCauseNames.size()>& seconds() const noexcept { return s_; }
  /// productive / all the time accounted; NaN before anything is.
  double goodput_ratio() const noexcept;
  /// The ideal step time now (seconds), 0 before the window has kMinSteps steps.
  double ideal_s() const noexcept { return ideal_s_; }

 private:
  void book_training(double training_s) noexcept;
  void update_ideal();

  std::int64_t process_start_unix_ns_;
  bool first_ = true;
  std::array<double, kBadputCauseNames.size()> s_{};
  std::array<double, kWindow> window_{};  // the latest training times, a ring
  std::size_t window_count_ = 0, window_next_ = 0;
  std::vector<double> sorted_, deviations_;  // update_ideal's scratch (no allocation per step)
  double ideal_s_ = 0;
  std::array<double, kMinSteps> waiting_{};  // training seconds before an ideal existed
  std::size_t waiting_count_ = 0;
  double first_step_s_ = -1;  // the first step's training time, booked once an ideal exists
};

}  // namespace steptrace::detail
