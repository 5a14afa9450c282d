// The CUPTI activity backend's record processing, fed canned records as the CUPTI layer
// parses them (real kernel names from NCCL 2.27, cuBLAS/cuBLASLt, cutlass, flash attention
// and TorchInductor traces), and the real backend's behaviour on a machine without a GPU.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "backends/cupti/activity_records.hpp"
#include "backends/cupti/cupti_host.hpp"
#include "steptrace/backend.hpp"

namespace steptrace::detail::cupti {
namespace {

constexpr int kCustom0 = 3;  // CUpti_ExternalCorrelationKind values (Kineto's: 0, 1)
constexpr int kCustom1 = 4;
constexpr int kCustom2 = 5;  // steptrace's

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

ParsedRecord correlation(std::uint32_t correlation, std::int64_t step, int kind = kCustom2) {
  ParsedRecord r;
  r.kind = ParsedRecord::Kind::kExternalCorrelation;
  r.correlation_id = correlation;
  r.external_kind = kind;
  r.external_id = ActivityRecords::external_id_for_step(step);
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

TEST(ActivityRecords, ExternalIdIsStepPlusOneSoZeroMeansNone) {
  EXPECT_EQ(ActivityRecords::external_id_for_step(0), 1u);
  EXPECT_EQ(ActivityRecords::external_id_for_step(41), 42u);
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

TEST(ActivityRecords, CorrelationBeforeKernelAttributesAtOnce) {
  ActivityRecords records;
  records.add(correlation(7, 3));
  records.add(kernel(7, kNccl, 100, 250));
  const auto out = take(records);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, 3);
  EXPECT_EQ(out[0].start_ns, 100);
  EXPECT_EQ(out[0].end_ns, 250);
  EXPECT_EQ(out[0].work, KernelWork::kCommunication);
  EXPECT_EQ(records.name(out[0].name_id), kNccl);
  EXPECT_EQ(records.held_correlations(), 0u);  // erased on use
  EXPECT_EQ(records.stats().attributed, 1u);
}

TEST(ActivityRecords, CorrelationAfterKernelAttributesWhenItArrives) {
  ActivityRecords records;
  records.add(kernel(9, kCutlassGemm, 500, 900));
  EXPECT_TRUE(take(records).empty());  // waits for its correlation
  EXPECT_EQ(records.waiting_kernels(), 1u);
  records.add(correlation(9, 12));  // in a later buffer of the same flush
  const auto out = take(records);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, 12);
  EXPECT_EQ(out[0].work, KernelWork::kMatmul);
  EXPECT_EQ(records.waiting_kernels(), 0u);
  EXPECT_EQ(records.held_correlations(), 0u);
  EXPECT_EQ(records.stats().late, 1u);
}

TEST(ActivityRecords, OutOfOrderAcrossBuffersAndDeliveries) {
  ActivityRecords records;
  // delivery 1: correlations recorded at launch, kernels not run yet
  records.add(correlation(2, 5));
  records.add(correlation(4, 7));
  records.end_delivery();
  // delivery 2, buffer 1: kernels of two steps before their correlations, and an early
  // correlation's kernel; buffer 2: the missing correlations in reverse order
  records.add(kernel(3, kNvjet, 30, 31));
  records.add(kernel(1, kTritonPoi, 10, 11));
  records.add(kernel(4, kNccl, 40, 41));
  records.add(correlation(3, 6));
  records.add(correlation(1, 5));
  records.add(kernel(2, kFlash, 20, 21));
  records.end_delivery();
  const auto out = take(records);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(step_of(out, 10), 5);
  EXPECT_EQ(step_of(out, 20), 5);
  EXPECT_EQ(step_of(out, 30), 6);
  EXPECT_EQ(step_of(out, 40), 7);
  EXPECT_EQ(records.stats().unattributed, 0u);
  EXPECT_EQ(records.stats().late, 2u);
}

TEST(ActivityRecords, KernelWithoutCorrelationIsUnattributedAtTheEndOfItsDelivery) {
  ActivityRecords records;
  records.add(kernel(40, kAtenFill, 7, 8));  // launched outside any step: no correlation
  EXPECT_TRUE(take(records).empty());        // its correlation may still be in this flush
  records.end_delivery();                    // not later: deliveries() promises it by now
  const auto out = take(records);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, -1);
  EXPECT_EQ(records.stats().unattributed, 1u);
  EXPECT_EQ(records.waiting_kernels(), 0u);
  // a correlation that only comes in a later delivery finds nothing left to tag
  records.add(correlation(40, 3));
  EXPECT_TRUE(take(records).empty());
}

TEST(ActivityRecords, KinetoCorrelationKindsAreIgnored) {
  ActivityRecords records;
  records.add(correlation(11, 99, kCustom0));
  records.add(correlation(11, 98, kCustom1));
  records.add(kernel(11, kCublasGemm));
  records.end_delivery();
  const auto out = take(records);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, -1);
  EXPECT_EQ(records.stats().foreign, 2u);
  EXPECT_EQ(records.stats().correlations, 0u);
}

