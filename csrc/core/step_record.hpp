// What the training thread hands to the writer for one step: fixed size, trivially
// copyable, so handing it over allocates nothing.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>

#include "steptrace/backend.hpp"
#include "steptrace/config.hpp"
#include "steptrace/ext/device_activity.hpp"
#include "steptrace/interval.hpp"
#include "steptrace/work.hpp"

namespace steptrace::detail {

/// Device work of one step from the kernel activity records (see device_activity.hpp).
struct KernelStats {
  bool present = false;
  std::int64_t compute_ns = 0;       // union of compute kernels' intervals (matmul included)
  std::int64_t nccl_ns = 0;          // union of communication kernels' intervals
  std::int64_t exposed_nccl_ns = 0;  // communication not overlapped by compute
  std::int64_t matmul_ns = 0;        // union of gemm / convolution / attention kernels
  std::int64_t busy_ns = 0;          // union of all kernels
  std::int64_t idle_ns = 0;          // the step's device window minus busy
  std::int64_t count = 0;
  std::int64_t window_start_ns = 0;  // the step's device window, on the activity clock
  std::int64_t window_end_ns = 0;
};

/// Collectives timed from the host during one step (see collective_timer.hpp).
struct CommStats {
  std::int64_t count = 0;       // collectives completed; 0: none timed
  std::int64_t busy_ns = 0;     // time with a collective outstanding
  std::int64_t exposed_ns = 0;  // from the last launch to the last completion: blocked
  int exposed_phase = -1;       // phase id open when the last one completed (-1: none)
  std::int64_t bytes = 0;       // their payload (nccl-tests' S); 0: unknown
  std::int64_t bus_bytes = 0;   // the same times each one's bus factor
  // Blocked in collectives that ran between the previous step and this one (a barrier
  // while rank 0 saved a checkpoint): part of the gap before the step, not of the step.
  std::int64_t between_blocked_ns = 0;
};

/// Hardware counters averaged over one step; NaN where not measured.
struct CounterStats {
  bool present = false;
  double values[kCounterCount] = {};
  double coverage_pct = 0;  // share of the step's window covered by samples
};

/// GPU hardware telemetry over one step (NVML samples joined on the writer thread, see
/// telemetry.hpp). NaN where the device does not report a figure.
struct HwStats {
  bool present = false;
  int samples = 0;         // samples whose interval overlaps the step
  double avg_power_w = 0;  // time-weighted over the step
  double min_power_w = 0;
  double energy_j = 0;  // from the energy counter (power x time where there is none)
  double max_temp_c = 0;
  double sm_clock_mhz = 0;             // time-weighted mean
  double max_drop_w = 0;               // largest fall of power between consecutive samples
  double power_limit_w = 0;            // the device's enforced limit; 0: unknown
  std::uint64_t throttle_reasons = 0;  // OR of the reasons seen during the step
  // Optional (NaN where the device does not report them): time-weighted means, hottest.
  double pcie_tx_mb_s = std::numeric_limits<double>::quiet_NaN();
  double pcie_rx_mb_s = std::numeric_limits<double>::quiet_NaN();
  double nvlink_tx_mb_s = std::numeric_limits<double>::quiet_NaN();
  double nvlink_rx_mb_s = std::numeric_limits<double>::quiet_NaN();
  double mem_clock_mhz = std::numeric_limits<double>::quiet_NaN();
  double max_mem_temp_c = std::numeric_limits<double>::quiet_NaN();
  double util_pct = std::numeric_limits<double>::quiet_NaN();  // share of time a kernel ran
};

/// Useful work of one step (Profiler::add_work): samples, tokens and model FLOPs, each
/// < 0 where unknown, with the source each came from (steptrace/work.hpp).
struct WorkCount {
  double samples = -1;
  double tokens = -1;
  double flops = -1;
  std::array<WorkSource, 3> source{};  // of samples, tokens, flops
  double peak_flops_per_s = 0;         // the device's peak for MFU at the step (0: none)

