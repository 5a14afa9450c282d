// The CUPTI activity backend's record processing, fed canned records as the CUPTI layer
// parses them (real kernel names from NCCL 2.27, cuBLAS/cuBLASLt, cutlass, flash attention
// and TorchInductor traces): attribution of kernels to steps by the correlation-id range
// of their launch calls, in any delivery order; the step-boundary ring; and the real
// backend's behaviour on a machine without a GPU.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "backends/cupti/activity_records.hpp"
#include "backends/cupti/cupti_host.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail::cupti {
namespace {

constexpr const char* kNccl =
    "_Z40ncclDevKernel_AllReduce_Sum_bf16_RING_LL24ncclDevKernelArgsStorageILm4096EE";
constexpr const char* kCutlassGemm =
    "_ZN7cutlass6KernelI57cutlass_80_tensorop_s1688gemm_bf16_256x128_32x3_tn_align4EEvNT_6ParamsE";
constexpr const char* kCublasGemm =
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize64x128x64_cgasize1x1x1_warpgroupsize"
    "1x1x1_aligna4_alignc4";
constexpr const char* kNvjet = "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN";
constexpr const char* kFlash =
    "_ZN13pytorch_flash16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi128ELi128ELi64"
    "ELi4ELb0ELb0EN7cutlass10bfloat16_tE19Flash_kernel_traitsILi128ELi128ELi64ELi4ES3_"
    "EELb0ELb1ELb0ELb0ELb0ELb0ELb0ELb0EEEvNS_16Flash_fwd_paramsE";
constexpr const char* kTritonPoi = "triton_poi_fused_add_mul_0";
constexpr const char* kAtenFill =
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
    "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)";

ParsedRecord kernel(std::uint32_t correlation, const char* name, std::uint64_t start = 1000,
                    std::uint64_t end = 2000) {
  ParsedRecord r;
  r.kind = ParsedRecord::Kind::kKernel;
  r.correlation_id = correlation;
  r.name = name;
  r.start_ns = start;
  r.end_ns = end;
  return r;
}

// The API record of the launch call with id `correlation`, started at host time t_ns.
ParsedRecord launch(std::uint32_t correlation, std::int64_t t_ns) {
  ParsedRecord r;
  r.kind = ParsedRecord::Kind::kApi;
  r.correlation_id = correlation;
  r.start_ns = static_cast<std::uint64_t>(t_ns);
  r.end_ns = static_cast<std::uint64_t>(t_ns) + 1;
  return r;
}

std::vector<KernelRecord> take(ActivityRecords& records) {
  std::vector<KernelRecord> out;
  records.take(out);
  return out;
}

// step of the taken record whose start is `start_ns` (-2: not taken)
std::int64_t step_of(const std::vector<KernelRecord>& out, std::int64_t start_ns) {
  for (const auto& r : out) {
    if (r.start_ns == start_ns) return r.step;
  }
  return -2;
}

// Steps 0..n-1 at host times [100 s, 100 s + 50), i.e. step 0 is [100, 150), then the
// data phase [150, 200) outside any step.
void steps(ActivityRecords& records, int n) {
  for (int s = 0; s < n; ++s) {
    records.add_mark(s, true, 100 * (s + 1));
    records.add_mark(s, false, 100 * (s + 1) + 50);
  }
}

// One delivered buffer: begin_buffer, the records, end_buffer.
void buffer(ActivityRecords& records, std::initializer_list<ParsedRecord> rs,
            std::uint64_t requested = 1, std::uint64_t done = 0) {
  records.begin_buffer(requested);
  for (const auto& r : rs) records.add(r);
  records.end_buffer(done);
}

TEST(ActivityRecords, ClassifiesRealKernelNames) {
  EXPECT_EQ(ActivityRecords::work_for(kNccl), KernelWork::kCommunication);
  EXPECT_EQ(ActivityRecords::work_for(kCutlassGemm), KernelWork::kMatmul);
  EXPECT_EQ(ActivityRecords::work_for(kCublasGemm), KernelWork::kMatmul);
  EXPECT_EQ(ActivityRecords::work_for(kNvjet), KernelWork::kMatmul);
  EXPECT_EQ(ActivityRecords::work_for(kFlash), KernelWork::kMatmul);
  EXPECT_EQ(ActivityRecords::work_for(kTritonPoi), KernelWork::kCompute);
  EXPECT_EQ(ActivityRecords::work_for(kAtenFill), KernelWork::kCompute);
}

TEST(ActivityRecords, AKernelBelongsToTheSegmentItsLaunchStartedIn) {
  ActivityRecords records;
  steps(records, 3);
  // ids grow with the calls' start times, whichever thread made them
  buffer(records, {launch(1, 50), kernel(1, kAtenFill, 1, 2),        // before step 0
                   launch(2, 100), kernel(2, kNccl, 100, 250),       // step 0's first
                   launch(3, 149), kernel(3, kNvjet, 3, 4),          // its last
                   launch(4, 150), kernel(4, kTritonPoi, 5, 6),      // data phase
                   launch(5, 320), kernel(5, kCutlassGemm, 7, 8)});  // step 2
  const auto out = take(records);
  ASSERT_EQ(out.size(), 5u);
  EXPECT_EQ(step_of(out, 1), -1);
  EXPECT_EQ(step_of(out, 100), 0);
  EXPECT_EQ(step_of(out, 3), 0);
  EXPECT_EQ(step_of(out, 5), -1);
  EXPECT_EQ(step_of(out, 7), 2);
  EXPECT_EQ(out[1].end_ns, 250);
  EXPECT_EQ(out[1].work, KernelWork::kCommunication);
  EXPECT_EQ(records.name(out[1].name_id), kNccl);
  EXPECT_EQ(records.stats().attributed, 3u);
  EXPECT_EQ(records.stats().unattributed, 2u);
  EXPECT_EQ(records.stats().waited, 0u);
}

TEST(ActivityRecords, KernelsWaitForTheirLaunchRecordInWhateverOrderBuffersCome) {
  ActivityRecords records;
  steps(records, 3);
  // buffer 1: kernels of steps 1 and 2 and an early one, before any launch record
  buffer(records,
         {kernel(30, kNvjet, 30, 31), kernel(10, kTritonPoi, 10, 11), kernel(40, kNccl, 40, 41)},
         /*requested=*/2, /*done=*/0);
  EXPECT_TRUE(take(records).empty());
  EXPECT_EQ(records.waiting_kernels(), 3u);
  // buffer 2 (another thread's): the launch records, newest first, and one more kernel
  buffer(records,
         {launch(40, 310), launch(30, 220), launch(20, 130), launch(10, 110),
          kernel(20, kFlash, 20, 21)},
         2, 0);
  const auto out = take(records);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(step_of(out, 10), 0);
  EXPECT_EQ(step_of(out, 20), 0);
  EXPECT_EQ(step_of(out, 30), 1);
  EXPECT_EQ(step_of(out, 40), 2);
  EXPECT_EQ(records.stats().waited, 3u);
  EXPECT_EQ(records.stats().placed_by_neighbours, 0u);
  EXPECT_EQ(records.waiting_kernels(), 0u);
}

TEST(ActivityRecords, AKernelWhoseLaunchRecordNeverComesIsPlacedByItsNeighbours) {
  ActivityRecords records;
  steps(records, 2);
  // a launch through a call whose records are not enabled: ids 11 and 21 have none
  buffer(records,
         {launch(10, 105), launch(12, 120), kernel(11, kTritonPoi, 11, 12), launch(20, 210),
          launch(22, 220), kernel(21, kNvjet, 21, 22)},
         /*requested=*/3, /*done=*/2);
  EXPECT_TRUE(take(records).empty());  // buffer 2 may still bring their launch records
  records.begin_buffer(3);
  records.end_buffer(3);  // every buffer that could hold them has come
  const auto out = take(records);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(step_of(out, 11), 0);
  EXPECT_EQ(step_of(out, 21), 1);
  EXPECT_EQ(records.stats().placed_by_neighbours, 2u);
}

TEST(ActivityRecords, KernelsOfOneGraphLaunchShareItsLaunchRecord) {
  ActivityRecords records;
  steps(records, 2);
  buffer(records, {launch(21, 120), kernel(21, kNvjet, 1, 2), kernel(21, kTritonPoi, 3, 4),
                   kernel(21, kNccl, 5, 6), kernel(22, kNvjet, 11, 12),
                   kernel(22, kTritonPoi, 13, 14), launch(22, 201), kernel(22, kFlash, 15, 16)});
  const auto out = take(records);
  ASSERT_EQ(out.size(), 6u);
  for (std::int64_t s : {1, 3, 5}) EXPECT_EQ(step_of(out, s), 0) << s;
  for (std::int64_t s : {11, 13, 15}) EXPECT_EQ(step_of(out, s), 1) << s;
}

TEST(ActivityRecords, ManyWaitingKernelsAreResolvedInOnePassPerBuffer) {
  // the former scheme rescanned every waiting kernel for each correlation record that
  // came (quadratic under the callback mutex); now each buffer is one pass
  ActivityRecords records;
  steps(records, 1);
  constexpr std::uint32_t kN = 50000;
  records.begin_buffer(1);
  for (std::uint32_t c = 1; c <= kN; ++c) records.add(kernel(c, kNvjet, c, c + 1));
  records.end_buffer(0);
  EXPECT_EQ(records.waiting_kernels(), kN);
  records.begin_buffer(1);
  for (std::uint32_t c = kN; c >= 1; --c) records.add(launch(c, 100 + c % 40));
  const auto before = std::chrono::steady_clock::now();
  records.end_buffer(0);
  const auto took = std::chrono::steady_clock::now() - before;
  EXPECT_EQ(records.waiting_kernels(), 0u);
  const auto out = take(records);
  ASSERT_EQ(out.size(), kN);
  for (const auto& k : out) EXPECT_EQ(k.step, 0);
  // 50k kernels: a quadratic pass would take minutes, this one milliseconds
  EXPECT_LT(took, std::chrono::seconds(5));
}

TEST(ActivityRecords, CorrelationIdsWrapAroundAfterTwoToThe32Calls) {
  ActivityRecords records;
  steps(records, 2);
  const std::uint32_t top = UINT32_MAX - 1;
  buffer(records, {launch(top, 110), kernel(top, kNvjet, 1, 2), launch(top + 1, 140),
                   launch(0, 210), kernel(0, kNccl, 3, 4), launch(3, 230), kernel(3, kFlash, 5, 6),
                   kernel(top + 1, kTritonPoi, 7, 8)});
  const auto out = take(records);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(step_of(out, 1), 0);
  EXPECT_EQ(step_of(out, 7), 0);
  EXPECT_EQ(step_of(out, 3), 1);
  EXPECT_EQ(step_of(out, 5), 1);
}

TEST(ActivityRecords, TheSeenWindowSlidesAndOldIdsArePlacedByNeighbours) {
  ActivityRecords::Options options;
  options.seen_window = 256;
  ActivityRecords records(options);
  steps(records, 2);
  buffer(records, {launch(5, 110)});
  for (std::uint32_t c = 1000; c < 1300; ++c) records.add(launch(c, 210));  // slides past 5
  // kernel 5 comes late: its id left the window, so it is placed by the boundaries,
  // which still know its launch
  buffer(records, {kernel(5, kNvjet, 1, 2), kernel(1299, kNccl, 3, 4)});
  const auto out = take(records);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(step_of(out, 1), 0);
  EXPECT_EQ(step_of(out, 3), 1);
}

TEST(ActivityRecords, MarksAreBoundedAndKernelsOfStepsDroppedLongAgoAreOutside) {
  ActivityRecords::Options options;
  options.max_marks = 8;
  ActivityRecords records(options);
  steps(records, 10);  // 20 marks: steps 0..5 forgotten
  EXPECT_EQ(records.held_marks(), 8u);
  buffer(records,
         {launch(1, 110), kernel(1, kNvjet, 1, 2), launch(2, 910), kernel(2, kNvjet, 3, 4)});
  const auto out = take(records);
  EXPECT_EQ(step_of(out, 1), -1);
  EXPECT_EQ(step_of(out, 3), 8);
  EXPECT_EQ(records.stats().api_before_marks, 1u);
}

TEST(ActivityRecords, WaitingKernelsAreBounded) {
  ActivityRecords::Options options;
  options.max_waiting_kernels = 16;
  ActivityRecords records(options);
  steps(records, 1);
  records.begin_buffer(1);
  for (std::uint32_t c = 1; c <= 100; ++c) records.add(kernel(c, kTritonPoi, c, c + 1));
  EXPECT_LE(records.waiting_kernels(), 16u);
  records.drain();
  EXPECT_EQ(take(records).size(), 100u);  // none lost, placed as well as can be
  EXPECT_EQ(records.waiting_kernels(), 0u);
}

TEST(ActivityRecords, DrainPlacesWaitingKernels) {
  ActivityRecords records;
  steps(records, 1);
  buffer(records, {launch(1, 120), launch(3, 160)}, 2, 0);
  buffer(records, {kernel(2, kNccl, 1, 2), kernel(4, kNvjet, 3, 4)}, 2, 0);
  EXPECT_EQ(records.waiting_kernels(), 2u);
  records.drain();
  const auto out = take(records);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(step_of(out, 1), 0);   // between two launches of step 0
  EXPECT_EQ(step_of(out, 3), -1);  // after the first launch of the data phase
  EXPECT_EQ(records.waiting_kernels(), 0u);
}

TEST(ActivityRecords, UntimedKernelsAreCountedAsLost) {
  ActivityRecords records;
  steps(records, 1);
  buffer(records, {launch(1, 110), kernel(1, kNvjet, 0, 0),  // CUPTI had no memory to time it
                   kernel(2, kNvjet, 50, 40)});
  records.drain();
  EXPECT_TRUE(take(records).empty());
  EXPECT_EQ(records.take_lost(), 2);
  EXPECT_EQ(records.take_lost(), 0);  // reset by taking
}

TEST(ActivityRecords, EachDistinctNameIsCopiedAndClassifiedOnce) {
  ActivityRecords records;
  const std::string copy_a = kNvjet;  // same name at another address (another module)
  const std::string copy_b = kNvjet;
  records.add(kernel(1, kNvjet, 1, 2));
  records.add(kernel(2, kNvjet, 3, 4));
  records.add(kernel(3, copy_a.c_str(), 5, 6));
  records.add(kernel(4, copy_b.c_str(), 7, 8));
  records.add(kernel(5, kNccl, 9, 10));
  records.drain();
  const auto out = take(records);
  ASSERT_EQ(out.size(), 5u);
  EXPECT_EQ(records.name_count(), 2u);
  EXPECT_EQ(records.classifications(), 2u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i].name_id, out[0].name_id) << i;
  EXPECT_NE(out[4].name_id, out[0].name_id);
  EXPECT_EQ(records.name(out[0].name_id), kNvjet);
  EXPECT_EQ(records.name(out[4].name_id), kNccl);
  EXPECT_EQ(records.name(12345), "");
}

