// CUDA-event timing rules, on the fake device: lagged resolution, the in-flight bound,
// pool reuse, close with pending events, out-of-order completion, stream changes, and a
// device that disappears.
#include <gtest/gtest.h>

#include "backends/fake/fake_backends.hpp"
#include "backends/fake/fake_device_timer.hpp"
#include "device_timing_fixture.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;

using testing::kMs;

// The shared run (device_timing_fixture.hpp) on the FakeDeviceTimer, on stream 42.
struct DeviceFixture : testing::DeviceTimingRun {
  explicit DeviceFixture(const TempDir& tmp, int max_inflight = 8)
      : DeviceFixture(tmp, max_inflight, new fake::FakeDeviceTimer) {}
  fake::FakeDeviceTimer* device;

 private:
  DeviceFixture(const TempDir& tmp, int max_inflight, fake::FakeDeviceTimer* d)
      : DeviceTimingRun(tmp, std::unique_ptr<DeviceTimer>(d), max_inflight, 42,
                        [d](double ms) { d->advance_device(static_cast<std::int64_t>(ms * kMs)); }),
        device(d) {}
};

TEST(DeviceTiming, StepsAreWrittenOnceTheirEventsComplete) {
  TempDir tmp;
  DeviceFixture f(tmp);
  f.step();
  EXPECT_EQ(f.prof->steps_in_flight(), 1u);
  EXPECT_TRUE(f.steps_written().empty());  // the device has not got there yet
  EXPECT_EQ(f.device->syncs, 0);           // and nobody waited for it
  f.device->complete_all();
  f.step();  // the next step polls and writes step 0
  const auto steps = f.steps_written();
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["clock"], "cuda");
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["backward"].get<double>(), 5.0);
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 8.0);
  EXPECT_DOUBLE_EQ(steps[0]["host_phases_ms"]["forward"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(steps[0]["host_ms"].get<double>(), 2.0);
  EXPECT_FALSE(steps[0].contains("waited"));
  EXPECT_EQ(f.device->last_stream, 42u);
  EXPECT_EQ(f.device->syncs, 0);
}

// A step begun late has no events before its begin, and a phase added afterwards none at
// all: their host time is counted into the device times as it is.
TEST(DeviceTiming, AStepBegunLateCountsItsHostLeadAndAddedPhases) {
  TempDir tmp;
  DeviceFixture f(tmp);
  const std::int64_t forward_begin = f.prof->clock_ns();
  f.clock->advance(4 * kMs);
  f.prof->begin_step_at(forward_begin);
  f.prof->add_phase(f.prof->phase_id("forward"), forward_begin, f.prof->clock_ns());
  {
    auto p = f.prof->phase("backward");
    f.clock->advance(1 * kMs);
    f.work(5);
  }
  f.prof->end_step();
  f.device->complete_all();
  f.step();
  const auto steps = f.steps_written();
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["clock"], "cuda");
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["backward"].get<double>(), 5.0);
  EXPECT_DOUBLE_EQ(steps[0]["step_ms"].get<double>(), 9.0);
  EXPECT_DOUBLE_EQ(steps[0]["host_ms"].get<double>(), 5.0);
}

TEST(DeviceTiming, AtTheInFlightBoundTheProfilerWaitsAndSaysSo) {
  TempDir tmp;
  DeviceFixture f(tmp, /*max_inflight=*/2);
  f.step();
  f.step();
  EXPECT_EQ(f.device->syncs, 0);
  f.step();                       // a third step: the oldest must be waited for
  EXPECT_EQ(f.device->syncs, 6);  // on each of the oldest step's six events
  const auto steps = f.steps_written();
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["step"], 0);
  EXPECT_EQ(steps[0]["waited"], true);
  EXPECT_EQ(f.prof->steps_in_flight(), 2u);
}

TEST(DeviceTiming, EventPoolIsReusedWithoutLeaks) {
  TempDir tmp;
  DeviceFixture f(tmp, 4);
  f.device->complete_all(/*from_now_on=*/true);
  for (int i = 0; i < 200; ++i) f.step();
  f.prof->close();
  EXPECT_EQ(f.device->live_events(), 0);
  EXPECT_LE(f.device->pool_size, 6 * 2);  // 6 events a step, at most two steps at once
  EXPECT_EQ(of_kind(read_jsonl(f.path), "step").size(), 200u);
}

