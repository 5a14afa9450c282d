// The host clock from the CPU's time-stamp counter (backends/host/tsc_clock.hpp): the map's
// arithmetic against synthetic clocks (a counter at 2.1 GHz, a kernel clock that NTP slews,
// a counter that is not the clock), then the real counter against the kernel's clock where
// the kernel keeps time with it.
#include "backends/host/tsc_clock.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "backends/host/monotonic_clock.hpp"

namespace steptrace {
namespace {

// A counter at 2.1 GHz against a kernel clock whose rate (ppm off the counter's) changes at
// given times, as NTP's slewing changes it (adjtimex(2): at most 500 ppm).
struct SyntheticClocks {
  struct Rate {
    std::int64_t from_ns;  // true time
    double ppm;
  };
  std::vector<Rate> rates;
  std::uint64_t tsc(std::int64_t t) const {
    return 1'000'000'000ULL + static_cast<std::uint64_t>(static_cast<double>(t) * 2.1);
  }
  std::int64_t kernel_ns(std::int64_t t) const {  // the kernel's clock at true time t
    double ns = 5e12;                             // an uptime of 5,000 s
    std::int64_t at = 0;
    double ppm = 0;
    for (const Rate& r : rates) {
      if (r.from_ns > t) break;
      ns += static_cast<double>(r.from_ns - at) * (1 + ppm * 1e-6);
      at = r.from_ns;
      ppm = r.ppm;
    }
    return static_cast<std::int64_t>(ns + static_cast<double>(t - at) * (1 + ppm * 1e-6));
  }
};

constexpr std::int64_t kMs = 1'000'000;
constexpr std::int64_t kS = 1'000'000'000;

TEST(TscMap, TheFirstPairStartsTheSpanAndTheSecondGivesTheRate) {
  SyntheticClocks c{{{0, 20}}};
  TscMap map;
  EXPECT_FALSE(map.calibrated());
  EXPECT_EQ(map.next_anchor_ns(), INT64_MAX);  // no pair asked for before start()
  map.start();
  EXPECT_EQ(map.next_anchor_ns(), INT64_MIN);  // the first pair at once (and again if it failed)
  ASSERT_TRUE(map.anchor(c.tsc(0), c.kernel_ns(0)));
  EXPECT_FALSE(map.calibrated());
  EXPECT_EQ(map.next_anchor_ns(), c.kernel_ns(0) + TscMap::kCalibrateNs);
  ASSERT_TRUE(map.anchor(c.tsc(100 * kMs), c.kernel_ns(100 * kMs)));
  ASSERT_TRUE(map.calibrated());
  EXPECT_EQ(map.next_anchor_ns(), c.kernel_ns(100 * kMs) + TscMap::kReanchorNs);
  // a second later, without another pair: within the rate's fixed-point rounding
  for (std::int64_t t = 100 * kMs; t <= 1100 * kMs; t += 7 * kMs) {
    EXPECT_NEAR(static_cast<double>(map.at(c.tsc(t))), static_cast<double>(c.kernel_ns(t)), 2.0)
        << "at " << t;
  }
}

TEST(TscMap, FollowsAClockThatNtpSlewsAndNeverGoesBack) {
  // steady, then NTP slewing at its limit one way, then the other, then steady again
  SyntheticClocks c{{{0, 0}, {3 * kS, 500}, {6 * kS, -500}, {9 * kS, 3}}};
  TscMap map;
  std::int64_t t = 0;
  ASSERT_TRUE(map.anchor(c.tsc(t), c.kernel_ns(t)));
  std::int64_t last = INT64_MIN;
  std::int64_t anchors_t[2] = {0, 0};  // the last two pairs' times
  while (t < 12 * kS) {
    t += 250'000 + (t / 977) % 300'000;  // a boundary every 0.25-0.55 ms
    const std::int64_t read = map.calibrated() ? map.at(c.tsc(t)) : c.kernel_ns(t);
    EXPECT_GE(read, last) << "back in time at " << t;
    last = read;
    // off by at most the rate change (1,000 ppm when it swings from +500 to -500) over
    // the time since the pair before the last: the last pair's own offset, held and
    // caught up over the next second, and the new rate's error since it; plus the rounding
    const double since = static_cast<double>(t - anchors_t[0]);
    EXPECT_LE(std::abs(static_cast<double>(read - c.kernel_ns(t))), since * 1000e-6 + 1000)
        << "at " << t;
    if (c.kernel_ns(t) >= map.next_anchor_ns()) {  // a step's end takes a pair
      ASSERT_TRUE(map.anchor(c.tsc(t), c.kernel_ns(t))) << "at " << t;
      anchors_t[0] = anchors_t[1];
      anchors_t[1] = t;
    }
  }
  // in the steady stretch at the end, a second after a pair, the map is on the clock
  EXPECT_NEAR(static_cast<double>(map.at(c.tsc(12 * kS))),
              static_cast<double>(c.kernel_ns(12 * kS)), 1000.0);
}

TEST(TscMap, AMapThatRanAheadHoldsItsReadingAndMeetsTheClockASecondLater) {
  SyntheticClocks c{{{0, 0}, {1100 * kMs, -100}}};  // the clock slows by 100 ppm at 1.1 s
  TscMap map;
  ASSERT_TRUE(map.anchor(c.tsc(0), c.kernel_ns(0)));
  ASSERT_TRUE(map.anchor(c.tsc(100 * kMs), c.kernel_ns(100 * kMs)));
  ASSERT_TRUE(map.anchor(c.tsc(1100 * kMs), c.kernel_ns(1100 * kMs)));
  const std::int64_t t = 2100 * kMs;  // the map is now ahead by ~100 us
  const std::int64_t before = map.at(c.tsc(t));
  ASSERT_GT(before - c.kernel_ns(t), 90'000);
  ASSERT_TRUE(map.anchor(c.tsc(t), c.kernel_ns(t)));
  EXPECT_GE(map.at(c.tsc(t)), before);  // held, not stepped back
  EXPECT_GE(map.at(c.tsc(t + 1000)), before);
  // a second later (the clock's new rate learned from this pair) it meets the clock
  EXPECT_NEAR(static_cast<double>(map.at(c.tsc(t + kS))), static_cast<double>(c.kernel_ns(t + kS)),
              2'000.0);
}

TEST(TscMap, ACounterThatIsNotTheClockIsDroppedForGood) {
  SyntheticClocks c{{{0, 0}}};
  auto calibrated = [&] {
    TscMap map;
    EXPECT_TRUE(map.anchor(c.tsc(0), c.kernel_ns(0)));
    EXPECT_TRUE(map.anchor(c.tsc(100 * kMs), c.kernel_ns(100 * kMs)));
    return map;
  };
  {  // the counter jumped 5 ms ahead (an unsynchronized CPU, a VM's counter reset)
    TscMap map = calibrated();
    EXPECT_FALSE(map.anchor(c.tsc(1100 * kMs) + 10'500'000, c.kernel_ns(1100 * kMs)));
    EXPECT_FALSE(map.calibrated());
    EXPECT_TRUE(map.failed());
    EXPECT_EQ(map.next_anchor_ns(), INT64_MAX);                            // no more pairs
    EXPECT_FALSE(map.anchor(c.tsc(2100 * kMs), c.kernel_ns(2100 * kMs)));  // not taken back
    EXPECT_FALSE(map.calibrated());
  }
  {  // the counter went back
    TscMap map = calibrated();
    EXPECT_FALSE(map.anchor(c.tsc(50 * kMs), c.kernel_ns(1100 * kMs)));
    EXPECT_FALSE(map.calibrated());
  }
  {  // the counter stopped (a non-invariant counter in a deep C-state)
    TscMap map;
    EXPECT_TRUE(map.anchor(c.tsc(0), c.kernel_ns(0)));
    EXPECT_FALSE(map.anchor(c.tsc(0), c.kernel_ns(100 * kMs)));
    EXPECT_FALSE(map.calibrated());
  }
  {  // 2,000 ppm off over a second: more than NTP ever slews
    TscMap map = calibrated();
    EXPECT_FALSE(map.anchor(c.tsc(1100 * kMs), c.kernel_ns(1100 * kMs) + 2'000'000));
  }
  {  // 500 ppm off over a second: slewing, followed
    TscMap map = calibrated();
    EXPECT_TRUE(map.anchor(c.tsc(1100 * kMs), c.kernel_ns(1100 * kMs) + 500'000));
    EXPECT_TRUE(map.calibrated());
  }
}

TEST(TscClock, OnThisMachineTheCounterReadsTheKernelsMonotonicClock) {
  if (!tsc_usable()) {
    GTEST_SKIP() << "the kernel does not keep time with an invariant TSC here: the host clock "
                    "is CLOCK_MONOTONIC itself";
  }
  TscMap map;
  std::uint64_t tsc = 0;
  std::int64_t ns = 0;
  ASSERT_TRUE(read_tsc_pair(&tsc, &ns));
  ASSERT_TRUE(map.anchor(tsc, ns));
  // wait out the calibration span on the kernel's clock (time has to pass: nothing to sync on)
  while (monotonic_now_ns() < map.next_anchor_ns()) {
  }
  ASSERT_TRUE(read_tsc_pair(&tsc, &ns));
  ASSERT_TRUE(map.anchor(tsc, ns));
  ASSERT_TRUE(map.calibrated());
  int outside = 0;
  std::int64_t worst = 0;
  for (int i = 0; i < 20'000; ++i) {
    const std::int64_t before = monotonic_now_ns();
    const std::int64_t read = map.at(read_tsc());
    const std::int64_t after = monotonic_now_ns();
    if (after - before > 20'000) continue;  // preempted between the readings: no bracket
    // within 2 us of the bracket (the pairs' spread and the rate over ~0.1 s)
    const std::int64_t off = read < before ? before - read : read > after ? read - after : 0;
    worst = std::max(worst, off);
    outside += off > 2'000;
  }
  EXPECT_EQ(outside, 0) << "worst " << worst << " ns off the kernel's clock";
}

}  // namespace
}  // namespace steptrace