TEST(ActivityRecords, ReusedNamePointerWithNewContentGetsItsOwnName) {
  ActivityRecords records;
  std::array<char, 128> buffer{};
  auto put = [&](const char* name) {
    ASSERT_LT(std::strlen(name), buffer.size());
    std::memcpy(buffer.data(), name, std::strlen(name) + 1);
  };
  put(kTritonPoi);
  records.add(kernel(1, buffer.data(), 1, 2));
  put(kNvjet);  // a module unloaded and another one reused the memory
  records.add(kernel(2, buffer.data(), 3, 4));
  records.drain();
  const auto out = take(records);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(records.name(out[0].name_id), kTritonPoi);
  EXPECT_EQ(records.name(out[1].name_id), kNvjet);
  EXPECT_EQ(out[0].work, KernelWork::kCompute);
  EXPECT_EQ(out[1].work, KernelWork::kMatmul);
}

TEST(ActivityRecords, NamesPastTheTableBoundStillCountRight) {
  ActivityRecords::Options options;
  options.max_names = 2;
  ActivityRecords records(options);
  records.add(kernel(1, kTritonPoi, 1, 2));
  records.add(kernel(2, kAtenFill, 3, 4));
  records.add(kernel(3, kNccl, 5, 6));
  records.add(kernel(4, kFlash, 7, 8));
  records.add(kernel(5, nullptr, 9, 10));
  records.drain();
  const auto out = take(records);
  ASSERT_EQ(out.size(), 5u);
  EXPECT_EQ(out[2].name_id, out[3].name_id);  // both the shared overflow name
  EXPECT_EQ(out[2].work, KernelWork::kCommunication);
  EXPECT_EQ(out[3].work, KernelWork::kMatmul);
  EXPECT_EQ(records.name_count(), 3u);
  EXPECT_EQ(records.classifications(), 2u);
}

