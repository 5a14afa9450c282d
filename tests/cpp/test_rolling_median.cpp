#include "core/rolling_median.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <random>

namespace steptrace::detail {
namespace {

double brute_median(const std::deque<double>& window) {
  std::vector<double> v(window.begin(), window.end());
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

TEST(RollingMedian, EmptyIsZero) {
  RollingMedian m(5);
  EXPECT_EQ(m.median(), 0.0);
}

TEST(RollingMedian, SmallExactCases) {
  RollingMedian m(3);
  m.push(5);
  EXPECT_EQ(m.median(), 5);
  m.push(1);
  EXPECT_EQ(m.median(), 3);
  m.push(9);
  EXPECT_EQ(m.median(), 5);
  m.push(2);  // window {1, 9, 2}
  EXPECT_EQ(m.median(), 2);
  m.push(10);  // {9, 2, 10}
  EXPECT_EQ(m.median(), 9);
  EXPECT_EQ(m.size(), 3u);
}

// Matches a brute-force sorted median on random data, with ties, for several windows.
TEST(RollingMedian, MatchesBruteForceOnRandomData) {
  std::mt19937 rng(1234);
  for (const std::size_t window : {1u, 2u, 7u, 10u, 100u}) {
    RollingMedian m(window);
    std::deque<double> ref;
    std::uniform_int_distribution<int> small(0, 20);  // many ties
    std::lognormal_distribution<double> times(0.0, 0.5);
    for (int i = 0; i < 5000; ++i) {
      const double v = (i % 3 == 0) ? small(rng) : times(rng);
      m.push(v);
      ref.push_back(v);
      if (ref.size() > window) ref.pop_front();
      ASSERT_DOUBLE_EQ(m.median(), brute_median(ref)) << "window " << window << " i " << i;
    }
  }
}

}  // namespace
}  // namespace steptrace::detail
