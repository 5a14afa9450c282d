// The CUPTI activity backend's call layer (make_cupti_activity) against a stand-in
// libcupti linked into this test under CUPTI's soname, so the backend's own loader picks
// it up: which kinds it enables, the step ids it pushes, the flush thread and the
// deliveries contract, yielding to another tool, finishing, and undoing a failed start.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fake_cupti/fake_cupti.hpp"
#include "steptrace/backend.hpp"

namespace steptrace {
namespace {

// CUpti_ActivityKind and CUptiResult values (cupti_activity.h, cupti_result.h)
constexpr int kKindKernel = 3;
constexpr int kKindConcurrentKernel = 10;
constexpr int kKindExternalCorrelation = 39;
constexpr int kCustom2 = 5;
constexpr int kInsufficientPrivileges = 35;
constexpr int kUnknown = 999;

constexpr const char* kNvjet = "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN";
constexpr const char* kNccl =
    "_Z40ncclDevKernel_AllReduce_Sum_bf16_RING_LL24ncclDevKernelArgsStorageILm4096EE";
constexpr const char* kTritonPoi = "triton_poi_fused_add_mul_0";

class CuptiActivityFake : public ::testing::Test {
 protected:
  void SetUp() override { fake_cupti_reset(); }

  static std::unique_ptr<KernelActivitySource> make() {
    std::string why;
    auto source = make_cupti_activity(&why);
    EXPECT_NE(source, nullptr) << why;
    return source;
  }

  static std::vector<KernelRecord> take(KernelActivitySource& source, std::int64_t* dropped) {
    std::vector<KernelRecord> out;
    source.take(out, dropped);
    return out;
  }
};

TEST_F(CuptiActivityFake, EnablesConcurrentKernelAndCorrelationOnlyAndFinishDisablesThem) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  EXPECT_GE(fake_cupti_registrations(), 1);  // it is the stand-in that was loaded
  EXPECT_STREQ(source->name(), "cupti");
  EXPECT_EQ(source->status(), "");
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindExternalCorrelation));
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindKernel));  // it serializes kernels
  EXPECT_GT(source->now_ns(), 0);
  source->finish();
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindExternalCorrelation));
  const int disables = fake_cupti_disables();
  source->finish();  // idempotent
  source.reset();    // and the destructor does not do it again
  EXPECT_EQ(fake_cupti_disables(), disables);
}

TEST_F(CuptiActivityFake, TagsKernelsWithTheStepThatLaunchedThem) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->begin_step(4);
  EXPECT_EQ(fake_cupti_stack_depth(kCustom2), 1);
  fake_cupti_launch(kNvjet, 100, 200, false);
  fake_cupti_launch(kNccl, 150, 300, true);  // its record ahead of its correlation
  source->end_step(4);
  EXPECT_EQ(fake_cupti_stack_depth(kCustom2), 0);
  fake_cupti_launch(kTritonPoi, 400, 500, false);  // between steps
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(dropped, 0);
  for (const auto& r : out) {
    const std::string name = source->kernel_name(r.name_id);
    if (name == kNvjet) {
      EXPECT_EQ(r.step, 4);
      EXPECT_EQ(r.work, KernelWork::kMatmul);
      EXPECT_EQ(r.start_ns, 100);
      EXPECT_EQ(r.end_ns, 200);
    } else if (name == kNccl) {
      EXPECT_EQ(r.step, 4);
      EXPECT_EQ(r.work, KernelWork::kCommunication);
    } else {
      EXPECT_EQ(name, kTritonPoi);
      EXPECT_EQ(r.step, -1);
      EXPECT_EQ(r.work, KernelWork::kCompute);
    }
  }
  EXPECT_EQ(fake_cupti_pushes(), 1);
  EXPECT_EQ(fake_cupti_pops(), 1);
}

TEST_F(CuptiActivityFake, BackgroundFlushDeliversWithinTwoDeliveries) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->begin_step(0);
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->end_step(0);
  const std::uint64_t g = source->deliveries();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (source->deliveries() < g + 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();  // waits for the flush thread, not for a fixed time
  }
  ASSERT_GE(source->deliveries(), g + 2);
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, 0);
  EXPECT_GE(fake_cupti_flushes(false), 2);
  EXPECT_EQ(fake_cupti_flushes(true), 0);  // periodic flushes are never forced
}

TEST_F(CuptiActivityFake, DroppedRecordsAreReported) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  fake_cupti_set_dropped(5);
  fake_cupti_launch(kNvjet, 10, 20, false);
  fake_cupti_launch(kNvjet, 0, 0, false);  // no timestamps: lost as well
  source->finish();
  std::int64_t dropped = 0;
  EXPECT_EQ(take(*source, &dropped).size(), 1u);
  EXPECT_EQ(dropped, 6);
  dropped = 0;
  take(*source, &dropped);
  EXPECT_EQ(dropped, 0);  // counted once
}