TEST(ActivityRecords, UnnamedKernelGetsAPlaceholderName) {
  ActivityRecords records;
  records.add(kernel(1, nullptr));
  records.drain();
  const auto out = take(records);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_FALSE(records.name(out[0].name_id).empty());
}

TEST(ActivityRecords, TakeAppendsAndOtherKindsAreIgnored) {
  ActivityRecords records;
  steps(records, 1);
  ParsedRecord other;  // e.g. a memcpy record of another tool's kinds
  buffer(records, {other, launch(1, 110), kernel(1, kNvjet, 1, 2)});
  std::vector<KernelRecord> out(2);
  records.take(out);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[2].step, 0);
  EXPECT_EQ(records.stats().other, 1u);
  out.clear();
  records.take(out);
  EXPECT_TRUE(out.empty());  // handed out once
}

TEST(ActivityRecords, ReadyRecordsAreBoundedWhenNobodyTakes) {
  ActivityRecords::Options options;
  options.max_ready = 8;
  ActivityRecords records(options);
  steps(records, 1);
  records.begin_buffer(1);
  for (std::uint32_t c = 1; c <= 20; ++c) {
    records.add(launch(c, 110));
    records.add(kernel(c, kNvjet, c, c + 1));
  }
  records.end_buffer(0);
  EXPECT_EQ(take(records).size(), 8u);
  EXPECT_EQ(records.take_lost(), 12);
}