  bool any() const noexcept { return samples >= 0 || tokens >= 0 || flops >= 0; }
  void add(double s, double t, double f, WorkSource from) noexcept {
    merge(samples, source[0], s, from);
    merge(tokens, source[1], t, from);
    merge(flops, source[2], f, from);
  }

 private:
  static void merge(double& into, WorkSource& held, double value, WorkSource from) noexcept {
    if (!(value >= 0)) return;  // unknown (NaN included)
    if (from > held) {
      into = value;
      held = from;
    } else if (from == held) {
      into += value;
    }
  }
};

/// Takes the figures `from` knows (>= 0) into `into`; the others stay.
inline void merge_memory_sample(MemorySample& into, const MemorySample& from) noexcept {
  auto take = [](std::int64_t& a, std::int64_t b) {
    if (b >= 0) a = b;
  };
  take(into.allocated_bytes, from.allocated_bytes);
  take(into.reserved_bytes, from.reserved_bytes);
  take(into.peak_bytes, from.peak_bytes);
  take(into.rss_bytes, from.rss_bytes);
  take(into.heap_bytes, from.heap_bytes);
  take(into.device_used_bytes, from.device_used_bytes);
  take(into.device_total_bytes, from.device_total_bytes);
}

/// One interval outside training work (Profiler::begin_interval), listed in the record of
/// the step it ended before (or inside).
struct IntervalEntry {
  IntervalKind kind = IntervalKind::kOther;
  bool inside_step = false;  // it ran inside the step, not between steps
  std::int64_t start_unix_ns = 0;
  std::int64_t duration_ns = 0;
};
inline constexpr std::size_t kMaxStepIntervals = 4;  // listed per step; more are summed only

/// Where the time before a step went, beyond the loader's wait (data_ns): the intervals
/// that ended since the previous step ended (between the steps or inside this one), and
/// the rest of the gap. Every nanosecond of the gap is data, one interval kind, or other.
struct BetweenSteps {
  std::array<std::int64_t, kIntervalKinds> interval_ns{};  // by IntervalKind
  std::int64_t other_ns = 0;  // the gap less data and the eval / checkpoint / restore intervals
  // the eval / checkpoint / restore intervals that ran inside the step
  std::int64_t inside_step_ns = 0;
  std::uint8_t listed = 0;     // entries in `intervals`
  std::uint16_t unlisted = 0;  // intervals beyond kMaxStepIntervals (in the sums only)
  std::array<IntervalEntry, kMaxStepIntervals> intervals{};
  std::int64_t eval_ns() const noexcept { return interval_ns[0]; }
  std::int64_t checkpoint_ns() const noexcept { return interval_ns[1]; }
  std::int64_t restore_ns() const noexcept { return interval_ns[3]; }
  // The intervals that are kinds of their own (other is part of `other_ns`).
  std::int64_t own_kinds_ns() const noexcept { return eval_ns() + checkpoint_ns() + restore_ns(); }
};

/// Generations of Python's garbage collector (gc.callbacks' info["generation"]).
inline constexpr std::size_t kGcGenerations = 3;

// Laid out in three parts: the fields the training thread fills in, then the per-slot
// arrays (phases, values) of which only the first phase_count / value_count entries
// belong to the record, then the fields the writer thread's completers fill in. The
// training thread copies only the first two parts, and of the arrays only the entries in
// use, into the ring (copy_step_record): with five phases 510 of its 1,744 bytes.
struct StepRecord {
  // ---- the training thread's fixed fields (copied whole) ----
  std::int64_t step = 0;
  std::int64_t start_unix_ns = 0;
  std::int64_t step_ns = 0;  // on the record's clock
  std::int64_t data_ns = 0;  // host
  // Of data_ns: waits that started or ended the loader's iterator (an epoch boundary:
  // workers stopped and started, a new iterator's first batch). Not part of iteration_ns.
  std::int64_t data_start_ns = 0;
  // Of step_ns: compiling (torch.compile) inside the step. Not part of iteration_ns.
  std::int64_t compile_ns = 0;
  // The training step the program is at (set_progress, counted on from there); -1: unknown.
  std::int64_t progress = -1;
  std::int64_t host_ns = 0;  // host wall time of the step
  BetweenSteps between;
  // The training thread's run-queue wait (time runnable but not running, Linux schedstat)
  // since the previous reading, read at the end of a step at most every 10 ms; -1: not
  // read at this step. Summed over the steps it is the run's total.
  std::int64_t runq_ns = -1;
  std::int64_t runq_span_ns = 0;  // the time since the previous reading
  std::int64_t on_cpu_ns = -1;    // the thread's time on a CPU in that span; -1: not read
  // CPU time the hypervisor took in that span (host_steal.hpp), at most the thread's time
  // off a CPU without waiting for one (span - on_cpu - runq); -1: not sampled (bare metal)
  std::int64_t steal_ns = -1;
  // Python's garbage collections (gc.callbacks, by generation 0-2): their time inside the
  // step, and in the gap before it (counted in data_ns / other_ns there as well), and how
  // many ended in either. A collection is timed whole where it ends.
  std::array<std::int64_t, kGcGenerations> gc_ns{};
  std::array<std::int64_t, kGcGenerations> gc_between_ns{};
  std::int32_t gc_count = 0;
  MemorySample memory;
  bool rss_fresh = false;  // rss_bytes was read at this step (else repeated from an earlier one)
  bool failed = false;
  bool device_clock = false;            // true: phase_ns are CUDA-event times, host_phase_ns host
  bool waited = false;                  // the profiler waited for the device before this record
  bool captured = false;                // a CUDA graph capture was live in the step: host-timed
  bool profiled = false;                // an evidence capture ran in the step: not judged
  std::uint16_t clamped_intervals = 0;  // device intervals that came out negative, written 0
  DeviceStream stream;                  // the stream a device-clocked step was timed on
  // Device activity: the step's host start and end on the activity backend's and the
  // counter sampler's clocks (training thread); the writer thread fills in `kernels` and
  // `counters` once the activity records and counter samples for the step have arrived.
  std::int64_t activity_begin_ns = -1;
  std::int64_t activity_end_ns = -1;
  bool counters_sampled = false;
  std::int64_t sampler_begin_ns = -1;
  std::int64_t sampler_end_ns = -1;
  // The step's host start and end on the telemetry clock (training thread); its hardware
  // figures (`hw`) are the writer thread's.
  std::int64_t telemetry_begin_ns = -1;
  std::int64_t telemetry_end_ns = -1;
  CommStats comm;
  WorkCount work;  // samples, tokens, FLOPs of the step (Profiler::add_work)
  // Memory levels for attributing growth to phases (the allocator's, else the C heap's
  // in-use bytes), sampled only while the memory-growth detector asks: at the step's
  // start and at the end of each phase (phase_memory_end), with the order the phases
  // ended in (phase_end_order).
  bool phase_memory = false;
  std::int64_t memory_at_start = 0;
  std::uint16_t phase_count = 0;
  // Values attached with Profiler::set_step_value, by slot in the order first set.
  std::uint8_t value_count = 0;

