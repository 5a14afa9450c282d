#include "steptrace/profiler.hpp"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/auxv.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

#include "backends/fake/fake_backends.hpp"
#include "backends/host/monotonic_clock.hpp"
#include "backends/host/tsc_clock.hpp"
#include "core/detect/hang_detector.hpp"
#include "core/this_thread.hpp"
#include "runtime/watchdog.hpp"
#include "steptrace/error.hpp"
#include "steptrace/ext/background_thread.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;
using testing::thread_ids;

constexpr std::int64_t kMs = 1'000'000;

// A profiler on a fake clock and a fake memory source, both still reachable by the test.
struct Fixture {
  explicit Fixture(const TempDir& tmp, const std::function<void(Config&)>& tweak = {}) {
    Config config = testing::run_config(tmp);
    if (tweak) tweak(config);
    Backends backends;
    auto c = std::make_unique<fake::FakeClock>();
    clock = c.get();
    backends.clock = std::move(c);
    auto m = std::make_unique<fake::FakeMemorySource>();
    memory = m.get();
    backends.memory_sources.push_back(std::move(m));
    prof = std::make_unique<Profiler>(config, RunInfo{{{"python", "3.11"}}}, std::move(backends));
    path = prof->log_path();
  }
  std::vector<nlohmann::json> close_and_read() {
    prof->close();
    return read_jsonl(path);
  }
  fake::FakeClock* clock;
  fake::FakeMemorySource* memory;
  std::unique_ptr<Profiler> prof;
  std::string path;
};

TEST(Profiler, ScopesTimePhasesAndSteps) {
  TempDir tmp;
  Fixture f(tmp);
  {
    auto step = f.prof->step();
    {
      auto p = step.phase("forward");
      f.clock->advance(2 * kMs);
    }
    {
      auto p = step.phase("backward");
      f.clock->advance(3 * kMs);
    }
    f.clock->advance(1 * kMs);  // outside any phase
  }
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["step"], 0);
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["backward"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 6.0);
  EXPECT_DOUBLE_EQ(steps[0]["host_ms"].get<double>(), 6.0);
  EXPECT_EQ(steps[0]["clock"], "host");
  EXPECT_EQ(steps[0]["status"], "ok");
  EXPECT_EQ(records.front()["kind"], "run_start");
  EXPECT_EQ(records.front()["versions"]["python"], "3.11");
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back()["reason"], "normal");
}

