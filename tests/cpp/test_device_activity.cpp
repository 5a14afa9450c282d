// Kernel activity and counters joined to step records: per-step kernel figures (unions,
// idle, exposed NCCL), records waiting for their deliveries, counters aligned by time,
// the diagnoses, and the whole path through a Profiler with the fake backends.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "backends/fake/fake_backends.hpp"
#include "backends/fake/fake_device_activity.hpp"
#include "core/detect/device_diagnosis_detector.hpp"
#include "core/device_activity_stage.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace::detail {
namespace {

using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;

constexpr std::int64_t kMs = 1'000'000;

KernelRecord kernel(std::int64_t start, std::int64_t end, KernelWork work = KernelWork::kCompute,
                    std::int64_t step = 0) {
  KernelRecord k;
  k.step = step;
  k.start_ns = start;
  k.end_ns = end;
  k.work = work;
  return k;
}

TEST(KernelStats, UnionsIdleAndExposedCommunication) {
  // compute [0,10), NCCL [5,20) overlapping it, matmul [20,30), a gap, compute [40,50)
  std::vector<KernelRecord> ks = {kernel(40, 50), kernel(5, 20, KernelWork::kCommunication),
                                  kernel(0, 10), kernel(20, 30, KernelWork::kMatmul)};
  const KernelStats s = kernel_stats(ks, 0);
  EXPECT_TRUE(s.present);
  EXPECT_EQ(s.count, 4);
  EXPECT_EQ(s.compute_ns, 30);  // [0,10) + [20,30) + [40,50); matmul is compute
  EXPECT_EQ(s.matmul_ns, 10);
  EXPECT_EQ(s.nccl_ns, 15);
  EXPECT_EQ(s.busy_ns, 40);          // [0,30) + [40,50)
  EXPECT_EQ(s.exposed_nccl_ns, 10);  // [10,20): communication with no compute beside it
  EXPECT_EQ(s.window_start_ns, 0);
  EXPECT_EQ(s.window_end_ns, 50);
  EXPECT_EQ(s.idle_ns, 10);
}

TEST(KernelStats, ConcurrentKernelsCountOnceAndTheWindowStartsWhenTheDeviceCouldStart) {
  std::vector<KernelRecord> ks = {kernel(100, 200), kernel(120, 180), kernel(150, 250)};
  // The step could start at 60 (host start / previous step's end): 40 ns idle before it.
  KernelStats s = kernel_stats(ks, 60);
  EXPECT_EQ(s.busy_ns, 150);
  EXPECT_EQ(s.compute_ns, 150);
  EXPECT_EQ(s.idle_ns, 40);
  // A first kernel before that bound (another stream) opens the window itself.
  s = kernel_stats(ks, 130);
  EXPECT_EQ(s.window_start_ns, 100);
  EXPECT_EQ(s.idle_ns, 0);
  std::vector<KernelRecord> none;
  s = kernel_stats(none, 0);
  EXPECT_TRUE(s.present);
  EXPECT_EQ(s.count, 0);
  EXPECT_EQ(s.idle_ns, 0);
}

StepRecord step_record(std::int64_t step, std::int64_t begin, std::int64_t end,
                       bool sampled = false) {
  StepRecord r;
  r.step = step;
  r.step_ns = end - begin;
  r.activity_begin_ns = begin;
  r.activity_end_ns = end;
  r.counters_sampled = sampled;
  r.sampler_begin_ns = sampled ? begin : -1;
  r.sampler_end_ns = sampled ? end : -1;
  return r;
}

struct StageFixture {
  Config config;
  fake::FakeKernelActivity activity;
  fake::FakeCounterSampler sampler;
  std::unique_ptr<DeviceActivityStage> stage =
      std::make_unique<DeviceActivityStage>(config, &activity, &sampler);
};

TEST(DeviceActivityStage, ARecordWaitsForTwoDeliveriesAfterItArrived) {
  StageFixture f;
  StepRecord r = step_record(0, 0, 100);
  StepRecord next = step_record(1, 100, 200);
  f.stage->arrived(r);
  f.stage->arrived(next);  // in the same batch: it must not wait for r's deliveries again
  f.activity.add_kernel("gemm", KernelWork::kMatmul, 10, 60, 0);
  EXPECT_FALSE(f.stage->complete(r, false));
  f.activity.delivery.deliver();
  EXPECT_FALSE(f.stage->complete(r, false));  // that delivery may have begun earlier
  f.activity.delivery.deliver();
  ASSERT_TRUE(f.stage->complete(r, false));
  EXPECT_TRUE(r.kernels.present);
  EXPECT_EQ(r.kernels.count, 1);
  EXPECT_EQ(r.kernels.matmul_ns, 50);
  EXPECT_EQ(r.kernels.idle_ns, 10);  // [0,10) before the kernel; the window ends with it
  EXPECT_TRUE(f.stage->complete(next, false));
}

TEST(DeviceActivityStage, ForceCompletesWithWhatIsKnownAndLateRecordsAreCounted) {
  StageFixture f;
  StepRecord r0 = step_record(0, 0, 100);
  f.activity.add_kernel("k", KernelWork::kCompute, 10, 20, 0);
  f.activity.delivery.deliver();
  ASSERT_TRUE(f.stage->complete(r0, /*force=*/true));
  EXPECT_EQ(r0.kernels.count, 1);
  // step 0's second kernel arrives after its record was written; one kernel outside steps
  f.activity.add_kernel("k", KernelWork::kCompute, 30, 40, 0);
  f.activity.add_kernel("memcpy-ish", KernelWork::kCompute, 45, 46, -1);
  f.activity.add_kernel("k", KernelWork::kCompute, 120, 150, 1);
  f.activity.delivery.deliver();
  StepRecord r1 = step_record(1, 100, 200);
  ASSERT_TRUE(f.stage->complete(r1, true));
  EXPECT_EQ(r1.kernels.count, 1);
  // the device window of step 1 starts at the later of its host start and step 0's end
  EXPECT_EQ(r1.kernels.window_start_ns, 100);
  EXPECT_EQ(r1.kernels.idle_ns, 20);
  f.activity.drop(7);
  const auto end = nlohmann::json::parse("{" + f.stage->run_end_fields() + "}");
  const auto& k = end["device_activity"]["kernels"];
  EXPECT_EQ(k["records"], 4);
  EXPECT_EQ(k["late_records"], 1);
  EXPECT_EQ(k["outside_step_records"], 1);
  EXPECT_EQ(k["dropped_records"], 7);
  ASSERT_EQ(k["top"].size(), 2u);
  EXPECT_EQ(k["top"][0]["name"], "k");
  EXPECT_EQ(k["top"][0]["count"], 3);
  EXPECT_DOUBLE_EQ(k["top"][0]["total_ms"].get<double>(), 50 / 1e6);
}

TEST(DeviceActivityStage, CountersAverageOverTheStepsDeviceWindowAndOnlyOnSampledSteps) {
  StageFixture f;
  // device windows: step 0 [0,100), step 1 [100,200); one sample straddles the boundary
  f.activity.add_kernel("k", KernelWork::kMatmul, 0, 100, 0);
  f.activity.add_kernel("k", KernelWork::kMatmul, 100, 200, 1);
  f.activity.add_kernel("k", KernelWork::kMatmul, 200, 300, 2);
  f.sampler.add_sample(0, 50, {20, 40});
  f.sampler.add_sample(50, 150, {60, 80});
  f.sampler.add_sample(150, 200, {100, 0});
  f.sampler.add_sample(200, 300, {1, 1});
  f.sampler.lose(3, true);
  f.activity.delivery.deliver();
  f.sampler.delivery.deliver();
  StepRecord r0 = step_record(0, 0, 10, true);
  StepRecord r1 = step_record(1, 10, 20, true);
  StepRecord r2 = step_record(2, 20, 30, false);
  for (StepRecord* r : {&r0, &r1, &r2}) ASSERT_TRUE(f.stage->complete(*r, true));
  ASSERT_TRUE(r0.counters.present);
  EXPECT_DOUBLE_EQ(r0.counters.values[0], 40);  // 50 ns at 20, 50 ns at 60
  EXPECT_DOUBLE_EQ(r0.counters.values[1], 60);
  EXPECT_TRUE(std::isnan(r0.counters.values[2]));
  EXPECT_DOUBLE_EQ(r0.counters.coverage_pct, 100);
  EXPECT_DOUBLE_EQ(r1.counters.values[0], 80);  // 50 ns at 60, 50 ns at 100
  EXPECT_FALSE(r2.counters.present);            // not sampled
  const auto end = nlohmann::json::parse("{" + f.stage->run_end_fields() + "}");
  const auto& c = end["device_activity"]["counters"];
  EXPECT_EQ(c["samples"], 4);
  EXPECT_EQ(c["dropped_samples"], 3);
  EXPECT_EQ(c["overflow"], true);
  EXPECT_EQ(c["sampled_steps"], 2);
  EXPECT_EQ(c["steps_with_counters"], 2);
  EXPECT_EQ(c["unaligned_samples"], 1);  // [200,300) fell in step 2, which was not sampled
}

TEST(DeviceActivityStage, StepTaggedSamplesAndHostWindowsWithoutKernels) {
  Config config;
  fake::FakeCounterSampler sampler;
  DeviceActivityStage stage(config, nullptr, &sampler);  // counters without activity
  sampler.add_sample(0, 0, {55}, /*step=*/1);            // a range over exactly step 1
  sampler.add_sample(0, 100, {10});
  sampler.add_sample(100, 200, {30});
  sampler.delivery.deliver();
  StepRecord r0 = step_record(0, 50, 150, true);
  StepRecord r1 = step_record(1, 150, 160, true);
  r0.activity_begin_ns = r1.activity_begin_ns = -1;  // no activity backend
  ASSERT_TRUE(stage.complete(r0, true));
  ASSERT_TRUE(stage.complete(r1, true));
  EXPECT_FALSE(r0.kernels.present);
  EXPECT_DOUBLE_EQ(r0.counters.values[0], 20);  // the host window [50,150)
  EXPECT_DOUBLE_EQ(r1.counters.values[0], (55.0 * 10 + 30 * 10) / 20);
}

TEST(DeviceActivityStage, SamplesOnAClockTheStepsDoNotShareStayBoundedAndAreCounted) {
  Config config;
  fake::FakeCounterSampler sampler;
  DeviceActivityStage stage(config, nullptr, &sampler);
  const std::int64_t far = std::int64_t{1} << 50;  // never inside a step window
  constexpr int kSamples = 70000;
  for (int i = 0; i < kSamples; ++i) sampler.add_sample(far + i, far + i + 1, {50});
  sampler.delivery.deliver();
  StepRecord r = step_record(0, 0, 100, true);
  r.activity_begin_ns = -1;
  ASSERT_TRUE(stage.complete(r, true));
  EXPECT_FALSE(r.counters.present);
  const auto end = nlohmann::json::parse("{" + stage.run_end_fields() + "}");
  EXPECT_EQ(end["device_activity"]["counters"]["samples"], kSamples);
  EXPECT_EQ(end["device_activity"]["counters"]["unaligned_samples"], kSamples);
}

// ---- diagnoses ----

StepRecord diagnosed(std::int64_t step, double tensor, double dram, double occupancy,
                     std::int64_t matmul_ns, std::int64_t compute_ns, std::int64_t nccl_ns) {
  StepRecord r;
  r.step = step;
  r.step_ns = 100 * kMs;
  r.kernels.present = true;
  r.kernels.compute_ns = compute_ns;
  r.kernels.matmul_ns = matmul_ns;
  r.kernels.nccl_ns = nccl_ns;
  r.kernels.count = 10;
  r.counters.present = true;
  r.counters.values[0] = tensor;
  r.counters.values[1] = dram;
  r.counters.values[2] = occupancy;
  r.counters.values[3] = NAN;
  return r;
}

std::vector<AlertEvent> run_detector(const Config& config, const std::vector<StepRecord>& steps) {
  DeviceDiagnosisDetector d(config);
  std::vector<AlertEvent> out;
  for (const auto& r : steps) d.observe(r, out);
  return out;
}

Config diagnosis_config() {
  Config c;
  c.warmup_steps = 2;
  c.regression_min_steps = 3;
  return c;
}

TEST(DeviceDiagnosis, LowTensorCoreOnMatmulDominatedStepsFiresOncePerEpisode) {
  std::vector<StepRecord> steps;
  for (int i = 0; i < 10; ++i) steps.push_back(diagnosed(i, 20, 30, 80, 80 * kMs, 90 * kMs, 0));
  for (int i = 10; i < 14; ++i) steps.push_back(diagnosed(i, 75, 30, 80, 80 * kMs, 90 * kMs, 0));
  const auto out = run_detector(diagnosis_config(), steps);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].type, "low_tensor_core");
  EXPECT_EQ(out[0].step, 4);  // steps 2, 3, 4 after the 2 warmup steps
  EXPECT_DOUBLE_EQ(out[0].value, 20);
  EXPECT_DOUBLE_EQ(out[0].threshold, 60);
  EXPECT_NE(out[0].message.find("bf16"), std::string::npos);
  EXPECT_TRUE(out[1].resolved);
  EXPECT_EQ(out[1].step, 12);
  EXPECT_EQ(out[1].first_step, 2);
}

