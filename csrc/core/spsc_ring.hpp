// Bounded single-producer single-consumer ring of trivially copyable slots. The training
// thread produces, the writer thread consumes; neither locks nor allocates.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <new>

namespace steptrace::detail {

template <typename T>
class SpscRing {
 public:
  /// capacity is rounded up to a power of two.
  explicit SpscRing(std::size_t capacity) {
    std::size_t cap = 1;
    while (cap < capacity) cap <<= 1;
    mask_ = cap - 1;
    slots_ = std::make_unique<T[]>(cap);
  }

  std::size_t capacity() const noexcept { return mask_ + 1; }

  /// Producer: the slot to fill next, or nullptr when the ring is full.
  T* begin_push() noexcept {
    const std::size_t head = head_.load(std::memory_order_relaxed);
    if (head - cached_tail_ > mask_) {
      cached_tail_ = tail_.load(std::memory_order_acquire);
      if (head - cached_tail_ > mask_) return nullptr;
    }
    return &slots_[head & mask_];
  }
  /// Producer: publishes the slot returned by begin_push.
  void commit_push() noexcept {
    head_.store(head_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }

  /// Producer: the slot the next push will fill (it may still be the consumer's), for a
  /// prefetch only.
  const T* next_slot() const noexcept {
    return &slots_[head_.load(std::memory_order_relaxed) & mask_];
  }
  /// Producer: at least half full, by the producer's view of the consumer first (its own
  /// line), reading the consumer's index only when that view says so.
  bool at_least_half_full() noexcept {
    const std::size_t head = head_.load(std::memory_order_relaxed);
    if (head - cached_tail_ < (mask_ + 1) / 2) return false;
    cached_tail_ = tail_.load(std::memory_order_acquire);
    return head - cached_tail_ >= (mask_ + 1) / 2;
  }

  /// Consumer: the oldest published slot, or nullptr when empty.
  const T* front() noexcept {
    const std::size_t tail = tail_.load(std::memory_order_relaxed);
    if (tail == cached_head_) {
      cached_head_ = head_.load(std::memory_order_acquire);
      if (tail == cached_head_) return nullptr;
    }
    return &slots_[tail & mask_];
  }
  /// Consumer: releases the slot returned by front.
  void pop() noexcept {
    tail_.store(tail_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }

  std::size_t size() const noexcept {
    return head_.load(std::memory_order_acquire) - tail_.load(std::memory_order_acquire);
  }

 private:
  static constexpr std::size_t kLine = 64;
  std::unique_ptr<T[]> slots_;
  std::size_t mask_ = 0;
  alignas(kLine) std::atomic<std::size_t> head_{0};
  std::size_t cached_tail_ = 0;  // producer's view of tail_
  alignas(kLine) std::atomic<std::size_t> tail_{0};
  std::size_t cached_head_ = 0;  // consumer's view of head_
};

}  // namespace steptrace::detail
