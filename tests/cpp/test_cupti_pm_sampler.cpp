// The CUPTI PM sampler: without a GPU it must refuse cleanly with a one-line reason; its
// pure parts (when sampling runs, which metric feeds which counter, the start/stop
// hand-off between the training and decode threads) are tested here on any machine. The
// sampling itself needs a GPU: GpuPmSampling runs only where /dev/nvidiactl exists.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/cupti/pm_sampling_logic.hpp"
#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/metrics.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using detail::cupti::CounterMap;
using detail::cupti::map_counters;
using detail::cupti::SamplingSchedule;
using detail::cupti::StartStopHandoff;

bool has_nvidia_device() { return access("/dev/nvidiactl", F_OK) == 0; }

bool cupti_missing(const std::string& why) {
  return why.rfind("libcupti could not be loaded", 0) == 0 ||
         why.rfind("built without CUPTI headers", 0) == 0;
}

// ---- no GPU: a clear refusal ----

TEST(CuptiPmSampler, WithoutAGpuItRefusesNamingTheDriverOrGpu) {
  if (has_nvidia_device()) GTEST_SKIP() << "an NVIDIA device is present: see GpuPmSampling";
  for (int device : {-1, 0, 3}) {
    std::string why;
    auto sampler = make_cupti_counter_sampler(device, &why);
    EXPECT_EQ(sampler, nullptr) << "device " << device;
    ASSERT_FALSE(why.empty());
    if (device < 0) std::printf("reason: %s\n", why.c_str());
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
    if (cupti_missing(why)) continue;  // no libcupti at all: that reason stands
    EXPECT_NE(why.find("no usable CUDA driver or GPU"), std::string::npos) << why;
    EXPECT_NE(why.find("cuptiProfilerInitialize"), std::string::npos) << why;
    if (device < 0) {
      EXPECT_NE(why.find("device 0 (no current CUDA context"), std::string::npos) << why;
    } else {
      EXPECT_NE(why.find("device " + std::to_string(device) + " (as configured)"),
                std::string::npos)
          << why;
    }
  }
}

TEST(CuptiPmSampler, NullReasonPointerIsAccepted) {
  if (has_nvidia_device()) GTEST_SKIP() << "an NVIDIA device is present";
  EXPECT_EQ(make_cupti_counter_sampler(-1, nullptr), nullptr);
}

// ---- with a GPU: a real session over a few steps (no CUDA work of its own) ----

TEST(CuptiPmSampler, GpuPmSampling) {
  if (!has_nvidia_device()) GTEST_SKIP() << "no NVIDIA device";
  std::string why;
  auto sampler = make_cupti_counter_sampler(-1, &why);
  if (sampler == nullptr) GTEST_SKIP() << "PM sampling unavailable here: " << why;
  EXPECT_STREQ(sampler->name(), "cupti_pm_sampling");
  EXPECT_EQ(sampler->status(), "");
  EXPECT_FALSE(sampler->metric(0).empty());  // tensor_active_pct is required
  EXPECT_EQ(sampler->metric(kCounterCount), "");
  const std::int64_t t0 = sampler->now_ns();
  for (std::int64_t step = 0; step < 4; ++step) {
    sampler->begin_step(step, step == 1);
    sampler->end_step(step);
  }
  const std::uint64_t before = sampler->deliveries();
  sampler->finish();
  EXPECT_GT(sampler->deliveries(), before) << "finish decodes once more";
  std::vector<CounterSample> samples;
  std::int64_t dropped = 0;
  bool overflow = false;
  sampler->take(samples, &dropped, &overflow);
  EXPECT_FALSE(overflow);
  EXPECT_EQ(dropped, 0);
  for (const auto& s : samples) {
    EXPECT_EQ(s.step, -1);
    EXPECT_LE(s.start_ns, s.end_ns);
  }
  std::printf("%zu samples; first start - t0 = %lld ns; status: %s\n", samples.size(),
              samples.empty() ? 0LL : static_cast<long long>(samples.front().start_ns - t0),
              sampler->status().c_str());
  sampler->finish();  // idempotent
}

// ---- when sampling runs ----

std::vector<bool> run_schedule(const std::vector<bool>& sampled) {
  SamplingSchedule s;
  std::vector<bool> running;
  for (std::size_t step = 0; step < sampled.size(); ++step) {
    running.push_back(s.begin_step(static_cast<std::int64_t>(step), sampled[step]));
  }
  return running;
}

