#include "badput.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "quantile.hpp"

namespace steptrace::detail {

namespace {

constexpr double kMadCutoff = 3.0;  // goodput.MAD_CUTOFF

double to_s(std::int64_t ns) { return ns > 0 ? static_cast<double>(ns) / 1e9 : 0.0; }

}  // namespace

std::optional<BadputCause> badput_cause(std::string_view name) noexcept {
  for (std::size_t i = 0; i < kBadputCauseNames.size(); ++i) {
    if (kBadputCauseNames[i] == name) return static_cast<BadputCause>(i);
  }
  return std::nullopt;
}

std::string_view badput_cause_name(BadputCause cause) noexcept {
  return kBadputCauseNames[static_cast<std::size_t>(cause)];
}

BadputAccount::BadputAccount(std::int64_t process_start_unix_ns)
    : process_start_unix_ns_(process_start_unix_ns) {
  sorted_.reserve(kWindow);
  deviations_.reserve(kWindow);
}

void BadputAccount::seed(BadputCause cause, double secs) noexcept {
  if (std::isfinite(secs) && secs > 0) s_[static_cast<std::size_t>(cause)] += secs;
}

double BadputAccount::goodput_ratio() const noexcept {
  double total = 0;
  for (const double v : s_) total += v;
  return total > 0 ? s_[static_cast<std::size_t>(BadputCause::kProductive)] / total
                   : std::numeric_limits<double>::quiet_NaN();
}

// The ideal step time as goodput.ideal_step_time finds it (after Google's
// ml-goodput-measurement): the mean of the window's times at or below median + 3 x MAD.
void BadputAccount::update_ideal() {
  sorted_.assign(window_.begin(), window_.begin() + static_cast<std::ptrdiff_t>(window_count_));
  std::sort(sorted_.begin(), sorted_.end());
  const double median = median_of_sorted(sorted_);
  deviations_.clear();
  for (const double t : sorted_) deviations_.push_back(std::abs(t - median));
  std::sort(deviations_.begin(), deviations_.end());
  const double cut = median + kMadCutoff * median_of_sorted(deviations_);
  double sum = 0;
  std::size_t kept = 0;
  for (; kept < sorted_.size() && sorted_[kept] <= cut; ++kept) sum += sorted_[kept];
  ideal_s_ = kept > 0 ? sum / static_cast<double>(kept) : median;
}

void BadputAccount::book_training(double training_s) noexcept {
  const double slow = std::max(0.0, training_s - ideal_s_);
  s_[static_cast<std::size_t>(BadputCause::kProductive)] += training_s - slow;
  s_[static_cast<std::size_t>(BadputCause::kSlowSteps)] += slow;
}

void BadputAccount::add_step(const StepRecord& r) {
  const BetweenSteps& between = r.between;
  auto add = [this](BadputCause c, double v) { s_[static_cast<std::size_t>(c)] += v; };
  if (first_ && process_start_unix_ns_ > 0) {
    // before the first step, what has a kind of its own is booked under it below
    const std::int64_t before = r.data_ns + between.own_kinds_ns() - between.inside_step_ns;
    add(BadputCause::kStartup, to_s(r.start_unix_ns - process_start_unix_ns_ - before));
  }
  add(BadputCause::kData, to_s(r.data_ns));
  add(BadputCause::kEval, to_s(between.eval_ns()));
  add(BadputCause::kCheckpoint, to_s(between.checkpoint_ns()));
  add(BadputCause::kRestore, to_s(between.restore_ns()));
  add(BadputCause::kOther, to_s(between.other_ns));
  add(BadputCause::kCompile, to_s(r.compile_ns));
  const std::int64_t training_ns =
      std::max<std::int64_t>(0, r.host_ns - between.inside_step_ns - r.compile_ns);
  // Python's collections in the step before its run-queue wait: a collection slowed by a
  // busy host is still the collection (the gc_pause rule's order; goodput.py agrees)
  std::int64_t gc_ns = 0;
  for (const std::int64_t ns : r.gc_ns) gc_ns += ns;
  gc_ns = std::clamp<std::int64_t>(gc_ns, 0, training_ns);
  add(BadputCause::kGc, to_s(gc_ns));
  const std::int64_t runq_ns = std::clamp<std::int64_t>(r.runq_ns, 0, training_ns - gc_ns);
  add(BadputCause::kHostContention, to_s(runq_ns));
  const double training_s = to_s(training_ns - runq_ns - gc_ns);
  if (first_) {  // warm-up: its time above the ideal is startup, once there is an ideal
    first_ = false;
    first_step_s_ = training_s;
  } else {
    window_[window_next_] = training_s;
    window_next_ = (window_next_ + 1) % kWindow;
    window_count_ = std::min(window_count_ + 1, kWindow);
    if (window_count_ < kMinSteps) {
      waiting_[waiting_count_++] = training_s;
      return;
    }
    update_ideal();
    if (waiting_count_ > 0) {  // the ideal exists now: book the steps that waited for it
      for (std::size_t i = 0; i < waiting_count_; ++i) book_training(waiting_[i]);
      waiting_count_ = 0;
    }
    book_training(training_s);
  }
  if (first_step_s_ >= 0 && ideal_s_ > 0) {
    const double warm_up = std::max(0.0, first_step_s_ - ideal_s_);
    add(BadputCause::kStartup, warm_up);
    add(BadputCause::kProductive, first_step_s_ - warm_up);
    first_step_s_ = -1;
  }
}

}  // namespace steptrace::detail
