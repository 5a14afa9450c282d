// The NVML backend's call layer and the profiler's hw records against the fake
// libnvidia-ml (tests/cpp/fake_nvml), loaded through STEPTRACE_NVML_LIBRARY. The source is
// sampled by hand (interval 0) on the profiler's fake clock: one reading per one-second
// step, so every scripted series plays out the same way each run, without waiting.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <thread>

#include <map>
#include <set>
#include <string>

#include "backends/fake/fake_backends.hpp"
#include "backends/nvml/nvml_testing.hpp"
#include "steptrace/ext/telemetry.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;
constexpr std::int64_t kS = 1'000'000'000;

struct ScriptedRun {
  std::vector<nlohmann::json> records;
  std::vector<nlohmann::json> steps() const { return of_kind(records, "step"); }
  std::vector<nlohmann::json> alerts() const { return of_kind(records, "alert"); }
  std::vector<std::string> alert_types() const {
    std::vector<std::string> out;
    for (const auto& a : alerts()) out.push_back(a.at("type"));
    return out;
  }
  const nlohmann::json& first(const std::string& type) const {
    for (const auto& r : records) {
      if (r.at("kind") == "alert" && r.at("type") == type) return r;
    }
    throw std::runtime_error("no " + type + " alert");
  }
};

// `steps` one-second steps of scenario `scenario`, a reading at the end of each. The fake's
// reading 0 is the backend's own check at creation, reading 1 is taken before the first
// step, so step i gets reading i + 2. Alerts reach `on_alert` with the steps done by then.
// With `readings_per_step` n > 1, readings come every 1/n s (of the fake clock and of the
// fake's scripted time) instead: step i gets readings 2 + n i .. 1 + n (i + 1).
ScriptedRun play(const TempDir& tmp, const char* scenario, int steps,
                 std::vector<std::pair<int, std::string>>* on_alert = nullptr,
                 int readings_per_step = 1) {
  setenv("STEPTRACE_NVML_LIBRARY", STEPTRACE_FAKE_NVML_PATH, 1);
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", scenario, 1);
  setenv("STEPTRACE_FAKE_NVML_READING_MS", std::to_string(1000 / readings_per_step).c_str(), 1);
  Config config = testing::run_config(tmp);
  config.warmup_steps = 5;
  Backends backends;
  auto clock = std::make_unique<fake::FakeClock>();
  fake::FakeClock* c = clock.get();
  std::string why;
  auto source = make_nvml_telemetry(0, 0, &why, c);
  unsetenv("STEPTRACE_FAKE_NVML_READING_MS");  // read at nvmlInit_v2, done
  EXPECT_NE(source, nullptr) << why;
  TelemetrySource* nvml = source.get();
  backends.clock = std::move(clock);
  backends.telemetry = std::move(source);
  sample_nvml_now(*nvml);  // the reading before the first step
  Profiler prof(config, RunInfo{}, std::move(backends));
  int done = 0;
  if (on_alert != nullptr) {
    prof.set_alert_callback([&](const std::string& line) {
      on_alert->push_back({done, nlohmann::json::parse(line).at("type")});
    });
  }
  const std::int64_t period_ns = kS / readings_per_step;
  for (int i = 0; i < steps; ++i) {
    {
      auto step = prof.step();
      for (int k = 1; k < readings_per_step; ++k) {
        c->advance(period_ns);
        sample_nvml_now(*nvml);
      }
      c->advance(period_ns);
    }
    done = i + 1;
    sample_nvml_now(*nvml);
  }
  prof.close();
  ScriptedRun run;
  run.records = read_jsonl(prof.log_path());
  return run;
}