TEST(SamplingSchedule, StartsAtTheSampledStepAndStopsThreeStepsLater) {
  //                            0      1      2     3      4      5      6      7
  const auto running = run_schedule({false, false, true, false, false, false, false, false});
  EXPECT_EQ(running, (std::vector<bool>{false, false, true, true, true, false, false, false}));
}

TEST(SamplingSchedule, ASampledStepWithinTheTailKeepsItRunning) {
  //                            0     1      2     3      4      5      6      7
  const auto running = run_schedule({true, false, true, false, false, false, true, false});
  EXPECT_EQ(running, (std::vector<bool>{true, true, true, true, true, false, true, true}));
}

TEST(SamplingSchedule, NothingSampledNeverRuns) {
  EXPECT_EQ(run_schedule({false, false, false}), (std::vector<bool>{false, false, false}));
}

TEST(SamplingSchedule, EveryStepSampledRunsThroughout) {
  EXPECT_EQ(run_schedule({true, true, true, true}), (std::vector<bool>(4, true)));
}

// ---- the first failure after setup ----

TEST(FirstFailure, KeepsTheFirstCallAndItsResult) {
  detail::cupti::FirstFailure f;
  EXPECT_FALSE(f.failed());
  EXPECT_EQ(f.call(), nullptr);
  f.record("cuptiPmSamplingStart", 7);
  f.record("cuptiPmSamplingStop", 999);  // a consequence of the first
  EXPECT_TRUE(f.failed());
  EXPECT_STREQ(f.call(), "cuptiPmSamplingStart");
  EXPECT_EQ(f.result(), 7);
}

// ---- which metric feeds which counter ----

MetricCheck check(const std::string& counter, const std::string& name, bool selected) {
  MetricCheck m;
  m.counter = counter;
  m.name = name;
  m.exists = true;
  m.selected = selected;
  return m;
}

TEST(CounterMap, SelectedMetricsMapToTheirCountersOthersAreLeftOut) {
  MetricSetReport r;
  r.metrics = {
      check("tensor_active_pct", "tensor_a", false), check("tensor_active_pct", "tensor_b", true),
      check("dram_throughput_pct", "dram", true),    check("sm_occupancy_pct", "warps", true),
      check("sm_cycles_active", "cycles", true),  // a normaliser: no counter
      check("sm_throughput_pct", "smthr", false)};
  const CounterMap map = map_counters(r);
  EXPECT_EQ(map.metrics, (std::vector<std::string>{"tensor_b", "dram", "warps"}));
  EXPECT_EQ(map.counter, (std::vector<std::size_t>{0, 1, 2}));
  EXPECT_EQ(map.metric_of[0], "tensor_b");
  EXPECT_EQ(map.metric_of[3], "");

  const double evaluated[] = {41.5, 12.0, 77.25};
  double values[kCounterCount] = {};
  map.to_values(evaluated, values);
  EXPECT_DOUBLE_EQ(values[0], 41.5);
  EXPECT_DOUBLE_EQ(values[1], 12.0);
  EXPECT_DOUBLE_EQ(values[2], 77.25);
  EXPECT_TRUE(std::isnan(values[3])) << "sm_throughput_pct is not measured";
}

TEST(CounterMap, CounterOrderFollowsKCounterNamesNotTheReport) {
  MetricSetReport r;
  r.metrics = {check("sm_throughput_pct", "smthr", true), check("dram_throughput_pct", "d", true)};
  const CounterMap map = map_counters(r);
  EXPECT_EQ(map.counter, (std::vector<std::size_t>{3, 1}));
  const double evaluated[] = {5.0, 6.0};
  double values[kCounterCount] = {};
  map.to_values(evaluated, values);
  EXPECT_DOUBLE_EQ(values[3], 5.0);
  EXPECT_DOUBLE_EQ(values[1], 6.0);
  EXPECT_TRUE(std::isnan(values[0]));
  EXPECT_TRUE(std::isnan(values[2]));
}

