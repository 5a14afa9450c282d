// The CUPTI activity backend's call layer (make_cupti_activity) against a stand-in
// libcupti linked into this test under CUPTI's soname, so the backend's own loader picks
// it up. The stand-in behaves as the real library is documented to (fake_cupti.hpp):
// records only for what is enabled, process-wide correlation ids, per-thread external
// ids, buffers returned by a non-forced flush only once full and complete, completed
// buffers handed to whichever callbacks are registered then. Covered: which kinds and
// calls it enables, attribution of kernels launched from other threads (autograd's
// backward thread, a DDP hook launching NCCL), step records waiting for the buffer that
// holds their kernels, yielding to another tool and who owns which buffer then, a tool
// that takes CUPTI's callbacks without telling us, a foreign cuptiFinalize, finishing,
// and undoing a failed start.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/device_activity_stage.hpp"
#include "fake_cupti/fake_cupti.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

// CUpti_ActivityKind, CUptiResult and callback-id values (cupti_activity.h,
// cupti_result.h, cupti_runtime_cbid.h, cupti_driver_cbid.h)
constexpr int kKindKernel = 3;
constexpr int kKindDriver = 4;
constexpr int kKindRuntime = 5;
constexpr int kKindConcurrentKernel = 10;
constexpr int kKindExternalCorrelation = 39;
constexpr int kCustom2 = 5;
constexpr int kInsufficientPrivileges = 35;
constexpr int kNotSupported = 27;
constexpr int kUnknown = 999;
constexpr int kCudaLaunchKernel = 211;
constexpr int kCudaGraphLaunch = 311;
constexpr int kCudaGetLastError = 10;
constexpr int kCuLaunchKernel = 307;
constexpr int kCuLaunchKernelEx = 652;
constexpr int kCuEventRecord = 119;

constexpr const char* kNvjet = "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN";
constexpr const char* kNccl =
    "_Z40ncclDevKernel_AllReduce_Sum_bf16_RING_LL24ncclDevKernelArgsStorageILm4096EE";
constexpr const char* kTritonPoi = "triton_poi_fused_add_mul_0";
constexpr const char* kAtenFill =
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)";

class CuptiActivityFake : public ::testing::Test {
 protected:
  void SetUp() override { fake_cupti_reset(); }
  void TearDown() override { fake_cupti_reset(); }

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

  // Waits (on the flush thread's progress, not for a fixed time) until it has ticked n
  // more times.
  static bool wait_ticks(KernelActivitySource& source, std::uint64_t n) {
    const std::uint64_t target = source.deliveries() + n;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (source.deliveries() < target && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    return source.deliveries() >= target;
  }

  // Runs f on another thread and waits for it (autograd's backward worker, a DDP hook).
  template <typename F>
  static void on_another_thread(F f) {
    std::thread t(f);
    t.join();
  }
};

// The step of the taken kernel that ran from `start_ns`; -2 when it was not taken.
std::int64_t step_of(const std::vector<KernelRecord>& out, std::int64_t start_ns) {
  for (const auto& r : out) {
    if (r.start_ns == start_ns) return r.step;
  }
  return -2;
}

TEST_F(CuptiActivityFake, EnablesKernelsAndTheLaunchCallsRecordsOnlyAndFinishUndoesIt) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  EXPECT_GE(fake_cupti_registrations(), 1);  // it is the stand-in that was loaded
  EXPECT_STREQ(source->name(), "cupti");
  EXPECT_EQ(source->status(), "");
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindKernel));  // it serializes kernels
  // the API records of the launch calls, runtime and driver (triton, NCCL), and no other
  // call's: every call would cost time and buffer space
  EXPECT_TRUE(fake_cupti_api_enabled(false, kCudaLaunchKernel));
  EXPECT_TRUE(fake_cupti_api_enabled(false, kCudaGraphLaunch));
  EXPECT_TRUE(fake_cupti_api_enabled(true, kCuLaunchKernel));
  EXPECT_TRUE(fake_cupti_api_enabled(true, kCuLaunchKernelEx));
  EXPECT_FALSE(fake_cupti_api_enabled(false, kCudaGetLastError));
  EXPECT_FALSE(fake_cupti_api_enabled(true, kCuEventRecord));
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindRuntime));
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindDriver));
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindExternalCorrelation));  // not needed any more
  EXPECT_GT(source->now_ns(), 0);
  source->finish();
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  EXPECT_EQ(fake_cupti_api_filters(), 0);
  const int disables = fake_cupti_disables();
  source->finish();  // idempotent
  source.reset();    // and the destructor does not do it again
  EXPECT_EQ(fake_cupti_disables(), disables);
}