TEST(DeviceTiming, CloseWaitsOnceForPendingSteps) {
  TempDir tmp;
  DeviceFixture f(tmp);
  for (int i = 0; i < 3; ++i) f.step();
  f.prof->close();
  const auto records = read_jsonl(f.path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 3u);
  for (const auto& s : steps) EXPECT_EQ(s["clock"], "cuda");
  EXPECT_EQ(f.device->live_events(), 0);
  EXPECT_EQ(records.back()["kind"], "run_end");
}

TEST(DeviceTiming, LaterStepsCompletingFirstWaitForEarlierOnes) {
  TempDir tmp;
  DeviceFixture f(tmp);
  f.step();  // events 0..5
  f.step();  // events 6..11
  for (int e = 6; e < 12; ++e) f.device->complete(e);
  f.prof->begin_step();  // polls: step 1 is done, step 0 is not
  EXPECT_TRUE(f.steps_written().empty());
  for (int e = 0; e < 6; ++e) f.device->complete(e);
  f.prof->end_step();  // polls again
  const auto steps = f.steps_written();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0]["step"], 0);
  EXPECT_EQ(steps[1]["step"], 1);
}

TEST(DeviceTiming, StreamChangesAndNoStreamMeansHostClock) {
  TempDir tmp;
  DeviceFixture f(tmp);
  f.device->complete_all(true);
  f.step();
  EXPECT_EQ(f.device->last_stream, 42u);
  f.prof->set_stream(7);
  f.step();
  EXPECT_EQ(f.device->last_stream, 7u);
  f.prof->clear_stream();
  const int before = f.device->records;
  f.step();
  EXPECT_EQ(f.device->records, before);  // no events without a stream
  f.prof->close();
  const auto steps = of_kind(read_jsonl(f.path), "step");
  ASSERT_EQ(steps.size(), 3u);
  EXPECT_EQ(steps[1]["clock"], "cuda");
  EXPECT_EQ(steps[1]["stream"], (nlohmann::json{{"id", 7}, {"device", -1}}));  // which was timed
  EXPECT_EQ(steps[2]["clock"], "host");
  EXPECT_FALSE(steps[2].contains("stream"));
}

TEST(DeviceTiming, AStreamSetDuringAStepTimesTheNextStep) {
  // Every event of a step on one stream: the step's own, set when it began.
  TempDir tmp;
  DeviceFixture f(tmp);
  f.device->complete_all(true);
  f.prof->set_stream(7, 0);
  {
    auto s = f.prof->step();
    f.prof->set_stream(8, 1);
    auto p = s.phase("forward");
    EXPECT_EQ(f.device->last_stream, 7u);
    EXPECT_EQ(f.device->last_device, 0);
  }
  { auto s = f.prof->step(); }
  EXPECT_EQ(f.device->last_stream, 8u);
  f.prof->close();
  const auto steps = of_kind(read_jsonl(f.path), "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0]["stream"]["id"], 7);
  EXPECT_EQ(steps[1]["stream"], (nlohmann::json{{"id", 8}, {"device", 1}}));
}

TEST(DeviceTiming, ANegativeDeviceIntervalIsClampedAndCounted) {
  // A timer whose end event reads earlier than its begin (events on one stream complete in
  // order, so only a timer's rounding or clock could do it): written as 0, never negative.
  TempDir tmp;
  DeviceFixture f(tmp);
  f.device->complete_all(true);
  {
    auto s = f.prof->step();
    f.device->advance_device(5 * kMs);
    {
      auto p = s.phase("forward");
      f.device->advance_device(-2 * kMs);
    }
    f.device->advance_device(4 * kMs);
  }
  f.prof->close();
  const auto records = read_jsonl(f.path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["clock"], "cuda");
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 0.0);
  EXPECT_EQ(steps[0]["clamped_intervals"], 1);
  EXPECT_EQ(of_kind(records, "run_end")[0]["device_timing"]["clamped_intervals"], 1);
  EXPECT_EQ(of_kind(records, "run_end")[0]["device_timing"]["steps"], 1);
}

