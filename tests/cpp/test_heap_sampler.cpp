// HeapSampler's schedule (heap_sampler.hpp): which steps read the C heap, on a fake clock
// with a scripted heap whose every reading costs a known time.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "backends/fake/fake_backends.hpp"
#include "core/host/heap_sampler.hpp"
#include "steptrace/config.hpp"

namespace steptrace::detail {
namespace {

constexpr std::int64_t kStepNs = 1'000'000;  // 1 ms per step
constexpr std::int64_t kReadNs = 5'000;      // 5 us per reading: 25 steps' 0.02% budget

struct HeapRun {
  fake::FakeClock* clock = nullptr;
  std::int64_t heap_bytes = 100 << 20;
  std::unique_ptr<HeapSampler> sampler;
  std::vector<std::int64_t> read_steps;  // the steps whose record got a heap figure

  explicit HeapRun(const Config& config) {
    auto fake = std::make_unique<fake::FakeClock>();
    clock = fake.get();
    sampler = std::make_unique<HeapSampler>(config, std::move(fake), [this] {
      clock->advance(kReadNs);
      return heap_bytes;
    });
  }

  void steps(std::int64_t from, std::int64_t to) {
    for (std::int64_t step = from; step < to; ++step) {
      clock->advance(kStepNs);
      MemorySample m;
      sampler->sample(step, m);
      if (m.heap_bytes >= 0) {
        EXPECT_EQ(m.heap_bytes, heap_bytes);
        read_steps.push_back(step);
      }
    }
  }

  std::vector<std::int64_t> gaps_from(std::int64_t step) const {
    std::vector<std::int64_t> gaps;
    std::int64_t before = -1;
    for (const std::int64_t s : read_steps) {
      if (s < step) {
        before = s;
        continue;
      }
      gaps.push_back(s - before);
      before = s;
    }
    return gaps;
  }
};

Config config() {
  Config c;
  c.warmup_steps = 10;
  c.min_history = 20;       // dense until step 30
  c.memory_growth_pct = 2;  // a reading 1% over the baseline starts a burst
  return c;
}

TEST(HeapSampler, ReadsTheFirstStepAndEveryBaselineStepThenRampsToTheBudgetsStride) {
  HeapRun run(config());
  run.steps(0, 400);
  // warmup (steps 0-9): only its first step, the first measure of a read's cost; nothing
  // uses the others (the detector skips warmup, the baseline starts after it)
  ASSERT_GE(run.read_steps.size(), 21U);
  EXPECT_EQ(run.read_steps[0], 0);
  for (std::int64_t s = 10; s < 30; ++s) EXPECT_EQ(run.read_steps[s - 9], s);
  // after the baseline: gaps 1, 2, 4, 8, 16, then the budget's 25 (5 us per 1 ms step)
  const std::vector<std::int64_t> gaps = run.gaps_from(30);
  const std::vector<std::int64_t> want = {1, 2, 4, 8, 16, 25, 25, 25, 25, 25, 25, 25, 25, 25};
  ASSERT_GE(gaps.size(), want.size());
  EXPECT_EQ(std::vector<std::int64_t>(gaps.begin(), gaps.begin() + want.size()), want);
  EXPECT_EQ(run.sampler->stride(), 25);
}

TEST(HeapSampler, SparseReadsStayWithinTwoHundredthsOfAPercentOfTheStepTime) {
  HeapRun run(config());
  run.steps(0, 30);
  const std::size_t dense = run.read_steps.size();
  run.steps(30, 20'030);
  const auto sparse = static_cast<double>(run.read_steps.size() - dense);
  const double budget_reads = 0.0002 * 20'000 * kStepNs / kReadNs;  // 800
  EXPECT_LE(sparse, budget_reads * 1.01);
  EXPECT_GE(sparse, budget_reads * 0.95);  // and not much sparser than it may be
}

TEST(HeapSampler, ACrossingStartsABurstOfDenseReadsThenRampsAgain) {
  HeapRun run(config());
  run.steps(0, 300);
  run.heap_bytes = 110 << 20;  // 10% over the baseline: well past half the tolerance
  const std::int64_t before = run.read_steps.back();
  run.steps(300, 600);
  std::int64_t crossing = -1;
  for (const std::int64_t s : run.read_steps) {
    if (s >= 300) {
      crossing = s;
      break;
    }
  }
  ASSERT_GT(crossing, 0);
  EXPECT_LE(crossing - before, 25);  // the next sparse reading sees it
  // the 40 steps after it read at every step (the trend test gets its points at once)
  const std::vector<std::int64_t> gaps = run.gaps_from(crossing + 1);
  ASSERT_GE(gaps.size(), 45U);
  for (std::size_t i = 0; i < 40; ++i) EXPECT_EQ(gaps[i], 1) << i;
  // then the burst's peak is the baseline: the ramp starts over
  EXPECT_EQ(std::vector<std::int64_t>(gaps.begin() + 40, gaps.begin() + 45),
            (std::vector<std::int64_t>{1, 2, 4, 8, 16}));
}

TEST(HeapSampler, NoFigureWhereTheReadingHasNone) {
  Config c = config();
  HeapSampler sampler(c, std::make_unique<fake::FakeClock>(), [] { return std::int64_t{-1}; });
  MemorySample m;
  sampler.sample(0, m);
  EXPECT_EQ(m.heap_bytes, -1);
}

}  // namespace
}  // namespace steptrace::detail
