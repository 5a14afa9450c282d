// The range-profiler fallback's call layer (make_cupti_counter_sampler) against a stand-in
// libcupti without PM sampling and a stand-in libcuda (tests/cpp/fake_cupti/fake_profiler.hpp),
// linked into this test under their sonames: the fallback order, lazy setup on the first
// sampled step with a context, ranges only on sampled steps and never without a context,
// samples per step, finishing, the device chosen for the rank (LOCAL_RANK), and a CUPTI
// torn down under it (another tool's cuptiFinalize). Everything is checked after
// finish(), which decodes synchronously: nothing waits on the decode thread's timing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "fake_cupti/fake_cupti.hpp"
#include "fake_cupti/fake_profiler.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

int g_ctx_a = 0;
int g_ctx_b = 0;
void* const kCtxA = &g_ctx_a;
void* const kCtxB = &g_ctx_b;

class RangeProfilerFake : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_rp_reset();
    unsetenv("LOCAL_RANK");
  }
  void TearDown() override { unsetenv("LOCAL_RANK"); }

  static std::unique_ptr<CounterSampler> make(int device = 0) {
    std::string why;
    auto sampler = make_cupti_counter_sampler(device, &why);
    EXPECT_NE(sampler, nullptr) << why;
    return sampler;
  }

  static std::vector<CounterSample> take(CounterSampler& s, std::int64_t* dropped = nullptr) {
    std::vector<CounterSample> out;
    bool overflow = false;
    s.take(out, dropped, &overflow);
    EXPECT_FALSE(overflow);
    return out;
  }

  static void step(CounterSampler& s, std::int64_t n, bool sampled) {
    s.begin_step(n, sampled);
    s.end_step(n);
  }
};

TEST_F(RangeProfilerFake, FallsBackWhenPmSamplingIsMissingAndSetsUpNothingWithoutAContext) {
  auto sampler = make();
  ASSERT_NE(sampler, nullptr);
  EXPECT_STREQ(sampler->name(), "cupti_range_profiler");
  EXPECT_EQ(sampler->status(), "");
  EXPECT_FALSE(sampler->metric(0).empty());
  EXPECT_EQ(sampler->metric(kCounterCount), "");
  EXPECT_EQ(fake_rp_initializes(), 1);
  EXPECT_EQ(fake_rp_enables(), 0) << "enabled lazily, with a context";
  step(*sampler, 0, true);  // no context yet
  step(*sampler, 1, true);
  EXPECT_EQ(fake_rp_enables(), 0);
  EXPECT_EQ(fake_rp_pushes(), 0);
  sampler->finish();
  EXPECT_EQ(fake_rp_null_context_enables(), 0);
  EXPECT_EQ(fake_rp_disables(), 0);
  EXPECT_EQ(fake_rp_deinitializes(), 1);
  EXPECT_TRUE(take(*sampler).empty());
  EXPECT_NE(sampler->status().find("2 with no CUDA context"), std::string::npos)
      << sampler->status();
}

TEST_F(RangeProfilerFake, OneRangePerSampledStepEachDecodedIntoItsStep) {
  auto sampler = make();
  ASSERT_NE(sampler, nullptr);
  step(*sampler, 0, true);  // before the framework created its context
  fake_cuda_set_current(kCtxA, 0);
  step(*sampler, 1, false);
  EXPECT_EQ(fake_rp_enables(), 0) << "an unsampled step sets nothing up";
  step(*sampler, 2, true);
  EXPECT_EQ(fake_rp_enables(), 1);
  EXPECT_EQ(fake_rp_enabled_context(), kCtxA);
  step(*sampler, 3, true);
  step(*sampler, 4, false);  // ends the burst: the pass stops
  EXPECT_EQ(fake_rp_stops(), 1);
  step(*sampler, 5, false);
  const std::uint64_t before = sampler->deliveries();
  sampler->finish();
  EXPECT_GT(sampler->deliveries(), before);

  ASSERT_EQ(fake_rp_pushes(), 2);
  EXPECT_STREQ(fake_rp_pushed_name(0), "2");
  EXPECT_STREQ(fake_rp_pushed_name(1), "3");
  EXPECT_EQ(fake_rp_pops(), 2);
  EXPECT_EQ(fake_rp_starts(), 1) << "one pass for the burst";
  EXPECT_EQ(fake_rp_misuses(), 0);
  EXPECT_EQ(fake_rp_null_context_enables(), 0);
  EXPECT_EQ(fake_rp_disables(), 1);
  EXPECT_EQ(fake_rp_deinitializes(), 1);

  std::int64_t dropped = 0;
  const auto samples = take(*sampler, &dropped);
  EXPECT_EQ(dropped, 0);
  ASSERT_EQ(samples.size(), 2u);
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto& s = samples[i];
    EXPECT_EQ(s.step, static_cast<std::int64_t>(i) + 2);
    // the fake evaluates metric m of a range to step + m/4; counters 0..2 are mapped
    EXPECT_DOUBLE_EQ(s.values[0], static_cast<double>(s.step));
    EXPECT_DOUBLE_EQ(s.values[1], static_cast<double>(s.step) + 0.25);
    EXPECT_DOUBLE_EQ(s.values[2], static_cast<double>(s.step) + 0.5);
  }
  sampler->finish();  // idempotent
  sampler.reset();
  EXPECT_EQ(fake_rp_disables(), 1);
  EXPECT_EQ(fake_rp_deinitializes(), 1);
}

