// Detectors on synthetic timelines: the exact step each alert fires at, nothing before
// warmup, one alert per episode, the resolved record, and no false alarms.
#include "core/detectors.hpp"

#include <gtest/gtest.h>

#include <random>

namespace steptrace::detail {
namespace {

constexpr std::int64_t kMs = 1'000'000;

struct Timeline {
  Timeline() {
    config.log_dir = "unused";
    config.warmup_steps = 10;
    config.min_history = 10;
    config.window = 100;
    forward = names.intern("forward");
    backward = names.intern("backward");
  }
  // A step of data + forward + backward milliseconds.
  StepRecord step(std::int64_t index, double data_ms, double forward_ms, double backward_ms) {
    StepRecord r;
    r.step = index;
    r.data_ns = static_cast<std::int64_t>(data_ms * kMs);
    r.phase_count = 2;
    r.phase_ids[0] = forward;
    r.phase_ids[1] = backward;
    r.phase_ns[0] = static_cast<std::int64_t>(forward_ms * kMs);
    r.phase_ns[1] = static_cast<std::int64_t>(backward_ms * kMs);
    r.step_ns = r.phase_ns[0] + r.phase_ns[1];
    r.host_ns = r.step_ns;
    return r;
  }
  Config config;
  PhaseNames names;
  std::uint16_t forward, backward;
};

using Events = std::vector<AlertEvent>;

TEST(SlowStepDetector, FiresAtTheSlowStepNamingThePhaseAndResolves) {
  Timeline t;
  t.config.regression_min_steps = 1;
  SlowStepDetector d(t.config, t.names);
  Events events;
  for (int i = 0; i < 60; ++i) d.observe(t.step(i, 1, 4, 5), events);
  EXPECT_TRUE(events.empty());
  d.observe(t.step(60, 1, 4, 14), events);  // 19 ms vs a median of 10 ms
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, "step_regression");
  EXPECT_EQ(events[0].step, 60);
  EXPECT_EQ(events[0].phase, "backward");
  EXPECT_DOUBLE_EQ(events[0].value, 19.0);
  EXPECT_DOUBLE_EQ(*events[0].baseline, 10.0);
  EXPECT_DOUBLE_EQ(events[0].threshold, 1.5);
  EXPECT_NE(events[0].message.find("backward grew most"), std::string::npos) << events[0].message;
  d.observe(t.step(61, 1, 4, 5), events);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_TRUE(events[1].resolved);
  EXPECT_EQ(events[1].step, 61);
  EXPECT_EQ(events[1].first_step, 60);
}

TEST(SlowStepDetector, ARegressionNeedsConsecutiveSlowSteps) {
  Timeline t;  // regression_min_steps = 3
  SlowStepDetector d(t.config, t.names);
  Events events;
  for (int i = 0; i < 40; ++i) d.observe(t.step(i, 1, 4, 5), events);
  d.observe(t.step(40, 1, 4, 15), events);  // one noisy step
  d.observe(t.step(41, 1, 4, 5), events);
  d.observe(t.step(42, 1, 4, 15), events);
  d.observe(t.step(43, 1, 4, 15), events);
  EXPECT_TRUE(events.empty());
  d.observe(t.step(44, 1, 4, 15), events);  // the third in a row
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].step, 44);
  EXPECT_EQ(events[0].details["slow_since_step"], 42);
  EXPECT_NE(events[0].message.find("slow since step 42"), std::string::npos);
  d.observe(t.step(45, 1, 4, 5), events);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].first_step, 42);
}

TEST(SlowStepDetector, NothingDuringWarmupOrShortHistory) {
  Timeline t;
  SlowStepDetector d(t.config, t.names);
  Events events;
  d.observe(t.step(0, 1, 4, 5), events);
  d.observe(t.step(1, 1, 400, 5), events);  // warmup: ignored
  for (int i = 10; i < 19; ++i) d.observe(t.step(i, 1, 4, 5), events);
  d.observe(t.step(19, 1, 400, 5), events);  // 9 steps of history: not enough
  EXPECT_TRUE(events.empty());
  d.observe(t.step(20, 1, 4, 5), events);
  d.observe(t.step(21, 1, 400, 5), events);  // now 11 steps
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].step, 21);
}

TEST(SlowStepDetector, StallAboveFiveTimesAndDataNamed) {
  Timeline t;
  SlowStepDetector d(t.config, t.names);
  Events events;
  for (int i = 0; i < 30; ++i) d.observe(t.step(i, 1, 4, 5), events);
  d.observe(t.step(30, 55, 4, 5), events);  // 64 ms: 6.4x, all of it waiting on data
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, "stall");
  EXPECT_DOUBLE_EQ(events[0].threshold, 5.0);
  EXPECT_EQ(events[0].phase, "data");
  EXPECT_NE(events[0].message.find("DataLoader workers"), std::string::npos);
}

