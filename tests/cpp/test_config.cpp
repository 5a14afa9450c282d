#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "steptrace/config.hpp"
#include "steptrace/error.hpp"
#include "steptrace/profiler.hpp"
#include "test_util.hpp"

namespace steptrace {
namespace {

Config valid() {
  Config c;
  c.log_dir = "/tmp/steptrace-config-test";
  return c;
}

// Expects validate() to throw ConfigError whose message contains `needle`.
template <typename Mutate>
void expect_rejected(Mutate mutate, const std::string& needle) {
  Config c = valid();
  mutate(c);
  try {
    c.validate();
    FAIL() << "expected ConfigError mentioning " << needle;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Config, DefaultsAreValid) { EXPECT_NO_THROW(valid().validate()); }

TEST(Config, DefaultsMatchDesign) {
  const Config c;
  EXPECT_EQ(c.window, 100);
  EXPECT_DOUBLE_EQ(c.regression_threshold, 1.5);
  EXPECT_DOUBLE_EQ(c.stall_threshold, 5.0);
  EXPECT_EQ(c.flush_interval_ms, 100);
  EXPECT_EQ(c.phases,
            (std::vector<std::string>{"forward", "loss", "backward", "clip", "optimizer"}));
}

TEST(Config, RejectsBadValuesNamingThem) {
  expect_rejected([](Config& c) { c.log_dir.clear(); }, "log_dir");
  expect_rejected([](Config& c) { c.window = 1; }, "window=1");
  expect_rejected([](Config& c) { c.regression_threshold = 1.0; }, "regression_threshold=1");
  expect_rejected([](Config& c) { c.stall_threshold = 0.5; }, "stall_threshold=0.5");
  expect_rejected([](Config& c) { c.flush_interval_ms = 0; }, "flush_interval_ms=0");
  expect_rejected([](Config& c) { c.queue_capacity = 3; }, "queue_capacity=3");
  expect_rejected([](Config& c) { c.warmup_steps = -1; }, "warmup_steps=-1");
  expect_rejected([](Config& c) { c.clock = "sundial"; }, "\"sundial\"");
  expect_rejected([](Config& c) { c.rank = 4, c.world_size = 2; }, "rank=4");
  expect_rejected([](Config& c) { c.world_size = 0; }, "world_size=0");
  expect_rejected([](Config& c) { c.phases = {"forward", ""}; }, "empty");
  expect_rejected([](Config& c) { c.phases = {"forward", "forward"}; }, "twice");
  expect_rejected([](Config& c) { c.phases = {"data"}; }, "reserved");
  expect_rejected([](Config& c) { c.metrics_pushgateway = "pushgateway:9091"; }, "http://");
}

// The bundled cpp-httplib has no TLS (the wheel links no libssl): https:// is refused up
// front, with the reason, instead of a failed push at close.
TEST(Config, HttpsPushgatewayIsRefusedWithoutTls) {
  expect_rejected([](Config& c) { c.metrics_pushgateway = "https://pushgateway:9091"; },
                  "without TLS");
  Config c = valid();
  c.metrics_pushgateway = "http://pushgateway:9091";
  EXPECT_NO_THROW(c.validate());
}

TEST(Config, DeviceActivityOptionsAreChecked) {
  const Config d;
  EXPECT_DOUBLE_EQ(d.tensor_core_min_pct, 60);  // DESIGN.md's diagnosis thresholds
  EXPECT_DOUBLE_EQ(d.occupancy_min_pct, 60);
  EXPECT_DOUBLE_EQ(d.dram_bound_pct, 80);
  EXPECT_DOUBLE_EQ(d.comm_bound_pct, 25);
  expect_rejected([](Config& c) { c.kernel_activity = "on"; }, "kernel_activity=\"on\"");
  expect_rejected([](Config& c) { c.counters = "always"; }, "counters=\"always\"");
  expect_rejected([](Config& c) { c.counter_every = 0; }, "counter_every=0");
  expect_rejected(
      [](Config& c) {
        c.counter_every = 4;
        c.counter_burst = 5;
      },
      "counter_burst=5 is out of range; allowed: 1..counter_every (4)");
  expect_rejected([](Config& c) { c.device_index = -2; }, "device_index=-2");
  expect_rejected([](Config& c) { c.top_kernels = -1; }, "top_kernels=-1");
  expect_rejected([](Config& c) { c.comm_bound_pct = 0; }, "comm_bound_pct=0");
  expect_rejected([](Config& c) { c.dram_bound_pct = 120; }, "dram_bound_pct=120");
  expect_rejected([](Config& c) { c.tensor_core_min_pct = NAN; }, "tensor_core_min_pct=nan");
}

TEST(Config, NaNThresholdIsRejected) {
  expect_rejected([](Config& c) { c.regression_threshold = std::nan(""); }, "regression_threshold");
}

TEST(PhaseName, Rules) {
  EXPECT_NO_THROW(validate_phase_name("attention block 3"));
  EXPECT_THROW(validate_phase_name(""), ConfigError);
  EXPECT_THROW(validate_phase_name(std::string(kMaxPhaseNameBytes + 1, 'x')), ConfigError);
  EXPECT_THROW(validate_phase_name("a\nb"), ConfigError);
  EXPECT_THROW(validate_phase_name("data"), ConfigError);
}

TEST(Config, BadConfigCreatesNothing) {
  testing::TempDir tmp;
  Config c;
  c.log_dir = tmp.str("never");
  c.window = 0;
  EXPECT_THROW(Profiler p(c), ConfigError);
  EXPECT_FALSE(std::filesystem::exists(c.log_dir));
}

TEST(Config, LogDirThatIsAFileIsRejected) {
  testing::TempDir tmp;
  const std::string file = tmp.str("a-file");
  std::ofstream(file) << "x";
  Config c;
  c.log_dir = file;
  try {
    Profiler p(c);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos) << e.what();
  }
}

TEST(Config, UncreatableLogDirIsRejected) {
  testing::TempDir tmp;
  const std::string file = tmp.str("a-file");
  std::ofstream(file) << "x";
  Config c;
  c.log_dir = file + "/sub";  // parent is a file: even root cannot create it
  EXPECT_THROW(Profiler p(c), ConfigError);
}

TEST(Config, ExistingLogNeedsOverwrite) {
  testing::TempDir tmp;
  Config c;
  c.log_dir = tmp.str();
  c.rank = 0;
  c.world_size = 1;
  { Profiler p(c); }
  try {
    Profiler again(c);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("overwrite"), std::string::npos) << e.what();
  }
  c.overwrite = true;
  EXPECT_NO_THROW(Profiler third(c));
}

TEST(Config, RankComesFromTheEnvironment) {
  testing::TempDir tmp;
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "4", 1);
  Config c;
  c.log_dir = tmp.str();
  {
    Profiler p(c);
    EXPECT_EQ(p.config().rank, 3);
    EXPECT_EQ(p.config().world_size, 4);
    EXPECT_EQ(std::filesystem::path(p.log_path()).filename(), "rank3.jsonl");
  }
  setenv("RANK", "x", 1);
  EXPECT_THROW(Profiler bad(c), ConfigError);
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
}

}  // namespace
}  // namespace steptrace
