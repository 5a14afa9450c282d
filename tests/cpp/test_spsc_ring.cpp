#include "core/spsc_ring.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <thread>

namespace steptrace::detail {
namespace {

TEST(SpscRing, RoundsCapacityUpToPowerOfTwo) {
  SpscRing<int> ring(5);
  EXPECT_EQ(ring.capacity(), 8u);
}

TEST(SpscRing, FullAndEmpty) {
  SpscRing<int> ring(4);
  EXPECT_EQ(ring.front(), nullptr);
  for (int i = 0; i < 4; ++i) {
    int* slot = ring.begin_push();
    ASSERT_NE(slot, nullptr);
    *slot = i;
    ring.commit_push();
  }
  EXPECT_EQ(ring.begin_push(), nullptr);
  EXPECT_EQ(ring.size(), 4u);
  EXPECT_EQ(*ring.front(), 0);
  ring.pop();
  EXPECT_NE(ring.begin_push(), nullptr);
}

TEST(SpscRing, ConcurrentTransferKeepsOrder) {
  SpscRing<std::int64_t> ring(64);
  constexpr std::int64_t kCount = 200000;
  std::thread producer([&] {
    for (std::int64_t i = 0; i < kCount; ++i) {
      std::int64_t* slot;
      while ((slot = ring.begin_push()) == nullptr) std::this_thread::yield();
      *slot = i;
      ring.commit_push();
    }
  });
  std::int64_t expected = 0;
  while (expected < kCount) {
    const std::int64_t* v = ring.front();
    if (v == nullptr) {
      std::this_thread::yield();
      continue;
    }
    ASSERT_EQ(*v, expected);
    ring.pop();
    ++expected;
  }
  producer.join();
  EXPECT_EQ(ring.size(), 0u);
}

}  // namespace
}  // namespace steptrace::detail
