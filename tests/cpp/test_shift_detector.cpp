// A lasting slowdown found by how the distribution moved (issue 52, point 0): a ~1 ms loop
// beside a CPU hog per core, whose single steps vary by the scheduler's slices, regressed
// for good, is flagged in its phase; the same loop without the regression, contention that
// arrives mid-run, and heavy-tailed noise stay silent; one slowdown is one alert.
#include "core/detect/shift_detector.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/detect/record_detectors.hpp"

namespace steptrace::detail {
namespace {

constexpr double kMs = 1e6;

// A loop of forward + backward steps beside a busy host: a step is preempted with
// probability `preempt`, for up to one 4 ms slice (read as run-queue wait, as the core
// reads schedstat at the end of a step).
struct BusyLoop {
  explicit BusyLoop(std::uint64_t seed) : rng(seed) {
    config.log_dir = "unused";
    forward = names.intern("forward");
    backward = names.intern("backward");
  }
  StepRecord step(std::int64_t index, double forward_ms, double preempt) {
    std::lognormal_distribution<double> jitter(0.0, 0.08);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    StepRecord r;
    r.step = index;
    const double f = forward_ms * jitter(rng);
    const double b = 0.4 * jitter(rng);
    double wait = u(rng) < preempt ? 4.0 * u(rng) : 0.0;
    if (saturated > 0) wait = saturated / (1 - saturated) * (f + b) * jitter(rng);
    r.phase_count = 2;
    r.phase_ids[0] = forward;
    r.phase_ids[1] = backward;
    r.phase_ns[0] = static_cast<std::int64_t>((f + wait) * kMs);  // preempted in forward
    r.phase_ns[1] = static_cast<std::int64_t>(b * kMs);
    r.step_ns = r.host_ns = r.phase_ns[0] + r.phase_ns[1];
    r.data_ns = static_cast<std::int64_t>(0.05 * kMs);
    r.start_unix_ns = now_ns + r.data_ns;
    now_ns = r.start_unix_ns + r.host_ns;
    r.runq_ns = static_cast<std::int64_t>(wait * kMs);
    r.runq_span_ns = r.host_ns + r.data_ns;
    if (read_cpu) r.on_cpu_ns = static_cast<std::int64_t>((f + b + 0.05) * kMs);
    return r;
  }
  // Runs steps [from, to) and returns their alerts (resolved events too).
  std::vector<AlertEvent> run(RecordDetectors& d, int from, int to, double forward_ms,
                              double preempt) {
    std::vector<AlertEvent> out;
    for (int i = from; i < to; ++i) d.observe(step(i, forward_ms, preempt), out);
    return out;
  }
  Config config;
  PhaseNames names;
  std::uint16_t forward, backward;
  std::mt19937_64 rng;
  // > 0: the thread waits this share of every step (a host saturated all along)
  double saturated = 0;
  bool read_cpu = false;  // the thread's CPU time is read (Linux schedstat), else not
  std::int64_t now_ns = 0;
};

std::vector<AlertEvent> alerts_of(const std::vector<AlertEvent>& events, const char* type) {
  std::vector<AlertEvent> out;
  for (const auto& e : events) {
    if (!e.resolved && !e.update && e.type == type) out.push_back(e);
  }
  return out;
}

// Forward gains ~2.5 ms of work at step 400 beside a hog per core: before, no alert of any
// kind in 1,000 slow steps; now one step_regression in forward within 400 steps.
TEST(ShiftDetector, ALastingRegressionBesideABusyHostIsFlaggedInItsPhase) {
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    BusyLoop loop(seed);
    loop.read_cpu = seed % 2 == 0;
    RecordDetectors d(loop.config, loop.names, 0);
    auto events = loop.run(d, 0, 400, 0.6, 0.35);
    const auto after = loop.run(d, 400, 3400, 3.1, 0.35);
    events.insert(events.end(), after.begin(), after.end());
    const auto regressions = alerts_of(events, "step_regression");
    ASSERT_EQ(regressions.size(), 1u) << "seed " << seed;
    EXPECT_LE(regressions[0].step, 800) << "seed " << seed;
    EXPECT_GE(regressions[0].step, 400) << "seed " << seed;
    EXPECT_EQ(regressions[0].phase, "forward") << regressions[0].message;
    EXPECT_TRUE(alerts_of(events, "stall").empty()) << "seed " << seed;
  }
}

// A loop beside a host that gets busier (the thread then waits 70% of each step: every
// quantile moves 3x) while
// a full garbage collection of ~900 ms, on a CPU, comes every 60 steps: the collections
// are gc_pause's, the time a step spends on a CPU without them did not grow, no
// step_regression (test_gc_pause beside a CPU hog and a compile: "its CPU time per step
// went from 0.41 to 1.51 ms", the collections' CPU time read as work).
TEST(ShiftDetector, CollectionsOnACpuAreNotWorkThatGrew) {
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    BusyLoop loop(seed);
    loop.read_cpu = true;
    RecordDetectors d(loop.config, loop.names, 0);
    std::vector<AlertEvent> events;
    for (int i = 0; i < 1200; ++i) {
      loop.saturated = i < 400 ? 0.0 : 0.7;  // then the thread waits 70% of every step
      StepRecord r = loop.step(i, 0.6, 0.3);
      if (i % 60 == 59) {
        const auto gc = static_cast<std::int64_t>(900 * kMs);
        r.gc_ns[2] = gc;
        r.gc_count = 1;
        r.phase_ns[0] += gc;
        r.step_ns += gc;
        r.host_ns += gc;
        r.runq_span_ns += gc;
        r.on_cpu_ns += gc;
        loop.now_ns += gc;
      }
      d.observe(r, events);
    }
    EXPECT_TRUE(alerts_of(events, "step_regression").empty())
        << "seed " << seed << ": " << alerts_of(events, "step_regression")[0].message;
  }
}