TEST_F(CuptiActivityFake, TheFlushThreadLeavesTheProcessesSignalsToTheProgramsThreads) {
  // as the profiler's own threads (test_profiler.cpp): SIGTERM sent to the process must
  // reach one of the program's threads, never the flush thread
  std::thread([] {}).join();  // a sanitizer's own background thread, if any, starts now
  const std::set<std::string> before = testing::thread_ids();
  auto source = make();
  ASSERT_NE(source, nullptr);
  const auto masks = testing::masks_of_started_threads(before);
  ASSERT_EQ(masks.size(), 1U);  // the flush thread (the fake library starts none)
  testing::expect_signals_left_to_the_program(masks);
  source->finish();
}

TEST_F(CuptiActivityFake, TagsKernelsWithTheStepThatLaunchedThem) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  fake_cupti_launch(kAtenFill, 50, 60, false);  // before the first step
  source->begin_step(4);
  fake_cupti_launch(kNvjet, 100, 200, false);
  fake_cupti_api_call(false, kCudaGetLastError);  // launches nothing, no record
  fake_cupti_launch(kNccl, 150, 300, true);       // its record ahead of its launch's
  source->end_step(4);
  fake_cupti_launch(kTritonPoi, 400, 500, false);  // between steps
  source->begin_step(5);
  fake_cupti_launch_via(true, kCuLaunchKernel, kTritonPoi, 600, 700, false, 1);  // triton
  source->end_step(5);
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 5u);
  EXPECT_EQ(dropped, 0);
  EXPECT_EQ(step_of(out, 50), -1);
  EXPECT_EQ(step_of(out, 100), 4);
  EXPECT_EQ(step_of(out, 150), 4);
  EXPECT_EQ(step_of(out, 400), -1);
  EXPECT_EQ(step_of(out, 600), 5);
  for (const auto& r : out) {
    const std::string name = source->kernel_name(r.name_id);
    if (r.start_ns == 100) {
      EXPECT_EQ(name, kNvjet);
      EXPECT_EQ(r.work, KernelWork::kMatmul);
      EXPECT_EQ(r.end_ns, 200);
    }
    if (r.start_ns == 150) EXPECT_EQ(r.work, KernelWork::kCommunication);
    if (r.start_ns == 400) EXPECT_EQ(r.work, KernelWork::kCompute);
  }
  EXPECT_EQ(fake_cupti_pushes(), 0);  // no per-thread external ids
  EXPECT_EQ(fake_cupti_records(kKindRuntime), 4);
  EXPECT_EQ(fake_cupti_records(kKindDriver), 1);
}

// The case external correlation ids missed: on CUDA, loss.backward() runs on autograd's
// per-device worker thread, and DDP launches its all-reduce (NCCL, through the driver's
// cuLaunchKernelEx) from a hook on that thread. Their kernels belong to the step during
// which they were launched, whichever thread launched them.
TEST_F(CuptiActivityFake, KernelsLaunchedFromOtherThreadsDuringTheStepBelongToIt) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  for (std::int64_t step = 0; step < 3; ++step) {
    const std::uint64_t base = 1000 * static_cast<std::uint64_t>(step + 1);
    source->begin_step(step);
    fake_cupti_launch(kNvjet, base + 1, base + 2, false);  // forward, training thread
    on_another_thread([&] {                                // backward
      fake_cupti_launch(kNvjet, base + 3, base + 4, step % 2 == 0);
      fake_cupti_launch(kTritonPoi, base + 5, base + 6, false);
      on_another_thread([&] {  // a communication hook
        fake_cupti_launch_via(true, kCuLaunchKernelEx, kNccl, base + 7, base + 8, true, 1);
      });
    });
    fake_cupti_launch(kAtenFill, base + 9, base + 10, false);  // optimizer
    source->end_step(step);
    on_another_thread([&] { fake_cupti_launch(kAtenFill, base + 11, base + 12, false); });
  }
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 18u);
  for (std::int64_t step = 0; step < 3; ++step) {
    const auto base = 1000 * (step + 1);
    for (int k : {1, 3, 5, 7, 9}) EXPECT_EQ(step_of(out, base + k), step) << base + k;
    EXPECT_EQ(step_of(out, base + 11), -1) << "launched after the step ended";
  }
}

TEST_F(CuptiActivityFake, KernelsOfAGraphLaunchShareItsCorrelationAndStep) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->begin_step(2);
  fake_cupti_launch_via(false, kCudaGraphLaunch, kNvjet, 10, 20, true, 3);
  source->end_step(2);
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 3u);
  for (const auto& r : out) EXPECT_EQ(r.step, 2);
}