TEST(DeviceDiagnosis, LowTensorActivityIsFineWhenMatmulsDoNotDominate) {
  std::vector<StepRecord> steps;
  for (int i = 0; i < 10; ++i) steps.push_back(diagnosed(i, 5, 30, 80, 10 * kMs, 90 * kMs, 0));
  EXPECT_TRUE(run_detector(diagnosis_config(), steps).empty());
}

TEST(DeviceDiagnosis, MemoryBoundNeedsLowOccupancyAndHighDram) {
  std::vector<StepRecord> steps;
  for (int i = 0; i < 6; ++i) steps.push_back(diagnosed(i, 0, 90, 40, 0, 90 * kMs, 0));
  auto out = run_detector(diagnosis_config(), steps);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].type, "memory_bound");
  EXPECT_DOUBLE_EQ(out[0].value, 90);
  steps.clear();
  for (int i = 0; i < 6; ++i) steps.push_back(diagnosed(i, 0, 90, 70, 0, 90 * kMs, 0));
  EXPECT_TRUE(run_detector(diagnosis_config(), steps).empty());  // occupancy is fine
}

TEST(DeviceDiagnosis, CommBoundWhenNcclTakesOverAQuarterOfTheStep) {
  std::vector<StepRecord> steps;
  for (int i = 0; i < 6; ++i)
    steps.push_back(diagnosed(i, 70, 30, 80, 50 * kMs, 60 * kMs, 30 * kMs));
  auto out = run_detector(diagnosis_config(), steps);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].type, "comm_bound");
  EXPECT_DOUBLE_EQ(out[0].value, 30);
  EXPECT_NE(out[0].message.find("accumulate gradients"), std::string::npos);
  steps.clear();
  for (int i = 0; i < 6; ++i)
    steps.push_back(diagnosed(i, 70, 30, 80, 50 * kMs, 60 * kMs, 20 * kMs));
  EXPECT_TRUE(run_detector(diagnosis_config(), steps).empty());
  // The share is of the step's device window when the kernels give one (a host-clock
  // step time can be far shorter than the device work it launched).
  for (auto& r : steps) {
    r.step_ns = kMs;
    r.kernels.window_start_ns = 0;
    r.kernels.window_end_ns = 50 * kMs;
  }
  out = run_detector(diagnosis_config(), steps);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_DOUBLE_EQ(out[0].value, 40);
}