TEST(Nvml, UnavailableWithoutTheLibraryOrADevice) {
  std::string why;
  setenv("STEPTRACE_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1", 1);
  EXPECT_EQ(make_nvml_telemetry(-1, 100, &why), nullptr);
  EXPECT_NE(why.find("could not be loaded"), std::string::npos) << why;
  setenv("STEPTRACE_NVML_LIBRARY", STEPTRACE_FAKE_NVML_PATH, 1);
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", "nodevice", 1);
  EXPECT_EQ(make_nvml_telemetry(-1, 100, &why), nullptr);
  EXPECT_NE(why.find("no GPU"), std::string::npos) << why;
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady", 1);
  setenv("CUDA_VISIBLE_DEVICES", "3", 1);
  EXPECT_EQ(make_nvml_telemetry(0, 100, &why), nullptr);  // NVML device 3 does not exist
  EXPECT_NE(why.find("NVML device 3"), std::string::npos) << why;
  unsetenv("CUDA_VISIBLE_DEVICES");

  // the profiler says why in run_start and writes steps without hw
  TempDir tmp;
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", "nodevice", 1);
  Config config = testing::run_config(tmp);
  Profiler prof(config);
  { auto step = prof.step(); }
  prof.close();
  const auto records = read_jsonl(prof.log_path());
  const auto& telemetry = records.front().at("backends").at("telemetry");
  EXPECT_TRUE(telemetry.at("active").empty());
  EXPECT_NE(telemetry.at("unavailable").at("nvml").get<std::string>().find("no GPU"),
            std::string::npos);
  EXPECT_FALSE(of_kind(records, "step").at(0).contains("hw"));
  EXPECT_FALSE(of_kind(records, "run_end").at(0).contains("hw"));
}

TEST(Nvml, SteadyRunHasHwInEveryStepAndRaisesNothing) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "steady", 120);
  const auto& backends = run.records.front().at("backends").at("telemetry");
  EXPECT_EQ(backends.at("active"), nlohmann::json::array({"nvml"}));
  EXPECT_NE(backends.at("device").get<std::string>().find("Fake H100"), std::string::npos);
  EXPECT_EQ(backends.at("power_limit_w"), 700);
  const auto steps = run.steps();
  ASSERT_EQ(steps.size(), 120u);
  for (const auto& s : steps) {
    ASSERT_TRUE(s.contains("hw")) << s.dump();
    const auto& hw = s.at("hw");
    // reading i+1 stands for step i: 650 W +- 2 over one second
    EXPECT_NEAR(hw.at("power_w").get<double>(), 650, 2.01);
    EXPECT_NEAR(hw.at("energy_j").get<double>(), hw.at("power_w").get<double>(), 1e-3);
    EXPECT_EQ(hw.at("min_power_w"), hw.at("power_w"));
    EXPECT_EQ(hw.at("sm_clock_mhz"), 1980);
    EXPECT_GE(hw.at("max_temp_c").get<double>(), 65);
    EXPECT_TRUE(hw.at("throttle_reasons").empty());
    EXPECT_EQ(hw.at("samples"), 1);
    // the optional readings the fake device has: 2,000,000 / 1,000,000 KB/s
    EXPECT_EQ(hw.at("pcie_tx_mb_s"), 2000);
    EXPECT_EQ(hw.at("pcie_rx_mb_s"), 1000);
    // 4 links x 1,000,000 / 500,000 KiB a one-second reading: 4096 / 2048 MB/s, read from
    // the all-links scope (the fake, like the driver, answers each link's scope with the
    // all-links total too: summing the links would read 4x this)
    EXPECT_EQ(hw.at("nvlink_tx_mb_s"), 4096);
    EXPECT_EQ(hw.at("nvlink_rx_mb_s"), 2048);
    EXPECT_EQ(hw.at("mem_clock_mhz"), 2619);
    EXPECT_EQ(hw.at("max_mem_temp_c"), 70);
    EXPECT_EQ(hw.at("util_pct"), 98);
    // device-wide memory from NVML's sampler thread, not a per-step driver call
    EXPECT_EQ(s.at("memory").at("device_used_bytes"), 80LL << 30) << s.dump();
    EXPECT_EQ(s.at("memory").at("device_total_bytes"), 141LL << 30);
  }
  EXPECT_EQ(backends.at("device_memory"), true);
  EXPECT_TRUE(run.alerts().empty()) << run.alerts().front().dump();
  const nlohmann::json hw_end = of_kind(run.records, "run_end").at(0).at("hw");
  EXPECT_EQ(hw_end.at("steps_with_hw"), 120);
  EXPECT_NEAR(hw_end.at("energy_j_per_1000_steps").get<double>(), 650'000, 2'100);
  // the steps cover the run: the counter's rise is the steps' energy
  EXPECT_NEAR(hw_end.at("energy_j").get<double>(), hw_end.at("steps_energy_j").get<double>(), 1);
  // the final error counters: four active links, flat
  EXPECT_EQ(hw_end.at("nvlink_crc_errors"), 4 * 5);
  EXPECT_EQ(hw_end.at("nvlink_replay_errors"), 4 * 7);
  EXPECT_EQ(hw_end.at("remapped_rows"),
            (nlohmann::json{
                {"corrected", 3}, {"uncorrected", 0}, {"pending", false}, {"failure", false}}));
}