TEST_F(CuptiActivityFake, YieldsWithoutTouchingCuptiAndResumes) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->begin_step(1);
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->end_step(1);
  const int disables = fake_cupti_disables();
  const int registrations = fake_cupti_registrations();
  source->set_yielding(true);
  EXPECT_EQ(source->status(), "yielding to torch.profiler");
  EXPECT_EQ(fake_cupti_flushes(true), 1);  // our pending records came to us first
  EXPECT_EQ(fake_cupti_disables(), disables);
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));  // now the other tool's
  // torch.profiler runs: its callbacks, its records; we push no ids
  fake_cupti_register_other();
  const int pushes = fake_cupti_pushes();
  source->begin_step(2);
  fake_cupti_launch(kTritonPoi, 30, 40, false);
  source->end_step(2);
  EXPECT_EQ(fake_cupti_pushes(), pushes);
  fake_cupti_discard_pending();  // the other tool flushed them into its buffers
  source->set_yielding(false);
  EXPECT_EQ(source->status(), "");
  EXPECT_EQ(fake_cupti_registrations(), registrations + 2);  // the other's, then ours again
  EXPECT_TRUE(fake_cupti_first_callbacks_registered());
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindExternalCorrelation));
  source->begin_step(3);
  fake_cupti_launch(kNccl, 50, 60, false);
  source->end_step(3);
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].step, 1);
  EXPECT_EQ(out[1].step, 3);
}

TEST_F(CuptiActivityFake, AStepOpenWhenYieldingStillPopsItsId) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->begin_step(5);
  source->set_yielding(true);
  source->end_step(5);
  EXPECT_EQ(fake_cupti_stack_depth(kCustom2), 0);
  EXPECT_EQ(fake_cupti_pops(), fake_cupti_pushes());
}

TEST_F(CuptiActivityFake, FinishWhileYieldingLeavesTheOtherToolsKindsAlone) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->set_yielding(true);
  const int disables = fake_cupti_disables();
  source->finish();
  EXPECT_EQ(fake_cupti_disables(), disables);
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
}

TEST_F(CuptiActivityFake, FailedResumeStopsWithAReason) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->set_yielding(true);
  fake_cupti_reset();  // the other tool disabled its kinds when it stopped
  fake_cupti_fail_enable(kKindConcurrentKernel, kUnknown);
  source->set_yielding(false);
  EXPECT_NE(source->status().find("no usable CUDA driver or GPU"), std::string::npos)
      << source->status();
  source->begin_step(7);
  source->end_step(7);
  EXPECT_EQ(fake_cupti_pushes(), 0);
  source->finish();
  EXPECT_EQ(fake_cupti_disables(), 0);
}

TEST_F(CuptiActivityFake, FailedStartUndoesWhatItEnabledAndSaysWhy) {
  fake_cupti_fail_enable(kKindExternalCorrelation, kInsufficientPrivileges);
  std::string why;
  EXPECT_EQ(make_cupti_activity(&why), nullptr);
  EXPECT_NE(why.find("admin"), std::string::npos) << why;
  EXPECT_NE(why.find("cuptiActivityEnable(EXTERNAL_CORRELATION)"), std::string::npos) << why;
  EXPECT_NE(why.find("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES (35)"), std::string::npos) << why;
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindConcurrentKernel));  // undone
  fake_cupti_fail_enable(kKindExternalCorrelation, 0);
  EXPECT_NE(make(), nullptr);  // nothing left behind
}

TEST_F(CuptiActivityFake, NoDriverSaysSo) {
  fake_cupti_fail_enable(kKindConcurrentKernel, kUnknown);
  std::string why;
  EXPECT_EQ(make_cupti_activity(&why), nullptr);
  EXPECT_NE(why.find("no usable CUDA driver or GPU"), std::string::npos) << why;
}

TEST_F(CuptiActivityFake, OneSourcePerProcess) {
  auto first = make();
  ASSERT_NE(first, nullptr);
  std::string why;
  EXPECT_EQ(make_cupti_activity(&why), nullptr);
  EXPECT_NE(why.find("one at a time"), std::string::npos) << why;
  first->finish();  // a closed profiler's source no longer holds the buffers
  auto second = make();
  EXPECT_NE(second, nullptr);
}

TEST_F(CuptiActivityFake, StartedWhileAnotherToolRunsItTouchesNothingUntilThatEnds) {
  const int registrations = fake_cupti_registrations();
  std::string why;
  auto source = make_cupti_activity(&why, /*yielding=*/true);
  ASSERT_NE(source, nullptr) << why;
  EXPECT_EQ(fake_cupti_registrations(), registrations);  // the other tool's callbacks stay
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  EXPECT_EQ(source->status(), "yielding to torch.profiler");
  source->begin_step(0);
  source->end_step(0);
  EXPECT_EQ(fake_cupti_pushes(), 0);
  source->set_yielding(false);
  EXPECT_GT(fake_cupti_registrations(), registrations);
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  source->begin_step(1);
  source->end_step(1);
  EXPECT_EQ(fake_cupti_pushes(), 1);
  EXPECT_EQ(source->status(), "");
}

TEST_F(CuptiActivityFake, NothingIsPushedAfterFinish) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->finish();
  source->begin_step(9);
  source->end_step(9);
  EXPECT_EQ(fake_cupti_pushes(), 0);
}

}  // namespace
}  // namespace steptrace