// The gap between steps is data only where the loader's wait was measured; the rest is
// other host work, and intervals are their own kinds.
TEST(Profiler, TheGapIsDataOnlyWhenTheLoaderIsWrappedTheRestIsOther) {
  TempDir tmp;
  Fixture f(tmp);
  { auto s = f.prof->step(); }
  f.clock->advance(7 * kMs);
  { auto s = f.prof->step(); }  // gap: 7 ms, nothing known of it
  f.clock->advance(1 * kMs);
  f.prof->begin_data();
  f.clock->advance(4 * kMs);
  f.prof->end_data();
  { auto s = f.prof->step(); }  // wrapped: 4 ms data, 1 ms other
  const auto steps = of_kind(f.close_and_read(), "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_DOUBLE_EQ(steps[0]["data_ms"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(steps[0]["other_ms"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(steps[1]["data_ms"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(steps[1]["other_ms"].get<double>(), 7.0);
  EXPECT_DOUBLE_EQ(steps[2]["data_ms"].get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(steps[2]["other_ms"].get<double>(), 1.0);
}

// The loader's start at an epoch boundary (ending one iterator, making the next, its first
// batch) is data and data_start_ms; the other waits are data only, and a step after none
// has no data_start_ms.
TEST(Profiler, TheLoadersStartIsDataAndItsOwnFigure) {
  TempDir tmp;
  Fixture f(tmp);
  { auto s = f.prof->step(); }
  for (const auto& [ms, start] : {std::pair{3, true}, std::pair{20, true}, std::pair{2, false}}) {
    f.prof->begin_data();
    f.clock->advance(ms * kMs);
    f.prof->end_data(start);
  }
  { auto s = f.prof->step(); }
  f.prof->begin_data();
  f.clock->advance(1 * kMs);
  f.prof->end_data();
  { auto s = f.prof->step(); }
  const auto steps = of_kind(f.close_and_read(), "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_DOUBLE_EQ(steps[1]["data_ms"].get<double>(), 25.0);
  EXPECT_DOUBLE_EQ(steps[1]["data_start_ms"].get<double>(), 23.0);
  EXPECT_DOUBLE_EQ(steps[2]["data_ms"].get<double>(), 1.0);
  EXPECT_FALSE(steps[2].contains("data_start_ms"));
}

// Compiling inside a step is the step's time and its compile_ms; a nested begin counts
// once, and outside a step the calls do nothing.
TEST(Profiler, CompilingInsideAStepIsItsCompileTime) {
  TempDir tmp;
  Fixture f(tmp);
  {
    auto s = f.prof->step();
    f.clock->advance(1 * kMs);
    f.prof->begin_compile();
    f.clock->advance(30 * kMs);
    f.prof->begin_compile();
    f.clock->advance(10 * kMs);
    f.prof->end_compile();
    f.clock->advance(2 * kMs);
    f.prof->end_compile();  // no compile open: nothing
  }
  f.prof->begin_compile();  // between steps: nothing
  f.clock->advance(5 * kMs);
  f.prof->end_compile();
  { auto s = f.prof->step(); }
  const auto steps = of_kind(f.close_and_read(), "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 43.0);
  EXPECT_DOUBLE_EQ(steps[0]["compile_ms"].get<double>(), 40.0);
  EXPECT_FALSE(steps[1].contains("compile_ms"));
}

// Evaluation and checkpoint intervals between steps: their own figures in the next step,
// an interval record each, never data or other; a step ends the interval open before it.
TEST(Profiler, IntervalsBetweenStepsAreAccountedByKind) {
  TempDir tmp;
  Fixture f(tmp);
  { auto s = f.prof->step(); }
  f.prof->begin_data();
  f.clock->advance(2 * kMs);
  f.prof->end_data();
  {
    auto eval = f.prof->interval(IntervalKind::kEval);
    EXPECT_EQ(f.prof->open_interval(), IntervalKind::kEval);
    f.clock->advance(30 * kMs);
  }
  EXPECT_FALSE(f.prof->open_interval().has_value());
  f.clock->advance(1 * kMs);  // logging
  f.prof->begin_interval(IntervalKind::kCheckpoint);
  f.clock->advance(50 * kMs);
  f.prof->begin_interval(IntervalKind::kOther);  // ends the checkpoint
  f.clock->advance(3 * kMs);
  EXPECT_THROW(f.prof->begin_interval(IntervalKind::kOther), UsageError);  // no nesting
  f.prof->end_interval(IntervalKind::kEval);  // not the open one: nothing happens
  EXPECT_EQ(f.prof->open_interval(), IntervalKind::kOther);
  { auto s = f.prof->step(); }  // ends the open interval
  EXPECT_FALSE(f.prof->open_interval().has_value());
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_DOUBLE_EQ(steps[1]["data_ms"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(steps[1]["eval_ms"].get<double>(), 30.0);
  EXPECT_DOUBLE_EQ(steps[1]["checkpoint_ms"].get<double>(), 50.0);
  EXPECT_DOUBLE_EQ(steps[1]["other_ms"].get<double>(), 4.0);  // logging + the "other" interval
  EXPECT_FALSE(steps[0].contains("eval_ms"));
  const auto intervals = of_kind(records, "interval");
  ASSERT_EQ(intervals.size(), 3u);
  EXPECT_EQ(intervals[0]["interval"], "eval");
  EXPECT_EQ(intervals[0]["step"], 1);
  EXPECT_EQ(intervals[0]["inside_step"], false);
  EXPECT_DOUBLE_EQ(intervals[0]["duration_ms"].get<double>(), 30.0);
  EXPECT_EQ(intervals[1]["interval"], "checkpoint");
  EXPECT_DOUBLE_EQ(intervals[1]["duration_ms"].get<double>(), 50.0);
  EXPECT_EQ(intervals[2]["interval"], "other");
  EXPECT_DOUBLE_EQ(intervals[2]["duration_ms"].get<double>(), 3.0);
  EXPECT_GT(intervals[1]["start_unix_ns"].get<std::int64_t>(),
            intervals[0]["start_unix_ns"].get<std::int64_t>());
}

// A step begun late (a hook that learns only after a forward that it was training): it
// starts at the given reading, the interval open before it ends there or is dropped when
// it began there, and the phases that ran since are added at their readings.
TEST(Profiler, AStepBegunLateStartsAtItsReadingWithItsPhases) {
  TempDir tmp;
  Fixture f(tmp);
  { auto s = f.prof->step(); }
  f.clock->advance(4 * kMs);  // logging: other
  f.prof->begin_interval(IntervalKind::kEval);
  f.clock->advance(30 * kMs);  // evaluation forwards
  const std::int64_t forward_begin = f.prof->clock_ns();
  f.clock->advance(6 * kMs);  // the forward a backward then follows
  const std::int64_t forward_end = f.prof->clock_ns();
  f.clock->advance(1 * kMs);  // the loss
  f.prof->begin_step_at(forward_begin);
  EXPECT_FALSE(f.prof->open_interval().has_value());
  const PhaseId forward = f.prof->phase_id("forward");
  f.prof->add_phase(forward, forward_begin, forward_end);
  f.prof->add_phase(f.prof->phase_id("loss"), forward_end, f.prof->clock_ns());
  EXPECT_THROW(f.prof->add_phase(forward, forward_end, forward_begin), UsageError);  // backwards
  {
    auto p = f.prof->phase("backward");
    f.clock->advance(8 * kMs);
    EXPECT_THROW(f.prof->add_phase(f.prof->phase_id("backward"), forward_end, forward_end),
                 UsageError);  // while it runs
  }
  f.prof->end_step();
  // the interval began where the step did (it held nothing): dropped, and a step begun
  // "before" the previous step's end starts at that end
  f.prof->begin_interval(IntervalKind::kEval);
  const std::int64_t at = f.prof->clock_ns();
  f.clock->advance(2 * kMs);
  f.prof->begin_step_at(at - 1000 * kMs);
  f.prof->add_phase(forward, at - 1000 * kMs, at + 1000 * kMs);  // clamped to [start, now]
  f.prof->end_step();
  EXPECT_THROW(f.prof->add_phase(forward, at, at), UsageError);  // outside a step
  const auto recs = f.close_and_read();
  const auto steps = of_kind(recs, "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_DOUBLE_EQ(steps[1]["step_ms"].get<double>(), 15.0);
  EXPECT_DOUBLE_EQ(steps[1]["phases_ms"]["forward"].get<double>(), 6.0);
  EXPECT_DOUBLE_EQ(steps[1]["phases_ms"]["loss"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(steps[1]["phases_ms"]["backward"].get<double>(), 8.0);
  EXPECT_DOUBLE_EQ(steps[1]["eval_ms"].get<double>(), 30.0);
  EXPECT_DOUBLE_EQ(steps[1]["other_ms"].get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(steps[2]["step_ms"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(steps[2]["phases_ms"]["forward"].get<double>(), 2.0);
  EXPECT_FALSE(steps[2].contains("eval_ms"));
  const auto intervals = of_kind(recs, "interval");
  ASSERT_EQ(intervals.size(), 1u);
  EXPECT_DOUBLE_EQ(intervals[0]["duration_ms"].get<double>(), 30.0);
}

// The run queue's wait is host time: on another clock (this fake one) it could not be
// compared with the steps, so none is written (a real wait would judge fake steps).
TEST(Profiler, OnAnotherClockNoRunQueueFigureIsWritten) {
  TempDir tmp;
  Fixture f(tmp);
  for (int i = 0; i < 13; ++i) {
    auto s = f.prof->step();
    f.clock->advance((i == 12 ? 30 : 4) * kMs);
  }
  for (const auto& s : of_kind(f.close_and_read(), "step")) EXPECT_FALSE(s.contains("host"));
}

// A data wait open when an interval begins pauses for it (a validation run between the
// loader's bracketing calls), and a loader advanced inside an interval is the interval's.
TEST(Profiler, AnIntervalPausesTheDataWaitAndOwnsItsLoader) {
  TempDir tmp;
  Fixture f(tmp);
  { auto s = f.prof->step(); }
  f.prof->begin_data();
  f.clock->advance(2 * kMs);
  f.prof->begin_interval(IntervalKind::kEval);
  f.clock->advance(20 * kMs);
  f.prof->begin_data();  // the evaluation's loader
  f.clock->advance(5 * kMs);
  f.prof->end_data();
  f.prof->end_interval(IntervalKind::kEval);
  f.clock->advance(3 * kMs);
  f.prof->end_data();
  { auto s = f.prof->step(); }
  f.prof->begin_data();
  f.prof->begin_interval(IntervalKind::kCheckpoint);
  EXPECT_THROW(f.prof->begin_step(), UsageError);  // the data wait was never ended
  f.prof->end_data();
  { auto s = f.prof->step(); }
  const auto steps = of_kind(f.close_and_read(), "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_DOUBLE_EQ(steps[1]["data_ms"].get<double>(), 5.0);
  EXPECT_DOUBLE_EQ(steps[1]["eval_ms"].get<double>(), 25.0);
  EXPECT_DOUBLE_EQ(steps[1]["other_ms"].get<double>(), 0.0);
}

// An interval inside a step stays in step_ms but is named (interval_in_step_ms), so the
// detectors can leave it out; one after the last step is written at close and goes to
// goodput. The goodput parts add up to the wall clock.
TEST(Profiler, IntervalsInsideStepsAndAfterTheLastStepAndGoodput) {
  TempDir tmp;
  Fixture f(tmp);
  f.prof->begin_data();  // the first batch's wait: data, not startup
  f.clock->advance(7 * kMs);
  f.prof->end_data();
  for (int i = 0; i < 3; ++i) {
    auto s = f.prof->step();
    f.clock->advance(10 * kMs);
    if (i == 1) {
      auto eval = f.prof->interval(IntervalKind::kEval);
      f.clock->advance(40 * kMs);
    }
  }
  {
    auto s = f.prof->step();  // an "other" interval inside a step stays the step's time
    auto log = f.prof->interval(IntervalKind::kOther);
    f.clock->advance(10 * kMs);
  }
  f.clock->advance(5 * kMs);
  f.prof->begin_interval(IntervalKind::kCheckpoint);
  f.clock->advance(100 * kMs);  // still open at close: ended there
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 4u);
  EXPECT_FALSE(steps[3].contains("interval_in_step_ms"));
  EXPECT_DOUBLE_EQ(steps[1]["step_ms"].get<double>(), 50.0);
  EXPECT_DOUBLE_EQ(steps[1]["eval_ms"].get<double>(), 40.0);
  EXPECT_DOUBLE_EQ(steps[1]["interval_in_step_ms"].get<double>(), 40.0);
  const auto intervals = of_kind(records, "interval");
  ASSERT_EQ(intervals.size(), 3u);
  EXPECT_EQ(intervals[0]["inside_step"], true);
  EXPECT_EQ(intervals[0]["step"], 1);
  EXPECT_EQ(intervals[2]["interval"], "checkpoint");
  EXPECT_EQ(intervals[2]["step"], 4);  // after the last step: the index the next would have
  EXPECT_DOUBLE_EQ(intervals[2]["duration_ms"].get<double>(), 100.0);
  const auto& g = records.back()["goodput"];
  EXPECT_NEAR(g["steps_s"].get<double>(), 0.040, 1e-6);
  EXPECT_NEAR(g["eval_s"].get<double>(), 0.040, 1e-6);
  EXPECT_NEAR(g["data_s"].get<double>(), 0.007, 1e-6);
  EXPECT_NEAR(g["checkpoint_s"].get<double>(), 0.100, 1e-6);
  EXPECT_NEAR(g["after_last_step_s"].get<double>(), 0.005, 2e-3);  // + the close's own time
  double parts = 0;
  for (const char* k : {"startup_s", "steps_s", "data_s", "eval_s", "checkpoint_s", "other_s",
                        "after_last_step_s"}) {
    parts += g[k].get<double>();
  }
  EXPECT_NEAR(parts, g["wall_s"].get<double>(), 0.005);
  EXPECT_EQ(g["from"], "process_start");
}

// Steps of 1 ms on the host clock, then optionally one long step: run-queue figures come
// every 10 ms (the first reading is the baseline), taken by the watchdog thread
// (HostReadings) with `detect`, by the steps themselves without it.
std::vector<nlohmann::json> busy_steps_on_the_host_clock(const TempDir& tmp, bool detect, int ms,
                                                         int long_step_ms = 0) {
  Config config = testing::run_config(tmp);
  config.detect = detect;
  auto prof = std::make_unique<Profiler>(config, RunInfo{}, Backends{});
  auto busy = [](int busy_ms) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(busy_ms);
    while (std::chrono::steady_clock::now() < end) {
    }
  };
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    auto s = prof->step();
    busy(1);
  }
  if (long_step_ms > 0) {
    auto s = prof->step();
    busy(long_step_ms);
  }
  const std::string path = prof->log_path();
  prof->close();
  return of_kind(read_jsonl(path), "step");
}

// The first step has the process RSS (read before it).
TEST(Profiler, OnTheHostClockTheStepsCarryRunQueueFiguresEveryTenMilliseconds) {
  for (const bool detect : {true, false}) {
    TempDir tmp;
    const auto steps = busy_steps_on_the_host_clock(tmp, detect, 300);
    ASSERT_GE(steps.size(), 30u);
    EXPECT_GT(steps.front()["memory"]["rss_bytes"].get<std::int64_t>(), 0) << detect;
    int readings = 0;
    for (const auto& s : steps) {
      if (!s.contains("host")) continue;
      ++readings;
      EXPECT_GE(s["host"]["runq_ms"].get<double>(), 0.0);
      EXPECT_GT(s["host"]["runq_span_ms"].get<double>(), 0.0);
    }
    // ~29 at a 10 ms pace; a loaded host delays the readings, not by 3x
    EXPECT_GE(readings, 10) << "detect " << detect;
  }
}

// An iteration much longer than the recent ones reads its own run queue at its end, so that
// a slow step always carries the figure that tells contention from the model.
TEST(Profiler, ALongIterationCarriesItsRunQueueFigure) {
  for (const bool detect : {true, false}) {
    TempDir tmp;
    const auto steps = busy_steps_on_the_host_clock(tmp, detect, 30, /*long_step_ms=*/20);
    ASSERT_TRUE(steps.back().contains("host")) << "detect " << detect;
    EXPECT_GE(steps.back()["host"]["runq_span_ms"].get<double>(), 20.0);
  }
}

// A loader advanced inside a step (a nested next()) must not throw into training: the
// wait stays part of the step, and run_end counts it.
TEST(Profiler, DataInsideAStepIsCountedNotThrown) {
  TempDir tmp;
  Fixture f(tmp);
  f.prof->begin_data();
  f.clock->advance(2 * kMs);
  f.prof->end_data();
  f.prof->begin_step();
  for (int i = 0; i < 2; ++i) {
    EXPECT_NO_THROW(f.prof->begin_data());
    f.clock->advance(3 * kMs);
    EXPECT_NO_THROW(f.prof->end_data());
  }
  f.prof->end_step();
  EXPECT_EQ(f.prof->data_inside_step(), 2);
  f.prof->begin_data();  // between steps it is timed as before
  f.clock->advance(5 * kMs);
  f.prof->end_data();
  { auto s = f.prof->step(); }
  EXPECT_THROW(f.prof->end_data(), UsageError);  // an end without a begin is still misuse
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_DOUBLE_EQ(steps[0]["data_ms"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 6.0);  // the inner waits stay in the step
  EXPECT_DOUBLE_EQ(steps[1]["data_ms"].get<double>(), 5.0);
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back()["data_inside_step"], 2);
}

TEST(Profiler, RepeatedPhaseAddsUpAndOpenPhaseEndsWithStep) {
  TempDir tmp;
  Fixture f(tmp);
  const PhaseId fwd = f.prof->phase_id("forward");
  f.prof->begin_step();
  for (int i = 0; i < 3; ++i) {
    f.prof->begin_phase(fwd);
    f.clock->advance(1 * kMs);
    f.prof->end_phase(fwd);
  }
  f.prof->begin_phase(f.prof->phase_id("custom"));
  f.clock->advance(2 * kMs);
  f.prof->end_step();  // "custom" is still open: it ends with the step
  const auto steps = of_kind(f.close_and_read(), "step");
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["custom"].get<double>(), 2.0);
}

TEST(Profiler, NestedDifferentPhasesAreAllowed) {
  TempDir tmp;
  Fixture f(tmp);
  {
    auto s = f.prof->step();
    auto outer = s.phase("forward");
    auto inner = s.phase("attention");
    f.clock->advance(1 * kMs);
  }
  const auto steps = of_kind(f.close_and_read(), "step");
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["attention"].get<double>(), 1.0);
}

TEST(Profiler, MisuseThrowsAndLeavesTheLogValid) {
  TempDir tmp;
  Fixture f(tmp);
  const PhaseId fwd = f.prof->phase_id("forward");
  EXPECT_THROW(f.prof->begin_phase(fwd), UsageError);  // outside a step
  EXPECT_THROW(f.prof->end_step(), UsageError);        // end without start
  f.prof->begin_step();
  EXPECT_THROW(f.prof->begin_step(), UsageError);    // step inside a step
  EXPECT_THROW(f.prof->end_phase(fwd), UsageError);  // end without start
  f.prof->begin_phase(fwd);
  EXPECT_THROW(f.prof->begin_phase(fwd), UsageError);  // nested in itself
  f.prof->begin_data();  // loader inside a step: counted, not thrown (DataInsideAStep...)
  f.prof->end_data();
  f.clock->advance(kMs);
  f.prof->end_phase(fwd);
  f.prof->end_step();
  EXPECT_THROW(f.prof->end_data(), UsageError);
  EXPECT_THROW(f.prof->phase_id(""), ConfigError);
  try {
    f.prof->begin_phase(fwd);
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("\"forward\""), std::string::npos) << e.what();
  }
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);  // the misuse did not start, end or corrupt a step
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 1.0);
  EXPECT_EQ(records.back()["kind"], "run_end");
}

TEST(Profiler, ExceptionInAStepMarksItFailed) {
  TempDir tmp;
  Fixture f(tmp);
  try {
    auto s = f.prof->step();
    auto p = s.phase("forward");
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  { auto s = f.prof->step(); }
  const auto records = f.close_and_read();
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0]["status"], "error");
  EXPECT_EQ(steps[1]["status"], "ok");
  EXPECT_EQ(records.back()["error_steps"], 1);
}

TEST(Profiler, DestroyedByAnExceptionEndsWithReasonException) {
  TempDir tmp;
  std::string path;
  try {
    Fixture f(tmp);
    path = f.path;
    auto s = f.prof->step();
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  const auto records = read_jsonl(path);
  EXPECT_EQ(records.back()["reason"], "exception");
}

TEST(Profiler, CloseEndsAnOpenStepAsFailedAndIsIdempotent) {
  TempDir tmp;
  Fixture f(tmp);
  f.prof->begin_step();
  f.prof->close(EndReason::kSignal);
  f.prof->close();
  EXPECT_TRUE(f.prof->closed());
  EXPECT_THROW(f.prof->begin_step(), UsageError);
  const auto records = read_jsonl(f.path);
  ASSERT_EQ(of_kind(records, "step").size(), 1u);
  EXPECT_EQ(of_kind(records, "step")[0]["status"], "error");
  EXPECT_EQ(records.back()["reason"], "signal");
  EXPECT_EQ(of_kind(records, "run_end").size(), 1u);
}

TEST(Profiler, MemoryIsSampledEveryStep) {
  TempDir tmp;
  Fixture f(tmp);
  for (int i = 0; i < 3; ++i) {
    f.memory->allocated_bytes = 1000 * (i + 1);
    f.memory->rss_bytes = 5000;
    auto s = f.prof->step();
  }
  f.prof->begin_step();
  MemorySample outside;
  outside.peak_bytes = 777;
  f.prof->set_step_memory(outside);
  f.prof->end_step();
  const auto steps = of_kind(f.close_and_read(), "step");
  EXPECT_EQ(f.memory->samples, 4);
  EXPECT_EQ(steps[2]["memory"]["allocated_bytes"], 3000);
  EXPECT_EQ(steps[2]["memory"]["rss_bytes"], 5000);
  EXPECT_FALSE(steps[2]["memory"].contains("peak_bytes"));
  EXPECT_EQ(steps[3]["memory"]["peak_bytes"], 777);
}

TEST(Profiler, AMemorySourceIsReadOnceItsIntervalHasPassedAndHeldInBetween) {
  TempDir tmp;
  Fixture f(tmp);
  f.memory->interval_ns = 10 * kMs;  // as the RSS source
  for (int i = 0; i < 10; ++i) {
    f.memory->rss_bytes = 1000 * (i + 1);
    auto s = f.prof->step();
    f.clock->advance(3 * kMs);
  }
  const auto steps = of_kind(f.close_and_read(), "step");
  ASSERT_EQ(steps.size(), 10U);
  EXPECT_EQ(f.memory->samples, 3);  // at the ends of steps 0, 4 and 8: 12 ms apart
  const std::vector<int> held = {1000, 1000, 1000, 1000, 5000, 5000, 5000, 5000, 9000, 9000};
  for (std::size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i]["memory"]["rss_bytes"], held[i]) << i;
  }
}

TEST(Profiler, FlushMakesStepsVisibleWhileRunning) {
  TempDir tmp;
  Fixture f(tmp);
  for (int i = 0; i < 5; ++i) auto s = f.prof->step();
  f.prof->flush();
  EXPECT_EQ(of_kind(read_jsonl(f.path), "step").size(), 5u);
  EXPECT_EQ(f.prof->step_index(), 5);
}

TEST(Profiler, RegressionAlertFollowsItsStepAndIsCounted) {
  TempDir tmp;
  Fixture f(tmp);
  std::atomic<int> callbacks{0};
  f.prof->set_alert_callback([&](const std::string& line) {
    if (line.find("\"kind\":\"alert\"") != std::string::npos) ++callbacks;
  });
  auto run_step = [&](std::int64_t backward_ms) {
    auto s = f.prof->step();
    auto p = s.phase("backward");
    f.clock->advance(backward_ms * kMs);
  };
  for (int i = 0; i < 30; ++i) run_step(10);
  // a regression's slow steps last regression_min_ms (1,000 ms) in all: 34 of 30 ms
  for (int i = 0; i < 40; ++i) run_step(30);  // steps 30..69: 3x
  run_step(10);
  const auto records = f.close_and_read();
  std::size_t alert_at = 0;
  for (std::size_t i = 0; i < records.size(); ++i) {
    if (records[i]["kind"] == "alert") alert_at = i;
  }
  ASSERT_GT(alert_at, 0u);
  const auto& alert = records[alert_at];
  EXPECT_EQ(alert["type"], "step_regression");
  EXPECT_EQ(alert["step"], 63);
  EXPECT_EQ(alert["phase"], "backward");
  EXPECT_EQ(records[alert_at - 1]["kind"], "step");  // written right after its step
  EXPECT_EQ(records[alert_at - 1]["step"], 63);
  // stamped with its step's end, on the run's clock: never after run_end
  const auto& step63 = records[alert_at - 1];
  EXPECT_EQ(alert["unix_ns"].get<std::int64_t>(),
            step63["start_unix_ns"].get<std::int64_t>() + 30 * kMs);
  EXPECT_LE(alert["unix_ns"].get<std::int64_t>(),
            records.back()["end_unix_ns"].get<std::int64_t>());
  const auto resolved = of_kind(records, "resolved");
  ASSERT_EQ(resolved.size(), 1u);
  EXPECT_EQ(resolved[0]["first_step"], 30);
  EXPECT_EQ(resolved[0]["repeats"], 39);
  EXPECT_EQ(records.back()["alerts"]["step_regression"], 1);
  EXPECT_EQ(records.back()["alert_repeats"]["step_regression"], 39);
  EXPECT_EQ(callbacks.load(), 1);
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

TEST(Profiler, DetectionCanBeTurnedOff) {
  TempDir tmp;
  Fixture f(tmp, [](Config& c) { c.detect = false; });
  for (int i = 0; i < 30; ++i) {
    auto s = f.prof->step();
    f.clock->advance((i == 25 ? 100 : 1) * kMs);
  }
  const auto records = f.close_and_read();
  EXPECT_TRUE(of_kind(records, "alert").empty());
}

TEST(Profiler, RealHostClockAndRss) {
  TempDir tmp;
  Config config;
  config.log_dir = tmp.str();
  config.overwrite = true;
  std::string path;
  {
    Profiler prof(config);
    auto s = prof.step();
    auto p = s.phase("forward");
    path = prof.log_path();
  }
  const auto records = read_jsonl(path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_GT(steps[0]["memory"]["rss_bytes"].get<std::int64_t>(), 0);
  EXPECT_GE(steps[0]["step_ms"].get<double>(), steps[0]["phases_ms"]["forward"].get<double>());
  EXPECT_EQ(records.front()["backends"]["memory"]["active"][0], "rss");
}

// ---- the log file's open: nothing planted in the log folder is followed or truncated ----

std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A planted rank0.jsonl -> victim: overwrite=true (steptrace run's default) truncated the
// victim through the link; now a clear error naming the link, and the victim untouched.
TEST(LogOpen, ASymlinkAtTheLogPathIsAnErrorAndItsTargetIsUntouched) {
  TempDir tmp;
  const auto victim = tmp.path() / "victim.txt";
  std::ofstream(victim) << "precious\n";
  Config config = testing::run_config(tmp);
  std::filesystem::create_directories(config.log_dir);
  const auto link = std::filesystem::path(config.log_dir) / "rank0.jsonl";
  std::filesystem::create_symlink(victim, link);
  for (const bool overwrite : {true, false}) {
    config.overwrite = overwrite;
    try {
      Profiler prof(config);
      FAIL() << "a symlink at the log path was opened";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("symbolic link"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(link.string()), std::string::npos) << e.what();
    }
    EXPECT_EQ(file_text(victim), "precious\n");
    EXPECT_TRUE(std::filesystem::is_symlink(link));  // left for the user to look at
  }
  // a dangling link (to a file it would create) is refused the same way
  std::filesystem::remove(link);
  std::filesystem::create_symlink(tmp.path() / "created.txt", link);
  config.overwrite = true;
  EXPECT_THROW(Profiler prof(config), ConfigError);
  EXPECT_FALSE(std::filesystem::exists(tmp.path() / "created.txt"));
}

// overwrite replaces the name: a hard link to another file is unlinked, not truncated;
// a FIFO planted at the path is replaced, never opened (an open for writing would block).
TEST(LogOpen, OverwriteReplacesTheNameNeverWhatItLinksTo) {
  TempDir tmp;
  const auto victim = tmp.path() / "victim.txt";
  std::ofstream(victim) << "precious\n";
  Config config = testing::run_config(tmp);
  config.overwrite = true;
  std::filesystem::create_directories(config.log_dir);
  const auto path = std::filesystem::path(config.log_dir) / "rank0.jsonl";
  std::filesystem::create_hard_link(victim, path);
  { Profiler prof(config); }
  EXPECT_EQ(file_text(victim), "precious\n");
  EXPECT_EQ(std::filesystem::hard_link_count(path), 1u);
  EXPECT_EQ(read_jsonl(path.string()).front()["kind"], "run_start");
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  { Profiler prof(config); }
  EXPECT_TRUE(std::filesystem::is_regular_file(path));
  EXPECT_EQ(read_jsonl(path.string()).back()["kind"], "run_end");
}

// Logs hold exception text, stack dumps and host names: 0640 by default, log_mode to change
// it (the umask still applies); a replaced log gets the mode again.
TEST(LogOpen, TheLogIsNotWorldReadableByDefault) {
  TempDir tmp;
  const mode_t old_umask = ::umask(022);
  Config config = testing::run_config(tmp);
  std::string path;
  {
    Profiler prof(config);
    path = prof.log_path();
  }
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0640u);
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  config.overwrite = true;
  config.log_mode = 0644;
  { Profiler prof(config); }
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  config.log_mode = 0400;  // the owner must be able to write its own log
  EXPECT_THROW(Profiler prof(config), ConfigError);
  ::umask(old_umask);
}

// On the host clock the boundaries read the CPU's counter once it is calibrated (100 ms in,
// then checked every second: tsc_clock.hpp): across both, a phase measures what the
// kernel's clock measures inside and around it.
TEST(HostClock, APhaseMeasuresWhatTheKernelsClockMeasuresAroundIt) {
  TempDir tmp;
  Config config;
  config.log_dir = tmp.str();
  config.overwrite = true;
  config.detect = false;
  struct Bracket {
    std::int64_t outer_ns;  // from before the phase began to after it ended
    std::int64_t inner_ns;  // from after it began to before it ended
  };
  std::vector<Bracket> brackets;
  std::string path;
  {
    Profiler prof(config);
    path = prof.log_path();
    const std::int64_t until = monotonic_now_ns() + 1'300'000'000;  // a calibration, a check
    while (monotonic_now_ns() < until) {
      auto s = prof.step();
      Bracket b{};
      b.outer_ns = -monotonic_now_ns();
      {
        auto p = s.phase("forward");
        b.inner_ns = -monotonic_now_ns();
        const std::int64_t end = monotonic_now_ns() + 2'000'000;  // 2 ms of work
        while (monotonic_now_ns() < end) {
        }
        b.inner_ns += monotonic_now_ns();
      }
      b.outer_ns += monotonic_now_ns();
      brackets.push_back(b);
    }
  }
  const auto records = read_jsonl(path);
  const std::string method = records.front()["backends"]["timer"]["method"];
  EXPECT_EQ(method.find("time-stamp counter") != std::string::npos, tsc_clock_chosen()) << method;
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), brackets.size());
  int outside = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    // phases_ms has four decimals (100 ns); the counter's map is within ~1 us of the clock
    const auto ns = std::llround(steps[i]["phases_ms"]["forward"].get<double>() * 1e6);
    const bool in = ns >= brackets[i].inner_ns - 2'000 && ns <= brackets[i].outer_ns + 2'000;
    outside += !in;
    EXPECT_TRUE(in) << "step " << i << ": " << ns << " ns, the kernel's clock "
                    << brackets[i].inner_ns << " inside and " << brackets[i].outer_ns << " around";
    if (outside > 5) break;
  }
}

TEST(HostClock, ReadsTheKernelsClockThroughTheVdsoAsLibcDoes) {
  const ClockGettime read = vdso_clock_gettime();
#if defined(__GLIBC__) && (defined(__x86_64__) || defined(__aarch64__))
  if (getauxval(AT_SYSINFO_EHDR) != 0) {  // the kernel mapped a vDSO (vdso(7))
    EXPECT_NE(read, &::clock_gettime) << "the vDSO's clock_gettime was not found";
  }
#endif
  for (const clockid_t id : {CLOCK_MONOTONIC, CLOCK_REALTIME}) {
    timespec before{};
    timespec mid{};
    timespec after{};
    ASSERT_EQ(::clock_gettime(id, &before), 0);
    ASSERT_EQ(read(id, &mid), 0);
    ASSERT_EQ(::clock_gettime(id, &after), 0);
    auto ns = [](const timespec& t) { return t.tv_sec * 1'000'000'000LL + t.tv_nsec; };
    EXPECT_LE(ns(before), ns(mid)) << "clock " << id;  // the same clock as libc's
    EXPECT_LE(ns(mid), ns(after)) << "clock " << id;
  }
}

TEST(ThisThreadToken, TellsTheRunningThreadsApart) {
  const void* mine = detail::this_thread_token();
  EXPECT_NE(mine, nullptr);
  EXPECT_EQ(detail::this_thread_token(), mine);
  const void* other = nullptr;
  std::thread([&] { other = detail::this_thread_token(); }).join();  // both alive meanwhile
  EXPECT_NE(other, mine);
}

// ---- lifecycle: close from another thread, fork, SIGTERM ----

// A one-shot event between threads (no sleeps).
class Event {
 public:
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      set_ = true;
    }
    cv_.notify_all();
  }
  bool wait(std::chrono::seconds limit = std::chrono::seconds(60)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

// Joins `t`, or ends the test binary when it does not finish in time (a hung thread
// cannot be joined).
void join_within(std::thread& t, std::future<void>& done, std::chrono::seconds limit) {
  if (done.wait_for(limit) != std::future_status::ready) {
    ADD_FAILURE() << "the thread did not finish within " << limit.count() << " s (a hang)";
    std::_Exit(1);
  }
  t.join();
}

Config host_config(const TempDir& tmp) {
  Config c;
  c.log_dir = tmp.str();
  c.overwrite = true;
  c.queue_capacity = 16;  // small: steps not drained would fill it at once
  c.flush_interval_ms = 1;
  return c;
}

TEST(Profiler, CloseFromAnotherThreadWhileTheLoopKeepsStepping) {
  TempDir tmp;
  Profiler prof(host_config(tmp));
  const std::string path = prof.log_path();
  std::atomic<std::int64_t> steps_done{0};
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  Event stepped;
  std::packaged_task<void()> loop([&] {
    const PhaseId fwd = prof.phase_id("forward");
    while (!stop.load()) {
      try {
        auto s = prof.step();
        auto p = s.phase(fwd);
      } catch (const std::exception&) {
        errors.fetch_add(1);  // nothing may reach the training loop
      }
      if (steps_done.fetch_add(1) + 1 == 20) stepped.set();
    }
  });
  auto done = loop.get_future();
  std::thread trainer(std::move(loop));
  ASSERT_TRUE(stepped.wait());
  prof.close();  // from this thread while the loop keeps stepping
  EXPECT_TRUE(prof.closed());
  // Many more steps than the ring holds after the close: none waits, none is recorded.
  const std::int64_t at_close = steps_done.load();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (steps_done.load() < at_close + 200 &&
         done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "the loop stopped stepping after the close (a hang)";
      std::_Exit(1);
    }
    std::this_thread::yield();
  }
  stop.store(true);
  join_within(trainer, done, std::chrono::seconds(60));
  EXPECT_EQ(errors.load(), 0);
  const auto records = read_jsonl(path);
  const auto steps = of_kind(records, "step");
  ASSERT_GE(steps.size(), 20u);
  EXPECT_LE(static_cast<std::int64_t>(steps.size()), at_close + 1);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    ASSERT_EQ(steps[i]["step"], static_cast<std::int64_t>(i));
    EXPECT_EQ(steps[i]["status"], "ok");  // the step in progress ended normally
  }
  EXPECT_EQ(of_kind(records, "run_end").size(), 1u);
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back()["steps"], steps.size());
}

