// The pure half of the CUPTI activity backend: turns parsed activity records (kernel
// executions and external-correlation records) into KernelRecords tagged with the step
// that launched them, interns kernel names and classifies each distinct name once. No
// CUPTI headers, so it is tested from canned records on any machine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "steptrace/backend.hpp"

namespace steptrace::detail::cupti {

/// The fields steptrace reads from one CUPTI activity record.
struct ParsedRecord {
  enum class Kind : std::uint8_t {
    kKernel,               // CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
    kExternalCorrelation,  // CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION
    kOther,                // any other kind (ignored, counted)
  };
  Kind kind = Kind::kOther;
  std::uint64_t start_ns = 0;  // kernel: device start and end (0, 0: not timed)
  std::uint64_t end_ns = 0;
  std::uint32_t correlation_id = 0;  // both kinds: the launching API call's id
  const char* name = nullptr;        // kernel: owned by CUPTI, read during add() only
  int external_kind = 0;             // external correlation: CUpti_ExternalCorrelationKind
  std::uint64_t external_id = 0;     // external correlation: the id pushed at launch
};

/// Counters of what add() saw, for tests and diagnostics.
struct ActivityStats {
  std::uint64_t kernels = 0;       // kernel records added (timed ones)
  std::uint64_t attributed = 0;    // delivered with a step
  std::uint64_t unattributed = 0;  // delivered without one (launched outside any step,
                                   // or its correlation expired / never came)
  std::uint64_t untimed = 0;       // kernel records without timestamps (dropped)
  std::uint64_t late = 0;          // kernels matched with a correlation that came after them
  std::uint64_t overflowed = 0;    // delivered kernels lost because take() lagged (full)
  std::uint64_t correlations = 0;  // our external-correlation records
  std::uint64_t correlations_expired = 0;  // never matched a kernel (memcpy, sync, ...)
  std::uint64_t foreign = 0;  // external correlations of other kinds (Kineto's CUSTOM0/1)
  std::uint64_t other = 0;    // records of other kinds
};

/// Correlates kernel records with the step ids pushed at launch. Not thread-safe: the
/// backend serializes calls. Memory is bounded: correlations live for at most two
/// generations; a kernel whose correlation has not come waits until the end of the
/// delivery it came in (one flush delivers both buffers), so the deliveries() contract
/// of KernelActivitySource holds for every kernel.
class ActivityRecords {
 public:
  struct Options {
    int step_external_kind = 5;  // CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2
    // Correlations that match no kernel (most API calls launch none) expire: a generation
    // lasts this many deliveries or this many entries, whichever comes first.
    std::uint32_t generation_deliveries = 20;
    std::size_t generation_capacity = std::size_t{1} << 17;
    std::size_t max_waiting_kernels = std::size_t{1} << 16;
    std::size_t max_ready = std::size_t{1} << 20;  // kernels not yet taken (32 MiB)
    std::size_t max_names = std::size_t{1} << 16;
  };

  /// The external id pushed for a step (0 is never pushed, so it means "none").
  static constexpr std::uint64_t external_id_for_step(std::int64_t step) noexcept {
    return static_cast<std::uint64_t>(step) + 1;
  }

  /// How a kernel name counts in the step record (classify_kernel's verdict).
  static KernelWork work_for(const std::string& name);

  ActivityRecords() : ActivityRecords(Options{}) {}
  explicit ActivityRecords(Options options);

  /// One record from a delivered buffer, in buffer order.
  void add(const ParsedRecord& record);
  /// After each delivery (flush): hands out the kernels still waiting for a correlation
  /// (unattributed) and ages the correlations.
  void end_delivery();
  /// Hands out every waiting kernel (unattributed) and forgets all correlations: at close
  /// and before yielding, when no correlation can still arrive for us.
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
  /// Kernels and correlations held now (bounded; a test hook).
  std::size_t waiting_kernels() const noexcept { return waiting_.size(); }
  std::size_t held_correlations() const noexcept { return current_.size() + previous_.size(); }

 private:
  struct Waiting {
    KernelRecord record;
    std::uint32_t correlation_id;
  };
  struct Recent {
    std::uint32_t correlation_id = 0;
    std::int64_t step = -1;
  };
  static constexpr std::size_t kRecent = 32;

  void add_kernel(const ParsedRecord& r);
  void add_correlation(const ParsedRecord& r);
  bool find_step(std::uint32_t correlation_id, std::int64_t* step);
  void remember(std::uint32_t correlation_id, std::int64_t step);
  void rotate();
  void release_waiting();
  void deliver(KernelRecord record);
  std::uint32_t intern(const char* name);

  Options options_;
  std::uint64_t delivery_ = 0;
  std::uint64_t generation_start_ = 0;
  // correlation id -> step, in two generations: a lookup tries both, rotation drops the
  // older one, so unmatched entries (API calls that launch no kernel) expire in bulk
  std::unordered_map<std::uint32_t, std::int64_t> current_;
  std::unordered_map<std::uint32_t, std::int64_t> previous_;
  // the last correlations used: the kernels of one CUDA graph launch share one id
  Recent recent_[kRecent];
  std::size_t recent_next_ = 0;
  // kernels whose correlation has not arrived yet, and how many wait per correlation id
  std::vector<Waiting> waiting_;
  std::unordered_map<std::uint32_t, std::uint32_t> waiting_ids_;
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