TEST(MarkRing, HandsOutMarksInOrderAndCountsOverrun) {
  MarkRing ring;
  std::vector<std::int64_t> seen;
  ring.publish(3, true, 10);
  ring.publish(3, false, 20);
  EXPECT_EQ(ring.consume([&](std::int64_t step, bool begin, std::int64_t t) {
    seen.insert(seen.end(), {step, begin ? 1 : 0, t});
  }),
            0u);
  EXPECT_EQ(seen, (std::vector<std::int64_t>{3, 1, 10, 3, 0, 20}));
  for (std::size_t i = 0; i < MarkRing::kCapacity + 5; ++i) {
    ring.publish(static_cast<std::int64_t>(i), true, static_cast<std::int64_t>(i));
  }
  std::int64_t first = -1;
  std::size_t n = 0;
  const std::uint64_t lost = ring.consume([&](std::int64_t step, bool, std::int64_t) {
    if (first < 0) first = step;
    ++n;
  });
  EXPECT_EQ(lost, 5u);
  EXPECT_EQ(n, MarkRing::kCapacity);
  EXPECT_EQ(first, 5);
}

TEST(MarkRing, AConsumerOnAnotherThreadSeesEveryMarkOnce) {
  MarkRing ring;
  constexpr std::int64_t kSteps = 200000;
  std::atomic<bool> done{false};
  std::int64_t expected = 0;
  bool ordered = true;
  std::uint64_t lost = 0;
  std::thread consumer([&] {
    auto read = [&] {
      lost += ring.consume([&](std::int64_t step, bool begin, std::int64_t t) {
        const std::int64_t index = step * 2 + (begin ? 0 : 1);
        if (index < expected || t != index) ordered = false;
        expected = index + 1;
      });
    };
    while (!done.load()) read();
    read();
  });
  for (std::int64_t s = 0; s < kSteps; ++s) {
    ring.publish(s, true, 2 * s);
    ring.publish(s, false, 2 * s + 1);
  }
  done.store(true);
  consumer.join();
  EXPECT_TRUE(ordered);  // a mark is never torn (its time matches its step)
  EXPECT_EQ(static_cast<std::uint64_t>(expected), 2 * kSteps - 0);
  EXPECT_LE(lost, static_cast<std::uint64_t>(2 * kSteps));
}