// ---- through the profiler ----

struct ProfilerFixture {
  explicit ProfilerFixture(const TempDir& tmp, int counter_every = 2) {
    Config config = testing::run_config(tmp);
    config.clock = "host";
    config.counter_every = counter_every;
    config.top_kernels = 2;
    Backends b;
    clock = testing::install(std::make_unique<fake::FakeClock>(), b.clock);
    activity = testing::install(std::make_unique<fake::FakeKernelActivity>(), b.kernel_activity);
    sampler = testing::install(std::make_unique<fake::FakeCounterSampler>(), b.counter_sampler);
    activity->delivery.auto_deliver = true;
    sampler->delivery.auto_deliver = true;
    prof = std::make_unique<Profiler>(config, RunInfo{}, std::move(b));
  }
  // One step of 10 ms host time whose device work is a gemm, an all-reduce and a relu.
  void step() {
    const std::int64_t t = clock->now_ns();
    activity->clock_ns = t;
    sampler->clock_ns = t;
    auto s = prof->step();
    activity->add_kernel("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn", KernelWork::kMatmul,
                         t + 1 * kMs, t + 6 * kMs);
    activity->add_kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", KernelWork::kCommunication,
                         t + 5 * kMs, t + 8 * kMs);
    activity->add_kernel("relu", KernelWork::kCompute, t + 8 * kMs, t + 9 * kMs);
    sampler->add_sample(t, t + 10 * kMs, {42, 17, 65, 30});
    clock->advance(10 * kMs);
    activity->clock_ns = clock->now_ns();
    sampler->clock_ns = clock->now_ns();
  }
  fake::FakeClock* clock;
  fake::FakeKernelActivity* activity;
  fake::FakeCounterSampler* sampler;
  std::unique_ptr<Profiler> prof;
};