TEST_F(CuptiActivityFake, WithoutPerCallFiltersTheWholeApiKindsAreEnabled) {
  fake_cupti_fail_api_filter(kNotSupported);  // a CUPTI without EnableRuntimeApi's effect
  auto source = make();
  ASSERT_NE(source, nullptr);
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindRuntime));
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindDriver));
  source->begin_step(0);
  fake_cupti_api_call(false, kCudaGetLastError);  // records of calls that launch nothing
  fake_cupti_launch(kNvjet, 10, 20, false);
  on_another_thread([] {
    fake_cupti_api_call(true, kCuEventRecord);
    fake_cupti_launch(kNccl, 30, 40, true);
  });
  source->end_step(0);
  fake_cupti_api_call(false, kCudaGetLastError);
  fake_cupti_launch(kTritonPoi, 50, 60, false);
  source->finish();
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindRuntime));
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindDriver));
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(step_of(out, 10), 0);
  EXPECT_EQ(step_of(out, 30), 0);
  EXPECT_EQ(step_of(out, 50), -1);
}

// Point 2 of the review: a step counted as complete after two flush ticks whether a
// buffer had come or not, but a non-forced flush returns the buffer being filled only
// once it is full (and all its records complete). The step record waits for it.
TEST_F(CuptiActivityFake, AStepRecordWaitsForTheBufferHoldingItsKernels) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  Config config;
  detail::DeviceActivityStage stage(config, source.get(), nullptr);
  fake_cupti_set_busy(true);  // kernels run later than they are launched
  source->begin_step(0);
  for (std::uint64_t i = 0; i < 3; ++i) fake_cupti_launch(kNvjet, 10 * i + 10, 10 * i + 15, true);
  source->end_step(0);
  fake_cupti_complete_kernels();  // the device finished step 0: its record may go on
  detail::StepRecord r0;
  r0.step = 0;
  r0.activity_begin_ns = 1;
  r0.activity_end_ns = 2;
  stage.arrived(r0);
  ASSERT_TRUE(wait_ticks(*source, 3));
  r0.held_since = std::chrono::steady_clock::now();  // the 2 s bound is not what is tested
  EXPECT_FALSE(stage.complete(r0, false)) << "went out with " << r0.kernels.count << " kernels";
  EXPECT_EQ(fake_cupti_buffers_returned(), 0);

  // step 1 fills the buffer while its kernels are still running: full, not complete
  const std::uint64_t size = fake_cupti_last_buffer_size();
  EXPECT_GT(size, 0u);
  source->begin_step(1);
  int step1_kernels = 0;
  while (fake_cupti_full_buffers() == 0) {
    fake_cupti_launch(kTritonPoi, 1000 + step1_kernels, 1001 + step1_kernels, true);
    ++step1_kernels;
  }
  source->end_step(1);
  ASSERT_TRUE(wait_ticks(*source, 3));
  r0.held_since = std::chrono::steady_clock::now();
  EXPECT_FALSE(stage.complete(r0, false));
  EXPECT_EQ(fake_cupti_buffers_returned(), 0);

  // the device finishes step 1 as well: the next flush returns the full buffer
  fake_cupti_complete_kernels();
  detail::StepRecord r1;
  r1.step = 1;
  r1.activity_begin_ns = 1;
  r1.activity_end_ns = 2;
  stage.arrived(r1);  // its last kernels are in the buffer being filled now
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool done = false;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    r0.held_since = std::chrono::steady_clock::now();
    done = stage.complete(r0, false);
    if (!done) std::this_thread::yield();
  }
  ASSERT_TRUE(done);
  EXPECT_EQ(r0.kernels.count, 3);
  EXPECT_GE(fake_cupti_buffers_returned(), 1);
  ASSERT_TRUE(wait_ticks(*source, 3));
  r1.held_since = std::chrono::steady_clock::now();
  EXPECT_FALSE(stage.complete(r1, false));  // part of it is still in the active buffer
  stage.finish();                           // close: a forced flush brings the rest
  EXPECT_TRUE(stage.complete(r1, false));
  EXPECT_EQ(r1.kernels.count, step1_kernels);
  const auto end = nlohmann::json::parse("{" + stage.run_end_fields() + "}");
  const auto& k = end["device_activity"]["kernels"];
  EXPECT_EQ(k["late_records"], 0);
  EXPECT_EQ(k["outside_step_records"], 0);
  EXPECT_EQ(k["records"], 3 + step1_kernels);
}