TEST(SlowStepDetector, OneAlertPerEpisodeAndEscalationToStall) {
  Timeline t;
  SlowStepDetector d(t.config, t.names);
  Events events;
  for (int i = 0; i < 50; ++i) d.observe(t.step(i, 1, 4, 5), events);
  for (int i = 50; i < 55; ++i) d.observe(t.step(i, 1, 4, 15), events);  // 2x, five steps
  d.observe(t.step(55, 1, 4, 65), events);                               // 7x in the same episode
  d.observe(t.step(56, 1, 4, 15), events);                               // still slow
  d.observe(t.step(57, 1, 4, 5), events);                                // normal again
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].type, "step_regression");
  EXPECT_EQ(events[0].step, 52);  // confirmed by the third slow step
  EXPECT_EQ(events[1].type, "stall");
  EXPECT_EQ(events[1].step, 55);
  EXPECT_TRUE(events[2].resolved);
  EXPECT_EQ(events[2].type, "stall");
  EXPECT_EQ(events[2].first_step, 50);
  EXPECT_EQ(events[2].step, 57);
}

TEST(SlowStepDetector, WindowBoundaryAdaptsToANewNormal) {
  Timeline t;
  t.config.window = 10;
  SlowStepDetector d(t.config, t.names);
  Events events;
  for (int i = 0; i < 20; ++i) d.observe(t.step(i, 0, 5, 5), events);    // 10 ms
  for (int i = 20; i < 40; ++i) d.observe(t.step(i, 0, 5, 15), events);  // 20 ms from now on
  // Median of the last 10: 10 ms while at most 4 slow steps are in it, 15 ms with 5.
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].step, 22);
  EXPECT_TRUE(events[1].resolved);
  EXPECT_EQ(events[1].step, 25);
}

TEST(SlowStepDetector, NoAlarmOnNoisyButSteadySteps) {
  Timeline t;
  SlowStepDetector d(t.config, t.names);
  Events events;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> jitter(0.8, 1.2);
  for (int i = 0; i < 2000; ++i)
    d.observe(t.step(i, jitter(rng), 4 * jitter(rng), 5 * jitter(rng)), events);
  EXPECT_TRUE(events.empty());
}

TEST(SlowStepDetector, FailedStepsAreIgnored) {
  Timeline t;
  SlowStepDetector d(t.config, t.names);
  Events events;
  for (int i = 0; i < 30; ++i) d.observe(t.step(i, 1, 4, 5), events);
  StepRecord failed = t.step(30, 1, 400, 5);
  failed.failed = true;
  d.observe(failed, events);
  EXPECT_TRUE(events.empty());
}

// ---- memory growth ----

struct MemoryTimeline : Timeline {
  StepRecord mem_step(std::int64_t i, double rss_bytes, double forward_delta = 0) {
    StepRecord r = step(i, 1, 4, 5);
    r.memory.rss_bytes = static_cast<std::int64_t>(rss_bytes);
    if (forward_delta != 0) {  // forward keeps forward_delta; backward frees its own temporaries
      r.phase_memory = true;
      r.memory_at_start = 0;
      r.phase_memory_end[0] = static_cast<std::int64_t>(forward_delta) + 5000;
      r.phase_memory_end[1] = static_cast<std::int64_t>(forward_delta);
      r.phase_end_order[0] = 0;
      r.phase_end_order[1] = 1;
    }
    return r;
  }
};

constexpr double kMiB = 1024.0 * 1024.0;

TEST(MemoryGrowthDetector, LeakIsFoundWithRateAndPhase) {
  MemoryTimeline t;
  MemoryGrowthDetector d(t.config, t.names, static_cast<std::int64_t>(2000 * kMiB));
  Events events;
  double rss = 1000 * kMiB;
  int fired_at = -1;
  for (int i = 0; i < 200 && fired_at < 0; ++i) {
    if (i >= 20) rss += kMiB;  // leaks 1 MiB per step from step 20
    d.observe(t.mem_step(i, rss, d.wants_phase_memory() ? kMiB : 0), events);
    if (!events.empty()) fired_at = i;
  }
  ASSERT_EQ(events.size(), 1u);
  // 2% of 1000 MiB is crossed at step 40; the phase needs 5 attributed steps.
  EXPECT_GE(fired_at, 40);
  EXPECT_LE(fired_at, 60);
  const AlertEvent& a = events[0];
  EXPECT_EQ(a.type, "memory_growth");
  EXPECT_EQ(a.phase, "forward");
  EXPECT_NEAR(a.details["bytes_per_step"].get<double>(), kMiB, 0.01 * kMiB);
  const double left = a.details["steps_until_full"].get<double>();
  EXPECT_NEAR(left, (2000 * kMiB - a.value) / kMiB, 1.0);
  EXPECT_DOUBLE_EQ(*a.baseline, 1000 * kMiB);
}