TEST_F(RangeProfilerFake, FinishClosesAnOpenRangeAndDecodesIt) {
  auto sampler = make();
  ASSERT_NE(sampler, nullptr);
  fake_cuda_set_current(kCtxA, 0);
  sampler->begin_step(7, true);  // training stopped inside a step
  sampler->finish();
  EXPECT_EQ(fake_rp_pops(), 1);
  EXPECT_EQ(fake_rp_stops(), 1);
  EXPECT_EQ(fake_rp_misuses(), 0);
  const auto samples = take(*sampler);
  ASSERT_EQ(samples.size(), 1u);
  EXPECT_EQ(samples[0].step, 7);
  sampler->begin_step(8, true);  // after finish: no calls
  sampler->end_step(8);
  EXPECT_EQ(fake_rp_pushes(), 1);
}

TEST_F(RangeProfilerFake, OnlyTheProfiledContextAndDeviceGetRanges) {
  auto sampler = make(0);
  ASSERT_NE(sampler, nullptr);
  fake_cuda_set_current(kCtxB, 1);  // a context on another device: not set up on it
  step(*sampler, 0, true);
  EXPECT_EQ(fake_rp_enables(), 0);
  fake_cuda_set_current(kCtxA, 0);
  step(*sampler, 1, true);
  EXPECT_EQ(fake_rp_enables(), 1);
  fake_cuda_set_current(kCtxB, 0);  // another context of the same device
  step(*sampler, 2, true);
  sampler->finish();
  ASSERT_EQ(fake_rp_pushes(), 1);
  EXPECT_STREQ(fake_rp_pushed_name(0), "1");
  EXPECT_EQ(fake_rp_misuses(), 0);
  EXPECT_NE(sampler->status().find("2 on another context"), std::string::npos) << sampler->status();
}

TEST_F(RangeProfilerFake, ALongBurstIsSplitIntoFullPasses) {
  auto sampler = make();
  ASSERT_NE(sampler, nullptr);
  fake_cuda_set_current(kCtxA, 0);
  for (int n = 0; n < 8; ++n) step(*sampler, n, true);
  EXPECT_EQ(fake_rp_stops(), 1) << "a full pass stops at once";
  sampler->finish();
  EXPECT_EQ(fake_rp_misuses(), 0);
  EXPECT_EQ(take(*sampler).size(), 8u);
}

TEST_F(RangeProfilerFake, WhenBothFailTheReasonNamesBoth) {
  fake_rp_fail_initialize(35);  // CUPTI_ERROR_INSUFFICIENT_PRIVILEGES
  std::string why;
  EXPECT_EQ(make_cupti_counter_sampler(0, &why), nullptr);
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  EXPECT_EQ(why.rfind("PM sampling: ", 0), 0u) << why;
  EXPECT_NE(why.find("too old for PM sampling"), std::string::npos) << why;
  EXPECT_NE(why.find("cuptiPmSampling"), std::string::npos) << why;
  EXPECT_NE(why.find("; range profiler: "), std::string::npos) << why;
  EXPECT_NE(why.find("cuptiProfilerInitialize failed"), std::string::npos) << why;
  EXPECT_NE(why.find("admin"), std::string::npos) << why;
}

