#include "core/record_json.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "steptrace/error.hpp"

namespace steptrace::detail {
namespace {

StepRecord sample_record(PhaseNames& names) {
  StepRecord r;
  r.step = 7;
  r.start_unix_ns = 1'700'000'000'000'000'000;
  r.step_ns = 5'250'000;
  r.data_ns = 1'000'000;
  r.host_ns = 5'250'000;
  r.memory.rss_bytes = 123456;
  r.phase_count = 2;
  r.phase_ids = {names.intern("forward"), names.intern("back\"ward")};
  r.phase_ns = {2'000'000, 3'000'100};
  return r;
}

TEST(RecordJson, StepRecordHasTheSchemaFields) {
  PhaseNames names;
  const StepRecord r = sample_record(names);
  fmt::memory_buffer out;
  append_step_json(out, r, 2, names);
  const std::string line = fmt::to_string(out);
  ASSERT_EQ(line.back(), '\n');
  const auto j = nlohmann::json::parse(line);
  EXPECT_EQ(j["kind"], "step");
  EXPECT_EQ(j["rank"], 2);
  EXPECT_EQ(j["step"], 7);
  EXPECT_EQ(j["start_unix_ns"], 1'700'000'000'000'000'000);
  EXPECT_EQ(j["clock"], "host");
  EXPECT_EQ(j["status"], "ok");
  EXPECT_DOUBLE_EQ(j["step_ms"].get<double>(), 5.25);
  EXPECT_DOUBLE_EQ(j["data_ms"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(j["phases_ms"]["forward"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(j["phases_ms"]["back\"ward"].get<double>(), 3.0001);
  EXPECT_EQ(j["memory"], (nlohmann::json{{"rss_bytes", 123456}}));
  EXPECT_FALSE(j.contains("host_phases_ms"));
}

TEST(RecordJson, DeviceClockRecordsCarryHostTimesToo) {
  PhaseNames names;
  StepRecord r = sample_record(names);
  r.device_clock = true;
  r.failed = true;
  r.host_phase_ns = {10'000, 20'000};
  fmt::memory_buffer out;
  append_step_json(out, r, 0, names);
  const auto j = nlohmann::json::parse(fmt::to_string(out));
  EXPECT_EQ(j["clock"], "cuda");
  EXPECT_EQ(j["status"], "error");
  EXPECT_DOUBLE_EQ(j["host_phases_ms"]["forward"].get<double>(), 0.01);
}

TEST(RecordJson, RunEndSummarizesTotals) {
  PhaseNames names;
  RunTotals totals;
  StepRecord r = sample_record(names);
  totals.add(r);
  r.failed = true;
  r.step_ns = 7'250'000;
  totals.add(r);
  RunEnd end{"exception", "ValueError: bad \"batch\"", 42, 1.5, 3};
  fmt::memory_buffer out;
  append_run_end_json(out, end, totals, 0, names);
  const auto j = nlohmann::json::parse(fmt::to_string(out));
  EXPECT_EQ(j["kind"], "run_end");
  EXPECT_EQ(j["reason"], "exception");
  EXPECT_EQ(j["error"], "ValueError: bad \"batch\"");
  EXPECT_EQ(j["steps"], 2);
  EXPECT_EQ(j["error_steps"], 1);
  EXPECT_EQ(j["writer_waits"], 3);
  EXPECT_DOUBLE_EQ(j["summary"]["step_ms_mean"].get<double>(), 6.25);
  EXPECT_DOUBLE_EQ(j["summary"]["step_ms_max"].get<double>(), 7.25);
  EXPECT_DOUBLE_EQ(j["summary"]["phases_ms_total"]["forward"].get<double>(), 4.0);
}

TEST(RecordJson, EscapesControlCharacters) {
  fmt::memory_buffer out;
  append_json_string(out, std::string("a\x01\tb\\", 5));
  EXPECT_EQ(fmt::to_string(out), "\"a\\u0001\\tb\\\\\"");
  EXPECT_EQ(nlohmann::json::parse(fmt::to_string(out)), std::string("a\x01\tb\\", 5));
}

TEST(PhaseNames, InternsOnceAndCaps) {
  PhaseNames names;
  EXPECT_EQ(names.intern("forward"), names.intern("forward"));
  for (std::size_t i = 1; i < kMaxPhases; ++i) names.intern("p" + std::to_string(i));
  EXPECT_EQ(names.size(), kMaxPhases);
  EXPECT_THROW(names.intern("one-too-many"), ConfigError);
  EXPECT_EQ(names.find("p5"), 5);
  EXPECT_EQ(names.find("nope"), -1);
}

}  // namespace
}  // namespace steptrace::detail

namespace steptrace::detail {
namespace {

TEST(RetainedByPhase, CountsOnlyWhatSurvivesTheStep) {
  StepRecord r;
  r.phase_memory = true;
  r.phase_count = 3;
  r.memory_at_start = 1000;
  // forward allocates 500 (100 of it kept), backward frees 400 and allocates 50 of
  // gradients, optimizer frees those gradients again.
  r.phase_memory_end = {1500, 1150, 1100};
  r.phase_end_order = {0, 1, 2};
  const auto retained = retained_by_phase(r);
  EXPECT_EQ(retained[0], 100);
  EXPECT_EQ(retained[1], 0);
  EXPECT_EQ(retained[2], 0);
}

TEST(RetainedByPhase, FollowsTheOrderPhasesEnded) {
  StepRecord r;
  r.phase_memory = true;
  r.phase_count = 2;
  r.memory_at_start = 0;
  // slot 0 (outer) ended after slot 1 (inner), which kept 30; the outer kept 20 more.
  r.phase_memory_end = {50, 30};
  r.phase_end_order = {1, 0};
  const auto retained = retained_by_phase(r);
  EXPECT_EQ(retained[1], 30);
  EXPECT_EQ(retained[0], 20);
}

}  // namespace
}  // namespace steptrace::detail
