#include "record_detectors.hpp"

namespace steptrace::detail {

void RecordDetectors::observe(const StepRecord& r, std::vector<AlertEvent>& out) {
  const std::size_t first = out.size();
  slow_.observe(r, out);
  fold_into_shift(r, first, out);
  // (two windows: the shift is judged once its window is mostly the slower steps)
  shift_.observe(r, r.step - last_slow_alert_ <= 2 * window_, out);
  // A shift alerted: the per-step rules take the slower steps as the norm from here (beside
  // a busy host they held them out of their window for up to kMaxRegressionSteps, and a
  // streak of them paged the same slowdown again 500 steps later).
  if (shift_.last_alert_step() == r.step) slow_.adopt_new_normal();
  memory_.observe(r, out);
  device_.observe(r, out);
  hw_.observe(r, out);
  checkpoints_.observe(r, out);
  for (std::size_t i = first; i < out.size(); ++i) {
    if (out[i].unix_ns == 0)
      out[i].unix_ns = r.start_unix_ns + r.host_ns;  // (a held one has its own)
  }
}

void RecordDetectors::fold_into_shift(const StepRecord& r, std::size_t first,
                                      std::vector<AlertEvent>& out) {
  for (std::size_t i = first; i < out.size();) {
    const AlertEvent& e = out[i];
    const bool slow_alert = !e.update && (e.type == "step_regression" || e.type == "stall");
    if (slow_alert && !e.resolved && e.type == "step_regression" && shifted_already(e)) {
      folded_ = true;
    } else if (slow_alert && e.resolved && folded_ && e.type == "step_regression") {
      folded_ = false;
    } else {
      if (slow_alert && e.resolved) folded_ = false;  // (it escalated to a stall: kept)
      if (slow_alert && !e.resolved) last_slow_alert_ = r.step;
      ++i;
      continue;
    }
    out.erase(out.begin() + static_cast<std::ptrdiff_t>(i));
  }
}

bool RecordDetectors::shifted_already(const AlertEvent& e) const {
  if (shift_.episode_open()) return true;
  const auto since = e.details.find("slow_since_step");
  return shift_.last_alert_step() >= 0 && since != e.details.end() && since->is_number_integer() &&
         since->get<std::int64_t>() <= shift_.last_alert_step();
}

}  // namespace steptrace::detail