bool has_nvidia_device() { return std::filesystem::exists("/dev/nvidiactl"); }

TEST(CuptiActivity, UnavailableWithoutAGpuSaysWhyAndCanBeRetried) {
  if (has_nvidia_device()) GTEST_SKIP() << "a GPU is present: see CuptiActivityGpu";
  std::string why;
  auto source = make_cupti_activity(&why);
  ASSERT_EQ(source, nullptr);
  std::string lib_why;
  if (!STEPTRACE_TEST_HAVE_CUPTI_HEADERS) {
    EXPECT_NE(why.find("built without the CUPTI headers"), std::string::npos) << why;
  } else if (const Library* lib = load_library({}, &lib_why); lib == nullptr) {
    EXPECT_NE(why.find("libcupti"), std::string::npos) << why;
  } else if (!activity_records_unreadable(*lib).empty()) {
    // the toolkit's libcupti of another release than the headers (torch's): refused first
    EXPECT_EQ(why, activity_records_unreadable(*lib));
    EXPECT_NE(why.find("activity record structs differ"), std::string::npos) << why;
  } else {
    // CPU-only with CUPTI installed: registering callbacks works, enabling a kind fails
    EXPECT_NE(why.find("no usable CUDA driver or GPU"), std::string::npos) << why;
    EXPECT_NE(why.find("cuptiActivityEnable(CONCURRENT_KERNEL)"), std::string::npos) << why;
  }
  EXPECT_EQ(why.find('\n'), std::string::npos) << why;  // one line
  // nothing left behind: a second attempt fails the same way (not "already in use")
  std::string again;
  EXPECT_EQ(make_cupti_activity(&again), nullptr);
  EXPECT_EQ(again, why);
  EXPECT_EQ(make_cupti_activity(nullptr), nullptr);  // no reason wanted: no crash
}