TEST(Nvml, SlowPowerSagIsPowerLow) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "sag", 120);
  EXPECT_EQ(run.alert_types(), std::vector<std::string>{"power_low"});
  const auto& a = run.first("power_low");
  // below 490 W from reading 53 (step 51), sustained 30 s later
  EXPECT_EQ(a.at("step"), 80);
  EXPECT_NEAR(a.at("threshold").get<double>(), 490, 1e-9);
  EXPECT_EQ(a.at("baseline"), 700);
}

TEST(Nvml, CoolingFailureIsTemperatureRisingBeforeItPeaks) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "cooling", 80);
  EXPECT_EQ(run.alert_types(), std::vector<std::string>{"temperature_rising"});
  const auto& a = run.first("temperature_rising");
  EXPECT_GT(a.at("value").get<double>(), 10);
  EXPECT_GT(a.at("step").get<int>(), 20);
  EXPECT_LT(a.at("step").get<int>(), 50);  // while the temperature still climbs
  EXPECT_EQ(run.steps().at(60).at("hw").at("max_temp_c"), 85);
}

TEST(Nvml, PowerDrop700To200WIsPowerDrop) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "drop", 60);
  ASSERT_FALSE(run.alert_types().empty());
  EXPECT_EQ(run.alert_types().front(), "power_drop");
  const auto& a = run.first("power_drop");
  EXPECT_EQ(a.at("step"), 38);  // reading 40 is the first at 200 W: step 38's
  EXPECT_EQ(a.at("value"), 500);
  EXPECT_EQ(a.at("threshold"), 280);  // min(300 W, 0.4 x the 700 W limit)
}

// Issue 49: nvmlDeviceGetPowerUsage is a trailing 1 s mean on Hopper, so read every 100 ms
// (the default nvml_interval_ms) the 700 -> 200 W drop falls 50 W a reading for a second and
// never crosses the 280 W threshold. The instantaneous field shows it in one reading.
TEST(Nvml, PowerDropReadEvery100MsIsPowerDropThroughTheInstantaneousField) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "drop", 45, nullptr, 10);
  const auto& telemetry = run.records.front().at("backends").at("telemetry");
  EXPECT_NE(telemetry.at("device").get<std::string>().find("NVML_FI_DEV_POWER_INSTANT"),
            std::string::npos)
      << telemetry.dump();
  ASSERT_FALSE(run.alert_types().empty());
  EXPECT_EQ(run.alert_types().front(), "power_drop");
  const auto& a = run.first("power_drop");
  // reading 391 (39.1 s) is the first at 200 W: the last of step 38's 382..391
  EXPECT_EQ(a.at("step"), 38);
  EXPECT_EQ(a.at("value"), 500);
  EXPECT_EQ(run.steps().at(30).at("hw").at("samples"), 10);
  EXPECT_NEAR(run.steps().at(30).at("hw").at("power_w").get<double>(), 700, 1e-6);
  EXPECT_NEAR(run.steps().at(42).at("hw").at("power_w").get<double>(), 200, 1e-6);
}

// An A100 (GA100) under a driver without the power fields: field 186 answers NOT_SUPPORTED,
// and nvmlDeviceGetPowerUsage, instantaneous on GA100 and older, is read instead.
TEST(Nvml, PowerDropOnAGa100WithoutThePowerFieldsReadsGetPowerUsage) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "drop_ga100", 45, nullptr, 10);
  const auto& telemetry = run.records.front().at("backends").at("telemetry");
  EXPECT_EQ(telemetry.at("active"), nlohmann::json::array({"nvml"}));
  EXPECT_NE(telemetry.at("device").get<std::string>().find("power: nvmlDeviceGetPowerUsage"),
            std::string::npos)
      << telemetry.dump();
  ASSERT_FALSE(run.alert_types().empty());
  EXPECT_EQ(run.alert_types().front(), "power_drop");
  EXPECT_EQ(run.first("power_drop").at("step"), 38);
  EXPECT_EQ(run.first("power_drop").at("value"), 500);
}