TEST(MemoryGrowthDetector, WithoutPhaseMeasurementsItStillFiresLater) {
  MemoryTimeline t;
  MemoryGrowthDetector d(t.config, t.names, 0);
  Events events;
  double rss = 1000 * kMiB;
  int fired_at = -1;
  for (int i = 0; i < 400 && fired_at < 0; ++i) {
    if (i >= 20) rss += kMiB;
    d.observe(t.mem_step(i, rss), events);  // never any per-phase levels
    if (!events.empty()) fired_at = i;
  }
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].phase, "");
  EXPECT_GT(fired_at, 200);
}

TEST(MemoryGrowthDetector, WobbleWithinToleranceRaisesNothing) {
  MemoryTimeline t;
  MemoryGrowthDetector d(t.config, t.names, 0);
  Events events;
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> wobble(-0.015, 0.015);  // +-1.5% around 1 GiB
  for (int i = 0; i < 1000; ++i) d.observe(t.mem_step(i, 1024 * kMiB * (1 + wobble(rng))), events);
  EXPECT_TRUE(events.empty());
}

TEST(MemoryGrowthDetector, OneJumpThenFlatIsNotALeak) {
  MemoryTimeline t;
  MemoryGrowthDetector d(t.config, t.names, 0);
  Events events;
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> wobble(-0.002, 0.002);
  for (int i = 0; i < 600; ++i) {
    const double level = i < 100 ? 1000 * kMiB : 1100 * kMiB;  // +10% once (a bigger batch)
    d.observe(t.mem_step(i, level * (1 + wobble(rng))), events);
  }
  EXPECT_TRUE(events.empty());
}

TEST(MemoryGrowthDetector, ResolvesWhenMemoryReturns) {
  MemoryTimeline t;
  MemoryGrowthDetector d(t.config, t.names, 0);
  Events events;
  double rss = 1000 * kMiB;
  int i = 0;
  for (; i < 120; ++i) {
    if (i >= 20) rss += kMiB;
    d.observe(t.mem_step(i, rss, d.wants_phase_memory() ? kMiB : 0), events);
  }
  ASSERT_EQ(events.size(), 1u);
  d.observe(t.mem_step(i, 1000 * kMiB), events);  // the leak was freed
  ASSERT_EQ(events.size(), 2u);
  EXPECT_TRUE(events[1].resolved);
  EXPECT_EQ(events[1].type, "memory_growth");
}

TEST(MemoryGrowthDetector, AllocatorFigurePreferredOverRss) {
  MemoryTimeline t;
  MemoryGrowthDetector d(t.config, t.names, 0);
  Events events;
  for (int i = 0; i < 150; ++i) {
    StepRecord r = t.mem_step(i, 1000 * kMiB, d.wants_phase_memory() ? kMiB : 0);  // RSS flat
    r.memory.allocated_bytes = static_cast<std::int64_t>((100 + (i >= 20 ? i - 20 : 0)) * kMiB);
    r.memory.device_total_bytes = static_cast<std::int64_t>(1000 * kMiB);
    d.observe(r, events);
  }
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events[0].details["metric"], "allocated_bytes");
  EXPECT_EQ(events[0].details["limit_bytes"].get<double>(), 1000 * kMiB);
}

// ---- hang ----

TEST(HangDetector, FloorBeforeHistoryThenRatio) {
  Config config;
  config.hang_floor_s = 10;
  config.hang_min_s = 1;
  config.hang_threshold = 5;
  HangDetector h(config);
  const std::int64_t s = 1'000'000'000;
  EXPECT_FALSE(h.check(9 * s, 3, 0, "forward", 0, false));  // 9 s < 10 s floor
  auto a = h.check(11 * s, 3, 0, "forward", 0, false);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->type, "hang");
  EXPECT_EQ(a->step, 3);
  EXPECT_EQ(a->phase, "forward");
  EXPECT_FALSE(a->baseline.has_value());
  EXPECT_FALSE(h.check(20 * s, 3, 0, "forward", 0, false));  // once per hung step
  auto done = h.check(21 * s, -1, 0, "", 0, false);
  ASSERT_TRUE(done);
  EXPECT_TRUE(done->resolved);
  EXPECT_EQ(done->step, 3);
  // With history: 5 x 400 ms = 2 s.
  EXPECT_FALSE(h.check(100 * s + 19 * s / 10, 4, 100 * s, "backward", 400, true));
  auto b = h.check(100 * s + 21 * s / 10, 4, 100 * s, "backward", 400, true);
  ASSERT_TRUE(b);
  EXPECT_DOUBLE_EQ(*b->baseline, 400);
  EXPECT_TRUE(h.check(150 * s, -1, 0, "", 400, true)->resolved);
  // Fast steps: hang_min_s (1 s) applies, not 5 x 1 ms.
  EXPECT_FALSE(h.check(200 * s + s / 2, 9, 200 * s, "", 1, true));
}

}  // namespace
}  // namespace steptrace::detail
