// Median of the last `capacity` values, maintained in O(log W) per push with fixed
// memory: two indexed heaps (a max-heap of the lower half, a min-heap of the upper half)
// over a ring of slots, so the value leaving the window is removed from the middle of
// its heap without a search.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace steptrace::detail {

class RollingMedian {
 public:
  explicit RollingMedian(std::size_t capacity)
      : capacity_(capacity), values_(capacity), heap_of_(capacity), pos_(capacity) {
    lower_.reserve(capacity);
    upper_.reserve(capacity);
  }

  /// Adds a value, dropping the oldest once the window is full.
  void push(double value) {
    std::size_t slot;
    if (count_ < capacity_) {
      slot = count_++;
    } else {
      slot = next_;
      erase(slot);
    }
    next_ = (slot + 1) % capacity_;
    values_[slot] = value;
    insert(slot);
  }

  std::size_t size() const noexcept { return count_; }
  std::size_t capacity() const noexcept { return capacity_; }

  /// The window's values, in no particular order, into `out` (replacing its contents).
  void copy_to(std::vector<double>& out) const {
    out.assign(values_.begin(), values_.begin() + static_cast<std::ptrdiff_t>(count_));
  }

  /// Median of the window (mean of the two middle values for an even count); 0 if empty.
  double median() const noexcept {
    if (lower_.empty()) return 0.0;
    if (lower_.size() > upper_.size()) return values_[lower_[0]];
    return 0.5 * (values_[lower_[0]] + values_[upper_[0]]);
  }

 private:
  enum Heap : std::uint8_t { kLower = 0, kUpper = 1 };

  std::vector<std::uint32_t>& heap(Heap h) { return h == kLower ? lower_ : upper_; }
  // Lower is a max-heap, upper a min-heap: "a above b" in heap order.
  bool above(Heap h, std::uint32_t a, std::uint32_t b) const {
    return h == kLower ? values_[a] > values_[b] : values_[a] < values_[b];
  }

  void place(Heap h, std::size_t i, std::uint32_t slot) {
    heap(h)[i] = slot;
    heap_of_[slot] = h;
    pos_[slot] = static_cast<std::uint32_t>(i);
  }

  void sift_up(Heap h, std::size_t i) {
    auto& v = heap(h);
    const std::uint32_t slot = v[i];
    while (i > 0) {
      const std::size_t parent = (i - 1) / 2;
      if (!above(h, slot, v[parent])) break;
      place(h, i, v[parent]);
      i = parent;
    }
    place(h, i, slot);
  }

  void sift_down(Heap h, std::size_t i) {
    auto& v = heap(h);
    const std::uint32_t slot = v[i];
    const std::size_t n = v.size();
    for (;;) {
      std::size_t child = 2 * i + 1;
      if (child >= n) break;
      if (child + 1 < n && above(h, v[child + 1], v[child])) ++child;
      if (!above(h, v[child], slot)) break;
      place(h, i, v[child]);
      i = child;
    }
    place(h, i, slot);
  }

  void push_heap(Heap h, std::uint32_t slot) {
    heap(h).push_back(slot);
    sift_up(h, heap(h).size() - 1);
  }

  std::uint32_t pop_top(Heap h) {
    auto& v = heap(h);
    const std::uint32_t top = v[0];
    const std::uint32_t last = v.back();
    v.pop_back();
    if (!v.empty()) {
      place(h, 0, last);
      sift_down(h, 0);
    }
    return top;
  }

  void insert(std::size_t slot) {
    const auto s = static_cast<std::uint32_t>(slot);
    if (lower_.empty() || values_[s] <= values_[lower_[0]]) {
      push_heap(kLower, s);
    } else {
      push_heap(kUpper, s);
    }
    rebalance();
  }

  void erase(std::size_t slot) {
    const Heap h = static_cast<Heap>(heap_of_[slot]);
    auto& v = heap(h);
    const std::size_t i = pos_[slot];
    const std::uint32_t last = v.back();
    v.pop_back();
    if (i < v.size()) {
      place(h, i, last);
      sift_up(h, i);
      sift_down(h, pos_[last]);
    }
    rebalance();
  }

  // Keeps lower_ equal to upper_ in size, or one larger.
  void rebalance() {
    if (lower_.size() > upper_.size() + 1) {
      push_heap(kUpper, pop_top(kLower));
    } else if (upper_.size() > lower_.size()) {
      push_heap(kLower, pop_top(kUpper));
    }
  }

  std::size_t capacity_;
  std::size_t count_ = 0;
  std::size_t next_ = 0;  // slot the next value goes to once the window is full
  std::vector<double> values_;
  std::vector<std::uint8_t> heap_of_;
  std::vector<std::uint32_t> pos_;
  std::vector<std::uint32_t> lower_;
  std::vector<std::uint32_t> upper_;
};

}  // namespace steptrace::detail
