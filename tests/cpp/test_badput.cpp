// The live waste account: every second from the process's start to the last step in one
// cause, the ideal step time as the offline report finds it (goodput.ideal_step_time).
#include "core/badput.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

namespace steptrace::detail {
namespace {

constexpr std::int64_t kMs = 1'000'000;
constexpr std::int64_t kT0 = 1'700'000'000'000'000'000;  // the process's start

double cause(const BadputAccount& a, BadputCause c) {
  return a.seconds()[static_cast<std::size_t>(c)];
}
double total(const BadputAccount& a) {
  return std::accumulate(a.seconds().begin(), a.seconds().end(), 0.0);
}

// A timeline of steps, each after a gap of `data` + `other`; returns where the last ends.
struct Timeline {
  std::int64_t now = kT0;
  StepRecord next(std::int64_t host_ns, std::int64_t data_ns = 0, std::int64_t other_ns = 0) {
    StepRecord r;
    r.data_ns = data_ns;
    r.between.other_ns = other_ns;
    r.start_unix_ns = now + data_ns + other_ns;
    r.host_ns = r.step_ns = host_ns;
    now = r.start_unix_ns + host_ns;
    return r;
  }
};

TEST(BadputAccount, EverySecondFromTheProcessStartIsInOneCause) {
  BadputAccount a(kT0);
  Timeline t;
  t.now = kT0 + 800 * kMs;                  // 0.8 s of imports and set-up
  a.add_step(t.next(50 * kMs, 200 * kMs));  // warm-up: 50 ms against an ideal of 10
  for (int i = 0; i < 30; ++i) a.add_step(t.next(i == 20 ? 40 * kMs : 10 * kMs, kMs, kMs / 2));
  EXPECT_NEAR(a.ideal_s(), 0.010, 1e-12);
  EXPECT_NEAR(cause(a, BadputCause::kStartup), 0.8 + 0.040, 1e-9);
  EXPECT_NEAR(cause(a, BadputCause::kSlowSteps), 0.030, 1e-9);
  EXPECT_NEAR(cause(a, BadputCause::kProductive), 0.010 * 31, 1e-9);
  EXPECT_NEAR(cause(a, BadputCause::kData), 0.2 + 0.030, 1e-9);
  EXPECT_NEAR(cause(a, BadputCause::kOther), 0.015, 1e-9);
  EXPECT_NEAR(total(a), static_cast<double>(t.now - kT0) / 1e9, 1e-9);
  EXPECT_NEAR(a.goodput_ratio(), 0.31 / total(a), 1e-12);
}

// Steps before the window has kMinSteps wait for the ideal and are then booked.
TEST(BadputAccount, StepsBeforeAnIdealWaitForIt) {
  BadputAccount a(kT0);
  Timeline t;
  for (std::size_t i = 0; i < BadputAccount::kMinSteps; ++i) {
    a.add_step(t.next(10 * kMs));
    EXPECT_EQ(cause(a, BadputCause::kProductive), 0.0) << i;
  }
  a.add_step(t.next(10 * kMs));
  EXPECT_NEAR(cause(a, BadputCause::kProductive), 0.010 * 11, 1e-9);
}

// Waiting for a CPU is the host's, not a slow step; compiling and intervals inside the
// step have their own causes.
TEST(BadputAccount, RunQueueWaitCompileAndIntervalsInsideAreNotSlowSteps) {
  BadputAccount a(kT0);
  Timeline t;
  for (int i = 0; i < 20; ++i) a.add_step(t.next(10 * kMs));
  StepRecord r = t.next(35 * kMs);
  r.runq_ns = 20 * kMs;
  r.compile_ns = 4 * kMs;
  r.between.interval_ns[static_cast<std::size_t>(IntervalKind::kCheckpoint)] = kMs;
  r.between.inside_step_ns = kMs;
  a.add_step(r);
  EXPECT_NEAR(cause(a, BadputCause::kHostContention), 0.020, 1e-9);
  EXPECT_NEAR(cause(a, BadputCause::kCompile), 0.004, 1e-9);
  EXPECT_NEAR(cause(a, BadputCause::kCheckpoint), 0.001, 1e-9);
  EXPECT_NEAR(cause(a, BadputCause::kSlowSteps), 0.0, 1e-9);
  EXPECT_NEAR(total(a), static_cast<double>(t.now - kT0) / 1e9, 1e-9);
}

// Google's cut-off: a step far above median + 3 MAD is not part of the ideal's mean.
// Python's collections inside a step are the gc cause (issue 52), not slow steps; those
// in the gap before it stay in the gap's kind (here other).
TEST(BadputAccount, GarbageCollectionInsideAStepIsItsOwnCause) {
  BadputAccount a(kT0);
  Timeline t;
  a.add_step(t.next(10 * kMs));
  for (int i = 0; i < 20; ++i) {
    StepRecord r = t.next(i == 15 ? 190 * kMs : 10 * kMs, 0, 2 * kMs);
    if (i == 15) {  // a 180 ms generation-2 collection in the step, 1 ms of gen 0 before it
      r.gc_ns[2] = 180 * kMs;
      r.gc_between_ns[0] = kMs;
      r.gc_count = 2;
      r.runq_ns = 150 * kMs;  // waiting for a CPU, much of it during the collection
    }
    a.add_step(r);
  }
  EXPECT_NEAR(cause(a, BadputCause::kGc), 0.180, 1e-9);
  // the collection first: the wait counts up to the rest of the step (as goodput.py)
  EXPECT_NEAR(cause(a, BadputCause::kHostContention), 0.010, 1e-9);
  EXPECT_NEAR(cause(a, BadputCause::kOther), 0.040, 1e-9);
  // what is left of the step (nothing) joins the ideal's window like any step's training time
  EXPECT_NEAR(cause(a, BadputCause::kProductive) + cause(a, BadputCause::kSlowSteps), 0.010 * 20,
              1e-9);
  EXPECT_LT(cause(a, BadputCause::kSlowSteps), 0.005);
  EXPECT_NEAR(total(a), static_cast<double>(t.now - kT0) / 1e9, 1e-9);
  EXPECT_EQ(badput_cause("gc"), BadputCause::kGc);
}

TEST(BadputAccount, TheIdealLeavesOutTheOutliers) {
  BadputAccount a(0);
  Timeline t;
  a.add_step(t.next(10 * kMs));
  for (int i = 0; i < 40; ++i) a.add_step(t.next(10 * kMs));
  a.add_step(t.next(500 * kMs));
  EXPECT_NEAR(a.ideal_s(), 0.010, 1e-12);  // the mean would be 21.95 ms with it
  EXPECT_NEAR(cause(a, BadputCause::kSlowSteps), 0.490, 1e-9);
}

TEST(BadputAccount, EarlierAttemptsAreSeededAndCauseNamesRoundTrip) {
  BadputAccount a(0);
  EXPECT_TRUE(std::isnan(a.goodput_ratio()));
  a.seed(BadputCause::kRecovery, 3.0);
  a.seed(BadputCause::kProductive, 1.0);
  a.seed(BadputCause::kWastedProgress, -1.0);  // ignored
  EXPECT_DOUBLE_EQ(a.goodput_ratio(), 0.25);
  for (std::size_t i = 0; i < kBadputCauseNames.size(); ++i) {
    EXPECT_EQ(badput_cause(kBadputCauseNames[i]), static_cast<BadputCause>(i));
  }
  EXPECT_FALSE(badput_cause("swap").has_value());
}

}  // namespace
}  // namespace steptrace::detail
