// The range-profiler fallback's call layer (make_cupti_counter_sampler) against a stand-in
// libcupti without PM sampling and a stand-in libcuda (tests/cpp/fake_cupti/fake_profiler.hpp),
// linked into this test under their sonames: the fallback order, lazy setup on the first
// sampled step with a context, ranges only on sampled steps and never without a context,
// samples per step, finishing. Everything is checked after finish(), which decodes
// synchronously: nothing waits on the decode thread's timing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fake_cupti/fake_profiler.hpp"
#include "steptrace/backend.hpp"

namespace steptrace {
namespace {

int g_ctx_a = 0;
int g_ctx_b = 0;
void* const kCtxA = &g_ctx_a;
void* const kCtxB = &g_ctx_b;

class RangeProfilerFake : public ::testing::Test {
 protected:
  void SetUp() override { fake_rp_reset(); }

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

}  // namespace
}  // namespace steptrace
