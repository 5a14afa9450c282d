// The watchdog (csrc/runtime/watchdog.*): its hang limits on given clock values
// (HangLimits and HangDetector through the watchdog's header), and the running watchdog
// through the Profiler on a fake clock (hangs written while the step is still in flight).
#include "runtime/watchdog.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "core/detect/hang_detector.hpp"
#include "profiler_fixture.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::Fixture;
using testing::kMs;
using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;

// Other ranks in an interval: the count (never negative) and the notice (never negative),
// as the cross-rank exchange sets them for the hang rule.
TEST(PeerState, SetKeepsThePeersAndTheirNoticeNonNegative) {
  detail::PeerState peers;
  peers.set(3, 1.5);
  EXPECT_EQ(peers.in_interval.load(), 3);
  EXPECT_EQ(peers.notice_ns.load(), 1'500 * kMs);
  peers.set(-1, -2.0);
  EXPECT_EQ(peers.in_interval.load(), 0);
  EXPECT_EQ(peers.notice_ns.load(), 0);
}

// The watchdog checks every 100 ms of real time: polls the log (bounded) until it holds
// alerts of `type`, and returns them.
std::vector<nlohmann::json> wait_for_alerts(const std::string& path, const char* type) {
  std::vector<nlohmann::json> found;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (found.empty() && std::chrono::steady_clock::now() < deadline) {
    for (const auto& r : of_kind(read_jsonl(path), "alert")) {
      if (r["type"] == type) found.push_back(r);
    }
    std::this_thread::yield();
  }
  return found;
}

TEST(Profiler, WatchdogWritesAHangWhileTheStepIsStillRunning) {
  TempDir tmp;
  Fixture f(tmp, [](Config& c) { c.first_step_hang_s = 10; });
  f.prof->begin_step();
  f.prof->begin_phase(f.prof->phase_id("backward"));
  f.clock->advance(11'000 * kMs);  // 11 s on the fake clock: past the 10 s floor
  const auto hangs = wait_for_alerts(f.path, "hang");
  ASSERT_EQ(hangs.size(), 1u);
  EXPECT_TRUE(f.prof->in_step());  // written while the step is still in flight
  EXPECT_EQ(hangs[0]["step"], 0);
  EXPECT_EQ(hangs[0]["phase"], "backward");
  EXPECT_GE(hangs[0]["value"].get<double>(), 11000.0);
  f.prof->end_step();
  const auto records = f.close_and_read();
  EXPECT_EQ(records.back()["alerts"]["hang"], 1);
}

// A generation-2 collection of 30 s (a large object graph on a busy host) is neither a hang
// while it runs nor part of the step's hang clock afterwards: before, the watchdog paged
// `hang` in forward during it. The step hanging afterwards is still caught, its time
// counted without the collection.
TEST(Profiler, WatchdogLeavesPythonsCollectionsOutOfTheHangClock) {
  TempDir tmp;
  Fixture f(tmp, [](Config& c) { c.first_step_hang_s = 10; });
  f.prof->begin_step();
  f.prof->begin_phase(f.prof->phase_id("forward"));
  f.prof->begin_gc(2);
  f.clock->advance(30'000 * kMs);
  f.prof->end_gc();
  f.clock->advance(11'000 * kMs);  // then 11 s hung: past the 10 s limit
  const auto hangs = wait_for_alerts(f.path, "hang");
  ASSERT_EQ(hangs.size(), 1u);
  EXPECT_GE(hangs[0]["value"].get<double>(), 11000.0);
  EXPECT_LT(hangs[0]["value"].get<double>(), 30000.0) << hangs[0]["message"];
  f.prof->end_step();
  f.close_and_read();
}

// The watchdog's hang rule on given clock values: HangLimits' floor and least limit fed to
// HangDetector through its own copy of the options, as Watchdog::loop does, polled every
// 100 ms.
struct HangWatch {
  explicit HangWatch(const Config& c) : config(c), hang_config(c), limits(config) {}
  Config config;
  Config hang_config;
  detail::HangLimits limits;
  detail::HangDetector hang{hang_config};
  detail::HangDetector bare{config};  // the rule without HangLimits (hang_floor_s at once)
  std::int64_t step = -1, start_ns = 0, done_step = -1, done_ns = 0;
  double median_ms = 0;
  bool history_ok = false;
  bool compiling = false;        // the step in flight compiles: its hang clock stops
  std::int64_t excluded_ns = 0;  // compile time inside it so far
  std::vector<detail::AlertEvent> alerts, bare_alerts;
  detail::HangLimits::Source source = detail::HangLimits::Source::kHistory;

  void poll(std::int64_t now_ns) {
    detail::HangLimits::Seen seen{now_ns,  step,       start_ns, done_step,
                                  done_ns, history_ok, median_ms};
    const auto limit = limits.observe(seen);
    hang_config.hang_floor_s = limit.floor_s;
    hang_config.hang_min_s = limit.min_s;
    detail::HangDetector::Poll p;
    p.now_ns = now_ns;
    p.step = compiling ? -1 : step;
    p.start_ns = start_ns + excluded_ns;
    p.last_done_step = done_step;
    p.last_done_ns = done_ns;
    p.median_ms = median_ms;
    p.history_ok = history_ok;
    if (auto a = hang.check(p); a && !a->resolved) {
      alerts.push_back(*a);
      source = limit.source;
    }
    if (auto a = bare.check(p); a && !a->resolved) bare_alerts.push_back(*a);
  }
  // The i-th alert (there are i + 1): its step, limit (ms) and where the limit came from.
  void expect_alert(std::size_t i, std::int64_t alert_step, double threshold_ms,
                    detail::HangLimits::Source from) const {
    ASSERT_EQ(alerts.size(), i + 1);
    EXPECT_EQ(alerts[i].step, alert_step);
    EXPECT_DOUBLE_EQ(alerts[i].threshold, threshold_ms);
    EXPECT_EQ(source, from);
  }
  // Polls from `from_ns` to `to_ns` (exclusive) every 100 ms.
  void run(std::int64_t from_ns, std::int64_t to_ns) {
    for (std::int64_t t = from_ns; t < to_ns; t += 100 * kMs) poll(t);
  }
  void begin(std::int64_t s, std::int64_t at_ns) {
    step = s;
    start_ns = at_ns;
  }
  void end(std::int64_t at_ns) {
    done_step = step;
    done_ns = at_ns - start_ns;
    step = -1;
  }
};

constexpr std::int64_t kS = 1000 * kMs;

// Issue 52: pytorch/examples' LBFGS loop takes ~28 s a step on a CPU and was paged `hang`
// at step 0 (the limit was hang_floor_s, 10 s). A 30 s first step is no hang; the next
// step's limit is learned from it (5 x 30 s).
TEST(HangLimits, AThirtySecondFirstStepIsNoHangAndTheNextStepLearnsFromIt) {
  HangWatch w{Config{}};
  w.begin(0, 0);
  w.run(0, 30 * kS);
  EXPECT_TRUE(w.alerts.empty());
  ASSERT_FALSE(w.bare_alerts.empty());  // what it did before: paged after 10 s
  EXPECT_DOUBLE_EQ(w.bare_alerts[0].threshold, 10'000.0);
  w.end(30 * kS);
  w.run(30 * kS, 30 * kS + 200 * kMs);
  w.begin(1, 30 * kS + 200 * kMs);
  w.run(30 * kS + 200 * kMs, 180 * kS);  // 149.8 s in flight: under 5 x 30 s
  EXPECT_TRUE(w.alerts.empty());
  w.run(180 * kS, 181 * kS);  // a step that never ends: named after 150 s
  w.expect_alert(0, 1, 150'000.0, detail::HangLimits::Source::kEarlierSteps);
}

// A first step that never ends is still named, after first_step_hang_s.
TEST(HangLimits, AFirstStepThatNeverEndsIsAHangAfterFirstStepHangS) {
  Config config;
  config.first_step_hang_s = 600;
  HangWatch w{config};
  w.begin(0, 5 * kS);
  w.run(0, 605 * kS);
  EXPECT_TRUE(w.alerts.empty());
  w.run(605 * kS, 606 * kS);
  w.expect_alert(0, 0, 600'000.0, detail::HangLimits::Source::kFirstStep);
  // min_history 0 (history from the start) gives the first step no shorter limit
  config.min_history = 0;
  HangWatch h{config};
  h.history_ok = true;
  h.begin(0, 0);
  h.run(0, 599 * kS);
  EXPECT_TRUE(h.alerts.empty());
}

// A restart: the first step of the job's previous attempt (30 s, from its log) sets the
// first step's limit (5 x 30 s) instead of first_step_hang_s.
TEST(HangLimits, ARestartsFirstStepLearnsFromThePreviousAttempt) {
  TempDir tmp;
  const std::string log = tmp.str("rank0.jsonl");
  {
    std::ofstream out(log);
    out << R"({"kind":"run_start","rank":0})"
        << "\n"
        << R"({"kind":"interval","interval":"restore","duration_ms":900.0})"
        << "\n"
        << R"({"kind":"step","step":0,"status":"ok","step_ms":31000.0,"host_ms":32000.0,)"
        << R"("compile_ms":2000.0,"phases_ms":{}})"
        << "\n"
        << R"({"kind":"step","step":1,"status":"ok","step_ms":1.0})"
        << "\n";
  }
  EXPECT_DOUBLE_EQ(detail::first_step_s_of_log(log), 30.0);  // host time less compile time
  EXPECT_DOUBLE_EQ(detail::first_step_s_of_log(tmp.str("missing.jsonl")), 0.0);
  HangWatch w{Config{}};
  w.limits.set_previous_first_step_s(detail::first_step_s_of_log(log));
  w.begin(0, 0);
  w.run(0, 150 * kS);
  EXPECT_TRUE(w.alerts.empty());
  w.run(150 * kS, 151 * kS);
  w.expect_alert(0, 0, 150'000.0, detail::HangLimits::Source::kPreviousAttempt);
}

// Later steps before min_history: hang_threshold x the longest step after the first (a
// slow first step does not keep the limit high), never under hang_floor_s.
TEST(HangLimits, StepsBeforeHistoryUseTheLongestLaterStepAtLeastTheFloor) {
  HangWatch w{Config{}};
  w.begin(0, 0);
  w.run(0, 180 * kS);  // a 3-minute first step (communicators, autotuning)
  w.end(180 * kS);
  w.poll(180 * kS + 50 * kMs);
  w.begin(1, 180 * kS + 100 * kMs);
  w.run(180 * kS + 100 * kMs, 181 * kS + 100 * kMs);  // 1 s
  w.end(181 * kS + 100 * kMs);
  w.poll(181 * kS + 150 * kMs);
  w.begin(2, 181 * kS + 200 * kMs);
  w.run(181 * kS + 200 * kMs, 191 * kS + 200 * kMs);  // 10 s: the floor, not 5 x 180 s
  EXPECT_TRUE(w.alerts.empty());
  w.run(191 * kS + 200 * kMs, 192 * kS);
  w.expect_alert(0, 2, 10'000.0, detail::HangLimits::Source::kFloor);
}

// With history (median 100 ms: limit 1 s), the first step after a long gap (an
// evaluation between steps, a long data wait) gets hang_floor_s; a step after no gap
// keeps the 1 s limit.
TEST(HangLimits, TheFirstStepAfterALongGapGetsTheFloor) {
  HangWatch w{Config{}};
  w.history_ok = true;
  w.median_ms = 100;
  w.done_step = 49;  // the first step ended long ago
  w.done_ns = 2 * kS;
  w.poll(0);
  w.poll(100 * kMs);  // no step in flight: a 60 s gap
  w.run(200 * kMs, 60 * kS);
  w.begin(50, 60 * kS);
  w.run(60 * kS, 69 * kS + 900 * kMs);  // 9.9 s: was a hang after 1 s
  EXPECT_TRUE(w.alerts.empty());
  EXPECT_FALSE(w.bare_alerts.empty());
  w.run(69 * kS + 900 * kMs, 70 * kS + 200 * kMs);
  w.expect_alert(0, 50, 10'000.0, detail::HangLimits::Source::kAfterGap);
  // The steps after it, with no gap seen between them, have the median's limit again.
  w.end(70 * kS + 300 * kMs);
  w.begin(51, 70 * kS + 310 * kMs);
  w.run(70 * kS + 350 * kMs, 70 * kS + 750 * kMs);
  w.end(70 * kS + 800 * kMs);  // 0.49 s: within the limit, the episode resolves
  w.begin(52, 70 * kS + 810 * kMs);
  w.run(70 * kS + 850 * kMs, 72 * kS);
  w.expect_alert(1, 52, 1'000.0, detail::HangLimits::Source::kHistory);
}

// A recompile inside a step (a new shape) stops the step's hang clock, as before; it is
// no gap either: the steps after it keep the median's limit.
TEST(HangLimits, ACompileInsideAStepIsNeitherAHangNorAGap) {
  HangWatch w{Config{}};
  w.history_ok = true;
  w.median_ms = 100;
  w.done_step = 49;
  w.done_ns = 100 * kMs;
  w.begin(50, 0);
  w.compiling = true;
  w.run(0, 60 * kS);  // 60 s compiling
  w.compiling = false;
  w.excluded_ns = 60 * kS;
  w.run(60 * kS, 60 * kS + 500 * kMs);  // then 0.5 s of work
  EXPECT_TRUE(w.alerts.empty());
  w.end(60 * kS + 500 * kMs);
  w.excluded_ns = 0;
  w.begin(51, 60 * kS + 510 * kMs);
  w.run(60 * kS + 550 * kMs, 62 * kS);
  w.expect_alert(0, 51, 1'000.0, detail::HangLimits::Source::kHistory);
}

// Through the running watchdog (fake clock): the run's first step is judged against
// first_step_hang_s, and the alert says so.
TEST(Profiler, WatchdogJudgesTheFirstStepAgainstFirstStepHangS) {
  TempDir tmp;
  Fixture f(tmp, [](Config& c) { c.first_step_hang_s = 120; });
  f.prof->begin_step();
  f.prof->begin_phase(f.prof->phase_id("optimizer"));
  f.clock->advance(121'000 * kMs);
  const auto hangs = wait_for_alerts(f.path, "hang");
  ASSERT_EQ(hangs.size(), 1u);
  EXPECT_EQ(hangs[0]["step"], 0);
  EXPECT_DOUBLE_EQ(hangs[0]["threshold"].get<double>(), 120'000.0);
  EXPECT_EQ(hangs[0]["details"]["limit_source"], "first_step_hang_s");
  EXPECT_NE(hangs[0]["message"].get<std::string>().find("first_step_hang_s"), std::string::npos);
  f.prof->end_step();
  f.close_and_read();
}

// Through the running watchdog: attempt 1 of a job learns its first step's limit from
// attempt 0's log (same log_dir, same job).
TEST(Profiler, WatchdogLearnsTheFirstStepsLimitFromThePreviousAttempt) {
  TempDir tmp;
  const auto same_job = [](Config& c) { c.job = "job-52"; };
  {
    Fixture first(tmp, same_job);
    first.prof->begin_step();
    first.clock->advance(30'000 * kMs);
    first.prof->end_step();
    first.close_and_read();
  }
  Fixture f(tmp, same_job);
  ASSERT_NE(f.path.find("attempt1"), std::string::npos) << f.path;
  f.prof->begin_step();
  f.clock->advance(151'000 * kMs);  // past 5 x 30 s, well within first_step_hang_s
  const auto hangs = wait_for_alerts(f.path, "hang");
  ASSERT_EQ(hangs.size(), 1u);
  EXPECT_EQ(hangs[0]["step"], 0);
  EXPECT_DOUBLE_EQ(hangs[0]["threshold"].get<double>(), 150'000.0);
  EXPECT_EQ(hangs[0]["details"]["limit_source"], "previous_attempt");
  f.prof->end_step();
  f.close_and_read();
}

// An evaluation that hangs: the watchdog names it while it is still open, judged against
// the longest earlier evaluation; a long checkpoint is not an evaluation's hang.
TEST(Profiler, WatchdogWritesAnIntervalHangWhileTheEvaluationIsStillOpen) {
  TempDir tmp;
  Fixture f(tmp, [](Config& c) { c.hang_min_s = 1; });
  { auto s = f.prof->step(); }
  {
    auto eval = f.prof->interval(IntervalKind::kEval);
    f.clock->advance(2'000 * kMs);  // the first evaluation: 2 s
  }
  { auto s = f.prof->step(); }
  f.prof->begin_interval(IntervalKind::kEval);
  f.clock->advance(10'001 * kMs);  // past 5 x 2 s
  std::vector<nlohmann::json> hangs;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (hangs.empty() && std::chrono::steady_clock::now() < deadline) {
    for (const auto& r : of_kind(read_jsonl(f.path), "alert")) {
      if (r["type"] == "interval_hang") hangs.push_back(r);
    }
    std::this_thread::yield();
  }
  ASSERT_EQ(hangs.size(), 1u);
  EXPECT_EQ(f.prof->open_interval(), IntervalKind::kEval);  // written while it is open
  EXPECT_EQ(hangs[0]["step"], 2);
  EXPECT_EQ(hangs[0]["phase"], "eval");
  EXPECT_DOUBLE_EQ(hangs[0]["threshold"].get<double>(), 10'000.0);
  EXPECT_NE(hangs[0]["message"].get<std::string>().find("longest earlier one"), std::string::npos);
  f.prof->end_interval(IntervalKind::kEval);
  const auto records = f.close_and_read();
  EXPECT_EQ(records.back()["alerts"]["interval_hang"], 1);
  EXPECT_FALSE(records.back()["alerts"].contains("hang"));  // no step was in flight
  const auto resolved = of_kind(records, "resolved");
  ASSERT_EQ(resolved.size(), 1u);
  EXPECT_EQ(resolved[0]["type"], "interval_hang");
}

}  // namespace
}  // namespace steptrace
