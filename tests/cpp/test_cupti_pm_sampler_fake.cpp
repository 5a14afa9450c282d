// The PM sampler's call layer (make_cupti_counter_sampler) against a stand-in libcupti with
// PM sampling and a stand-in libcuda (tests/cpp/fake_cupti/fake_profiler.hpp), linked into
// this test under their sonames: the device it samples (the rank's own, from LOCAL_RANK),
// and a CUPTI torn down under it by another tool's cuptiFinalize (Kineto with
// TEARDOWN_CUPTI=1). Waits are on the decode thread's progress, never for a fixed time.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fake_cupti/fake_cupti.hpp"
#include "fake_cupti/fake_profiler.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace {
namespace {

// CUptiResult values (cupti_result.h)
constexpr int kInvalidParameter = 1;
constexpr int kInvalidContext = 3;
constexpr int kInvalidOperation = 7;
constexpr int kNotInitialized = 15;
constexpr int kHardwareBusy = 26;

int g_ctx = 0;

class PmSamplerFake : public ::testing::Test {
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
    if (sampler != nullptr) EXPECT_STREQ(sampler->name(), "cupti_pm_sampling");
    return sampler;
  }

  // Until `done()` or 20 s; the decode thread runs every 25 ms.
  template <typename F>
  static bool eventually(F done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!done() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    return done();
  }

  static bool wait_deliveries(CounterSampler& s, std::uint64_t n) {
    const std::uint64_t target = s.deliveries() + n;
    return eventually([&] { return s.deliveries() >= target; });
  }
};

// Point 4 of the review: with no CUDA context yet (torchrun ranks before their first
// CUDA call) every rank sampled GPU 0. LOCAL_RANK names the rank's own GPU.
TEST_F(PmSamplerFake, SamplesTheDeviceLocalRankNames) {
  setenv("LOCAL_RANK", "2", 1);
  fake_cuda_set_device_count(4);
  auto sampler = make(-1);
  ASSERT_NE(sampler, nullptr);
  EXPECT_EQ(fake_rp_chip_device(), 2);
  EXPECT_EQ(fake_pm_availability_device(), 2);
  EXPECT_EQ(fake_pm_enabled_device(), 2);
  EXPECT_EQ(sampler->device(), "device 2 (LOCAL_RANK=2)");
  sampler->finish();
}

TEST_F(PmSamplerFake, ALocalRankThatIsNotVisibleFallsBackToTheCurrentContext) {
  // one GPU visible per rank (CUDA_VISIBLE_DEVICES set per rank): it is device 0
  setenv("LOCAL_RANK", "3", 1);
  fake_cuda_set_device_count(1);
  fake_cuda_set_current(&g_ctx, 0);
  auto sampler = make(-1);
  ASSERT_NE(sampler, nullptr);
  EXPECT_EQ(fake_pm_enabled_device(), 0);
  EXPECT_NE(sampler->device().find("LOCAL_RANK=3 is not among the 1 visible devices"),
            std::string::npos)
      << sampler->device();
  EXPECT_NE(sampler->device().find("the current CUDA context's"), std::string::npos);
  sampler->finish();
}

TEST_F(PmSamplerFake, WithoutLocalRankTheCurrentContextsDeviceAndAConfiguredOneWins) {
  fake_cuda_set_current(&g_ctx, 1);
  auto current = make(-1);
  ASSERT_NE(current, nullptr);
  EXPECT_EQ(fake_pm_enabled_device(), 1);
  EXPECT_EQ(current->device(), "device 1 (the current CUDA context's)");
  current->finish();
  current.reset();
  setenv("LOCAL_RANK", "2", 1);
  auto configured = make(3);
  ASSERT_NE(configured, nullptr);
  EXPECT_EQ(fake_pm_enabled_device(), 3);
  EXPECT_EQ(configured->device(), "device 3 (as configured)");
  configured->finish();
}