TEST(DeviceTiming, ADeviceThatDisappearsFallsBackToTheHostClock) {
  TempDir tmp;
  DeviceFixture f(tmp);
  f.step();
  f.step();
  f.device->fail();
  f.step();  // the events of this step fail to record
  f.step();
  f.prof->close();
  const auto records = read_jsonl(f.path);
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 4u);  // nothing lost
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(steps[i]["step"], i);
    EXPECT_EQ(steps[i]["clock"], "host");
    EXPECT_DOUBLE_EQ(steps[i]["phases_ms"]["forward"].get<double>(), 1.0);
  }
  const auto alerts = of_kind(records, "alert");
  ASSERT_EQ(alerts.size(), 1u);
  EXPECT_EQ(alerts[0]["type"], "timer_fallback");
  EXPECT_NE(alerts[0]["message"].get<std::string>().find("fake device lost"), std::string::npos);
  EXPECT_EQ(records.back()["reason"], "normal");
  EXPECT_EQ(f.device->live_events(), 0);
}

// Gradient accumulation: 50 micro-batches of forward + backward, 100 phase intervals in
// one step, more than a step's interval list holds. The device is far behind (nothing
// completes on its own), so making room means waiting for the oldest interval.
TEST(DeviceTiming, ManyPhaseIntervalsInOneStepStayOnTheDeviceClock) {
  TempDir tmp;
  DeviceFixture f(tmp, 4);
  {
    auto s = f.prof->step();
    for (int micro = 0; micro < 50; ++micro) {
      {
        auto p = s.phase("forward");
        f.clock->advance(kMs);
        f.device->advance_device(3 * kMs);
      }
      {
        auto p = s.phase("backward");
        f.clock->advance(kMs);
        f.device->advance_device(5 * kMs);
      }
    }
  }
  EXPECT_GT(f.device->syncs, 0);               // it waited (for the oldest intervals) ...
  EXPECT_LE(f.device->pool_size, 2 * 64 + 4);  // ... so the events in use stay bounded
  for (int i = 0; i < 3; ++i) f.step();
  f.prof->close();
  const auto records = read_jsonl(f.path);
  for (const auto& a : of_kind(records, "alert")) EXPECT_NE(a["type"], "timer_fallback") << a;
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 4u);
  EXPECT_EQ(steps[0]["clock"], "cuda");
  EXPECT_EQ(steps[0]["waited"], true);
  EXPECT_NEAR(steps[0]["phases_ms"]["forward"].get<double>(), 150.0, 1e-3);  // 50 x 3 ms
  EXPECT_NEAR(steps[0]["phases_ms"]["backward"].get<double>(), 250.0, 1e-3);
  EXPECT_NEAR(steps[0]["step_ms"].get<double>(), 400.0, 1e-3);
  EXPECT_DOUBLE_EQ(steps[0]["host_phases_ms"]["forward"].get<double>(), 50.0);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(steps[i]["clock"], "cuda") << i;  // later steps too: no run-wide fallback
    EXPECT_DOUBLE_EQ(steps[i]["phases_ms"]["forward"].get<double>(), 3.0);
  }
  EXPECT_EQ(f.device->live_events(), 0);  // every event back in the pool
}

// The same with a device that keeps up: completed intervals are folded, nobody waits.
TEST(DeviceTiming, ManyPhaseIntervalsFoldWithoutWaitingWhenTheDeviceKeepsUp) {
  TempDir tmp;
  DeviceFixture f(tmp, 4);
  f.device->complete_all(/*from_now_on=*/true);
  for (int step = 0; step < 3; ++step) {
    auto s = f.prof->step();
    for (int micro = 0; micro < 100; ++micro) {
      auto p = s.phase("forward");
      f.device->advance_device(2 * kMs);
    }
  }
  f.prof->close();
  EXPECT_EQ(f.device->syncs, 0);
  EXPECT_EQ(f.device->live_events(), 0);
  EXPECT_LE(f.device->pool_size, 2 * (2 * 64 + 2));
  const auto records = read_jsonl(f.path);
  EXPECT_TRUE(of_kind(records, "alert").empty());
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 3u);
  for (const auto& st : steps) {
    EXPECT_EQ(st["clock"], "cuda");
    EXPECT_FALSE(st.contains("waited"));
    EXPECT_NEAR(st["phases_ms"]["forward"].get<double>(), 200.0, 1e-3);
  }
}

