// Per-step values (Profiler::set_step_value) and the "meta" object of step records.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <limits>
#include <string>

#include "backends/fake/fake_backends.hpp"
#include "backends/fake/fake_device_timer.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

using testing::of_kind;
using testing::read_jsonl;
using testing::TempDir;

std::unique_ptr<Profiler> make_profiler(const TempDir& tmp,
                                        fake::FakeDeviceTimer** device = nullptr) {
  Backends backends;
  backends.clock = std::make_unique<fake::FakeClock>();
  if (device != nullptr) {
    auto d = std::make_unique<fake::FakeDeviceTimer>();
    *device = d.get();
    backends.device_timer = std::move(d);
  }
  auto prof = std::make_unique<Profiler>(testing::run_config(tmp), RunInfo{}, std::move(backends));
  if (device != nullptr) prof->set_stream(7);
  return prof;
}

std::vector<nlohmann::json> close_and_read_steps(Profiler& prof) {
  prof.close();
  return of_kind(read_jsonl(prof.log_path()), "step");
}

TEST(StepMeta, ValuesGoToTheStepInProgressInTheOrderFirstSet) {
  TempDir tmp;
  auto prof = make_profiler(tmp);
  {
    auto s = prof->step();
    prof->set_step_value("global_step", 120);
    prof->set_step_value("lr", 1e-3);
    prof->set_step_value("loss", 0.53);
    prof->set_step_value("global_step", 121);  // set again: replaces, keeps its place
  }
  const auto steps = close_and_read_steps(*prof);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_TRUE(steps[0].at("meta")["global_step"].is_number_integer());  // whole numbers as such
  // The line itself (nlohmann::json sorts keys): shortest round-trip numbers, in order.
  std::ifstream in(prof->log_path());
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find(R"("meta":{"global_step":121,"lr":0.001,"loss":0.53})"), std::string::npos)
      << text;
}

TEST(StepMeta, AStepRecordsOnlyTheValuesSetForItAndBetweenStepsTheNextOne) {
  TempDir tmp;
  auto prof = make_profiler(tmp);
  const StepValueId epoch = prof->step_value_id("epoch");
  prof->set_step_value(epoch, 3);  // before the first step: goes to step 0
  { auto s = prof->step(); }
  { auto s = prof->step(); }  // nothing set: no meta
  {
    auto s = prof->step();
    prof->set_step_value("loss", 2.5);
  }
  prof->set_step_value("loss", 1.25);  // after step 2 ended: step 3's
  { auto s = prof->step(); }
  const auto steps = close_and_read_steps(*prof);
  ASSERT_EQ(steps.size(), 4u);
  EXPECT_EQ(steps[0]["meta"].dump(), R"({"epoch":3})");
  EXPECT_FALSE(steps[1].contains("meta"));
  EXPECT_EQ(steps[2]["meta"].dump(), R"({"loss":2.5})");
  EXPECT_EQ(steps[3]["meta"].dump(), R"({"loss":1.25})");
}

TEST(StepMeta, NonFiniteValuesAreWrittenAsNull) {
  TempDir tmp;
  auto prof = make_profiler(tmp);
  {
    auto s = prof->step();
    prof->set_step_value("loss", std::numeric_limits<double>::quiet_NaN());
    prof->set_step_value("grad_norm", std::numeric_limits<double>::infinity());
    prof->set_step_value("tiny", 1e-300);
  }
  const auto steps = close_and_read_steps(*prof);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_TRUE(steps[0]["meta"]["loss"].is_null());
  EXPECT_TRUE(steps[0]["meta"]["grad_norm"].is_null());
  EXPECT_DOUBLE_EQ(steps[0]["meta"]["tiny"].get<double>(), 1e-300);
}

TEST(StepMeta, EverySlotOfAFullNameTableFitsInOneStep) {
  TempDir tmp;
  auto prof = make_profiler(tmp);
  {
    auto s = prof->step();
    for (std::size_t i = 0; i < kMaxStepValues; ++i) {
      prof->set_step_value("v" + std::to_string(i), static_cast<double>(i));
    }
    // One name too many: refused when it is first used, the step goes on.
    EXPECT_THROW(prof->set_step_value("one_too_many", 1.0), ConfigError);
    prof->set_step_value("v0", -1.0);  // known names still work
  }
  const auto steps = close_and_read_steps(*prof);
  ASSERT_EQ(steps.size(), 1u);
  const auto& meta = steps[0]["meta"];
  ASSERT_EQ(meta.size(), kMaxStepValues);
  EXPECT_EQ(meta["v0"].get<double>(), -1.0);
  EXPECT_EQ(meta["v15"].get<double>(), 15.0);
  EXPECT_FALSE(meta.contains("one_too_many"));
}

TEST(StepMeta, BadNamesAndIdsAreRefused) {
  TempDir tmp;
  auto prof = make_profiler(tmp);
  EXPECT_THROW(prof->step_value_id(""), ConfigError);
  EXPECT_THROW(prof->step_value_id(std::string(kMaxPhaseNameBytes + 1, 'x')), ConfigError);
  EXPECT_THROW(prof->step_value_id("a\nb"), ConfigError);
  EXPECT_THROW(prof->set_step_value(StepValueId{3}, 1.0), UsageError);  // never interned
  // Step values have a table of their own: "data" is fine, and phases keep all their room.
  EXPECT_EQ(prof->step_value_id("data"), 0);
  EXPECT_EQ(prof->phase_id("forward"), prof->phase_id("forward"));
  try {
    prof->step_value_id("");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("step value name is empty"), std::string::npos)
        << e.what();
  }
}

TEST(StepMeta, ValuesSurviveStepsHeldForTheirDeviceEvents) {
  TempDir tmp;
  fake::FakeDeviceTimer* device = nullptr;
  auto prof = make_profiler(tmp, &device);
  for (int i = 0; i < 3; ++i) {
    auto s = prof->step();
    auto p = s.phase("forward");
    device->advance_device(1'000'000);
    prof->set_step_value("global_step", 100 + i);
  }
  EXPECT_EQ(prof->steps_in_flight(), 3u);  // none written yet: the records wait for the device
  device->complete_all();
  const auto steps = close_and_read_steps(*prof);
  ASSERT_EQ(steps.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(steps[i]["clock"], "cuda");
    EXPECT_EQ(steps[i]["meta"]["global_step"].get<int>(), 100 + i) << steps[i].dump();
  }
}

}  // namespace
}  // namespace steptrace
