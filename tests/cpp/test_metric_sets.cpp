// The per-chip metric table, checked with CUPTI's profiler host API (no GPU needed):
// every metric in each chip's chosen set exists and the set is one pass. Skipped only
// when libcupti cannot be loaded (or the build had no CUPTI headers). The selection
// logic itself is also tested against a fake oracle.
#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <set>
#include <string>

#include "backends/cupti/metric_sets.hpp"
#include "steptrace/error.hpp"
#include "steptrace/metrics.hpp"

namespace steptrace {
namespace {

bool cupti_unavailable(const MetricSetReport& r) {
  return r.error.rfind("libcupti could not be loaded", 0) == 0 ||
         r.error.rfind("built without CUPTI headers", 0) == 0;
}

void expect_one_pass_set(const std::string& chip, const std::string& mode) {
  const MetricSetReport r = check_metric_set(chip, mode);
  if (cupti_unavailable(r)) GTEST_SKIP() << "CUPTI host API unavailable: " << r.error;
  ASSERT_TRUE(r.error.empty()) << chip << " " << mode << ": " << r.error;
  EXPECT_EQ(r.passes, 1) << chip << " " << mode;
  std::set<std::string> counters;
  int selected = 0;
  for (const auto& m : r.metrics) {
    if (!m.selected) continue;
    ++selected;
    EXPECT_TRUE(m.exists) << chip << " " << m.name;
    EXPECT_TRUE(counters.insert(m.counter).second) << "two metrics for " << m.counter;
  }
  for (const char* c : {"tensor_active_pct", "dram_throughput_pct", "sm_occupancy_pct"}) {
    EXPECT_EQ(counters.count(c), 1u) << chip << " " << mode << " lacks " << c;
  }
  std::printf("%s %s (%s): %d metrics, %d pass(es), CUPTI %d at %s\n", chip.c_str(), r.mode.c_str(),
              r.family.c_str(), selected, r.passes, r.cupti_version, r.cupti_library.c_str());
}

class ChipSets : public testing::TestWithParam<std::string> {};

TEST_P(ChipSets, PmSamplingSetExistsAndIsOnePass) {
  expect_one_pass_set(GetParam(), "pm_sampling");
}
TEST_P(ChipSets, RangeProfilerSetExistsAndIsOnePass) {
  expect_one_pass_set(GetParam(), "range_profiler");
}
TEST_P(ChipSets, AutoPicksPmSampling) {
  const MetricSetReport r = check_metric_set(GetParam());
  if (cupti_unavailable(r)) GTEST_SKIP() << "CUPTI host API unavailable: " << r.error;
  EXPECT_EQ(r.mode, "pm_sampling") << r.error;
  EXPECT_EQ(r.trigger, GetParam() == "GA100" ? "gpu_sysclk_interval" : "gpu_time_interval");
}

INSTANTIATE_TEST_SUITE_P(Ci, ChipSets, testing::Values("GA100", "GH100", "AD102", "GB100", "GB202"),
                         [](const auto& info) { return info.param; });

TEST(MetricSets, EveryTableChipResolvesToOnePassInAutoMode) {
  for (const auto& chip : supported_chips()) {
    const MetricSetReport r = check_metric_set(chip);
    if (cupti_unavailable(r)) GTEST_SKIP() << "CUPTI host API unavailable: " << r.error;
    EXPECT_TRUE(r.error.empty()) << chip << ": " << r.error;
    EXPECT_EQ(r.passes, 1) << chip;
  }
}

TEST(MetricSets, NvlinkCountersOnlyOnNvlinkChips) {
  const MetricSetReport gh = check_metric_set("GH100", "pm_sampling");
  if (cupti_unavailable(gh)) GTEST_SKIP() << "CUPTI host API unavailable: " << gh.error;
  const MetricSetReport ad = check_metric_set("AD102", "pm_sampling");
  auto has = [](const MetricSetReport& r, const std::string& counter) {
    for (const auto& m : r.metrics) {
      if (m.counter == counter) return true;
    }
    return false;
  };
  EXPECT_TRUE(has(gh, "nvlink_rx_bytes"));
  EXPECT_FALSE(has(ad, "nvlink_rx_bytes"));
}

TEST(MetricSets, UnknownChipOrModeIsAConfigError) {
  for (const char* bad : {"H100", "gh100", "GH200", "", "GX999"}) {
    try {
      check_metric_set(bad);
      ADD_FAILURE() << bad << " accepted";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string("\"") + bad + "\""), std::string::npos) << what;
      EXPECT_NE(what.find("GH100"), std::string::npos) << what;
    }
  }
  EXPECT_THROW(check_metric_set("GH100", "sometimes"), ConfigError);
  try {
    check_metric_set("TU102");
    ADD_FAILURE() << "TU102 accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("older than"), std::string::npos) << e.what();
  }
}

