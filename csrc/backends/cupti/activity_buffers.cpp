#if STEPTRACE_HAVE_CUPTI_HEADERS

#include "activity_buffers.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>

namespace steptrace::detail::cupti::activity {

std::int64_t steady_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool Shared::take_back(const std::uint8_t* buffer, Held* mine) noexcept {
  for (std::size_t i = 0; i < n_held; ++i) {
    if (held[i].buffer == buffer) {
      *mine = held[i];
      held[i] = held[--n_held];
      if (mine->gating) returned_below = std::max(returned_below, mine->seq + 1);
      return true;
    }
  }
  return false;
}

Shared& shared() {
  static Shared* s = new Shared;  // NOLINT(cppcoreguidelines-owning-memory): see Shared
  return *s;
}

void note_callback(Shared& s) noexcept {
  std::uint64_t t = 0;
  auto* timestamp = s.timestamp.load(std::memory_order_relaxed);
  if (timestamp != nullptr && timestamp(&t) == CUPTI_SUCCESS) {
    const auto now = static_cast<std::int64_t>(t);
    std::int64_t last = s.callback_ns.load(std::memory_order_relaxed);
    while (last < now && !s.callback_ns.compare_exchange_weak(last, now)) {
    }
  }
  s.callbacks.fetch_add(1, std::memory_order_acq_rel);
}

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size,
                               std::size_t* max_records) noexcept {
  Shared& s = shared();
  note_callback(s);
  *buffer = nullptr;  // declined: CUPTI drops records and counts them
  *size = 0;
  *max_records = 0;
  if (s.declining.load(std::memory_order_acquire)) return;
  const std::size_t want = s.buffer_bytes.load(std::memory_order_relaxed);
  std::uint8_t* b = nullptr;
  std::size_t capacity = want;
  {
    std::lock_guard<std::mutex> lock(s.buffers_mu);
    for (std::size_t i = s.pooled; i-- > 0;) {
      if (s.pool[i].capacity >= want) {
        b = s.pool[i].buffer;
        capacity = s.pool[i].capacity;
        s.pool[i] = s.pool[--s.pooled];
        break;
      }
    }
  }
  if (b == nullptr) b = static_cast<std::uint8_t*>(std::aligned_alloc(kBufferAlign, capacity));
  if (b == nullptr) return;
  bool tracked = false;
  {
    const std::int64_t now = steady_ns();
    std::lock_guard<std::mutex> lock(s.buffers_mu);
    if (s.n_held == kMaxHeld) {
      // full of buffers lost to another tool's callbacks: forget one (if it ever comes
      // back it is left alone as a stranger's, a leak as the other tool leaks ours)
      for (std::size_t i = 0; i < s.n_held; ++i) {
        if (!s.held[i].gating) {
          s.held[i] = s.held[--s.n_held];
          break;
        }
      }
    }
    if (s.n_held < kMaxHeld) {
      const std::uint64_t seq = s.requested.load(std::memory_order_relaxed);
      s.held[s.n_held++] = {b, seq, now, want, capacity, true};
      s.requested.store(seq + 1, std::memory_order_release);
      tracked = true;
    }
  }
  if (!tracked) {  // an untracked buffer could not be told from a stranger's later
    release_buffer(b, capacity);
    return;
  }
  *buffer = b;
  *size = want;
}

void release_buffer(std::uint8_t* b, std::size_t capacity) noexcept {
  Shared& s = shared();
  {
    std::lock_guard<std::mutex> lock(s.buffers_mu);
    // too small for what is handed out now (the size grew): not worth keeping
    if (s.pooled < kPoolMax && capacity >= s.buffer_bytes.load(std::memory_order_relaxed)) {
      s.pool[s.pooled++] = {b, capacity};
      return;
    }
  }
  std::free(b);  // NOLINT(cppcoreguidelines-no-malloc): from aligned_alloc
}

void adapt_buffer_size(const Shared::Held& o, std::size_t valid_size) noexcept {
  if (valid_size * 2 < o.size) return;  // returned early (forced, or all complete): no measure
  const std::int64_t took = std::max<std::int64_t>(1, steady_ns() - o.requested_ns);
  const double ideal =
      static_cast<double>(o.size) * static_cast<double>(kTargetFillNs) / static_cast<double>(took);
  const double lo = std::max<double>(kMinBuffer, static_cast<double>(o.size) / 4);
  const double hi = std::min<double>(kMaxBuffer, static_cast<double>(o.size) * 4);
  const auto next = static_cast<std::size_t>(std::clamp(ideal, lo, hi)) & ~std::size_t{4095};
  shared().buffer_bytes.store(std::max(next, kMinBuffer), std::memory_order_relaxed);
}

}  // namespace steptrace::detail::cupti::activity

#endif  // STEPTRACE_HAVE_CUPTI_HEADERS
