// The run's first and last records as the runtime builds them: run_start from a
// RunManifest (csrc/runtime/run_manifest.*) and run_end from what close() or the SIGTERM
// watcher knows (csrc/runtime/run_end_builder.*), each through its own header.
#include "runtime/run_manifest.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/fake/fake_backends.hpp"
#include "runtime/backend_setup.hpp"
#include "runtime/run_end_builder.hpp"
#include "steptrace/profiler.hpp"

namespace steptrace {
namespace {

constexpr std::int64_t kS = 1'000'000'000;

// A manifest of a run with no device side: each missing backend and why.
struct Manifest {
  Manifest() {
    config.run_id = "r1";
    info.versions = {{"python", "3.11"}};
    devices.timing_unavailable = "no GPU here";
    devices.activity_unavailable = "no device";
    devices.counters_unavailable = "no device either";
    devices.telemetry_unavailable = "no libnvidia-ml.so.1";
    memory_sources.push_back(std::make_unique<fake::FakeMemorySource>());
    m.config = &config;
    m.info = &info;
    m.start_unix_ns = 5 * kS;
    m.job = &job;
    m.log = &log;
    m.memory_sources = &memory_sources;
    m.devices = &devices;
  }
  nlohmann::json json() const { return nlohmann::json::parse(detail::run_start_json(m)); }
  Config config;
  RunInfo info;
  detail::JobIdentity job;
  detail::LogFile log;
  std::vector<std::unique_ptr<MemorySource>> memory_sources;
  detail::DeviceParts devices;
  detail::RunManifest m;
};

TEST(RunManifest, RunStartSaysWhichBackendsTheRunLacksAndWhy) {
  Manifest s;
  const auto j = s.json();
  EXPECT_EQ(j["kind"], "run_start");
  EXPECT_EQ(j["run_id"], "r1");
  EXPECT_EQ(j["start_unix_ns"], 5 * kS);
  EXPECT_EQ(j["versions"]["python"], "3.11");
  EXPECT_TRUE(j["device"].is_null());
  const auto& b = j["backends"];
  EXPECT_EQ(b["timer"]["active"], nlohmann::json::array({"host"}));
  EXPECT_EQ(b["timer"]["unavailable"]["cuda"], "no GPU here");
  EXPECT_EQ(b["kernel_activity"]["unavailable"]["cupti"], "no device");
  EXPECT_EQ(b["counters"]["unavailable"]["cupti"], "no device either");
  EXPECT_EQ(b["telemetry"]["unavailable"]["nvml"], "no libnvidia-ml.so.1");
  EXPECT_EQ(b["memory"]["active"].size(), 1u);
  EXPECT_FALSE(j.contains("process_start_unix_ns"));  // unknown: left out
  EXPECT_FALSE(j.contains("metrics"));
  EXPECT_FALSE(b["timer"].contains("method"));  // a given clock: no host method
}

TEST(RunManifest, RunStartNamesHowTheHostClockIsRead) {
  Manifest s;
  s.m.host_clock = detail::host_clock_method(/*counter=*/false);
  EXPECT_EQ(s.json()["backends"]["timer"]["method"], "host: CLOCK_MONOTONIC");
  s.m.host_clock = detail::host_clock_method(/*counter=*/true);
  const std::string method = s.json()["backends"]["timer"]["method"];
  EXPECT_NE(method.find("time-stamp counter"), std::string::npos) << method;
}

// ---- run_end ----

detail::RunEndFacts facts_at(std::int64_t now_ns) {
  detail::RunEndFacts f;
  f.start.start_ns = 100 * kS;     // the run's clock at start ...
  f.start.start_unix_ns = 7 * kS;  // ... was this unix time
  f.now_ns = now_ns;
  return f;
}

TEST(RunEndBuilder, TheEndIsOnTheRunsClockMappedToUnixTime) {
  detail::RunEndFacts f = facts_at(112 * kS);
  f.reason = EndReason::kException;
  f.error = "ValueError: boom";
  f.data_inside_step = 3;
  f.process_start_unix_ns = 6 * kS;
  f.mfu_dtype = "bf16";
  const detail::RunEnd end = detail::build_run_end(f);
  EXPECT_EQ(end.reason, "exception");
  EXPECT_EQ(end.error, "ValueError: boom");
  EXPECT_EQ(end.end_unix_ns, 19 * kS);
  EXPECT_DOUBLE_EQ(end.wall_s, 12.0);
  EXPECT_EQ(end.data_inside_step, 3);
  EXPECT_EQ(end.process_start_unix_ns, 6 * kS);
  EXPECT_EQ(end.profiler_start_unix_ns, 7 * kS);
  EXPECT_EQ(end.mfu_dtype, "bf16");
  EXPECT_EQ(end.trailing.listed, 0);  // no trailing intervals given (a foreign close)
}

TEST(RunEndBuilder, AStepLeftRunningByAForeignCloseIsNamedAfterTheCallersError) {
  detail::RunEndFacts f = facts_at(101 * kS);
  f.error = "interrupted";
  f.step_left_running = true;
  f.running_step = 41;
  f.close_wait_s = 2.5;
  const std::string error = detail::build_run_end(f).error;
  EXPECT_EQ(error.rfind("interrupted; closed from another thread while step 41", 0), 0u) << error;
  EXPECT_NE(error.find("close_wait_s=2.5"), std::string::npos) << error;
}

TEST(RunEndBuilder, ReasonsByName) {
  EXPECT_STREQ(detail::end_reason_name(EndReason::kNormal), "normal");
  EXPECT_STREQ(detail::end_reason_name(EndReason::kException), "exception");
  EXPECT_STREQ(detail::end_reason_name(EndReason::kSignal), "signal");
  EXPECT_STREQ(detail::end_reason_name(EndReason::kExit), "exit");
}

TEST(RunEndBuilder, TheSignalWatchersEndIsASignalOnUnixTime) {
  detail::ClockMapping start;
  start.start_unix_ns = 1;  // long ago: the wall time is positive
  const detail::RunEnd end = detail::signal_run_end(start, 2);
  EXPECT_EQ(end.reason, "signal");
  EXPECT_NE(end.error.find("grace period"), std::string::npos);
  EXPECT_GT(end.wall_s, 0);
  EXPECT_EQ(end.data_inside_step, 2);
}

TEST(RunEndBuilder, NoTrailingIntervalsWriteNoLines) {
  EXPECT_EQ(detail::trailing_interval_lines(detail::BetweenSteps{}, 4, 0), "");
}

}  // namespace
}  // namespace steptrace
