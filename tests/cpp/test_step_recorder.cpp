// The step recorder (csrc/runtime/step_recorder.*): what a step record holds (phases, the
// gap before a step as data, intervals and other host time, compile time, memory and
// run-queue figures), through the Profiler on a fake clock; and the recorder on its own,
// bound to a fake clock: what it publishes for the other threads (the watchdog, Python's
// comm hooks and watchers).
#include "runtime/step_recorder.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/fake/fake_backends.hpp"
#include "profiler_fixture.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::Fixture;
using testing::kMs;
using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;

// ---- through the Profiler: the step records ----

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

// ---- the recorder on its own ----

// A recorder bound to a fake clock (1 s at start, still unless advanced) and nothing else:
// no device, no memory source, no writer (no step is ended).
struct BareRecorder {
  BareRecorder() {
    forward = names.intern("forward");
    detail::StepRecorder::Parts parts;
    parts.config = &config;
    parts.names = &names;
    parts.clock = &clock;
    parts.memory_sources = &sources;
    recorder.bind(parts);
  }
  Config config;
  detail::PhaseNames names;
  fake::FakeClock clock;
  std::vector<MemorySource*> sources;
  detail::StepRecorder recorder;
  PhaseId forward = 0;
};

TEST(StepRecorder, PublishesTheStepAndPhaseInFlightForTheOtherThreads) {
  BareRecorder r;
  EXPECT_EQ(r.recorder.inflight().step.load(), -1);
  EXPECT_EQ(r.recorder.current_phase(), "");
  EXPECT_EQ(r.recorder.current_interval(), "");
  r.recorder.begin_step();
  EXPECT_TRUE(r.recorder.in_step());
  EXPECT_EQ(r.recorder.inflight().step.load(), 0);
  r.recorder.begin_phase(r.forward);
  EXPECT_EQ(r.recorder.current_phase(), "forward");
  r.recorder.end_phase(r.forward);
  EXPECT_EQ(r.recorder.current_phase(), "");
}

TEST(StepRecorder, AStepCannotBeginInsideAStepNorAPhaseOutsideOne) {
  BareRecorder r;
  EXPECT_THROW(r.recorder.begin_phase(r.forward), UsageError);
  r.recorder.begin_step();
  EXPECT_THROW(r.recorder.check_can_begin(), UsageError);
  r.recorder.begin_phase(r.forward);
  EXPECT_THROW(r.recorder.begin_phase(r.forward), UsageError);  // not nested in itself
}

// Python's collections are timed on the run's clock: the watchdog sees one running, and
// its time is left out of the step in flight's hang clock once it ends.
TEST(StepRecorder, ACollectionIsMarkedWhileItRunsAndItsTimeAddedUp) {
  BareRecorder r;
  r.recorder.begin_step();
  r.recorder.begin_gc(2);
  EXPECT_TRUE(r.recorder.inflight().collecting.load());
  r.clock.advance(30'000 * kMs);
  r.recorder.end_gc();
  EXPECT_FALSE(r.recorder.inflight().collecting.load());
  EXPECT_EQ(r.recorder.inflight().gc_ns.load(), 30'000 * kMs);
  r.recorder.begin_gc(0);
  r.clock.advance(5 * kMs);
  r.recorder.end_gc();
  EXPECT_EQ(r.recorder.inflight().gc_ns.load(), 30'005 * kMs);
}

// A collective's token is the run's clock at its launch; it is in flight until its end.
TEST(StepRecorder, CollectivesAreInFlightFromTheirBeginToTheirEndOnTheRunsClock) {
  BareRecorder r;
  const std::int64_t token = r.recorder.collective_begin();
  EXPECT_EQ(token, 1'000 * kMs);  // the fake clock's start
  EXPECT_EQ(r.recorder.collectives().in_flight(), 1);
  r.clock.advance(3 * kMs);
  r.recorder.collective_end(token, /*host_blocked=*/true, 1 << 20, 1 << 21);
  EXPECT_EQ(r.recorder.collectives().in_flight(), 0);
}

}  // namespace
}  // namespace steptrace