TEST_F(PmSamplerFake, SamplesWhileASampledStepRuns) {
  auto sampler = make(0);
  ASSERT_NE(sampler, nullptr);
  sampler->begin_step(0, true);
  EXPECT_EQ(fake_pm_starts(), 1);
  ASSERT_TRUE(eventually([] { return fake_pm_decodes() >= 2; }));
  sampler->end_step(0);
  sampler->finish();
  std::vector<CounterSample> samples;
  std::int64_t dropped = 0;
  bool overflow = false;
  sampler->take(samples, &dropped, &overflow);
  EXPECT_FALSE(samples.empty());
  EXPECT_EQ(fake_pm_disables(), 1);
  EXPECT_EQ(fake_rp_deinitializes(), 1);
  EXPECT_EQ(fake_rp_misuses(), 0);
  EXPECT_EQ(fake_rp_stale_calls(), 0);
}

// Point 3 of the review: Kineto's TEARDOWN_CUPTI=1 calls cuptiFinalize under the sampler.
// Whatever the destroyed session's calls then return, the sampler stops at the first
// failing call, says why once, and never calls into the destroyed objects again, not
// even to disable them at close.
class PmSamplerFinalized : public PmSamplerFake, public ::testing::WithParamInterface<int> {};

TEST_P(PmSamplerFinalized, StopsWithoutTouchingTheDestroyedSession) {
  fake_rp_set_stale_result(GetParam());
  auto sampler = make(0);
  ASSERT_NE(sampler, nullptr);
  sampler->begin_step(0, true);
  ASSERT_TRUE(eventually([] { return fake_pm_decodes() >= 1; }));
  fake_cupti_finalize(/*flush_first=*/true);
  ASSERT_TRUE(eventually([&] { return !sampler->status().empty(); }));  // the next decode
  const std::string status = sampler->status();
  EXPECT_NE(status.find("cuptiFinalize"), std::string::npos) << status;
  EXPECT_NE(status.find("cuptiPmSamplingDecodeData"), std::string::npos) << status;
  EXPECT_NE(status.find("PM sampling stopped, the run goes on"), std::string::npos) << status;
  // the decode pass that met the teardown may have made a call or two more on the way
  // (sample times, evaluation) before its DecodeData said so; none after that
  const int stale = fake_rp_stale_calls();
  EXPECT_GE(stale, 1);
  EXPECT_LE(stale, 3);
  // the run goes on: sampled and unsampled steps, decode passes
  for (std::int64_t step = 1; step < 20; ++step) {
    sampler->begin_step(step, step % 3 == 0);
    sampler->end_step(step);
  }
  ASSERT_TRUE(wait_deliveries(*sampler, 3));
  sampler->finish();
  EXPECT_EQ(fake_rp_stale_calls(), stale) << "called into the destroyed session again";
  EXPECT_EQ(fake_rp_stale_teardowns(), 0) << "disabled or deinitialized destroyed objects";
  EXPECT_EQ(sampler->status(), status);
}

INSTANTIATE_TEST_SUITE_P(StaleResults, PmSamplerFinalized,
                         ::testing::Values(kNotInitialized, kInvalidContext, kInvalidOperation,
                                           kInvalidParameter));

// A failure that is not a teardown (the counters taken by DCGM) leaves a live session:
// it is disabled at close as usual.
TEST_F(PmSamplerFake, CountersTakenByAnotherToolStillTearDownTheSession) {
  fake_pm_fail_start(kHardwareBusy);
  auto sampler = make(0);
  ASSERT_NE(sampler, nullptr);
  sampler->begin_step(0, true);
  EXPECT_NE(sampler->status().find("in use by another tool"), std::string::npos)
      << sampler->status();
  EXPECT_EQ(sampler->status().find("cuptiFinalize"), std::string::npos);
  sampler->finish();
  EXPECT_EQ(fake_pm_disables(), 1);
  EXPECT_EQ(fake_rp_deinitializes(), 1);
  EXPECT_EQ(fake_rp_stale_teardowns(), 0);
}

}  // namespace
}  // namespace steptrace