TEST(CuptiActivityGpu, StartsYieldsResumesAndFinishes) {
  if (!has_nvidia_device()) GTEST_SKIP() << "needs an NVIDIA GPU";
  if (!STEPTRACE_TEST_HAVE_CUPTI_HEADERS) GTEST_SKIP() << "built without the CUPTI headers";
  std::string why;
  auto source = make_cupti_activity(&why);
  ASSERT_NE(source, nullptr) << why;
  EXPECT_STREQ(source->name(), "cupti");
  EXPECT_EQ(source->status(), "");
  const std::int64_t t0 = source->now_ns();
  EXPECT_GT(t0, 0);
  std::string second_why;
  EXPECT_EQ(make_cupti_activity(&second_why), nullptr);  // one per process
  EXPECT_NE(second_why.find("one at a time"), std::string::npos) << second_why;
  source->begin_step(0);
  source->end_step(0);
  source->set_yielding(true);
  EXPECT_EQ(source->status(), "yielding to torch.profiler");
  source->set_yielding(false);
  EXPECT_EQ(source->status(), "");
  const std::uint64_t before = source->deliveries();
  source->finish();
  EXPECT_GT(source->deliveries(), before);
  source->finish();  // idempotent
  std::vector<KernelRecord> out;
  std::int64_t dropped = 0;
  source->take(out, &dropped);  // no kernels were launched
  EXPECT_EQ(dropped, 0);
}

}  // namespace
}  // namespace steptrace::detail::cupti