// The stand-in itself, as documented: on its H100, nvmlDeviceGetPowerUsage and field 185 are
// the mean over the second before the reading, field 186 the power at the reading; on a
// "_ga100" series GetPowerUsage is the power at the reading and both fields NOT_SUPPORTED.
// "drop" at a reading every 100 ms: 700 W up to 39 s, 200 W after.
struct StandIn {
  struct Field {  // nvmlFieldValue_t
    unsigned field_id, scope_id;
    long long timestamp, latency_usec;
    unsigned value_type;
    int nvml_return;
    union {
      double d;
      unsigned ui;
      unsigned long long ull;
    } value;
  };
  void* lib = dlopen(STEPTRACE_FAKE_NVML_PATH, RTLD_NOW | RTLD_LOCAL);
  int (*init)() = nullptr;
  int (*handle)(unsigned, void**) = nullptr;
  int (*usage)(void*, unsigned*) = nullptr;
  int (*fields)(void*, int, Field*) = nullptr;
  void* dev = nullptr;

  explicit StandIn(const char* scenario) {
    if (lib == nullptr) return;
    init = reinterpret_cast<decltype(init)>(dlsym(lib, "nvmlInit_v2"));
    handle = reinterpret_cast<decltype(handle)>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    usage = reinterpret_cast<decltype(usage)>(dlsym(lib, "nvmlDeviceGetPowerUsage"));
    fields = reinterpret_cast<decltype(fields)>(dlsym(lib, "nvmlDeviceGetFieldValues"));
    setenv("STEPTRACE_FAKE_NVML_SCENARIO", scenario, 1);
    setenv("STEPTRACE_FAKE_NVML_READING_MS", "100", 1);
    if (init != nullptr && init() == 0 && handle != nullptr) handle(0, &dev);
    unsetenv("STEPTRACE_FAKE_NVML_READING_MS");
  }
  ~StandIn() {
    if (lib != nullptr) dlclose(lib);
  }
  bool ok() const { return dev != nullptr && usage != nullptr && fields != nullptr; }
  // GetPowerUsage (field 0) or a field's value, W; -1 when not answered with success
  double read(unsigned field, int* ret = nullptr) {
    if (field == 0) {
      unsigned mw = 0;
      return usage(dev, &mw) == 0 ? mw / 1000.0 : -1;
    }
    Field f{};
    f.field_id = field;
    f.nvml_return = -1;
    if (fields(dev, 1, &f) != 0) return -1;
    if (ret != nullptr) *ret = f.nvml_return;
    return f.nvml_return == 0 && f.value_type == 1 ? f.value.ui / 1000.0 : -1;
  }
};

TEST(Nvml, TheStandInAveragesGetPowerUsageOverTheLastSecondAsNvmlDocumentsForHopper) {
  for (const unsigned field : {0u, 185u}) {  // GetPowerUsage, NVML_FI_DEV_POWER_AVERAGE
    StandIn nvml("drop");
    ASSERT_TRUE(nvml.ok());
    for (long k = 0; k <= 420; ++k) {  // reading k at k x 100 ms
      const double mean = k <= 390   ? 700
                          : k >= 400 ? 200
                                     : 700 - 50.0 * static_cast<double>(k - 390);
      ASSERT_NEAR(nvml.read(field), mean, 1e-3) << "field " << field << ", reading " << k;
    }
  }
  StandIn nvml("drop");  // NVML_FI_DEV_POWER_INSTANT: the drop in one reading
  ASSERT_TRUE(nvml.ok());
  for (long k = 0; k <= 420; ++k) {
    ASSERT_NEAR(nvml.read(186), k <= 390 ? 700 : 200, 1e-3) << "reading " << k;
  }
}