TEST(ProfilerDeviceActivity, StepRecordsCarryKernelsAndCountersOnSampledSteps) {
  TempDir tmp;
  ProfilerFixture f(tmp);
  for (int i = 0; i < 4; ++i) f.step();
  f.prof->close();
  EXPECT_EQ(f.activity->finish_calls, 1);
  EXPECT_EQ(f.sampler->sampled_steps, (std::vector<std::int64_t>{0, 2}));
  const auto records = read_jsonl(f.prof->log_path());
  const auto start = of_kind(records, "run_start").at(0);
  EXPECT_EQ(start["backends"]["kernel_activity"]["active"][0], "fake");
  EXPECT_EQ(start["backends"]["counters"]["metrics"]["tensor_active_pct"],
            "fake__metric_tensor_active_pct");
  EXPECT_EQ(start["config"]["counter_every"], 2);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 4u);
  for (const auto& s : steps) {
    const auto& k = s.at("kernels");
    EXPECT_EQ(k["count"], 3);
    EXPECT_DOUBLE_EQ(k["matmul_ms"].get<double>(), 5);
    EXPECT_DOUBLE_EQ(k["compute_ms"].get<double>(), 6);  // gemm [1,6) + relu [8,9)
    EXPECT_DOUBLE_EQ(k["nccl_ms"].get<double>(), 3);
    EXPECT_DOUBLE_EQ(k["exposed_nccl_ms"].get<double>(), 2);  // [6,8)
    EXPECT_DOUBLE_EQ(k["idle_ms"].get<double>(), 1);          // [0,1) of the window [0,9)
  }
  EXPECT_DOUBLE_EQ(steps[0]["counters"]["tensor_active_pct"].get<double>(), 42);
  EXPECT_DOUBLE_EQ(steps[2]["counters"]["sm_throughput_pct"].get<double>(), 30);
  EXPECT_FALSE(steps[1].contains("counters"));
  const auto end = of_kind(records, "run_end").at(0);
  const auto& top = end["device_activity"]["kernels"]["top"];
  ASSERT_EQ(top.size(), 2u);  // top_kernels = 2
  EXPECT_EQ(top[0]["work"], "matmul");
  EXPECT_EQ(top[0]["count"], 4);
  EXPECT_EQ(top[1]["name"], "ncclDevKernel_AllReduce_Sum_bf16_RING_LL");
  EXPECT_EQ(end["device_activity"]["counters"]["steps_with_counters"], 2);
}