// A buffer CUPTI asked for but does not fill (one kept in reserve) must not hold every
// step record back: once a later buffer has come back and it has been out a while, step
// records stop waiting for it.
TEST_F(CuptiActivityFake, ABufferCuptiKeepsInReserveDoesNotHoldStepsBackForever) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  Config config;
  detail::DeviceActivityStage stage(config, source.get(), nullptr);
  fake_cupti_hold_spare();
  source->begin_step(0);
  for (std::uint64_t i = 0; i < 3; ++i) fake_cupti_launch(kNvjet, 10 * i + 10, 10 * i + 15, true);
  source->end_step(0);
  detail::StepRecord r0;
  r0.step = 0;
  r0.activity_begin_ns = 1;
  stage.arrived(r0);
  while (fake_cupti_full_buffers() == 0) fake_cupti_launch(kTritonPoi, 1, 2, false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool done = false;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    r0.held_since = std::chrono::steady_clock::now();  // not the 2 s bound
    done = stage.complete(r0, false);
    if (!done) std::this_thread::yield();
  }
  ASSERT_TRUE(done);
  EXPECT_EQ(r0.kernels.count, 3);
  EXPECT_GE(fake_cupti_buffers_returned(), 1);
  source->finish();
}

TEST_F(CuptiActivityFake, BuffersShrinkWhenTheyTakeLongToFill) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  fake_cupti_launch(kNvjet, 1, 2, false);
  const std::uint64_t first = fake_cupti_last_buffer_size();
  ASSERT_GT(first, 0u);
  // a slow device: the buffer is still not full after 6 flush ticks (300 ms, longer than
  // the 200 ms a buffer should take to fill)
  ASSERT_TRUE(wait_ticks(*source, 6));
  while (fake_cupti_full_buffers() == 0) fake_cupti_launch(kNvjet, 1, 2, false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (fake_cupti_buffers_returned() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();  // the next flush tick returns it
  }
  ASSERT_GE(fake_cupti_buffers_returned(), 1);
  while (fake_cupti_buffers_requested() < 3) fake_cupti_launch(kNvjet, 1, 2, false);
  EXPECT_LT(fake_cupti_last_buffer_size(), first);
  EXPECT_GE(fake_cupti_last_buffer_size(), first / 4);  // at most 4x at once
  source->finish();
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
  const int forced = fake_cupti_flushes(true);
  source->set_yielding(true);
  EXPECT_EQ(source->status(), "yielding to torch.profiler");
  EXPECT_EQ(fake_cupti_flushes(true), forced + 1);  // our pending records came to us first
  EXPECT_EQ(fake_cupti_disables(), disables);
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));  // now the other tool's
  // torch.profiler runs: its callbacks, its records
  fake_cupti_register_other();
  source->begin_step(2);
  fake_cupti_launch(kTritonPoi, 30, 40, false);
  source->end_step(2);
  fake_cupti_other_stop(/*flush=*/true);  // Kineto flushes its buffers at its stop
  EXPECT_EQ(fake_cupti_other_buffers_received(), 1);
  source->set_yielding(false);
  EXPECT_EQ(source->status(), "");
  EXPECT_EQ(fake_cupti_registrations(), registrations + 2);  // the other's, then ours again
  EXPECT_TRUE(fake_cupti_first_callbacks_registered());
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  EXPECT_TRUE(fake_cupti_api_enabled(false, kCudaLaunchKernel));
  source->begin_step(3);
  fake_cupti_launch(kNccl, 50, 60, false);
  source->end_step(3);
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(step_of(out, 10), 1);
  EXPECT_EQ(step_of(out, 50), 3);
  EXPECT_TRUE(source->delivered(source->delivery_mark()));  // nothing left to wait for
  EXPECT_EQ(fake_cupti_other_unknown_buffers(), 0);
}