TEST(Profiler, CloseFromAnotherThreadWaitsForTheStepInProgress) {
  TempDir tmp;
  Profiler prof(host_config(tmp));
  const std::string path = prof.log_path();
  Event in_step;
  Event go;
  Event closed;
  std::packaged_task<void()> loop([&] {
    {
      auto s = prof.step();
      auto p = s.phase("forward");
      in_step.set();
      go.wait();
    }
    closed.wait();
    auto s = prof.step();  // after the close: not recorded, nothing thrown
    auto p = s.phase("forward");
  });
  auto done = loop.get_future();
  std::thread trainer(std::move(loop));
  ASSERT_TRUE(in_step.wait());
  std::thread closer([&] { prof.close(); });
  go.set();  // whether the close request comes before the step ends or not, it ends normally
  closer.join();
  closed.set();
  join_within(trainer, done, std::chrono::seconds(60));
  const auto records = read_jsonl(path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["status"], "ok");
  EXPECT_EQ(records.back()["kind"], "run_end");
  EXPECT_EQ(records.back().count("error"), 0u);
}

TEST(Profiler, CloseFromAnotherThreadGivesUpOnAStepThatDoesNotEnd) {
  TempDir tmp;
  Config config = host_config(tmp);
  config.close_wait_s = 0.2;
  Profiler prof(config);
  const std::string path = prof.log_path();
  Event in_step;
  Event go;
  std::packaged_task<void()> loop([&] {
    {
      auto s = prof.step();
      in_step.set();
      go.wait();  // "hung" until the close has returned
    }
    auto s = prof.step();
  });
  auto done = loop.get_future();
  std::thread trainer(std::move(loop));
  ASSERT_TRUE(in_step.wait());
  prof.close(EndReason::kSignal);
  EXPECT_TRUE(prof.closed());
  go.set();
  join_within(trainer, done, std::chrono::seconds(60));
  const auto records = read_jsonl(path);
  EXPECT_TRUE(of_kind(records, "step").empty());
  const auto& end = records.back();
  EXPECT_EQ(end["kind"], "run_end");
  EXPECT_EQ(end["reason"], "signal");
  EXPECT_NE(end["error"].get<std::string>().find("close_wait_s"), std::string::npos);
}