// A host saturated all along (the thread waits for a CPU 85% of the time, before and after):
// the wait per step grows with the work, its share does not. Seen on the 2-core CI machine.
TEST(ShiftDetector, OnAHostSaturatedAllAlongTheWaitGrowsWithTheWorkAndItIsStillARegression) {
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    BusyLoop loop(seed);
    loop.saturated = 0.85;
    loop.read_cpu = seed % 2 == 0;
    ShiftDetector shift(loop.config, loop.names);
    std::vector<AlertEvent> events;
    for (int i = 0; i < 400; ++i) shift.observe(loop.step(i, 0.15, 0.0), false, events);
    EXPECT_TRUE(events.empty());
    for (int i = 400; i < 800; ++i) shift.observe(loop.step(i, 3.0, 0.0), false, events);
    ASSERT_EQ(alerts_of(events, "step_regression").size(), 1u) << "seed " << seed;
    EXPECT_EQ(events[0].phase, "forward");
  }
}

TEST(ShiftDetector, TheSameLoopWithoutTheRegressionStaysSilent) {
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    BusyLoop loop(seed);
    loop.read_cpu = seed % 2 == 0;
    RecordDetectors d(loop.config, loop.names, 0);
    const auto events = loop.run(d, 0, 2000, 0.6, 0.35);
    EXPECT_TRUE(alerts_of(events, "step_regression").empty()) << "seed " << seed;
    EXPECT_TRUE(alerts_of(events, "stall").empty()) << "seed " << seed;
  }
}

// A hog that starts mid-run moves the median and the slow tail, not the fastest steps, and
// the time the thread waited for a CPU grew with it: the host's, not a regression.
TEST(ShiftDetector, ContentionThatArrivesMidRunIsNotARegression) {
  for (std::uint64_t seed = 1; seed <= 8; ++seed) {
    BusyLoop loop(seed);
    loop.read_cpu = seed % 2 == 0;
    ShiftDetector shift(loop.config, loop.names);
    std::vector<AlertEvent> events;
    for (int i = 0; i < 2000; ++i)
      shift.observe(loop.step(i, 0.6, i < 400 ? 0.0 : 0.9), false, events);
    EXPECT_TRUE(events.empty()) << "seed " << seed << ": " << events.front().message;
  }
}

// Contention that grows on a host already busy (the thread waited 60% of the time, then 75%:
// the 2-core CI machine as a parallel build starts) moves every quantile by 1.6x while the
// share of the time lost to the host grew by too little to explain it; the thread's CPU
// time per step stayed put, which says it is the host's.
TEST(ShiftDetector, ContentionThatMovesEveryQuantileLeavesTheCpuTimePut) {
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    BusyLoop loop(seed);
    loop.read_cpu = true;
    loop.saturated = 0.6;
    ShiftDetector shift(loop.config, loop.names);
    std::vector<AlertEvent> events;
    for (int i = 0; i < 400; ++i) shift.observe(loop.step(i, 0.6, 0.0), false, events);
    loop.saturated = 0.75;
    for (int i = 400; i < 1200; ++i) shift.observe(loop.step(i, 0.6, 0.0), false, events);
    EXPECT_TRUE(events.empty()) << "seed " << seed << ": " << events.front().message;
  }
}