// Point 3 of the review: after a yield, buffers of one side reach the other's callbacks
// (CUPTI completes a buffer into whichever are registered then). Ours never reach the
// other tool (which would leak them, and lose the records it wants), and the other
// tool's are neither read, freed, pooled nor handed back to CUPTI by us.
TEST_F(CuptiActivityFake, AfterAYieldEachSideKeepsItsOwnBuffers) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->begin_step(1);
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->end_step(1);
  source->set_yielding(true);  // torch.profiler is about to set CUPTI up
  // a launch before Kineto registers its callbacks: CUPTI asks ours, which decline (a
  // buffer of ours would be completed into Kineto's callbacks)
  const int requested = fake_cupti_buffers_requested();
  fake_cupti_launch(kAtenFill, 22, 24, false);
  EXPECT_EQ(fake_cupti_buffers_requested(), requested);
  fake_cupti_register_other();
  fake_cupti_launch(kTritonPoi, 30, 40, false);  // into the other tool's buffer
  // a tool that leaves its buffer with CUPTI (no flush at its stop): our resume hands it
  // back to its callbacks before ours replace them
  fake_cupti_other_stop(/*flush=*/false);
  ASSERT_EQ(fake_cupti_other_buffers_out(), 1);
  // a launch on another thread races with our registration: its record goes into a new
  // buffer of the other tool, which CUPTI then completes into our callbacks
  fake_cupti_before_next_registration([] { fake_cupti_launch(kAtenFill, 35, 36, false); });
  source->set_yielding(false);
  EXPECT_EQ(fake_cupti_other_buffers_received(), 1);
  source->begin_step(3);
  fake_cupti_launch(kNccl, 50, 60, false);
  source->end_step(3);
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  EXPECT_EQ(step_of(out, 10), 1);
  EXPECT_EQ(step_of(out, 50), 3);
  EXPECT_EQ(step_of(out, 30), -2) << "the other tool's record was read as ours";
  EXPECT_EQ(step_of(out, 22), -2);
  EXPECT_EQ(step_of(out, 35), -2) << "the other tool's buffer was read";
  EXPECT_EQ(out.size(), 2u);
  EXPECT_EQ(dropped, 0) << "what CUPTI dropped while we yielded is not ours to count";
  EXPECT_EQ(fake_cupti_other_unknown_buffers(), 0) << "a buffer of ours reached the other tool";
  EXPECT_EQ(fake_cupti_other_buffers_out(), 1) << "its buffer was freed or handed back";
  EXPECT_EQ(fake_cupti_stolen_buffers(), 0) << "its buffer was pooled and given to CUPTI";
  EXPECT_NE(source->status().find("1 activity buffers of another tool"), std::string::npos)
      << source->status();
}

// The step record of a step with device work whose kernel records went to another
// tool's callbacks (one that took them without the Python hook: on-demand Kineto through
// dynolog, proton) goes out without `kernels`, not with zeros; a step that ran nothing
// still says 0.
TEST_F(CuptiActivityFake, AStepWhoseRecordsWentToAnotherToolHasNoKernelsRatherThanZero) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  Config config;
  detail::DeviceActivityStage stage(config, source.get(), nullptr);
  fake_cupti_register_other();  // nothing of ours is out: every record goes to it
  auto run_step = [&](std::int64_t step, int launches, std::int64_t device_ns) {
    detail::StepRecord r;
    r.step = step;
    r.device_clock = true;
    r.step_ns = device_ns;
    r.activity_begin_ns = source->now_ns();
    source->begin_step(step);
    for (int i = 0; i < launches; ++i) {
      const auto t = static_cast<std::uint64_t>(100 * step + i);
      fake_cupti_launch(kNvjet, t, t + 1, false);
    }
    source->end_step(step);
    r.activity_end_ns = source->now_ns();
    stage.arrived(r);
    return r;
  };
  detail::StepRecord busy = run_step(1, 3, 2'000'000);  // 2 ms of device work
  detail::StepRecord idle = run_step(2, 0, 4'000);      // back-to-back events
  ASSERT_TRUE(wait_ticks(*source, 3));
  busy.held_since = idle.held_since = std::chrono::steady_clock::now();  // not the 2 s bound
  ASSERT_TRUE(stage.complete(busy, false));
  EXPECT_FALSE(busy.kernels.present) << "went out with " << busy.kernels.count << " kernels";
  ASSERT_TRUE(stage.complete(idle, false));
  EXPECT_TRUE(idle.kernels.present);
  EXPECT_EQ(idle.kernels.count, 0);
  fake_cupti_other_stop(/*flush=*/true);
  EXPECT_EQ(fake_cupti_other_buffers_received(), 1);  // the other tool got its records
  stage.finish();
  const auto end = nlohmann::json::parse("{" + stage.run_end_fields() + "}");
  const auto& k = end["device_activity"]["kernels"];
  EXPECT_EQ(k["not_collected_steps"], 1) << k.dump();
  EXPECT_NE(k.value("not_collected", "").find("another tool"), std::string::npos) << k.dump();
}

