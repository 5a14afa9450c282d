// PM samples -> per-step averages, from a fake sampler with known values: straddling
// samples split by overlap, gaps, invalid values, malformed samples, decoder losses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/sample_aggregation.hpp"

namespace steptrace::detail {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A fake sampler: back-to-back samples of `period` ns from `t0` to `t1`, each metric's
// value given by f(sample start).
template <typename F>
std::vector<PmSample> sampler(std::int64_t t0, std::int64_t t1, std::int64_t period, F f) {
  std::vector<PmSample> out;
  for (std::int64_t t = t0; t < t1; t += period) out.push_back({t, t + period, f(t)});
  return out;
}

TEST(SampleAggregation, ConstantValuesGiveThatValue) {
  auto samples = sampler(0, 1000, 10, [](std::int64_t) { return std::vector<double>{40, 80}; });
  auto r = aggregate_samples(samples, {{7, 100, 300}, {8, 300, 1000}}, 2);
  ASSERT_EQ(r.steps.size(), 2u);
  EXPECT_EQ(r.steps[0].step, 7);
  EXPECT_DOUBLE_EQ(r.steps[0].values[0], 40);
  EXPECT_DOUBLE_EQ(r.steps[1].values[1], 80);
  EXPECT_EQ(r.steps[0].samples, 20);
  EXPECT_DOUBLE_EQ(r.steps[0].coverage_pct, 100);
  EXPECT_EQ(r.outside_samples, 10);  // [0, 100) is before the first step
}

TEST(SampleAggregation, StraddlingSampleIsSplitByOverlap) {
  // one 100 ns sample at 50% from 0..100, one at 100% from 100..200; step [50, 150)
  std::vector<PmSample> samples = {{0, 100, {50}}, {100, 200, {100}}};
  auto r = aggregate_samples(samples, {{1, 50, 150}}, 1);
  EXPECT_DOUBLE_EQ(r.steps[0].values[0], 75);  // 50 ns of each
  // step [80, 200): 20 ns at 50, 100 ns at 100
  r = aggregate_samples(samples, {{1, 80, 200}}, 1);
  EXPECT_NEAR(r.steps[0].values[0], (20 * 50.0 + 100 * 100.0) / 120, 1e-12);
  EXPECT_EQ(r.steps[0].samples, 2);
}

TEST(SampleAggregation, OneSampleCoveringSeveralStepsCountsInEach) {
  std::vector<PmSample> samples = {{0, 1000, {33}}};
  auto r = aggregate_samples(samples, {{1, 100, 200}, {2, 200, 400}, {3, 900, 1100}}, 1);
  for (const auto& s : r.steps) EXPECT_DOUBLE_EQ(s.values[0], 33);
  EXPECT_DOUBLE_EQ(r.steps[2].coverage_pct, 50);  // [1000, 1100) has no sample
}

TEST(SampleAggregation, RampAveragesToItsMidpoint) {
  // value = t / 10 over [0, 1000) with 1 ns samples: the mean over [200, 400) is 29.95
  auto samples = sampler(
      0, 1000, 1, [](std::int64_t t) { return std::vector<double>{static_cast<double>(t) / 10}; });
  auto r = aggregate_samples(samples, {{0, 200, 400}}, 1);
  EXPECT_NEAR(r.steps[0].values[0], 29.95, 1e-9);
}

TEST(SampleAggregation, InvalidValuesAndGapsAreNotCounted) {
  std::vector<PmSample> samples = {{0, 100, {10, kNaN}}, {200, 300, {30, 5}}};
  auto r = aggregate_samples(samples, {{1, 0, 400}, {2, 500, 600}}, 2);
  EXPECT_DOUBLE_EQ(r.steps[0].values[0], 20);
  EXPECT_DOUBLE_EQ(r.steps[0].values[1], 5);  // only the second sample is valid
  EXPECT_DOUBLE_EQ(r.steps[0].coverage_pct, 50);
  EXPECT_TRUE(std::isnan(r.steps[1].values[0]));
  EXPECT_EQ(r.steps[1].samples, 0);
  EXPECT_DOUBLE_EQ(r.steps[1].coverage_pct, 0);
}

TEST(SampleAggregation, MalformedSamplesAndLossesAreReported) {
  std::vector<PmSample> samples = {{100, 50, {1}}, {0, 10, {1, 2}}, {0, 10, {4}}, {20, 20, {8}}};
  auto r = aggregate_samples(samples, {{1, 0, 100}}, 1, DecodeLosses{3, true});
  EXPECT_EQ(r.malformed_samples, 2);
  EXPECT_EQ(r.dropped_samples, 3);
  EXPECT_TRUE(r.overflow);
  // the zero-length sample counts as 1 ns: (10*4 + 1*8) / 11
  EXPECT_NEAR(r.steps[0].values[0], 48.0 / 11, 1e-12);
}

TEST(SampleAggregation, StepsInAnyOrderKeepTheirOrder) {
  auto samples = sampler(
      0, 300, 100, [](std::int64_t t) { return std::vector<double>{static_cast<double>(t)}; });
  auto r = aggregate_samples(samples, {{3, 200, 300}, {1, 0, 100}, {2, 100, 200}}, 1);
  EXPECT_EQ(r.steps[0].step, 3);
  EXPECT_DOUBLE_EQ(r.steps[0].values[0], 200);
  EXPECT_DOUBLE_EQ(r.steps[1].values[0], 0);
  EXPECT_DOUBLE_EQ(r.steps[2].values[0], 100);
}

}  // namespace
}  // namespace steptrace::detail
