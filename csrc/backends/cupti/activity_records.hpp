// The pure half of the CUPTI activity backend: turns parsed activity records (kernel
// executions and the API calls that launched them) into KernelRecords tagged with the
// step they were launched in, interns kernel names and classifies each distinct name
// once. No CUPTI headers, so it is tested from canned records on any machine.
//
// How a kernel finds its step (the attribution rule)
// ---------------------------------------------------
// CUPTI gives every CUDA API call, on any thread, a correlation id from one process-wide
// counter at the call's entry, so ids increase with the calls' start times whichever
// thread makes them; a kernel record carries the id of the launch call that queued it,
// and the API record of that call carries its id and its host start time. The training
// thread publishes a timestamp (on CUPTI's clock) at each step's begin and end (MarkRing:
// a few plain stores into a ring, no lock, no allocation). Those marks cut host time
// into segments: [begin(s), end(s)) is step s, [end(s), begin(s+1)) is outside any step.
// A kernel belongs to the segment in which its launch call started. Since ids grow with
// start times, that is the same as: step s owns the ids in [first(begin(s)),
// first(end(s))), where first(t) is the smallest id of an API record that started at or
// after t. So only the smallest id seen per segment is kept (no per-call table), and a
// kernel is placed by a binary search over those minima.
//
// This is correct for kernels launched from any thread during the step: autograd's
// backward worker, DDP's communication hooks and NCCL launches started between begin(s)
// and end(s) get ids in step s's range because their calls started then, not because of
// the thread they ran on (per-thread external correlation ids, the former scheme, only
// tagged the thread that pushed them, and CUPTI emits those records only beside API
// records). It holds whatever order the buffers arrive in, once the kernel's own launch
// record has been seen: that record lies in the kernel's segment, so the minimum of that
// segment is at most the kernel's id, and every record of a later segment has a larger
// id. So a kernel waits (bounded) until its launch record has come (a bitmap of the
// launch ids seen); if it never does (a launch API whose records are not enabled), it is
// placed by the neighbouring launches once every buffer that could hold that record has
// been delivered. A kernel launched between two steps (the data phase, a logging call)
// is outside any step, as before.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "steptrace/backend.hpp"
#include "steptrace/ext/device_activity.hpp"

namespace steptrace::detail::cupti {

/// The fields steptrace reads from one CUPTI activity record.
struct ParsedRecord {
  enum class Kind : std::uint8_t {
    kKernel,  // CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
    kApi,     // CUPTI_ACTIVITY_KIND_RUNTIME / DRIVER / INTERNAL_LAUNCH_API
    kOther,   // any other kind (ignored, counted)
  };
  Kind kind = Kind::kOther;
  std::uint64_t start_ns = 0;        // kernel: device start and end (0, 0: not timed);
  std::uint64_t end_ns = 0;          // API call: host start and end, on CUPTI's clock
  std::uint32_t correlation_id = 0;  // both kinds: the launching API call's id
  const char* name = nullptr;        // kernel: owned by CUPTI, read during add() only
};

/// Step boundaries from the training thread to whoever parses the records: a
/// single-producer ring of (step, begin or end, timestamp). publish() costs three
/// relaxed stores, a release fence and two release stores (plain moves on x86): no
/// allocation, no lock. One consumer at a time (the backend serializes them); one that
/// falls more than kCapacity marks behind loses the oldest, and counts them.
class MarkRing {
 public:
  static constexpr std::size_t kCapacity = 1024;

  void publish(std::int64_t step, bool begin, std::int64_t t_ns) noexcept {
    const std::uint64_t n = published_.load(std::memory_order_relaxed);
    Slot& s = slots_[n % kCapacity];
    s.seq.store(2 * n + 1, std::memory_order_relaxed);  // odd: being written
    std::atomic_thread_fence(std::memory_order_release);
    s.t_ns.store(t_ns, std::memory_order_relaxed);
    s.tag.store(step * 2 + (begin ? 0 : 1), std::memory_order_relaxed);
    s.seq.store(2 * n + 2, std::memory_order_release);
    published_.store(n + 1, std::memory_order_release);
  }

