#include "steptrace/replay.hpp"

#include <algorithm>

#include "alert.hpp"
#include "check.hpp"
#include "detect/record_detectors.hpp"
#include "step_record.hpp"
#include "steptrace/error.hpp"

namespace steptrace {

std::vector<std::string> replay_detectors(const Config& config,
                                          const std::vector<ReplayStep>& steps) {
  config.validate();
  detail::PhaseNames names;
  for (const auto& name : config.phases) names.intern(name);
  detail::RecordDetectors detectors(config, names, /*host_limit_bytes=*/0);  // not this host's
  std::vector<detail::AlertEvent> events;
  std::vector<std::string> lines;
  auto emit = [&] {
    for (const auto& e : events) {
      std::string line = detail::alert_json_line(e, config.rank < 0 ? 0 : config.rank);
      line.pop_back();  // the newline
      lines.push_back(std::move(line));
    }
    events.clear();
  };
  auto ns = [](double ms) { return static_cast<std::int64_t>(ms * 1e6); };
  std::int64_t previous = -1;
  for (const ReplayStep& s : steps) {
    STEPTRACE_CHECK(s.step > previous, UsageError,
                    "step {} comes after step {}; steps must be in increasing order", s.step,
                    previous);
    STEPTRACE_CHECK(s.phases_ms.size() <= kMaxPhases, UsageError,
                    "step {} has {} phases; at most {} are allowed", s.step, s.phases_ms.size(),
                    kMaxPhases);
    previous = s.step;
    detail::StepRecord r;
    r.step = s.step;
    r.start_unix_ns = s.start_unix_ns;
    r.data_ns = ns(s.data_ms);
    r.data_start_ns = ns(s.data_start_ms);
    r.compile_ns = ns(s.compile_ms);
    r.work.tokens = s.tokens;
    r.work.samples = s.samples;
    r.between.other_ns = ns(s.other_ms);
    r.between.inside_step_ns = ns(s.interval_in_step_ms);
    r.runq_ns = s.runq_ms >= 0 ? ns(s.runq_ms) : -1;
    r.runq_span_ns = ns(s.runq_span_ms);
    r.steal_ns = s.steal_ms >= 0 ? ns(s.steal_ms) : -1;
    r.step_ns = r.host_ns = ns(s.step_ms);
    r.gc_ns[2] = ns(s.gc_gen2_ms);
    r.gc_ns[0] = std::max<std::int64_t>(0, ns(s.gc_ms) - r.gc_ns[2]);  // the younger ones
    r.gc_between_ns[2] = ns(s.gc_between_gen2_ms);
    r.gc_between_ns[0] = std::max<std::int64_t>(0, ns(s.gc_between_ms) - r.gc_between_ns[2]);
    r.gc_count = s.gc_count;
    r.failed = s.failed;
    r.profiled = s.profiled;
    r.memory = s.memory;
    r.rss_fresh = s.rss_fresh;
    for (const auto& [name, ms] : s.phases_ms) {
      const std::uint16_t id = names.intern(name);
      r.phase_ids[r.phase_count] = id;
      r.phase_ns[r.phase_count] = r.host_phase_ns[r.phase_count] = ns(ms);
      ++r.phase_count;
    }
    detectors.observe(r, events);
    emit();
  }
  detectors.finish(events);
  emit();
  return lines;
}

}  // namespace steptrace