  // ---- by slot: entries [0, phase_count) and [0, value_count) only ----
  std::array<std::uint16_t, kMaxPhases> phase_ids{};
  std::array<std::int64_t, kMaxPhases> phase_ns{};
  std::array<std::int64_t, kMaxPhases> host_phase_ns{};
  std::array<std::int64_t, kMaxPhases> phase_memory_end{};  // only with phase_memory
  std::array<std::uint8_t, kMaxPhases> phase_end_order{};   // only with phase_memory
  std::array<std::uint16_t, kMaxStepValues> value_ids{};
  std::array<double, kMaxStepValues> values{};

  // ---- the writer thread's (never set by the training thread, so never copied) ----
  KernelStats kernels;
  CounterStats counters;
  HwStats hw;
  // When the record reached the writer, and the backends' deliveries then.
  std::chrono::steady_clock::time_point held_since{};
  std::uint64_t activity_deliveries_at_arrival = 0;
  std::uint64_t activity_mark_at_arrival = 0;  // KernelActivitySource::delivery_mark()
  std::uint64_t sampler_deliveries_at_arrival = 0;
  std::uint8_t completed_stages = 0;  // ChainedCompleter: the stages done with this record
};

/// Python's garbage collections in the record's iteration (in the step and in the gap
/// before it), ns; generation 2's alone with `gen2_only`.
inline std::int64_t gc_in_iteration_ns(const StepRecord& r, bool gen2_only = false) noexcept {
  std::int64_t ns = 0;
  for (std::size_t g = gen2_only ? 2 : 0; g < kGcGenerations; ++g) {
    ns += r.gc_ns[g] + r.gc_between_ns[g];
  }
  return ns;
}

/// Copies what the training thread fills in into `to` (a ring slot): the fixed fields,
/// and of the per-slot arrays the entries in use. `to`'s writer-thread fields keep what
/// they hold, the defaults in a ring slot (nothing else writes them there). With five
/// phases a step writes 510 bytes (9 cache lines) instead of 1,744 (28).
[[gnu::hot]] inline void copy_step_record(StepRecord& to, const StepRecord& from) noexcept {
  static_assert(std::is_trivially_copyable_v<StepRecord> && std::is_standard_layout_v<StepRecord>);
  std::memcpy(static_cast<void*>(&to), &from, offsetof(StepRecord, phase_ids));
  // The first kInlineSlots entries of an array go whole, however many are in use: a copy
  // of fixed size, which the compiler inlines, where one of n entries is a call to libc's
  // memmove through the PLT, lines that are cold at a step's end (issue 30). The entries
  // past the count are never read.
  constexpr std::size_t kInlineSlots = 8;
  static_assert(kMaxPhases >= kInlineSlots);
  auto copy_slots = [](auto& to_slots, const auto& from_slots, std::size_t n) {
    std::memcpy(to_slots.data(), from_slots.data(), kInlineSlots * sizeof(from_slots[0]));
    if (n > kInlineSlots) {
      std::copy(from_slots.begin() + kInlineSlots, from_slots.begin() + n,
                to_slots.begin() + kInlineSlots);
    }
  };
  const std::size_t n = std::min<std::size_t>(from.phase_count, kMaxPhases);
  copy_slots(to.phase_ids, from.phase_ids, n);
  copy_slots(to.phase_ns, from.phase_ns, n);
  copy_slots(to.host_phase_ns, from.host_phase_ns, n);
  if (from.phase_memory) {
    copy_slots(to.phase_memory_end, from.phase_memory_end, n);
    copy_slots(to.phase_end_order, from.phase_end_order, n);
  }
  const std::size_t v = std::min<std::size_t>(from.value_count, kMaxStepValues);
  if (v > 0) {
    std::copy_n(from.value_ids.begin(), v, to.value_ids.begin());
    std::copy_n(from.values.begin(), v, to.values.begin());
  }
}

/// Asks for the lines copy_step_record writes first (the fixed fields, the first line of
/// each phase array) for writing: a ring slot was last written a ring's length of steps
/// ago, so without it the copy waits for memory (issue 30). A hint only: nothing changes.
inline void prefetch_step_record(const StepRecord* slot) noexcept {
  const auto* at = reinterpret_cast<const char*>(slot);
  for (std::size_t i = 0; i < offsetof(StepRecord, phase_ids); i += 64)
    __builtin_prefetch(at + i, 1);
  __builtin_prefetch(slot->phase_ids.data(), 1);
  __builtin_prefetch(slot->phase_ns.data(), 1);
  __builtin_prefetch(slot->host_phase_ns.data(), 1);
}

/// The time a step's training iteration took, for the detectors: the loader's wait, the
/// rest of the gap before it (other), and the step, less the intervals inside the step.
/// Evaluation and checkpoint intervals between steps are not part of it, nor the loader's
/// start at an epoch boundary (data_start_ns: periodic), nor compiling inside the step
/// (compile_ns: a new shape's graph); no slow-step rule judges those.
inline std::int64_t iteration_ns(const StepRecord& r) noexcept {
  return r.data_ns - r.data_start_ns + r.between.other_ns + r.step_ns - r.between.inside_step_ns -
         r.compile_ns;
}

/// Bytes each phase added that were still allocated at the end of the step, by slot:
/// the rise of the suffix minimum of the memory levels (what a later phase freed again
/// does not count). Needs r.phase_memory.
inline std::array<std::int64_t, kMaxPhases> retained_by_phase(const StepRecord& r) {
  std::array<std::int64_t, kMaxPhases> retained{};
  std::array<std::uint8_t, kMaxPhases> by_end{};  // slots in the order they ended
  for (std::uint16_t i = 0; i < r.phase_count; ++i)
    by_end[r.phase_end_order[i]] = static_cast<std::uint8_t>(i);
  std::array<std::int64_t, kMaxPhases> suffix_min{};
  std::int64_t running = INT64_MAX;
  for (int k = r.phase_count - 1; k >= 0; --k) {
    running = std::min(running, r.phase_memory_end[by_end[k]]);
    suffix_min[k] = running;
  }
  std::int64_t before = std::min(r.memory_at_start, running);
  for (std::uint16_t k = 0; k < r.phase_count; ++k) {
    retained[by_end[k]] = suffix_min[k] - before;
    before = suffix_min[k];
  }
  return retained;
}

/// Interned phase names, and in a table of their own the names of step values
/// (Profiler::set_step_value), appended by the training thread and read by the writer
/// thread without a lock: an entry is fully written before its table's count is published,
/// and never changes afterwards.
class PhaseNames {
 public:
  /// Training thread only. Returns the id of `name`, interning it (ConfigError when full
  /// or for a bad name).
  std::uint16_t intern(std::string_view name);
  /// Training thread: id of name, or -1.
  int find(std::string_view name) const noexcept { return phases_.find(name); }
  std::size_t size() const noexcept { return phases_.size(); }
  const std::string& name(std::uint16_t id) const noexcept { return phases_.names[id]; }
  /// The name as a quoted, escaped JSON string (for the writer).
  const std::string& json_key(std::uint16_t id) const noexcept { return phases_.keys[id]; }

  /// The same for step-value names (at most kMaxStepValues).
  std::uint16_t intern_value(std::string_view name);
  std::size_t value_count() const noexcept { return values_.size(); }
  const std::string& value_name(std::uint16_t id) const noexcept { return values_.names[id]; }
  const std::string& value_json_key(std::uint16_t id) const noexcept { return values_.keys[id]; }

 private:
  template <std::size_t N>
  struct Table {
    std::array<std::string, N> names;
    std::array<std::string, N> keys;
    std::atomic<std::size_t> count{0};

    std::size_t size() const noexcept { return count.load(std::memory_order_acquire); }
    int find(std::string_view name) const noexcept {
      const std::size_t n = count.load(std::memory_order_relaxed);
      for (std::size_t i = 0; i < n; ++i) {
        if (names[i] == name) return static_cast<int>(i);
      }
      return -1;
    }
    std::uint16_t append(std::string owned);  // the caller checked the name and the room
  };
  Table<kMaxPhases> phases_;
  Table<kMaxStepValues> values_;
};

}  // namespace steptrace::detail
