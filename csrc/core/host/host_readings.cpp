#include "host_readings.hpp"

#include <algorithm>
#include <climits>

#include "../step_record.hpp"

namespace steptrace::detail {
namespace {
std::array<std::int64_t, 7> fields_of(const MemorySample& s) noexcept {
  return {s.allocated_bytes, s.reserved_bytes,    s.peak_bytes,        s.rss_bytes,
          s.heap_bytes,      s.device_used_bytes, s.device_total_bytes};
}
MemorySample sample_of(const std::array<std::int64_t, 7>& v) noexcept {
  MemorySample s;
  s.allocated_bytes = v[0];
  s.reserved_bytes = v[1];
  s.peak_bytes = v[2];
  s.rss_bytes = v[3];
  s.heap_bytes = v[4];
  s.device_used_bytes = v[5];
  s.device_total_bytes = v[6];
  return s;
}
}  // namespace

template <std::size_t N>
void HostReadings::Published<N>::write(const std::array<std::int64_t, N>& v) noexcept {
  const std::uint64_t s = seq.load(std::memory_order_relaxed);
  seq.store(s + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (std::size_t i = 0; i < N; ++i) values[i].store(v[i], std::memory_order_relaxed);
  seq.store(s + 2, std::memory_order_release);
}

template <std::size_t N>
bool HostReadings::Published<N>::read(std::uint64_t* seen,
                                      std::array<std::int64_t, N>* v) const noexcept {
  const std::uint64_t s = seq.load(std::memory_order_acquire);
  if (s == *seen || (s & 1) != 0) return false;  // nothing new, or being written
  for (std::size_t i = 0; i < N; ++i) (*v)[i] = values[i].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (seq.load(std::memory_order_relaxed) != s) return false;  // overwritten meanwhile
  *seen = s;
  return true;
}

void HostReadings::add_source(MemorySource* source) { sources_.push_back({source, 0, {}}); }

void HostReadings::watch_thread(long tid, clockid_t cpu_clock) noexcept {
  watch_clock_.store(cpu_clock, std::memory_order_relaxed);
  watch_tid_.store(tid, std::memory_order_release);
}

std::int64_t HostReadings::poll(std::int64_t now) noexcept {
  std::int64_t next = INT64_MAX;
  bool read_any = false;
  for (Source& s : sources_) {
    const std::int64_t interval = s.source->min_interval_ns();
    if (s.read_ns == 0 || now - s.read_ns >= interval) {
      s.sample = MemorySample{};
      s.source->sample(s.sample);
      s.read_ns = now;
      read_any = true;
    }
    next = std::min(next, s.read_ns + interval);
  }
  if (read_any) {
    MemorySample merged;
    for (const Source& s : sources_) merge_memory_sample(merged, s.sample);
    memory_out_.write(fields_of(merged));
  }
  const long tid = watch_tid_.load(std::memory_order_acquire);
  if (tid != 0 && tid != read_tid_) {  // a new training thread: its own file from now on
    read_tid_ = run_queue_.watch(tid, watch_clock_.load(std::memory_order_relaxed)) ? tid : -1;
    run_queue_read_ns_ = 0;
  }
  if (read_tid_ > 0) {
    if (run_queue_read_ns_ == 0 || now - run_queue_read_ns_ >= kRunQueueIntervalNs) {
      const SchedStat s = run_queue_.read();
      run_queue_read_ns_ = now;
      if (s.wait_ns >= 0) run_queue_out_.write({read_tid_, now, s.on_cpu_ns, s.wait_ns});
    }
    next = std::min(next, run_queue_read_ns_ + kRunQueueIntervalNs);
  }
  return next;
}

bool HostReadings::take_memory(std::uint64_t* seen, MemorySample* out) const noexcept {
  std::array<std::int64_t, 7> v;
  if (!memory_out_.read(seen, &v)) return false;
  *out = sample_of(v);
  return true;
}

bool HostReadings::take_run_queue(std::uint64_t* seen, std::int64_t* at_ns,
                                  SchedStat* out) const noexcept {
  std::array<std::int64_t, 4> v;
  if (!run_queue_out_.read(seen, &v)) return false;
  if (v[0] != watch_tid_.load(std::memory_order_relaxed)) return false;  // another thread's
  *at_ns = v[1];
  out->on_cpu_ns = v[2];
  out->wait_ns = v[3];
  return true;
}

}  // namespace steptrace::detail