  /// Calls f(step, begin, t_ns) for each mark published since the last call, in order;
  /// returns how many were lost (overwritten before they were read).
  template <typename F>
  std::uint64_t consume(F&& f) {
    const std::uint64_t end = published_.load(std::memory_order_acquire);
    std::uint64_t lost = 0;
    if (end - consumed_ > kCapacity) {
      lost += end - consumed_ - kCapacity;
      consumed_ = end - kCapacity;
    }
    for (; consumed_ < end; ++consumed_) {
      const Slot& s = slots_[consumed_ % kCapacity];
      const std::uint64_t seq = s.seq.load(std::memory_order_acquire);
      const std::int64_t t = s.t_ns.load(std::memory_order_relaxed);
      const std::int64_t tag = s.tag.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (seq != 2 * consumed_ + 2 || s.seq.load(std::memory_order_relaxed) != seq) {
        ++lost;  // overwritten by a later mark while we read it
        continue;
      }
      f(tag >> 1, (tag & 1) == 0, t);
    }
    return lost;
  }

 private:
  struct Slot {
    std::atomic<std::uint64_t> seq{0};
    std::atomic<std::int64_t> t_ns{0};
    std::atomic<std::int64_t> tag{0};
  };
  Slot slots_[kCapacity];
  std::atomic<std::uint64_t> published_{0};
  std::uint64_t consumed_ = 0;  // consumer side only
};

/// Counters of what add() saw, for tests and diagnostics.
struct ActivityStats {
  std::uint64_t kernels = 0;               // kernel records added (timed ones)
  std::uint64_t attributed = 0;            // delivered with a step
  std::uint64_t unattributed = 0;          // delivered without one (launched outside any step,
                                           // or before the oldest step boundary kept)
  std::uint64_t untimed = 0;               // kernel records without timestamps (dropped)
  std::uint64_t waited = 0;                // kernels that came before their launch record
  std::uint64_t placed_by_neighbours = 0;  // delivered without their launch record ever seen
  // Of those: delivered while no launch record at all had come, so with nothing to place
  // them by (-1). Kernels keep coming while their launch calls' records do not: the launch
  // records are not being written, and no kernel can be attributed to a step.
  std::uint64_t without_launch_records = 0;
  std::uint64_t overflowed = 0;        // delivered kernels lost because take() lagged (full)
  std::uint64_t api_records = 0;       // launch (API) records
  std::uint64_t api_before_marks = 0;  // API records older than the oldest mark kept
  std::uint64_t marks = 0;             // step boundaries received
  std::uint64_t marks_lost = 0;        // boundaries dropped (ring overrun, bound on marks)
  std::uint64_t other = 0;             // records of other kinds
};

/// Attributes kernel records to steps by the rule at the top of this file. Not
/// thread-safe: the backend serializes calls. Memory is bounded: the marks kept, the
/// seen-launch bitmap and the waiting kernels all have fixed bounds.
///
/// Per delivered activity buffer the backend calls begin_buffer(n) (n: buffers CUPTI
/// had asked for so far), add() for each record, then end_buffer(done) (done: every
/// buffer numbered below it has come back). A kernel still waiting for its launch record
/// is placed by its neighbours once done reaches the n of its own buffer: its launch
/// record was written before its kernel completed, so into one of those buffers.
class ActivityRecords {
 public:
  struct Options {
    std::size_t max_marks = 4096;                        // step boundaries kept (2 per step)
    std::uint64_t seen_window = std::uint64_t{1} << 22;  // launch ids remembered (512 KiB)
    std::size_t max_waiting_kernels = std::size_t{1} << 16;
    std::size_t max_ready = std::size_t{1} << 20;  // kernels not yet taken (32 MiB)
    std::size_t max_names = std::size_t{1} << 16;
  };

  /// How a kernel name counts in the step record (classify_kernel's verdict).
  static KernelWork work_for(const std::string& name);

  ActivityRecords() : ActivityRecords(Options{}) {}
  explicit ActivityRecords(Options options);