// A step record written (flush, the 2 s bound) before the buffer holding its kernels
// came back does not know its kernels: no `kernels`, not zeros; they count as late.
TEST_F(CuptiActivityFake, AStepWrittenBeforeItsBufferCameBackHasNoKernelsRatherThanZero) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  Config config;
  detail::DeviceActivityStage stage(config, source.get(), nullptr);
  fake_cupti_set_busy(true);
  detail::StepRecord r;
  r.step = 0;
  r.activity_begin_ns = source->now_ns();
  source->begin_step(0);
  fake_cupti_launch(kNvjet, 10, 20, true);
  fake_cupti_launch(kNvjet, 20, 30, true);
  source->end_step(0);
  stage.arrived(r);
  ASSERT_TRUE(stage.complete(r, /*force=*/true));  // flush(): written as it is
  EXPECT_FALSE(r.kernels.present) << "went out with " << r.kernels.count << " kernels";
  fake_cupti_complete_kernels();
  stage.finish();
  const auto end = nlohmann::json::parse("{" + stage.run_end_fields() + "}");
  const auto& k = end["device_activity"]["kernels"];
  EXPECT_EQ(k["late_records"], 2);
  EXPECT_EQ(k["not_collected_steps"], 1) << k.dump();
}

// Without any word from the Python hook, our callbacks unheard over many steps with
// launches: the backend says so, and leaves the kinds (now the other tool's) alone at
// close.
TEST_F(CuptiActivityFake, CallbacksTakenWithoutAWordAreNoticedAndTheOtherToolIsLeftAlone) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  fake_cupti_register_other();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::int64_t step = 0;
  while (source->status().empty() && std::chrono::steady_clock::now() < deadline) {
    source->begin_step(step);
    fake_cupti_launch(kNvjet, 10, 20, false);
    source->end_step(step);
    ++step;
    wait_ticks(*source, 1);
  }
  EXPECT_NE(source->status().find("taken CUPTI's activity callbacks"), std::string::npos)
      << source->status();
  EXPECT_GE(step, 8);
  const int disables = fake_cupti_disables();
  source->finish();  // its one forced flush finds no buffer of ours: the callbacks are not
  EXPECT_EQ(fake_cupti_disables(), disables) << "the other tool's kinds were disabled";
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  EXPECT_EQ(fake_cupti_other_buffers_received(), 1);  // its buffer went back to it
  EXPECT_EQ(fake_cupti_other_unknown_buffers(), 0);
}

// The same silence from a device busy all along with a buffer of ours not yet full: the
// close's forced flush brings it back to our callbacks, so they were ours after all and
// are undone as usual.
TEST_F(CuptiActivityFake, SilenceFromABusyDeviceIsNotMistakenForAnotherTool) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  fake_cupti_set_busy(true);  // nothing completes: no buffer comes back
  source->begin_step(0);
  fake_cupti_launch(kNvjet, 10, 20, true);  // CUPTI asks for our buffer here
  source->end_step(0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::int64_t step = 1;
  while (source->status().empty() && std::chrono::steady_clock::now() < deadline) {
    source->begin_step(step);
    source->end_step(step);  // steps without launches: our buffer has room
    ++step;
    wait_ticks(*source, 1);
  }
  ASSERT_FALSE(source->status().empty());
  fake_cupti_complete_kernels();
  source->finish();
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindConcurrentKernel)) << "our kinds were left on";
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  EXPECT_EQ(step_of(out, 10), 0);
}

// Kineto's TEARDOWN_CUPTI=1: a forced flush and cuptiFinalize, under our kernel activity.
// The backend notices, says so once, calls CUPTI no more (its callbacks and kinds are
// gone), later steps go out without `kernels`; the next resume registers ours again.
TEST_F(CuptiActivityFake, AForeignFinalizeStopsKernelActivityUntilTheNextResume) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  Config config;
  detail::DeviceActivityStage stage(config, source.get(), nullptr);
  source->begin_step(0);
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->end_step(0);
  fake_cupti_finalize(/*flush_first=*/true);  // our buffer comes back to us first
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (source->status().empty() && std::chrono::steady_clock::now() < deadline) {
    wait_ticks(*source, 1);
  }
  const std::string status = source->status();
  EXPECT_NE(status.find("cuptiFinalize"), std::string::npos) << status;
  EXPECT_NE(status.find("kernel activity stopped"), std::string::npos) << status;
  std::int64_t dropped = 0;
  const auto before = take(*source, &dropped);
  EXPECT_EQ(step_of(before, 10), 0);  // what the forced flush brought us before the teardown
  const int flushes = fake_cupti_flushes(false);
  detail::StepRecord r;
  r.step = 1;
  r.activity_begin_ns = source->now_ns();
  source->begin_step(1);
  fake_cupti_launch(kNvjet, 30, 40, false);
  source->end_step(1);
  stage.arrived(r);
  ASSERT_TRUE(wait_ticks(*source, 3));
  EXPECT_EQ(fake_cupti_flushes(false), flushes) << "CUPTI still called after the teardown";
  r.held_since = std::chrono::steady_clock::now();
  ASSERT_TRUE(stage.complete(r, false));
  EXPECT_FALSE(r.kernels.present);
  EXPECT_EQ(source->status(), status);  // said once
  // torch.profiler runs again through the hook: at its end ours are registered again
  source->set_yielding(true);
  source->set_yielding(false);
  EXPECT_EQ(source->status(), "");
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  source->begin_step(2);
  fake_cupti_launch(kNccl, 50, 60, false);
  source->end_step(2);
  source->finish();
  const auto out = take(*source, &dropped);
  EXPECT_EQ(step_of(out, 50), 2);
  EXPECT_EQ(step_of(out, 30), -2);
}