// A device lost while a long step's intervals are being folded is a device error (the
// run falls back, once), and every event goes back to the pool exactly once.
TEST(DeviceTiming, ADeviceLostWhileFoldingIntervalsReleasesEachEventOnce) {
  TempDir tmp;
  DeviceFixture f(tmp, 4);
  {
    auto s = f.prof->step();  // event 0; interval k: events 2k+1 and 2k+2
    for (int k = 0; k < 65; ++k) {
      if (k == 64) {
        for (int e = 1; e <= 20; ++e) f.device->complete(e);  // the first 10 intervals
        f.device->fail_after_queries(10);  // 5 of them fold, then the device is lost
      }
      auto p = s.phase("forward");
      f.clock->advance(kMs);
    }
  }
  f.step();
  f.prof->close();
  EXPECT_EQ(f.device->live_events(), 0);
  const auto records = read_jsonl(f.path);
  const auto alerts = of_kind(records, "alert");
  ASSERT_EQ(alerts.size(), 1u);
  EXPECT_EQ(alerts[0]["type"], "timer_fallback");
  const auto steps = of_kind(records, "step");
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0]["clock"], "host");
  EXPECT_DOUBLE_EQ(steps[0]["phases_ms"]["forward"].get<double>(), 65.0);
}

// A stream source that hands out a given stream (on device 3), or none.
class ScriptedStreams final : public StreamSource {
 public:
  explicit ScriptedStreams(std::vector<std::uintptr_t>* script) : script_(script) {}
  bool current(DeviceStream* stream) noexcept override {
    if (script_->empty()) return false;
    *stream = DeviceStream{script_->front(), 3};
    script_->erase(script_->begin());
    return stream->handle != 0;
  }

 private:
  std::vector<std::uintptr_t>* script_;
};

TEST(DeviceTiming, AStreamSourceIsAskedAtEveryStep) {
  TempDir tmp;
  std::vector<std::uintptr_t> script = {11, 12, 0};  // 0: no device stream for that step
  Config config;
  config.log_dir = tmp.str("run");
  Backends backends;
  auto d = std::make_unique<fake::FakeDeviceTimer>();
  auto* device = d.get();
  device->complete_all(true);
  backends.device_timer = std::move(d);
  backends.stream_source = std::make_unique<ScriptedStreams>(&script);
  Profiler prof(config, RunInfo{}, std::move(backends));
  std::vector<std::uintptr_t> seen;
  for (int i = 0; i < 3; ++i) {
    const int before = device->records;
    { auto s = prof.step(); }
    seen.push_back(device->records > before ? device->last_stream : 0);
  }
  EXPECT_EQ(seen, (std::vector<std::uintptr_t>{11, 12, 0}));
  prof.close();
  const auto steps = of_kind(read_jsonl(prof.log_path()), "step");
  EXPECT_EQ(steps[1]["clock"], "cuda");
  EXPECT_EQ(steps[1]["stream"], (nlohmann::json{{"id", 12}, {"device", 3}}));
  EXPECT_EQ(steps[2]["clock"], "host");
}

TEST(DeviceTiming, RunStartNamesTheTimerAndDevice) {
  TempDir tmp;
  DeviceFixture f(tmp);
  f.prof->close();
  const auto start = read_jsonl(f.path).front();
  EXPECT_EQ(start["backends"]["timer"]["active"][0], "fake");
  EXPECT_EQ(start["device"]["name"], "Fake GPU");
  EXPECT_EQ(start["device"]["memory_total_bytes"], 80LL << 30);
}

TEST(DeviceTiming, WithoutADriverTheRealTimerSaysWhy) {
  std::string why;
  auto timer = make_cuda_timer(&why);
  if (timer) GTEST_SKIP() << "a CUDA driver is present";
  EXPECT_FALSE(why.empty());
  TempDir tmp;
  Config config;
  config.log_dir = tmp.str();
  config.clock = "cuda";
  try {
    Profiler p(config);
    FAIL() << "clock=cuda without CUDA must be a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
  config.clock = "auto";
  std::string path;
  {
    Profiler p(config);
    p.set_stream(1);  // no device: ignored
    auto s = p.step();
    path = p.log_path();
  }
  const auto records = read_jsonl(path);
  EXPECT_EQ(records.front()["backends"]["timer"]["unavailable"]["cuda"], why);
  EXPECT_EQ(of_kind(records, "step")[0]["clock"], "host");
}

}  // namespace
}  // namespace steptrace