TEST(CounterMap, TheRealGh100SetFeedsTheRequiredCounters) {
  const MetricSetReport r = check_metric_set("GH100", "pm_sampling");
  if (!r.error.empty()) GTEST_SKIP() << "CUPTI host API unavailable: " << r.error;
  const CounterMap map = map_counters(r);
  const auto selected = r.selected();
  for (std::size_t c = 0; c < 3; ++c) {
    EXPECT_FALSE(map.metric_of[c].empty()) << kCounterNames[c];
    EXPECT_NE(std::find(selected.begin(), selected.end(), map.metric_of[c]), selected.end());
  }
  EXPECT_LT(map.metrics.size(), selected.size()) << "the normalisers are not configured";
}

// ---- the start/stop hand-off ----

struct Recorder {
  std::vector<bool>* calls;
  bool succeed = true;
  bool operator()(bool run) const {
    calls->push_back(run);
    return succeed ? run : !run;
  }
};

TEST(StartStopHandoff, AppliesAtOnceWhenNobodyHoldsTheObject) {
  StartStopHandoff h;
  std::vector<bool> calls;
  h.request(true, Recorder{&calls});
  EXPECT_EQ(calls, (std::vector<bool>{true}));
  EXPECT_TRUE(h.running());
  h.request(true, Recorder{&calls});  // already running: no call
  h.request(false, Recorder{&calls});
  EXPECT_EQ(calls, (std::vector<bool>{true, false}));
  EXPECT_FALSE(h.running());
}

TEST(StartStopHandoff, ARequestWhileHeldIsAppliedByTheHolderOnUnlock) {
  StartStopHandoff h;
  std::vector<bool> calls;
  h.lock();                           // the decode thread is decoding
  h.request(true, Recorder{&calls});  // the training thread must not wait
  EXPECT_TRUE(calls.empty());
  EXPECT_TRUE(h.wanted());
  h.unlock(Recorder{&calls});
  EXPECT_EQ(calls, (std::vector<bool>{true}));
  EXPECT_TRUE(h.running());
}

TEST(StartStopHandoff, OnAndOffWhileHeldCancelOut) {
  StartStopHandoff h;
  std::vector<bool> calls;
  h.lock();
  h.request(true, Recorder{&calls});
  h.request(false, Recorder{&calls});
  h.unlock(Recorder{&calls});
  EXPECT_TRUE(calls.empty());
  EXPECT_FALSE(h.running());
}

TEST(StartStopHandoff, AFailedStartIsNotRetriedUntilAskedAgain) {
  StartStopHandoff h;
  std::vector<bool> calls;
  h.request(true, Recorder{&calls, false});
  EXPECT_EQ(calls, (std::vector<bool>{true}));  // one attempt, no spinning
  EXPECT_FALSE(h.running());
  h.lock();
  h.unlock(Recorder{&calls, false});  // the next decode pass tries once more
  EXPECT_EQ(calls, (std::vector<bool>{true, true}));
}

TEST(StartStopHandoff, ConcurrentRequestsAndDecodesNeverOverlapAndEndInTheLastWish) {
  StartStopHandoff h;
  std::atomic<int> inside{0};
  std::atomic<int> overlaps{0};
  std::atomic<bool> done{false};
  auto apply = [&](bool run) {
    if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
    inside.fetch_sub(1);
    return run;
  };
  std::thread decoder([&] {
    while (!done.load()) {
      h.lock();
      if (inside.fetch_add(1) != 0) overlaps.fetch_add(1);
      inside.fetch_sub(1);
      h.unlock(apply);
    }
  });
  for (int i = 0; i < 200000; ++i) h.request(i % 3 != 0, apply);
  h.request(true, apply);
  done.store(true);
  decoder.join();
  EXPECT_EQ(overlaps.load(), 0);
  h.lock();
  EXPECT_TRUE(h.running()) << "the last wish (run) was lost";
  h.unlock(apply);
}

TEST(PeriodicThread, LeavesTheProcessesSignalsToTheProgramsThreads) {
  // the PM sampler's decoder: a SIGTERM sent to the process must reach one of the
  // program's threads (as the profiler's own threads, test_profiler.cpp)
  std::thread([] {}).join();  // a sanitizer's own background thread, if any, starts now
  const std::set<std::string> before = testing::thread_ids();
  detail::cupti::PeriodicThread thread;
  thread.start(std::chrono::hours(1), [] {});
  const auto masks = testing::masks_of_started_threads(before);
  ASSERT_EQ(masks.size(), 1U);
  testing::expect_signals_left_to_the_program(masks);
  thread.stop();
}

}  // namespace
}  // namespace steptrace