TEST(Nvml, TheStandInGa100IsInstantaneousAndLacksThePowerFields) {
  StandIn nvml("drop_ga100");
  ASSERT_TRUE(nvml.ok());
  for (long k = 0; k <= 420; ++k) {
    int ret185 = -1, ret186 = -1;  // not a reading: scripted time stays
    EXPECT_EQ(nvml.read(185, &ret185), -1);
    EXPECT_EQ(nvml.read(186, &ret186), -1);
    EXPECT_EQ(ret185, 3);  // NVML_ERROR_NOT_SUPPORTED
    EXPECT_EQ(ret186, 3);
    ASSERT_NEAR(nvml.read(0), k <= 390 ? 700 : 200, 1e-3) << "reading " << k;
  }
}

TEST(Nvml, XidAndEccAreHardwareErrorsWrittenAtOnce) {
  TempDir tmp;
  std::vector<std::pair<int, std::string>> seen;
  const ScriptedRun run = play(tmp, "xid", 40, &seen);
  EXPECT_EQ(run.alert_types(), (std::vector<std::string>{"hardware_error", "hardware_error"}));
  const auto alerts = run.alerts();
  EXPECT_EQ(alerts[0].at("details").at("kind"), "xid");
  EXPECT_EQ(alerts[0].at("details").at("code"), 79);
  EXPECT_EQ(alerts[1].at("details").at("kind"), "ecc_uncorrected");
  EXPECT_EQ(alerts[1].at("details").at("delta"), 2);
  // published as the sampler read them (readings 25 and 30: once 24 and 29 steps were
  // done), not when a later step record reached the writer
  EXPECT_EQ(seen, (std::vector<std::pair<int, std::string>>{{24, "hardware_error"},
                                                            {29, "hardware_error"}}));
}

TEST(Nvml, NvLinkCrcErrorsThatKeepGrowingAreOneHardwareError) {
  TempDir tmp;
  std::vector<std::pair<int, std::string>> seen;
  const ScriptedRun run = play(tmp, "nvlink", 60, &seen);
  // rising from reading 30 on: the third rise in a row (reading 32) raises it, once
  EXPECT_EQ(run.alert_types(), std::vector<std::string>{"hardware_error"});
  const auto& a = run.first("hardware_error");
  EXPECT_EQ(a.at("details").at("source"), "nvlink_crc");
  EXPECT_EQ(a.at("details").at("count"), 4 * 5 + 3);
  EXPECT_EQ(a.at("details").at("delta"), 3);
  EXPECT_EQ(seen, (std::vector<std::pair<int, std::string>>{{31, "hardware_error"}}));
}

TEST(Nvml, ASingleNvLinkCrcIncrementRaisesNothing) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "nvlink_blip", 60);
  EXPECT_TRUE(run.alerts().empty()) << run.alerts().front().dump();
  EXPECT_EQ(of_kind(run.records, "run_end").at(0).at("hw").at("nvlink_crc_errors"), 4 * 5 + 1);
}

TEST(Nvml, NvLinkErrorCountersThatDoNotAnswerAreLeftOutNotZero) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "nolinkerrors", 40);
  EXPECT_TRUE(run.alerts().empty()) << run.alerts().front().dump();
  const nlohmann::json hw_end = of_kind(run.records, "run_end").at(0).at("hw");
  EXPECT_FALSE(hw_end.contains("nvlink_crc_errors")) << hw_end.dump();
  EXPECT_FALSE(hw_end.contains("nvlink_replay_errors"));
  EXPECT_TRUE(run.steps().at(10).at("hw").contains("nvlink_tx_mb_s"));  // the links are there
}

TEST(Nvml, UncorrectableRowRemapIsAHardwareError) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "remap", 60);
  EXPECT_EQ(run.alert_types(), std::vector<std::string>{"hardware_error"});
  const auto& a = run.first("hardware_error");
  EXPECT_EQ(a.at("details").at("source"), "remapped_rows");
  EXPECT_EQ(a.at("details").at("count"), 1);
  const nlohmann::json rows = of_kind(run.records, "run_end").at(0).at("hw").at("remapped_rows");
  EXPECT_EQ(rows.at("uncorrected"), 1);
  EXPECT_EQ(rows.at("pending"), true);
}

