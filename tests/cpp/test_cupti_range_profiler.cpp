// The range-profiler fallback's pure parts, on any machine: which PM sampling failures
// fall back to it, the step <-> range name mapping, what each step boundary does (lazy
// setup, ranges only with a context, passes handed to the decode thread), when a decode
// pass counts as a delivery, and the sample queue both samplers share.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "backends/cupti/pm_sampling_logic.hpp"
#include "backends/cupti/range_profiler_logic.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace {
namespace {

using detail::cupti::BeginPlan;
using detail::cupti::counts_as_delivery;
using detail::cupti::falls_back_to_range_profiler;
using detail::cupti::kRangeNameSize;
using detail::cupti::pass_full;
using detail::cupti::PassState;
using detail::cupti::plan_begin_step;
using detail::cupti::pm_call_failure;
using detail::cupti::PmFailure;
using detail::cupti::range_name;
using detail::cupti::range_step;
using detail::cupti::SampleQueue;
using detail::cupti::Skip;

// ---- which PM sampling failures fall back ----

TEST(RangeProfilerFallback, OnlyWherePmSamplingItselfIsMissing) {
  EXPECT_TRUE(falls_back_to_range_profiler(PmFailure::kTooOld));
  EXPECT_TRUE(falls_back_to_range_profiler(PmFailure::kNoPmOnChip));
  EXPECT_TRUE(falls_back_to_range_profiler(PmFailure::kNotSupported));
  EXPECT_FALSE(falls_back_to_range_profiler(PmFailure::kOther));
}

TEST(RangeProfilerFallback, NotSupportedFallsBackOtherResultsDoNot) {
  EXPECT_EQ(pm_call_failure(27), PmFailure::kNotSupported);  // CUPTI_ERROR_NOT_SUPPORTED
  // CPU-only machine, no privileges, busy counters, MIG: the range profiler fails the same.
  for (int result : {999, 35, 7, 26, 43, 0}) {
    EXPECT_EQ(pm_call_failure(result), PmFailure::kOther) << result;
    EXPECT_FALSE(falls_back_to_range_profiler(pm_call_failure(result))) << result;
  }
}

// ---- range names ----

TEST(RangeName, StepsRoundTrip) {
  for (std::int64_t step : {std::int64_t{0}, std::int64_t{7}, std::int64_t{123456789},
                            std::numeric_limits<std::int64_t>::max()}) {
    char name[kRangeNameSize];
    range_name(step, name);
    EXPECT_EQ(range_step(name), step) << name;
  }
  char name[kRangeNameSize];
  range_name(42, name);
  EXPECT_STREQ(name, "42");
  range_name(std::numeric_limits<std::int64_t>::min(), name);  // fits, is not a step
  EXPECT_EQ(range_step(name), -1);
}

TEST(RangeName, NamesThatAreNoStepsMapToMinusOne) {
  for (const char* name : {"", "-3", "+3", "3a", "a3", " 3", "3 ", "1/2", "99999999999999999999"}) {
    EXPECT_EQ(range_step(name), -1) << '"' << name << '"';
  }
}

// ---- the step boundary ----

int ctx_a = 0;
int ctx_b = 0;
const void* const kA = &ctx_a;
const void* const kB = &ctx_b;

BeginPlan plan(bool stop, bool set_up, bool start, bool push, Skip skip = Skip::kNone) {
  BeginPlan p;
  p.stop = stop;
  p.set_up = set_up;
  p.start = start;
  p.push = push;
  p.skip = skip;
  return p;
}

TEST(RangePlan, NoContextYetSkipsTheStepAndSetsNothingUp) {
  EXPECT_EQ(plan_begin_step(true, PassState::kUnconfigured, nullptr, nullptr, false),
            plan(false, false, false, false, Skip::kNoContext));
}

TEST(RangePlan, TheFirstSampledStepWithAContextSetsUpStartsAndPushes) {
  EXPECT_EQ(plan_begin_step(true, PassState::kUnconfigured, kA, nullptr, true),
            plan(false, true, true, true));
}

TEST(RangePlan, AContextOnAnotherDeviceIsNotProfiled) {
  EXPECT_EQ(plan_begin_step(true, PassState::kUnconfigured, kA, nullptr, false),
            plan(false, false, false, false, Skip::kOtherContext));
}

TEST(RangePlan, UnsampledStepsNeverTouchTheProfilerExceptToEndABurst) {
  for (PassState s :
       {PassState::kUnconfigured, PassState::kIdle, PassState::kStopped, PassState::kFailed}) {
    EXPECT_EQ(plan_begin_step(false, s, kA, kA, true), plan(false, false, false, false));
    EXPECT_EQ(plan_begin_step(false, s, nullptr, kA, false), plan(false, false, false, false));
  }
  EXPECT_EQ(plan_begin_step(false, PassState::kRunning, kA, kA, true),
            plan(true, false, false, false));
}

TEST(RangePlan, ABurstStartsOnePassAndPushesARangePerStep) {
  EXPECT_EQ(plan_begin_step(true, PassState::kIdle, kA, kA, false), plan(false, false, true, true));
  EXPECT_EQ(plan_begin_step(true, PassState::kRunning, kA, kA, false),
            plan(false, false, false, true));
}

TEST(RangePlan, WhileThePreviousPassIsDecodedTheStepIsSkipped) {
  EXPECT_EQ(plan_begin_step(true, PassState::kStopped, kA, kA, false),
            plan(false, false, false, false, Skip::kDecoding));
}

TEST(RangePlan, AnotherContextIsSkippedAndEndsTheRunningPass) {
  EXPECT_EQ(plan_begin_step(true, PassState::kIdle, kB, kA, true),
            plan(false, false, false, false, Skip::kOtherContext));
  EXPECT_EQ(plan_begin_step(true, PassState::kRunning, kB, kA, true),
            plan(true, false, false, false, Skip::kOtherContext));
  EXPECT_EQ(plan_begin_step(true, PassState::kRunning, nullptr, kA, false),
            plan(false, false, false, false, Skip::kNoContext));
}

TEST(RangePlan, AfterAFailureNothingIsCalled) {
  EXPECT_EQ(plan_begin_step(true, PassState::kFailed, kA, kA, true),
            plan(false, false, false, false, Skip::kFailed));
}

TEST(RangePlan, APassStopsWhenItsImageIsFull) {
  EXPECT_FALSE(pass_full(7, 8));
  EXPECT_TRUE(pass_full(8, 8));
}

// Drives the plan over a run like the sampler's training thread does, with the decode
// thread finishing each stopped pass before the next step.
TEST(RangePlan, ARunPushesOnlySampledStepsWithAContext) {
  PassState state = PassState::kUnconfigured;
  const void* profiled = nullptr;
  std::vector<int> pushed;
  int stops = 0;
  int setups = 0;
  //                        0      1     2     3     4      5     6      7
  const bool sampled[] = {true, false, true, true, false, true, false, false};
  const bool has_ctx[] = {false, false, true, true, true, true, true, true};
  for (int step = 0; step < 8; ++step) {
    const void* ctx = has_ctx[step] ? kA : nullptr;
    const BeginPlan p = plan_begin_step(sampled[step], state, ctx, profiled, true);
    if (p.stop) {
      ++stops;
      state = PassState::kIdle;  // stopped, then decoded before the next step
    }
    if (p.set_up) {
      ++setups;
      profiled = ctx;
      state = PassState::kIdle;
    }
    if (p.start) state = PassState::kRunning;
    if (p.push) {
      ASSERT_NE(ctx, nullptr);
      pushed.push_back(step);
    }
  }
  EXPECT_EQ(pushed, (std::vector<int>{2, 3, 5}));
  EXPECT_EQ(setups, 1);
  EXPECT_EQ(stops, 2);  // after the burst 2-3, and after 5
}

// ---- deliveries ----

TEST(RangeDeliveries, ARunningPassHoldsDeliveriesBack) {
  EXPECT_FALSE(counts_as_delivery(PassState::kRunning));
  for (PassState s :
       {PassState::kUnconfigured, PassState::kIdle, PassState::kStopped, PassState::kFailed}) {
    EXPECT_TRUE(counts_as_delivery(s));
  }
}

// ---- the sample queue ----

TEST(SampleQueue, HandsOverOnceAndCountsWhatItDrops) {
  SampleQueue q(2);
  CounterSample s;
  s.step = 3;
  q.publish({s, s, s}, 1, false);
  std::vector<CounterSample> out;
  std::int64_t dropped = 0;
  bool overflow = false;
  q.take(out, &dropped, &overflow);
  EXPECT_EQ(out.size(), 2u);
  EXPECT_EQ(dropped, 2);  // one over the bound, one lost in decoding
  EXPECT_FALSE(overflow);
  q.publish({}, 0, true);
  out.clear();
  q.take(out, &dropped, &overflow);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(dropped, 2);
  EXPECT_TRUE(overflow);
  q.take(out, nullptr, nullptr);  // null outputs are accepted
}

}  // namespace
}  // namespace steptrace