TEST_F(CuptiActivityFake, AStepOpenWhenYieldingIsStillClosedAtItsEnd) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->begin_step(5);
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->set_yielding(true);
  source->end_step(5);
  source->set_yielding(false);
  fake_cupti_launch(kTritonPoi, 30, 40, false);  // after step 5 ended: outside
  source->begin_step(6);
  fake_cupti_launch(kNccl, 50, 60, false);
  source->end_step(6);
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(step_of(out, 10), 5);
  EXPECT_EQ(step_of(out, 30), -1);
  EXPECT_EQ(step_of(out, 50), 6);
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
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->end_step(7);
  source->finish();
  EXPECT_EQ(fake_cupti_disables(), 0);
  std::int64_t dropped = 0;
  EXPECT_TRUE(take(*source, &dropped).empty());
}

TEST_F(CuptiActivityFake, FailedStartUndoesWhatItEnabledAndSaysWhy) {
  fake_cupti_fail_api_filter(kNotSupported);
  fake_cupti_fail_enable(kKindRuntime, kInsufficientPrivileges);
  std::string why;
  EXPECT_EQ(make_cupti_activity(&why), nullptr);
  EXPECT_NE(why.find("admin"), std::string::npos) << why;
  EXPECT_NE(why.find("cuptiActivityEnable(RUNTIME)"), std::string::npos) << why;
  EXPECT_NE(why.find("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES (35)"), std::string::npos) << why;
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindConcurrentKernel));  // undone
  fake_cupti_fail_enable(kKindRuntime, 0);
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
  EXPECT_EQ(fake_cupti_api_filters(), 0);
  EXPECT_EQ(source->status(), "yielding to torch.profiler");
  source->set_yielding(false);
  EXPECT_GT(fake_cupti_registrations(), registrations);
  EXPECT_TRUE(fake_cupti_kind_enabled(kKindConcurrentKernel));
  source->begin_step(1);
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->end_step(1);
  EXPECT_EQ(source->status(), "");
  source->finish();
  std::int64_t dropped = 0;
  const auto out = take(*source, &dropped);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, 1);
}

TEST_F(CuptiActivityFake, NothingIsCollectedAfterFinish) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  source->finish();
  source->begin_step(9);
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->end_step(9);
  std::int64_t dropped = 0;
  EXPECT_TRUE(take(*source, &dropped).empty());
  EXPECT_FALSE(fake_cupti_kind_enabled(kKindConcurrentKernel));
}

// Through a Profiler: a short training loop whose backward pass and all-reduce run on
// other threads; every step record carries all of its kernels and none comes late.
TEST_F(CuptiActivityFake, ProfilerStepsCarryEveryKernelOfTheStepAndNoneLate) {
  testing::TempDir tmp;
  Config config = testing::run_config(tmp);
  config.clock = "host";
  Backends b;
  std::string why;
  b.kernel_activity = make_cupti_activity(&why);
  ASSERT_NE(b.kernel_activity, nullptr) << why;
  KernelActivitySource* source = b.kernel_activity.get();
  Profiler prof(config, RunInfo{}, std::move(b));
  constexpr int kSteps = 6;
  for (int i = 0; i < kSteps; ++i) {
    auto t = static_cast<std::uint64_t>(source->now_ns());
    auto step = prof.step();
    fake_cupti_launch(kNvjet, t + 1000, t + 2000, false);
    on_another_thread([&] {
      fake_cupti_launch(kNvjet, t + 2000, t + 3000, true);
      fake_cupti_launch_via(true, kCuLaunchKernelEx, kNccl, t + 2500, t + 4000, false, 1);
    });
    fake_cupti_launch(kAtenFill, t + 4000, t + 4500, false);
  }
  prof.close();
  const auto records = testing::read_jsonl(prof.log_path());
  const auto steps = testing::of_kind(records, "step");
  ASSERT_EQ(steps.size(), static_cast<std::size_t>(kSteps));
  for (const auto& s : steps) {
    ASSERT_TRUE(s.contains("kernels")) << s.dump();
    EXPECT_EQ(s["kernels"]["count"], 4) << s.dump();
    EXPECT_DOUBLE_EQ(s["kernels"]["nccl_ms"].get<double>(), 1.5e-3);
  }
  const auto end = testing::of_kind(records, "run_end").at(0);
  ASSERT_TRUE(end.contains("device_activity")) << end.dump();
  const auto& k = end["device_activity"]["kernels"];
  EXPECT_EQ(k["records"], 4 * kSteps);
  EXPECT_EQ(k["late_records"], 0);
  EXPECT_EQ(k["outside_step_records"], 0);
  EXPECT_EQ(k["dropped_records"], 0);
}