TEST(Nvml, ThrottleReasonsNamedInStepsAndAlerted) {
  TempDir tmp;
  const ScriptedRun run = play(tmp, "throttle", 70);
  EXPECT_EQ(run.alert_types(), (std::vector<std::string>{"thermal_throttle", "power_throttle"}));
  const auto steps = run.steps();
  // readings 30..39 and 50..59: steps 28..37 and 48..57
  EXPECT_EQ(steps.at(28).at("hw").at("throttle_reasons"),
            nlohmann::json::array({"hw_thermal_slowdown"}));
  EXPECT_EQ(steps.at(28).at("hw").at("sm_clock_mhz"), 1400);
  EXPECT_EQ(steps.at(48).at("hw").at("throttle_reasons"), nlohmann::json::array({"sw_power_cap"}));
  EXPECT_TRUE(steps.at(45).at("hw").at("throttle_reasons").empty());
  EXPECT_EQ(run.first("thermal_throttle").at("step"), 28);
  EXPECT_EQ(run.first("power_throttle").at("step"), 48);
  // both episodes end when the reasons clear
  EXPECT_EQ(of_kind(run.records, "resolved").size(), 2u);
}

// The real path: the fake library's steady device, read by the sampler thread every 1 ms.
Config sampled_every_ms(const TempDir& tmp) {
  setenv("STEPTRACE_NVML_LIBRARY", STEPTRACE_FAKE_NVML_PATH, 1);
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady", 1);
  Config config = testing::run_config(tmp);
  config.nvml_interval_ms = 1;
  return config;
}

TEST(Nvml, SamplerThreadFillsHwOnTheHostClock) {
  // steps wait for a reading after their end
  TempDir tmp;
  Profiler prof(sampled_every_ms(tmp));
  for (int i = 0; i < 5; ++i) {
    auto step = prof.step();
  }
  prof.close();
  const auto records = read_jsonl(prof.log_path());
  EXPECT_EQ(records.front().at("backends").at("telemetry").at("interval_ms"), 1);
  int with_hw = 0;
  for (const auto& s : of_kind(records, "step")) with_hw += s.contains("hw") ? 1 : 0;
  EXPECT_GE(with_hw, 4);  // the first may come before the first reading
  EXPECT_GT(of_kind(records, "run_end").at(0).at("hw").at("samples").get<int>(), 0);
}

TEST(Nvml, TheSamplerThreadLeavesTheProcessesSignalsToTheProgramsThreads) {
  // as the profiler's own threads (test_profiler.cpp): SIGTERM sent to the process must
  // reach one of the program's threads, never the sampler
  std::thread([] {}).join();  // a sanitizer's own background thread, if any, starts now
  const std::set<std::string> before = testing::thread_ids();
  TempDir tmp;
  Profiler prof(sampled_every_ms(tmp));
  const auto masks = testing::masks_of_started_threads(before);
  testing::expect_signals_left_to_the_program(masks);
  EXPECT_GE(masks.size(), 3U);  // the writer, the watchdog and the sampler
  prof.close();
  EXPECT_GT(of_kind(read_jsonl(prof.log_path()), "run_end").at(0).at("hw").at("samples").get<int>(),
            0);  // the sampler ran
}

// One reading now, on the calling thread, of CUDA device 0's telemetry source.
TelemetrySample read_once(const char* scenario, std::string* device = nullptr,
                          std::unique_ptr<TelemetrySource>* keep = nullptr) {
  setenv("STEPTRACE_NVML_LIBRARY", STEPTRACE_FAKE_NVML_PATH, 1);
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", scenario, 1);
  std::string why;
  auto source = make_nvml_telemetry(0, 0, &why);
  if (source == nullptr) {
    ADD_FAILURE() << why;
    return {};
  }
  EXPECT_TRUE(sample_nvml_now(*source));
  std::vector<TelemetrySample> got;
  source->take(got);
  if (device != nullptr) *device = source->device();
  if (keep != nullptr) *keep = std::move(source);
  return got.empty() ? TelemetrySample{} : got.back();
}