// Runs `child` in a forked process (ended by _exit with its return value, or by a 60 s
// alarm if it hangs) and returns its wait status.
int run_forked(const std::function<int()>& child) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(60);
    int rc = 1;
    try {
      rc = child();
    } catch (...) {
      rc = 2;
    }
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

TEST(Profiler, AForkedChildWritesNothingToTheParentsLog) {
  TempDir tmp;
  auto prof = std::make_unique<Profiler>(host_config(tmp));
  const std::string path = prof->log_path();
  for (int i = 0; i < 5; ++i) auto s = prof->step();
  prof->flush();
  for (const bool close_in_child : {true, false}) {
    const int status = run_forked([&] {
      for (int i = 0; i < 100; ++i) {  // more than the ring holds: no writer thread here
        auto s = prof->step();
        auto p = s.phase("forward");
      }
      prof->flush();
      if (close_in_child) prof->close();
      prof.reset();  // the destructor neither writes nor joins the parent's threads
      return 0;
    });
    ASSERT_TRUE(WIFEXITED(status)) << "child status " << status;
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  for (int i = 0; i < 3; ++i) auto s = prof->step();
  prof.reset();
  const auto records = read_jsonl(path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 8u);
  for (std::size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i]["step"], i);
  EXPECT_EQ(of_kind(records, "run_end").size(), 1u);
  EXPECT_EQ(of_kind(records, "run_start").size(), 1u);
}