// A shared VM runs ~1.5x slower for a quarter of a second now and then, with the thread on
// its CPU: every quantile and the CPU time move, for less than regression_min_ms. Not a
// regression; the same slowdown kept for longer is one.
TEST(ShiftDetector, AStretchShorterThanRegressionMinMsIsNotARegression) {
  BusyLoop loop(5);
  loop.read_cpu = true;
  ShiftDetector shift(loop.config, loop.names);
  std::vector<AlertEvent> events;
  int i = 0;
  for (; i < 400; ++i) shift.observe(loop.step(i, 0.6, 0.0), false, events);
  for (; i < 650; ++i) shift.observe(loop.step(i, 3.1, 0.0), false, events);  // 250 steps: 0.9 s
  for (; i < 1100; ++i) shift.observe(loop.step(i, 0.6, 0.0), false, events);
  EXPECT_TRUE(events.empty()) << events.front().message;
  for (; i < 1600; ++i) shift.observe(loop.step(i, 3.1, 0.0), false, events);
  ASSERT_EQ(alerts_of(events, "step_regression").size(), 1u);
  EXPECT_GE(events[0].step, 1100 + 280);  // a second of it, at least
}

// The CI VM itself ran a GPT-style loop 1.7x slower for over a second, the thread on its
// CPU throughout (CPU time per step up with it): below the shift rule's 2x, not paged.
TEST(ShiftDetector, AHostRunning1Point7xSlowerForSecondsIsNotARegression) {
  BusyLoop loop(6);
  loop.read_cpu = true;
  ShiftDetector shift(loop.config, loop.names);
  std::vector<AlertEvent> events;
  for (int i = 0; i < 400; ++i) shift.observe(loop.step(i, 0.6, 0.0), false, events);
  for (int i = 400; i < 1400; ++i) shift.observe(loop.step(i, 1.4, 0.0), false, events);
  EXPECT_TRUE(events.empty()) << events.front().message;
}

// Occasional steps many times the usual (a heavy tail: here Pareto-like spikes) do not move
// the lower quantiles: no shift.
TEST(ShiftDetector, HeavyTailedNoiseIsNotAShift) {
  BusyLoop loop(7);
  ShiftDetector shift(loop.config, loop.names);
  std::vector<AlertEvent> events;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < 3000; ++i) {
    StepRecord r = loop.step(i, 0.6, 0.0);
    const double x = u(loop.rng);
    if (x < 0.2)
      r.step_ns = r.host_ns = static_cast<std::int64_t>(r.host_ns / std::sqrt(x / 0.2 + 1e-3));
    shift.observe(r, false, events);
  }
  EXPECT_TRUE(events.empty()) << events.front().message;
}

// One slowdown, one alert: where the per-step rules page first (a quiet host, a large
// regression), the shift detector takes the slower steps as the norm instead of paging
// again a window later; a later shift against that norm is its own episode; a shift that
// lasts is resolved as the new baseline.
TEST(ShiftDetector, OneSlowdownIsOneAlertAndALastingOneBecomesTheBaseline) {
  BusyLoop loop(3);
  loop.config.regression_min_ms = 20;
  RecordDetectors d(loop.config, loop.names, 0);
  auto events = loop.run(d, 0, 300, 4.0, 0.0);
  auto more = loop.run(d, 300, 900, 12.0, 0.0);  // 3x: the per-step rules page within steps
  events.insert(events.end(), more.begin(), more.end());
  ASSERT_EQ(alerts_of(events, "step_regression").size(), 1u);
  EXPECT_FALSE(alerts_of(events, "step_regression")[0].details.contains("method"));

  BusyLoop busy(4);
  ShiftDetector shift(busy.config, busy.names);
  std::vector<AlertEvent> shifts;
  for (int i = 0; i < 300; ++i) shift.observe(busy.step(i, 0.6, 0.35), false, shifts);
  for (int i = 300; i < 900; ++i) shift.observe(busy.step(i, 3.1, 0.35), false, shifts);
  ASSERT_EQ(shifts.size(), 2u);  // the alert, and its end as the new baseline
  EXPECT_EQ(shifts[0].details["method"], "distribution_shift");
  EXPECT_TRUE(shifts[1].resolved);
  EXPECT_NE(shifts[1].message.find("new baseline"), std::string::npos) << shifts[1].message;
  for (int i = 900; i < 1500; ++i) shift.observe(busy.step(i, 9.0, 0.35), false, shifts);
  EXPECT_EQ(alerts_of(shifts, "step_regression").size(), 2u);  // the next slowdown: its own
}

}  // namespace
}  // namespace steptrace::detail