TEST(Nvml, SamplerStampsPowerWhenReadAndKeepsItsPeriodDespiteSlowPcieReads) {
  // nvmlDeviceGetPcieThroughput samples over 20 ms (the fake sleeps that long): the power
  // and energy readings keep their own time, and the sampler its 100 ms period
  setenv("STEPTRACE_NVML_LIBRARY", STEPTRACE_FAKE_NVML_PATH, 1);
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady", 1);
  setenv("STEPTRACE_FAKE_NVML_PCIE_MS", "20", 1);
  std::string why;
  auto source = make_nvml_telemetry(0, 100, &why);
  unsetenv("STEPTRACE_FAKE_NVML_PCIE_MS");  // read at nvmlInit_v2, done
  ASSERT_NE(source, nullptr) << why;
  source->start();
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  source->finish();
  std::vector<TelemetrySample> samples;
  source->take(samples);
  samples.pop_back();  // finish()'s closing reading comes off the period
  ASSERT_GE(samples.size(), 10u);
  void* lib = dlopen(STEPTRACE_FAKE_NVML_PATH, RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(lib, nullptr);
  auto read_ns = reinterpret_cast<long long (*)(long)>(dlsym(lib, "fake_nvml_power_read_ns"));
  ASSERT_NE(read_ns, nullptr);
  for (const TelemetrySample& s : samples) {
    long long read = -1;  // the last power reading at or before the stamp
    for (long i = 0; read_ns(i) >= 0; ++i) {
      if (read_ns(i) <= s.t_ns) read = read_ns(i);
    }
    ASSERT_GE(read, 0);
    EXPECT_LT(s.t_ns - read, 2'000'000) << "stamped " << (s.t_ns - read) / 1e6 << " ms late";
    EXPECT_TRUE(std::isfinite(s.pcie_tx_mb_s));  // slow fields: held between their readings
  }
  const double period_ms = static_cast<double>(samples.back().t_ns - samples.front().t_ns) /
                           static_cast<double>(samples.size() - 1) / 1e6;
  EXPECT_NEAR(period_ms, 100, 10);
  dlclose(lib);
}

TEST(Nvml, AbbreviatedGpuUuidInCudaVisibleDevicesIsMatchedByPrefix) {
  // CUDA accepts a unique UUID prefix; NVML's lookup wants the whole UUID
  setenv("CUDA_VISIBLE_DEVICES", "GPU-1932f937", 1);
  std::string device;
  const TelemetrySample s = read_once("steady,hot", &device);
  unsetenv("CUDA_VISIBLE_DEVICES");
  EXPECT_NEAR(s.temp_c, 75.5, 0.51);  // GPU 1 plays "hot" (75-76 C)
  EXPECT_NE(device.find("GPU-1932f937-5b4c-4a2e-9d5e-012345678901"), std::string::npos) << device;
}

TEST(Nvml, FullGpuUuidInCudaVisibleDevices) {
  setenv("CUDA_VISIBLE_DEVICES", "GPU-1932f937-5b4c-4a2e-9d5e-012345678901", 1);
  const TelemetrySample s = read_once("steady,hot");
  unsetenv("CUDA_VISIBLE_DEVICES");
  EXPECT_NEAR(s.temp_c, 75.5, 0.51);
}

TEST(Nvml, MigDeviceInCudaVisibleDevicesReadsItsBoardAndSaysWhichFiguresAreBoardWide) {
  setenv("CUDA_VISIBLE_DEVICES", "MIG-1a5e3c91-7d2b-5f0e-8c4a-fedcba987651", 1);
  std::string device;
  std::unique_ptr<TelemetrySource> source;
  const TelemetrySample s = read_once("steady,mig", &device, &source);
  ASSERT_NE(source, nullptr);
  EXPECT_NEAR(s.power_w, 650, 2.01);    // the parent board's power
  EXPECT_TRUE(std::isnan(s.util_pct));  // not supported under MIG
  EXPECT_NE(device.find("MIG"), std::string::npos) << device;
  const std::vector<std::string> board = source->board_wide();
  for (const char* figure :
       {"power_w", "energy_j", "temp_c", "sm_clock_mhz", "pcie_tx_mb_s", "nvlink_tx_mb_s"}) {
    EXPECT_NE(std::find(board.begin(), board.end(), figure), board.end()) << figure;
  }
  std::int64_t used = -1, total = -1;  // board-wide memory is no slice's: not taken
  EXPECT_FALSE(source->device_memory(&used, &total));
  source.reset();

  // and run_start's telemetry section says so
  TempDir tmp;
  Config config = testing::run_config(tmp);
  config.nvml_interval_ms = 1;
  Profiler prof(config);
  { auto step = prof.step(); }
  prof.close();
  unsetenv("CUDA_VISIBLE_DEVICES");
  const auto records = read_jsonl(prof.log_path());
  const auto& telemetry = records.front().at("backends").at("telemetry");
  ASSERT_TRUE(telemetry.contains("board_wide")) << telemetry.dump();
  EXPECT_NE(telemetry.at("board_wide").dump().find("power_w"), std::string::npos);
  EXPECT_FALSE(telemetry.contains("device_memory"));
}

// Issue 49: one GPU per rank, CUDA_VISIBLE_DEVICES naming the rank's own. LOCAL_RANK=1 is
// then no device this process can see: its one visible device (CUDA device 0) is the rank's,
// by the rule the counters follow. Without the CUDA driver (none in this test's process) the
// visible devices are CUDA_VISIBLE_DEVICES' entries.
TEST(Nvml, LocalRankBeyondTheVisibleDevicesReadsTheRanksOneGpu) {
  setenv("STEPTRACE_NVML_LIBRARY", STEPTRACE_FAKE_NVML_PATH, 1);
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady,hot", 1);
  setenv("LOCAL_RANK", "1", 1);
  for (const char* visible : {"1", "GPU-1932f937"}) {  // an index, a UUID prefix
    setenv("CUDA_VISIBLE_DEVICES", visible, 1);
    std::string why;
    auto source = make_nvml_telemetry(-1, 0, &why);
    ASSERT_NE(source, nullptr) << visible << ": " << why;
    EXPECT_NE(source->device().find("LOCAL_RANK=1 is not among the 1 visible devices"),
              std::string::npos)
        << source->device();
    ASSERT_TRUE(sample_nvml_now(*source));
    std::vector<TelemetrySample> got;
    source->take(got);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_NEAR(got[0].temp_c, 75.5, 0.51) << visible;  // NVML's GPU 1 plays "hot"
  }
  // and the profiler has NVML telemetry on for it
  setenv("CUDA_VISIBLE_DEVICES", "1", 1);
  TempDir tmp;
  Config config = testing::run_config(tmp);
  config.nvml_interval_ms = 1;
  Profiler prof(config);
  { auto step = prof.step(); }
  prof.close();
  const auto records = read_jsonl(prof.log_path());
  const auto& telemetry = records.front().at("backends").at("telemetry");
  EXPECT_EQ(telemetry.at("active"), nlohmann::json::array({"nvml"})) << telemetry.dump();
  EXPECT_NE(telemetry.at("device").get<std::string>().find("GPU-1932f937"), std::string::npos)
      << telemetry.dump();
  // LOCAL_RANK among the visible devices is the rank's device, as before
  setenv("CUDA_VISIBLE_DEVICES", "0,1", 1);
  std::string why;
  auto source = make_nvml_telemetry(-1, 0, &why);
  ASSERT_NE(source, nullptr) << why;
  EXPECT_EQ(source->device().rfind("device 1 (LOCAL_RANK=1, NVML device 1", 0), 0u)
      << source->device();
  unsetenv("CUDA_VISIBLE_DEVICES");
  unsetenv("LOCAL_RANK");
}

TEST(Nvml, UnknownOrAmbiguousUuidSaysSo) {
  std::string why;
  setenv("STEPTRACE_NVML_LIBRARY", STEPTRACE_FAKE_NVML_PATH, 1);
  setenv("STEPTRACE_FAKE_NVML_SCENARIO", "steady,hot", 1);
  setenv("CUDA_VISIBLE_DEVICES", "GPU-7", 1);
  EXPECT_EQ(make_nvml_telemetry(0, 0, &why), nullptr);
  EXPECT_NE(why.find("GPU-7"), std::string::npos) << why;
  setenv("CUDA_VISIBLE_DEVICES", "GPU-", 1);  // a prefix of both
  EXPECT_EQ(make_nvml_telemetry(0, 0, &why), nullptr);
  EXPECT_NE(why.find("ambiguous"), std::string::npos) << why;
  unsetenv("CUDA_VISIBLE_DEVICES");
}

}  // namespace
}  // namespace steptrace