TEST(ActivityRecords, KernelsOfOneGraphLaunchShareTheCorrelation) {
  ActivityRecords records;
  records.add(correlation(21, 4));
  records.add(kernel(21, kNvjet, 1, 2));
  records.add(kernel(21, kTritonPoi, 3, 4));
  records.add(kernel(21, kNccl, 5, 6));
  // and the other way round: the graph's kernels wait, one correlation resolves them all
  records.add(kernel(22, kNvjet, 11, 12));
  records.add(kernel(22, kTritonPoi, 13, 14));
  records.add(correlation(22, 5));
  records.add(kernel(22, kFlash, 15, 16));
  const auto out = take(records);
  ASSERT_EQ(out.size(), 6u);
  for (std::int64_t s : {1, 3, 5}) EXPECT_EQ(step_of(out, s), 4) << s;
  for (std::int64_t s : {11, 13, 15}) EXPECT_EQ(step_of(out, s), 5) << s;
}

TEST(ActivityRecords, UnmatchedCorrelationsExpireSoMemoryStaysBounded) {
  ActivityRecords::Options options;
  options.generation_deliveries = 4;
  options.generation_capacity = 64;
  ActivityRecords records(options);
  // most API calls launch no kernel (memcpy, event record, sync): their ids never match
  for (std::uint32_t c = 1; c <= 1000; ++c) records.add(correlation(c, 0));
  EXPECT_LE(records.held_correlations(), 2 * options.generation_capacity);
  for (int d = 0; d < 2 * 4; ++d) records.end_delivery();
  EXPECT_EQ(records.held_correlations(), 0u);
  EXPECT_EQ(records.stats().correlations_expired, 1000u);
  // a fresh correlation still works after the rotations
  records.add(correlation(5000, 8));
  records.add(kernel(5000, kTritonPoi));
  const auto out = take(records);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, 8);
}

TEST(ActivityRecords, CorrelationSurvivesSomeDeliveriesBeforeItsKernel) {
  ActivityRecords::Options options;
  options.generation_deliveries = 4;
  ActivityRecords records(options);
  records.add(correlation(77, 2));
  for (int d = 0; d < 4; ++d) records.end_delivery();  // the device runs behind the host
  records.add(kernel(77, kNvjet));
  const auto out = take(records);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, 2);
}

TEST(ActivityRecords, WaitingKernelsAreBounded) {
  ActivityRecords::Options options;
  options.max_waiting_kernels = 16;
  ActivityRecords records(options);
  for (std::uint32_t c = 1; c <= 100; ++c) records.add(kernel(c, kTritonPoi, c, c + 1));
  EXPECT_LE(records.waiting_kernels(), 16u);
  records.drain();
  EXPECT_EQ(take(records).size(), 100u);  // none lost, all unattributed
  EXPECT_EQ(records.stats().unattributed, 100u);
}

TEST(ActivityRecords, DrainHandsOutWaitingKernelsAndForgetsCorrelations) {
  ActivityRecords records;
  records.add(kernel(1, kNccl));
  records.add(correlation(2, 3));
  records.drain();
  const auto out = take(records);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].step, -1);
  EXPECT_EQ(records.held_correlations(), 0u);
  EXPECT_EQ(records.waiting_kernels(), 0u);
}

TEST(ActivityRecords, UntimedKernelsAreCountedAsLost) {
  ActivityRecords records;
  records.add(correlation(1, 0));
  records.add(kernel(1, kNvjet, 0, 0));  // CUPTI had no device memory to time it
  records.add(kernel(2, kNvjet, 50, 40));
  EXPECT_TRUE(take(records).empty());
  EXPECT_EQ(records.take_lost(), 2);
  EXPECT_EQ(records.take_lost(), 0);  // reset by taking
}

TEST(ActivityRecords, EachDistinctNameIsCopiedAndClassifiedOnce) {
  ActivityRecords records;
  const std::string copy_a = kNvjet;  // same name at another address (another module)
  const std::string copy_b = kNvjet;
  records.add(correlation(1, 0));
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
  ParsedRecord other;  // e.g. a memcpy record of another tool's kinds
  records.add(other);
  records.add(correlation(1, 0));
  records.add(kernel(1, kNvjet, 1, 2));
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
  for (std::uint32_t c = 1; c <= 20; ++c) {
    records.add(correlation(c, 0));
    records.add(kernel(c, kNvjet, c, c + 1));
  }
  EXPECT_EQ(take(records).size(), 8u);
  EXPECT_EQ(records.take_lost(), 12);
}

bool has_nvidia_device() { return std::filesystem::exists("/dev/nvidiactl"); }

TEST(CuptiActivity, UnavailableWithoutAGpuSaysWhyAndCanBeRetried) {
  if (has_nvidia_device()) GTEST_SKIP() << "a GPU is present: see CuptiActivityGpu";
  std::string why;
  auto source = make_cupti_activity(&why);
  ASSERT_EQ(source, nullptr);
  std::string lib_why;
  if (load_library({}, &lib_why) == nullptr) {
    EXPECT_NE(why.find("libcupti"), std::string::npos) << why;
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