TEST(ProfilerDeviceActivity, YieldsToAnotherProfilerAndResumes) {
  TempDir tmp;
  ProfilerFixture f(tmp);
  f.step();
  f.prof->set_external_profiler(true);
  f.step();
  f.prof->set_external_profiler(false);
  f.step();
  f.prof->close();
  const auto steps = of_kind(read_jsonl(f.prof->log_path()), "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_TRUE(steps[0].contains("kernels"));
  EXPECT_FALSE(steps[1].contains("kernels"));  // torch.profiler had the activity records
  EXPECT_TRUE(steps[2].contains("kernels"));
}

TEST(ProfilerDeviceActivity, WithoutACudaDeviceRunStartSaysWhyBothAreUnavailable) {
  TempDir tmp;
  Config config;
  config.log_dir = tmp.str("run");
  config.rank = 0;
  config.world_size = 1;
  config.clock = "host";
  {
    Profiler p(config);
    p.close();
  }
  const auto start = of_kind(read_jsonl(tmp.str("run/rank0.jsonl")), "run_start").at(0);
  for (const char* b : {"kernel_activity", "counters"}) {
    const auto& entry = start["backends"][b];
    EXPECT_TRUE(entry["active"].empty()) << b;
    const std::string why = entry["unavailable"]["cupti"];
    EXPECT_NE(why.find("CUDA event timing"), std::string::npos) << why;
    EXPECT_NE(why.find("clock=\"host\""), std::string::npos) << why;
  }
  config.overwrite = true;
  config.kernel_activity = "off";
  config.counters = "off";
  {
    Profiler p(config);
    p.close();
  }
  const auto off = of_kind(read_jsonl(tmp.str("run/rank0.jsonl")), "run_start").at(0);
  EXPECT_EQ(off["backends"]["counters"]["unavailable"]["cupti"], "disabled by counters=\"off\"");
}

}  // namespace
}  // namespace steptrace::detail