// Point 4 of the review: the range profiler is set up lazily on the first sampled step
// whose context is on its device; with no context at creation that device was 0 on every
// torchrun rank. LOCAL_RANK names the rank's own.
TEST_F(RangeProfilerFake, ProfilesTheDeviceLocalRankNames) {
  setenv("LOCAL_RANK", "1", 1);
  fake_cuda_set_device_count(2);
  auto sampler = make(-1);
  ASSERT_NE(sampler, nullptr);
  EXPECT_EQ(sampler->device(), "device 1 (LOCAL_RANK=1)");
  EXPECT_EQ(fake_rp_chip_device(), 1);
  fake_cuda_set_current(kCtxA, 0);  // a context on GPU 0 (made before set_device)
  step(*sampler, 0, true);
  EXPECT_EQ(fake_rp_enables(), 0);
  fake_cuda_set_current(kCtxB, 1);  // the rank's own GPU
  step(*sampler, 1, true);
  EXPECT_EQ(fake_rp_enables(), 1);
  EXPECT_EQ(fake_rp_enabled_context(), kCtxB);
  sampler->finish();
  ASSERT_EQ(fake_rp_pushes(), 1);
  EXPECT_STREQ(fake_rp_pushed_name(0), "1");
}

// Point 3 of the review: cuptiFinalize from another tool (Kineto with TEARDOWN_CUPTI=1)
// under a running pass. Whatever the destroyed objects' calls return, the range profiler
// stops at the first failing call, says why once, and calls into them no more, not even
// Disable or cuptiProfilerDeInitialize at close.
class RangeProfilerFinalized : public RangeProfilerFake,
                               public ::testing::WithParamInterface<int> {};

TEST_P(RangeProfilerFinalized, StopsWithoutTouchingTheDestroyedObjects) {
  fake_rp_set_stale_result(GetParam());
  auto sampler = make(0);
  ASSERT_NE(sampler, nullptr);
  fake_cuda_set_current(kCtxA, 0);
  step(*sampler, 1, true);
  step(*sampler, 2, true);
  fake_cupti_finalize(/*flush_first=*/true);
  step(*sampler, 3, true);  // its push meets the destroyed object
  const std::string status = sampler->status();
  EXPECT_NE(status.find("cuptiFinalize"), std::string::npos) << status;
  EXPECT_NE(status.find("cuptiRangeProfilerPushRange"), std::string::npos) << status;
  EXPECT_NE(status.find("noticed at step 3"), std::string::npos) << status;
  EXPECT_EQ(fake_rp_stale_calls(), 1);
  for (int n = 4; n < 20; ++n) step(*sampler, n, n % 2 == 0);
  sampler->finish();
  EXPECT_EQ(fake_rp_stale_calls(), 1) << "called into a destroyed object again";
  EXPECT_EQ(fake_rp_stale_teardowns(), 0) << "disabled or deinitialized destroyed objects";
  EXPECT_EQ(sampler->status(), status);
}

INSTANTIATE_TEST_SUITE_P(StaleResults, RangeProfilerFinalized,
                         ::testing::Values(15 /* NOT_INITIALIZED */, 3 /* INVALID_CONTEXT */,
                                           7 /* INVALID_OPERATION */, 1 /* INVALID_PARAMETER */));

// Through a Profiler: the counters stop, the run goes on with its own timing, and
// run_end says why; run_start names the device the counters sample.
TEST_F(RangeProfilerFake, AFinalizeUnderTheCountersLeavesTheRunGoingAndSaysWhy) {
  testing::TempDir tmp;
  Config config = testing::run_config(tmp);
  config.clock = "host";
  config.counter_every = 2;  // sampled: 0, 2, 4, ...; each pass ends at the next step
  Backends b;
  std::string why;
  b.counter_sampler = make_cupti_counter_sampler(0, &why);
  ASSERT_NE(b.counter_sampler, nullptr) << why;
  fake_cuda_set_current(kCtxA, 0);
  Profiler prof(config, RunInfo{}, std::move(b));
  constexpr int kSteps = 12;
  for (int i = 0; i < kSteps; ++i) {
    if (i == 6) fake_cupti_finalize(/*flush_first=*/true);
    auto scope = prof.step();
  }
  prof.close();
  const auto records = testing::read_jsonl(prof.log_path());
  const auto start = testing::of_kind(records, "run_start").at(0);
  EXPECT_EQ(start["backends"]["counters"].value("device", ""), "device 0 (as configured)")
      << start["backends"].dump();
  const auto steps = testing::of_kind(records, "step");
  ASSERT_EQ(steps.size(), static_cast<std::size_t>(kSteps));
  for (const auto& s : steps) {
    if (s["step"].get<int>() >= 6) EXPECT_FALSE(s.contains("counters")) << s.dump();
  }
  const auto end = testing::of_kind(records, "run_end").at(0);
  const auto& counters = end["device_activity"]["counters"];
  EXPECT_NE(counters.value("status", "").find("cuptiFinalize"), std::string::npos)
      << counters.dump();
  EXPECT_EQ(fake_rp_stale_teardowns(), 0);
}

}  // namespace
}  // namespace steptrace