// The launch calls' records enabled one call at a time after CUDA initialized, and CUPTI
// writing none of them (reported on CUDA 13; fake_cupti_ignore_api_filters_after_init):
// kernel records come, each with its launch's correlation id, and no launch record does.
// No kernel can be placed in a step: step records go without `kernels` rather than with
// zeros, and run_end says how many kernel records could not be attributed, and why.
TEST_F(CuptiActivityFake, KernelsWithNoLaunchRecordAtAllAreUnattributedNotZeros) {
  fake_cupti_ignore_api_filters_after_init();
  testing::TempDir tmp;
  Config config = testing::run_config(tmp);
  config.clock = "host";
  Backends b;
  std::string why;
  b.kernel_activity = make_cupti_activity(&why);
  ASSERT_NE(b.kernel_activity, nullptr) << why;
  KernelActivitySource* source = b.kernel_activity.get();
  Profiler prof(config, RunInfo{}, std::move(b));
  constexpr int kSteps = 4;
  for (int i = 0; i < kSteps; ++i) {
    auto t = static_cast<std::uint64_t>(source->now_ns());
    auto step = prof.step();
    fake_cupti_launch(kNvjet, t + 1000, t + 2000, false);
    fake_cupti_launch_via(true, kCuLaunchKernelEx, kNccl, t + 2500, t + 4000, false, 1);
  }
  prof.close();
  EXPECT_EQ(fake_cupti_records(kKindRuntime) + fake_cupti_records(kKindDriver), 0);
  EXPECT_EQ(fake_cupti_records(kKindConcurrentKernel), 2 * kSteps);
  const auto records = testing::read_jsonl(prof.log_path());
  const auto steps = testing::of_kind(records, "step");
  ASSERT_EQ(steps.size(), static_cast<std::size_t>(kSteps));
  for (const auto& s : steps) EXPECT_FALSE(s.contains("kernels")) << s.dump();
  const auto end = testing::of_kind(records, "run_end").at(0);
  ASSERT_TRUE(end.contains("device_activity")) << end.dump();
  const auto& k = end["device_activity"]["kernels"];
  EXPECT_EQ(k["records"], 2 * kSteps);
  EXPECT_EQ(k["outside_step_records"], 2 * kSteps);
  EXPECT_EQ(k["not_collected_steps"], kSteps) << k.dump();
  const std::string status = k.value("status", "");
  EXPECT_NE(status.find("8 kernel records came with no launch record"), std::string::npos)
      << k.dump();
  EXPECT_NE(status.find("one call at a time"), std::string::npos) << status;
  EXPECT_NE(k.value("not_collected", "").find("attribute"), std::string::npos) << k.dump();
}

// A kernel without its launch record (launched before ours were enabled, or through a call
// they do not cover) among launches with theirs: it is outside any step, the step's
// kernel is placed as usual, and nothing is said.
TEST_F(CuptiActivityFake, AKernelWithoutItsLaunchRecordAmongOthersIsNoAlarm) {
  auto source = make();
  ASSERT_NE(source, nullptr);
  Config config;
  detail::DeviceActivityStage stage(config, source.get(), nullptr);
  // launched through a call whose records are not enabled: no launch record for it
  fake_cupti_launch_via(false, kCudaGetLastError, kNvjet, 1, 2, true, 1);
  detail::StepRecord r;
  r.step = 0;
  r.activity_begin_ns = source->now_ns();
  source->begin_step(0);
  fake_cupti_launch(kNvjet, 10, 20, false);
  source->end_step(0);
  stage.arrived(r);
  stage.finish();  // every record delivered (the buffer is not full)
  ASSERT_TRUE(stage.complete(r, false));
  EXPECT_TRUE(r.kernels.present);
  EXPECT_EQ(r.kernels.count, 1);
  const auto end = nlohmann::json::parse("{" + stage.run_end_fields() + "}");
  EXPECT_EQ(end["device_activity"]["kernels"]["outside_step_records"], 1) << end.dump();
  EXPECT_EQ(source->status().find("no launch record"), std::string::npos) << source->status();
}

}  // namespace
}  // namespace steptrace