  /// A step boundary, in time order (as MarkRing hands them out): from t_ns on, launches
  /// belong to `step` (begin) or to no step (end).
  void add_mark(std::int64_t step, bool begin, std::int64_t t_ns);
  void count_lost_marks(std::uint64_t n) noexcept { stats_.marks_lost += n; }
  /// Before the records of one delivered buffer: CUPTI had asked for `buffers_requested`
  /// buffers when it was delivered.
  void begin_buffer(std::uint64_t buffers_requested) noexcept { buffer_mark_ = buffers_requested; }
  /// One record from a delivered buffer, in buffer order.
  void add(const ParsedRecord& record);
  /// After the records of one buffer: places the kernels whose launch record has come,
  /// and those whose launch record can no longer come (every buffer below `done_through`
  /// has been delivered).
  void end_buffer(std::uint64_t done_through);
  /// Places every waiting kernel as well as it can: at close and before yielding, when
  /// no more records can come for us.
  void drain();
  /// Moves the kernels ready since the last call to the end of `out`.
  void take(std::vector<KernelRecord>& out);
  /// Kernel records lost since the last call (no timestamps, or take() fell behind).
  std::int64_t take_lost() noexcept;

  /// The interned name (as CUPTI reported it); "" for an unknown id.
  const std::string& name(std::uint32_t name_id) const;
  std::size_t name_count() const noexcept { return names_.size(); }
  /// How many times a name was classified (once per distinct name; a test hook).
  std::uint64_t classifications() const noexcept { return classifications_; }
  const ActivityStats& stats() const noexcept { return stats_; }
  /// Kernels waiting for their launch record, and marks held now (bounded; test hooks).
  std::size_t waiting_kernels() const noexcept { return waiting_.size(); }
  std::size_t held_marks() const noexcept { return marks_.size(); }

 private:
  static constexpr std::uint64_t kNoId = UINT64_MAX;
  struct Mark {
    std::int64_t t_ns = 0;
    std::int64_t step = -1;        // -1: an end mark (outside any step from here)
    std::uint64_t min_id = kNoId;  // smallest launch id that started in this segment
  };
  struct Waiting {
    KernelRecord record;
    std::uint64_t id;
    std::uint64_t buffer_mark;  // buffers requested when its record was delivered
    bool counted;               // in stats_.waited already
  };

  void add_kernel(const ParsedRecord& r);
  void add_api(const ParsedRecord& r);
  std::uint64_t unwrap(std::uint32_t id) noexcept;
  void mark_seen(std::uint64_t id);
  bool seen(std::uint64_t id) const noexcept;
  void prepare_placement();
  std::int64_t place(std::uint64_t id) const;
  void deliver(KernelRecord record);
  void count_unseen_launch() noexcept;
  std::uint32_t intern(const char* name);

  Options options_;
  // step boundaries in time order, each with the smallest launch id seen in its segment
  std::deque<Mark> marks_;
  std::vector<std::uint64_t> suffix_min_;  // placement table, rebuilt per end_buffer
  std::vector<std::int64_t> suffix_step_;
  // correlation ids widened to 64 bits (CUPTI's wrap after 2^32 calls)
  std::uint64_t last_id_ = 0;
  bool any_id_ = false;
  // launch ids seen, as a ring of bits over [seen_base_, seen_base_ + window)
  std::vector<std::uint64_t> seen_bits_;
  std::uint64_t seen_base_ = 0;
  // kernels whose launch record has not come yet
  std::uint64_t buffer_mark_ = 0;
  std::vector<Waiting> waiting_;
  std::vector<KernelRecord> ready_;
  std::int64_t lost_ = 0;
  // names: by CUPTI's pointer first (checked against the copy, since a pointer can be
  // reused after a module unloads), then by content
  std::vector<std::string> names_;
  std::vector<KernelWork> works_;
  std::unordered_map<const char*, std::uint32_t> by_pointer_;
  std::unordered_map<std::string, std::uint32_t> by_name_;
  std::uint32_t overflow_id_ = UINT32_MAX;  // the shared name past max_names distinct ones
  std::uint64_t classifications_ = 0;
  ActivityStats stats_;
};

}  // namespace steptrace::detail::cupti
