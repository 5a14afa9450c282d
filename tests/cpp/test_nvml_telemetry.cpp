// The pure parts of GPU telemetry: per-step figures from readings, throttle names, and
// the detectors on synthetic timelines.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/telemetry_stage.hpp"
#include "steptrace/error.hpp"
#include "steptrace/ext/telemetry.hpp"

namespace steptrace::detail {
namespace {

constexpr std::int64_t kS = 1'000'000'000;

TelemetrySample reading(std::int64_t t_ns, double power_w, double energy_j, double temp_c = 60,
                        std::uint64_t reasons = 0) {
  TelemetrySample s;
  s.t_ns = t_ns;
  s.power_w = power_w;
  s.energy_j = energy_j;
  s.temp_c = temp_c;
  s.sm_clock_mhz = 1980;
  s.throttle_reasons = reasons;
  return s;
}

TEST(HwStats, WeighsReadingsByTheirPeriodAndTakesEnergyFromTheCounter) {
  // readings every second; each stands for the second before it
  std::vector<TelemetrySample> s = {reading(0, 500, 1000), reading(1 * kS, 600, 1600),
                                    reading(2 * kS, 400, 2000, 70), reading(3 * kS, 700, 2700)};
  // the step spans [0.5 s, 2.5 s]: half of 600 W's period, all of 400 W's... and half of 700 W's
  const HwStats h = hw_stats(s, kS / 2, 5 * kS / 2, 0, 700);
  ASSERT_TRUE(h.present);
  EXPECT_NEAR(h.avg_power_w, (0.5 * 600 + 1 * 400 + 0.5 * 700) / 2.0, 1e-9);
  EXPECT_DOUBLE_EQ(h.min_power_w, 400);
  EXPECT_DOUBLE_EQ(h.max_temp_c, 70);
  // counter interpolated at 0.5 s (1300 J) and 2.5 s (2350 J)
  EXPECT_NEAR(h.energy_j, 1050, 1e-9);
  EXPECT_DOUBLE_EQ(h.max_drop_w, 200);  // 600 -> 400
  EXPECT_EQ(h.samples, 3);
  EXPECT_DOUBLE_EQ(h.power_limit_w, 700);
}

TEST(HwStats, AbsentBeforeAnyReadingAndPowerTimesTimeWithoutACounter) {
  std::vector<TelemetrySample> s = {reading(kS, 300, NAN)};
  EXPECT_FALSE(hw_stats(s, 2 * kS, 3 * kS, 0, 0).present);  // nothing after the start
  const HwStats h = hw_stats(s, 0, kS, 0, 0);
  ASSERT_TRUE(h.present);
  EXPECT_NEAR(h.energy_j, 300, 1e-9);
}

TEST(HwStats, OptionalReadingsAreMeansOrLeftOutWhereTheDeviceLacksThem) {
  std::vector<TelemetrySample> s = {reading(0, 500, 1000), reading(kS, 500, 1500),
                                    reading(2 * kS, 500, 2000)};
  s[1].pcie_tx_mb_s = 1000;
  s[2].pcie_tx_mb_s = 3000;
  s[1].mem_temp_c = 70;
  s[2].mem_temp_c = 74;
  const HwStats h = hw_stats(s, 0, 2 * kS, 0, 700);
  EXPECT_DOUBLE_EQ(h.pcie_tx_mb_s, 2000);
  EXPECT_DOUBLE_EQ(h.max_mem_temp_c, 74);
  EXPECT_TRUE(std::isnan(h.pcie_rx_mb_s));  // never read: absent from the record
  EXPECT_TRUE(std::isnan(h.mem_clock_mhz));
}

TEST(ThrottleReasons, NamesTheSetBits) {
  EXPECT_EQ(throttle_reason_names(0), std::vector<std::string>{});
  EXPECT_EQ(throttle_reason_names(kThrottleSwPowerCap | kThrottleHwThermal),
            (std::vector<std::string>{"sw_power_cap", "hw_thermal_slowdown"}));
  EXPECT_EQ(throttle_reason_names(1ULL << 40), std::vector<std::string>{"reason_0x10000000000"});
}

// A run of one-second steps with the given per-step figures through the detector.
struct Timeline {
  Config config;
  std::vector<AlertEvent> events;
  TelemetryDetector detector{config};
  std::int64_t step = 0;
  double limit_w = 700;
  std::int64_t data_ns = 0;          // the loader's wait before each step
  std::int64_t comm_exposed_ns = 0;  // each step's exposed communication (host-timed)
  std::int64_t step_ns = kS;
  Timeline() { config.warmup_steps = 2; }
  void add(double power_w, double temp_c, double drop_w = 0, std::uint64_t reasons = 0,
           double sm_throughput_pct = std::numeric_limits<double>::quiet_NaN()) {
    StepRecord r;
    if (!std::isnan(sm_throughput_pct)) {  // CUPTI counters for this step
      r.counters.present = true;
      for (double& v : r.counters.values) v = std::numeric_limits<double>::quiet_NaN();
      r.counters.values[3] = sm_throughput_pct;
    }
    r.step = step;
    r.step_ns = step_ns;
    r.host_ns = kS;
    r.data_ns = data_ns;
    r.comm.exposed_ns = comm_exposed_ns;
    r.telemetry_begin_ns = step * kS;
    r.telemetry_end_ns = (step + 1) * kS;
    r.hw.present = true;
    r.hw.avg_power_w = power_w;
    r.hw.min_power_w = power_w;
    r.hw.max_temp_c = temp_c;
    r.hw.max_drop_w = drop_w;
    r.hw.power_limit_w = limit_w;
    r.hw.throttle_reasons = reasons;
    r.hw.sm_clock_mhz = 1980;
    ++step;
    detector.observe(r, events);
  }
  std::vector<std::string> alerts() const {
    std::vector<std::string> out;
    for (const auto& e : events) {
      if (!e.resolved) out.push_back(e.type);
    }
    return out;
  }
};

TEST(TelemetryDetector, SteadyTrainingRaisesNothing) {
  Timeline run;
  for (int i = 0; i < 300; ++i) run.add(650 + (i % 5) - 2, 65 + (i % 2), 4);
  EXPECT_TRUE(run.events.empty());
}

TEST(TelemetryDetector, PowerLowOnlyOnceSustained) {
  Timeline run;
  for (int i = 0; i < 10; ++i) run.add(650, 65);
  for (int i = 0; i < 29; ++i) run.add(400, 65);  // 29 s below 490 W: not yet
  EXPECT_TRUE(run.events.empty());
  for (int i = 0; i < 20; ++i) run.add(400, 65);
  ASSERT_EQ(run.alerts(), std::vector<std::string>{"power_low"});
  EXPECT_EQ(run.events[0].step, 39);
  EXPECT_DOUBLE_EQ(run.events[0].threshold, 490);
  EXPECT_NE(run.events[0].message.find("batch-size bound"), std::string::npos);
  run.add(650, 65);
  ASSERT_EQ(run.events.size(), 2u);
  EXPECT_TRUE(run.events[1].resolved);
  EXPECT_EQ(run.events[1].repeats, 19);
}

// The cause comes from the step's own split: data wait over 20% of the iteration, else
// exposed communication over comm_bound_pct (25%) of the step, else the batch size.
TEST(TelemetryDetector, PowerLowNamesTheDataPipelineOrCommunicationFromThePhaseSplit) {
  const auto bound_of = [](std::int64_t data_ns, std::int64_t comm_ns, double data_pct = 20) {
    Timeline run;
    run.config.power_low_data_pct = data_pct;
    run.data_ns = data_ns;
    run.comm_exposed_ns = comm_ns;
    for (int i = 0; i < 10; ++i) run.add(650, 65);
    for (int i = 0; i < 40; ++i) run.add(400, 65);
    EXPECT_EQ(run.alerts(), std::vector<std::string>{"power_low"});
    return run.events.empty() ? std::string() : run.events[0].details.value("bound", "");
  };
  EXPECT_EQ(bound_of(kS / 2, 0), "data-pipeline");      // 1/3 of the iteration waits on data
  EXPECT_EQ(bound_of(kS / 5, 0), "batch-size");         // 1/6: below 20%
  EXPECT_EQ(bound_of(kS / 5, 0, 10), "data-pipeline");  // configurable
  EXPECT_EQ(bound_of(0, kS * 3 / 10), "communication");
  EXPECT_EQ(bound_of(0, kS / 5), "batch-size");               // 20% < comm_bound_pct
  EXPECT_EQ(bound_of(kS / 2, kS * 3 / 10), "data-pipeline");  // the loader is named first
  Config bad;
  bad.power_low_data_pct = 0;
  EXPECT_THROW(bad.validate(), ConfigError);
}

TEST(TelemetryDetector, PowerLowNeedsIdleSmsWhereCountersSayHowBusyTheyAre) {
  Timeline run;
  for (int i = 0; i < 10; ++i) run.add(650, 65);
  // 60 s at 400 W with the SMs 85% busy (memory-bound work): not a power_low
  for (int i = 0; i < 60; ++i) run.add(400, 65, 0, 0, 85.0);
  EXPECT_TRUE(run.events.empty());
  // the same power with the SMs 20% busy: the episode starts counting now, fires at 30 s
  for (int i = 0; i < 29; ++i) run.add(400, 65, 0, 0, 20.0);
  EXPECT_TRUE(run.events.empty());
  for (int i = 0; i < 5; ++i) run.add(400, 65, 0, 0, 20.0);
  ASSERT_EQ(run.alerts(), std::vector<std::string>{"power_low"});
  EXPECT_EQ(run.events[0].step, 99);
  EXPECT_NE(run.events[0].message.find("SM throughput 20% of peak"), std::string::npos)
      << run.events[0].message;
  EXPECT_EQ(run.events[0].details["sm_throughput_pct"], 20.0);
  // the SMs busy again at the same power: resolved
  run.add(400, 65, 0, 0, 90.0);
  ASSERT_EQ(run.events.size(), 2u);
  EXPECT_TRUE(run.events[1].resolved);
}

TEST(TelemetryDetector, PowerLowSmThresholdIsConfigurable) {
  Timeline run;
  run.config.power_low_sm_pct = 90.0;  // the detector reads the config at each step
  for (int i = 0; i < 10; ++i) run.add(650, 65);
  for (int i = 0; i < 40; ++i) run.add(400, 65, 0, 0, 85.0);
  EXPECT_EQ(run.alerts(), std::vector<std::string>{"power_low"});
  Config bad;
  bad.power_low_sm_pct = 0;
  EXPECT_THROW(bad.validate(), ConfigError);
}

TEST(TelemetryDetector, TemperatureRisingAtTheThreshold) {
  Timeline run;
  // 8 C/min (below 10) for two minutes: nothing
  for (int i = 0; i < 120; ++i) run.add(650, 60 + 8.0 * i / 60.0);
  EXPECT_TRUE(run.events.empty());
  // then 50 C/min (the cooling failure)
  const double base = 60 + 8.0 * 2;
  for (int i = 0; i < 30; ++i) run.add(650, base + 25.0 * i / 30.0);
  EXPECT_EQ(run.alerts(), std::vector<std::string>{"temperature_rising"});
}

TEST(TelemetryDetector, PowerDropUsesTheSmallerOf300WAnd40PercentOfTheLimit) {
  Timeline run;  // a 700 W limit: min(300, 280) = 280 W
  for (int i = 0; i < 10; ++i) run.add(650, 65);
  run.add(650, 65, 270);
  EXPECT_TRUE(run.events.empty());
  run.add(200, 65, 500);
  EXPECT_EQ(run.alerts(), std::vector<std::string>{"power_drop"});
  Timeline small;  // a 300 W card: min(300, 120) = 120 W, which 300 W alone never reaches
  small.limit_w = 300;
  for (int i = 0; i < 10; ++i) small.add(280, 65);
  small.add(270, 65, 100);
  EXPECT_TRUE(small.events.empty());
  small.add(120, 65, 150);
  EXPECT_EQ(small.alerts(), std::vector<std::string>{"power_drop"});
  Timeline big;  // a 1,000 W card: min(300, 400) = 300 W
  big.limit_w = 1000;
  for (int i = 0; i < 10; ++i) big.add(950, 65);
  big.add(650, 65, 310);
  EXPECT_EQ(big.alerts(), std::vector<std::string>{"power_drop"});
  Timeline strict;  // configurable: both bounds raised
  strict.config.power_drop_w = 600;
  strict.config.power_drop_fraction = 0.9;
  for (int i = 0; i < 10; ++i) strict.add(650, 65);
  strict.add(200, 65, 500);
  EXPECT_TRUE(strict.events.empty());
}

TEST(TelemetryDetector, ThrottlesNamedWithTheStepTimeTheyCost) {
  Timeline run;
  for (int i = 0; i < 10; ++i) run.add(650, 65);
  run.add(650, 80, 0, kThrottleHwThermal);
  run.add(650, 80, 0, kThrottleHwThermal);  // same episode
  run.add(650, 65, 0, kThrottleSwPowerCap);
  EXPECT_EQ(run.alerts(), (std::vector<std::string>{"thermal_throttle", "power_throttle"}));
  const AlertEvent& thermal = run.events[0];
  EXPECT_EQ(thermal.details["reasons"][0], "hw_thermal_slowdown");
  ASSERT_TRUE(thermal.baseline.has_value());
  EXPECT_NE(thermal.message.find("+0%"), std::string::npos);
}

TEST(TelemetryDetector, ThrottleCostIsMeasuredAgainstStepsAfterWarmup) {
  Timeline run;           // warmup: 2 steps
  run.step_ns = 10 * kS;  // the first steps compile and allocate: slow, not the baseline
  run.add(650, 65);
  run.add(650, 65);
  run.step_ns = kS;
  for (int i = 0; i < 8; ++i) run.add(650, 65);
  run.step_ns = kS * 3 / 2;  // the throttled step runs 50% longer
  run.add(650, 80, 0, kThrottleHwThermal);
  ASSERT_EQ(run.alerts(), std::vector<std::string>{"thermal_throttle"});
  EXPECT_DOUBLE_EQ(*run.events[0].baseline, 1000.0);
  EXPECT_NE(run.events[0].message.find("+50%"), std::string::npos) << run.events[0].message;
}

TEST(ChainedCompleter, CompletesEachStageOnceAndJoinsRunEndFields) {
  struct Stage final : StepCompleter {
    int completes = 0;
    bool ready = true;
    std::string fields;
    void arrived(StepRecord&) override {}
    bool complete(StepRecord&, bool force) override {
      ++completes;
      return ready || force;
    }
    void finish() noexcept override {}
    std::string run_end_fields() override { return fields; }
  };
  Stage a, b;
  a.fields = "\"a\":1";
  b.fields = "\"b\":2";
  b.ready = false;
  ChainedCompleter chain({&a, &b});
  StepRecord r;
  chain.arrived(r);
  EXPECT_FALSE(chain.complete(r, false));
  EXPECT_FALSE(chain.complete(r, false));
  EXPECT_TRUE(chain.complete(r, true));
  EXPECT_EQ(a.completes, 1);  // not asked again while the second waits
  EXPECT_EQ(b.completes, 3);
  EXPECT_EQ(chain.run_end_fields(), "\"a\":1,\"b\":2");
}

}  // namespace
}  // namespace steptrace::detail