TEST(Profiler, ItsThreadsLeaveTheProcessesSignalsToTheProgramsThreads) {
  // A SIGTERM sent to the process must reach a thread of the program (under TSan, one that
  // landed on the writer waited out its flush interval), so steptrace's threads block it.
  std::thread([] {}).join();  // a sanitizer's own background thread, if any, starts now
  const std::set<std::string> before = thread_ids();
  TempDir tmp;
  Config config = host_config(tmp);
  config.metrics_port = 0;  // the Prometheus server's thread too
  Profiler prof(config);
  // read once each is past its start (a thread still starting has every signal blocked)
  const auto masks = testing::masks_of_started_threads(before);
  testing::expect_signals_left_to_the_program(masks);
  EXPECT_GE(masks.size(), 2U);  // the writer and the watchdog at least
}

TEST(BackgroundThread, BlocksTheAsynchronousSignalsNotTheFaults) {
  sigset_t caller;
  pthread_sigmask(SIG_BLOCK, nullptr, &caller);
  sigset_t in_thread;
  sigemptyset(&in_thread);
  start_background_thread([&] { pthread_sigmask(SIG_BLOCK, nullptr, &in_thread); }).join();
  EXPECT_EQ(sigismember(&in_thread, SIGTERM), 1);
  EXPECT_EQ(sigismember(&in_thread, SIGINT), 1);
  EXPECT_EQ(sigismember(&in_thread, SIGUSR1), 1);
  // a fault in the thread still reaches the program's handlers (faulthandler)
  EXPECT_EQ(sigismember(&in_thread, SIGSEGV), 0);
  EXPECT_EQ(sigismember(&in_thread, SIGABRT), 0);
  sigset_t here;
  pthread_sigmask(SIG_BLOCK, nullptr, &here);
  // the starting thread's mask is back
  EXPECT_EQ(sigismember(&here, SIGTERM), sigismember(&caller, SIGTERM));
}

