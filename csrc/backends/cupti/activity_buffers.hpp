// CUPTI's activity buffers, for the kernel activity backend (cupti_activity.cpp): the
// process-wide registry of the buffers steptrace hands CUPTI, the pool they are reused
// from, their adaptive size, and CUPTI's buffer-request callback. The completion callback,
// which parses a buffer into the backend, is cupti_activity.cpp's. Built only with the
// CUPTI headers (the callbacks' types are theirs).
#pragma once

#include <cupti_activity.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace steptrace::detail::cupti::activity {

// Activity buffers. A non-forced flush hands back only buffers whose records are all
// complete, so while the device is busy the buffer being filled comes back once it is
// full: its size bounds how long a step record waits for its kernels. It is adapted so
// that a buffer fills in about kTargetFill (measured from request to return), within
// [kMinBuffer, kMaxBuffer]: a few hundred KB on a busy GPU, smaller on a slow one.
constexpr std::size_t kMinBuffer = std::size_t{32} << 10;
constexpr std::size_t kMaxBuffer = std::size_t{4} << 20;
constexpr std::size_t kInitialBuffer = std::size_t{512} << 10;
constexpr std::int64_t kTargetFillNs = 200'000'000;
constexpr std::size_t kBufferAlign = 8;  // CUPTI's requirement for activity buffers
constexpr std::size_t kPoolMax = 8;      // free buffers kept for reuse
constexpr std::size_t kMaxHeld = 256;    // buffers of ours CUPTI holds at once
// A buffer still out this long after it was handed over, while a later one has come
// back, is not the one being filled (CUPTI fills them in turn): records stop waiting for
// it, so that one CUPTI keeps in reserve cannot hold every step back.
constexpr std::int64_t kStaleBufferNs = 1'000'000'000;

class CuptiActivity;

std::int64_t steady_ns() noexcept;

// What CUPTI's process-wide buffer callbacks reach. Leaked on purpose: CUPTI may call
// them after the backend is gone (or at exit), when they only hand buffers back.
//
// Buffer ownership. CUPTI hands a completed buffer to whichever callbacks are registered
// when it completes, not to those that gave it: after a yield to torch.profiler (or a
// tool that took the callbacks on its own) steptrace's buffers can reach the other
// tool's callbacks and the other tool's buffers ours. Kineto ignores (leaks) buffers it
// did not allocate and frees its own with its own allocator; so do we: `held` lists every
// buffer of ours that CUPTI holds, a completed buffer not in it is never read, freed or
// pooled, and while yielding no buffer of ours is handed out (one would be completed into
// the other tool's callbacks), after a forced flush has brought ours back.
struct Shared {
  std::mutex mu;                   // guards owner and the owner's collected state
  CuptiActivity* owner = nullptr;  // the live backend; null when there is none

  // buffers (lock order: mu, then buffers_mu; buffer_requested takes buffers_mu only)
  std::mutex buffers_mu;
  struct Pooled {
    std::uint8_t* buffer;
    std::size_t capacity;
  };
  Pooled pool[kPoolMax] = {};  // free buffers (fixed arrays: no allocation)
  std::size_t pooled = 0;
  struct Held {
    std::uint8_t* buffer;
    std::uint64_t seq;          // the order CUPTI asked for it in
    std::int64_t requested_ns;  // steady clock
    std::size_t size;           // as told to CUPTI
    std::size_t capacity;       // as allocated
    bool gating;                // step records wait for it (false: gone to another tool's time)
  };
  Held held[kMaxHeld] = {};  // the registry of our buffers CUPTI holds
  std::size_t n_held = 0;
  std::uint64_t returned_below = 0;            // 1 + the newest buffer (by number) that came back
  std::atomic<std::uint64_t> requested{0};     // buffers handed to CUPTI so far
  std::atomic<std::uint64_t> done_through{0};  // every buffer numbered below is back and parsed
  std::atomic<std::size_t> buffer_bytes{kInitialBuffer};  // the size handed out next
  std::atomic<bool> declining{false};  // hand CUPTI no buffer (yielding, or closed)

  // Whether the callbacks are ours: every call of either one, and when (CUPTI's clock).
  std::atomic<decltype(&::cuptiGetTimestamp)> timestamp{nullptr};
  std::atomic<std::uint64_t> callbacks{0};
  std::atomic<std::int64_t> callback_ns{INT64_MIN};
  std::atomic<std::uint64_t> foreign{0};  // other tools' buffers handed to us, left alone

  // with buffers_mu held: `buffer` is one of ours back from CUPTI (its entry into *mine,
  // out of the registry); false: another tool's
  bool take_back(const std::uint8_t* buffer, Held* mine) noexcept;
  // with buffers_mu held: the lowest number of a buffer CUPTI still holds (and fills)
  std::uint64_t low_watermark(std::int64_t now_ns) const noexcept {
    std::uint64_t low = requested.load(std::memory_order_relaxed);
    for (std::size_t i = 0; i < n_held; ++i) {
      const Held& o = held[i];
      if (!o.gating) continue;
      if (o.seq < returned_below && now_ns - o.requested_ns > kStaleBufferNs) continue;
      low = std::min(low, o.seq);
    }
    return low;
  }
};

// The one Shared of the process.
Shared& shared();

// Either callback ran: they are registered (ours), as of now.
void note_callback(Shared& s) noexcept;

// CUPTI's buffer request: a pooled or new buffer of the current size, registered as held;
// none while declining.
void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size,
                               std::size_t* max_records) noexcept;

// A buffer of ours back: into the pool, or freed.
void release_buffer(std::uint8_t* b, std::size_t capacity) noexcept;

// A buffer that came back mostly filled tells how long filling one takes: size the next
// ones so that it takes about kTargetFillNs (at most 4x larger or smaller at once).
void adapt_buffer_size(const Shared::Held& o, std::size_t valid_size) noexcept;

}  // namespace steptrace::detail::cupti::activity
