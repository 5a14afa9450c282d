// The host's periodic readings, taken off the training thread (issue 30): the memory
// sources that may be read from any thread (the process RSS) and the training thread's
// run-queue wait (its schedstat). Each is a /proc read of ~3.5 us once a training step has
// left the caches cold; taken at a step's end every 10 ms they were the largest single
// item of steptrace's cost on a 0.5 ms step. The watchdog thread polls; the training thread
// takes the latest figures at a step's end with a few atomic loads. A possibly slow step
// still reads its run queue itself (StepRecorder::end_step), so that it has its figure.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <ctime>
#include <vector>

#include "run_queue.hpp"
#include "steptrace/backend.hpp"

namespace steptrace::detail {

class HostReadings {
 public:
  static constexpr std::int64_t kRunQueueIntervalNs = 10'000'000;  // also the steps' own pace

  // Before the watchdog starts: a source it reads from now on (any_thread, nonzero
  // min_interval_ns); it outlives this object.
  void add_source(MemorySource* source);

  // Training thread: the thread whose run queue to read (its tid and CPU clock); the
  // watchdog opens its file at its next poll. Called again when steps move to a thread.
  void watch_thread(long tid, clockid_t cpu_clock) noexcept;

  // The polling thread (watchdog; any one thread): reads what is due at `now` (the run's
  // clock). The time of the next reading due.
  std::int64_t poll(std::int64_t now) noexcept;

  // Training thread: whether a reading newer than `seen` was published (one load).
  bool has_memory_since(std::uint64_t seen) const noexcept {
    return memory_out_.seq.load(std::memory_order_relaxed) != seen;
  }
  bool has_run_queue_since(std::uint64_t seen) const noexcept {
    return run_queue_out_.seq.load(std::memory_order_relaxed) != seen;
  }
  // Training thread: the merged figures of the sources, when a reading newer than *seen
  // has been published since (then *seen is updated).
  bool take_memory(std::uint64_t* seen, MemorySample* out) const noexcept;
  // Training thread: the latest run-queue reading and when it was taken, when newer than
  // *seen; of the thread last given to watch_thread (else: false).
  bool take_run_queue(std::uint64_t* seen, std::int64_t* at_ns, SchedStat* out) const noexcept;

 private:
  // A seqlock of atomics: the poller writes, the training thread reads without waiting and
  // skips a reading caught mid-write (it takes the next one).
  template <std::size_t N>
  struct Published {
    std::atomic<std::uint64_t> seq{0};  // odd: being written
    std::array<std::atomic<std::int64_t>, N> values{};
    void write(const std::array<std::int64_t, N>& v) noexcept;
    bool read(std::uint64_t* seen, std::array<std::int64_t, N>* v) const noexcept;
  };

  struct Source {
    MemorySource* source = nullptr;
    std::int64_t read_ns = 0;  // when last read (0: never)
    MemorySample sample;
  };
  std::vector<Source> sources_;  // poller only, after start

  std::atomic<long> watch_tid_{0};  // written by the training thread
  std::atomic<clockid_t> watch_clock_{CLOCK_THREAD_CPUTIME_ID};
  long read_tid_ = 0;  // poller: the thread run_queue_ reads
  RunQueueReader run_queue_;
  std::int64_t run_queue_read_ns_ = 0;

  // The training thread's line: both read at every step's end.
  alignas(64) Published<7> memory_out_;  // MemorySample's fields, in declaration order
  Published<4> run_queue_out_;           // tid, at_ns, on_cpu_ns, wait_ns
};

}  // namespace steptrace::detail