TEST(Profiler, SigtermWhileEveryThreadIsBlockedWritesRunEnd) {
  TempDir tmp;
  const std::string path = tmp.str("rank0.jsonl");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(60);
    ::close(ready[0]);
    Config config = host_config(tmp);
    config.flush_interval_ms = 60000;  // only the signal path gets the steps out
    Profiler prof(config);
    for (int i = 0; i < 7; ++i) auto s = prof.step();
    auto s = prof.step();  // still running when the signal comes
    if (!install_sigterm_handler(/*terminate=*/true, /*grace_s=*/0.0)) ::_exit(3);
    (void)!::write(ready[1], "r", 1);
    // Blocked for good in native code: the handler runs, but nothing after it returns to
    // the program. (Not a self-deadlocked mutex: ThreadSanitizer holds a signal back until
    // pthread_mutex_lock returns, so under TSan the handler would never run.)
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child status " << status;
  EXPECT_EQ(WTERMSIG(status), SIGTERM);  // re-raised with the default action
  const auto records = read_jsonl(path);
  EXPECT_EQ(of_kind(records, "step").size(), 7u);
  const auto& end = records.back();
  EXPECT_EQ(end["kind"], "run_end");
  EXPECT_EQ(end["reason"], "signal");
  EXPECT_EQ(end["steps"], 7);
}

}  // namespace
}  // namespace steptrace