TEST(MetricSets, SupportedChipsCoverTheCiChips) {
  const auto chips = supported_chips();
  const std::set<std::string> all(chips.begin(), chips.end());
  for (const char* c : {"GA100", "GH100", "AD102", "GB100", "GB202"}) EXPECT_EQ(all.count(c), 1u);
  EXPECT_EQ(all.size(), chips.size()) << "a chip listed twice";
}

// ---- selection logic against a fake oracle ----

using detail::cupti::CounterSpec;
using detail::cupti::MetricOracle;
using detail::cupti::select_metric_set;

MetricOracle fake_oracle(std::set<std::string> exists, std::map<std::string, int> cost,
                         std::set<std::string> refused = {}) {
  MetricOracle o;
  o.exists = [exists](const std::string& n) { return exists.count(n) > 0; };
  // passes: 1 + the sum of the extra passes each metric costs
  o.passes = [cost, refused](const std::vector<std::string>& ms, std::string* why) {
    int p = 1;
    for (const auto& m : ms) {
      if (refused.count(m) && ms.size() > 1) {
        *why = "CUPTI_ERROR_NOT_SUPPORTED";
        return -1;
      }
      auto it = cost.find(m);
      if (it != cost.end()) p += it->second;
    }
    return p;
  };
  return o;
}

TEST(MetricSelection, FirstExistingCandidateWinsAndOptionalsStayWithinOnePass) {
  const std::vector<CounterSpec> specs = {
      {"tensor", true, {"t_new", "t_old"}},
      {"dram", true, {"d"}},
      {"sm_thr", false, {"s_fast", "s_slow"}},
      {"io", false, {"io"}},
      {"nvl", false, {"nvl"}},
  };
  MetricSetReport r;
  r.chip = "FAKE";
  r.mode = "pm_sampling";
  select_metric_set(
      specs, fake_oracle({"t_old", "d", "s_slow", "io", "nvl"}, {{"s_slow", 7}}, {"nvl"}), &r);
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.passes, 1);
  EXPECT_EQ(r.selected(), (std::vector<std::string>{"t_old", "d", "io"}));
  for (const auto& m : r.metrics) {
    if (m.name == "s_slow") EXPECT_NE(m.note.find("8 passes"), std::string::npos) << m.note;
    if (m.name == "nvl") EXPECT_NE(m.note.find("NOT_SUPPORTED"), std::string::npos) << m.note;
    if (m.name == "t_new") EXPECT_FALSE(m.exists);
  }
}

TEST(MetricSelection, MissingRequiredCounterOrMultiPassRequiredSetIsAnError) {
  const std::vector<CounterSpec> specs = {{"tensor", true, {"t"}}, {"dram", true, {"d"}}};
  MetricSetReport r;
  r.chip = "FAKE";
  r.mode = "range_profiler";
  select_metric_set(specs, fake_oracle({"t"}, {}), &r);
  EXPECT_NE(r.error.find("no metric for dram exists on FAKE in range_profiler mode"),
            std::string::npos)
      << r.error;
  MetricSetReport r2;
  select_metric_set(specs, fake_oracle({"t", "d"}, {{"d", 1}}), &r2);
  EXPECT_NE(r2.error.find("needs 2 passes"), std::string::npos) << r2.error;
  EXPECT_EQ(r2.passes, 2);
}

}  // namespace
}  // namespace steptrace
