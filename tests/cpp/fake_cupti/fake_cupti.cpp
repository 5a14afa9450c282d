#include "fake_cupti.hpp"

#include <cupti_activity.h>
#include <cupti_result.h>
#include <cupti_version.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace {

#if CUPTI_API_VERSION >= 130000
using KernelRecord = CUpti_ActivityKernel10;  // what CUPTI 13 writes
#else
using KernelRecord = CUpti_ActivityKernel9;
#endif

struct Buffer {
  std::uint8_t* data = nullptr;
  std::size_t size = 0;
  std::size_t used = 0;
  int incomplete = 0;  // kernel records whose timestamps are not filled in yet
};

struct InFlight {  // a kernel that has not run yet: where its record is
  std::uint8_t* data;
  std::size_t offset;
  std::uint64_t start, end;
};

struct State {
  std::mutex mu;
  std::set<int> enabled;
  std::set<int> runtime_calls, driver_calls;  // records enabled one call at a time
  std::map<int, CUptiResult> fail_enable;
  CUptiResult fail_filter = CUPTI_SUCCESS;
  bool late_filters_ignored = false;  // fake_cupti_ignore_api_filters_after_init
  CUpti_BuffersCallbackRequestFunc request = nullptr;
  CUpti_BuffersCallbackCompleteFunc complete = nullptr;
  CUpti_BuffersCallbackRequestFunc first_request = nullptr;
  bool has_active = false;
  Buffer active;
  std::deque<Buffer> full;     // no room left; returned once complete (or forced)
  std::vector<Buffer> spares;  // asked for, never filled
  std::vector<InFlight> in_flight;
  bool busy = false;
  std::uint64_t dropped = 0;
  std::map<int, int> records;
  int registrations = 0, flushes = 0, forced_flushes = 0, pushes = 0, pops = 0, disables = 0;
  int buffers_requested = 0, buffers_returned = 0;
  std::uint64_t last_size = 0;
  int finalizes = 0;
};

State& state() {
  static State s;
  return s;
}

// Correlation ids: one process-wide counter, as CUPTI's.
std::atomic<std::uint32_t> g_next_correlation{1};
// Timestamps: the steady clock, strictly increasing (so marks and calls never tie).
std::atomic<std::uint64_t> g_last_timestamp{0};

std::uint64_t timestamp() {
  const auto now =
      static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  std::uint64_t last = g_last_timestamp.load();
  std::uint64_t next = 0;
  do {
    next = std::max(now, last + 1);
  } while (!g_last_timestamp.compare_exchange_weak(last, next));
  return next;
}

thread_local std::map<int, std::vector<std::uint64_t>> t_stacks;

std::size_t record_size(const CUpti_Activity* r) {
  switch (r->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      return sizeof(KernelRecord);
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER:
    case CUPTI_ACTIVITY_KIND_INTERNAL_LAUNCH_API:
      return sizeof(CUpti_ActivityAPI);
    default:
      return sizeof(CUpti_ActivityExternalCorrelation);
  }
}

// The other tool's buffers come from its own arena (as Kineto's come from its own
// allocator): a client that freed one would abort in free(), and one it handed to CUPTI
// as its own is counted.
constexpr std::size_t kOtherSize = 1 << 16;
constexpr std::size_t kOtherBuffers = 16;
alignas(8) std::uint8_t g_other_arena[kOtherBuffers][kOtherSize];
bool g_other_used[kOtherBuffers] = {};
int g_other_unknown = 0;   // buffers the other tool's completion callback did not know
int g_other_received = 0;  // its own buffers it got back
int g_stolen = 0;          // the other's buffers a client handed to CUPTI

int other_slot(const std::uint8_t* b) {
  for (std::size_t i = 0; i < kOtherBuffers; ++i) {
    if (b == g_other_arena[i]) return static_cast<int>(i);
  }
  return -1;
}

void CUPTIAPI other_request(uint8_t** buffer, size_t* size, size_t* max_records);

// Runs inside the next cuptiActivityRegisterCallbacks, before it takes effect: a launch on
// another thread racing with the registration.
void (*g_before_registration)() = nullptr;

Buffer* find_buffer(State& s, std::uint8_t* data) {
  if (s.has_active && s.active.data == data) return &s.active;
  for (Buffer& b : s.full) {
    if (b.data == data) return &b;
  }
  return nullptr;
}

// Writes one record into the buffer being filled (asking the client for one when there
// is none or the record does not fit), with s.mu held, as CUPTI writes records when they
// are created. Returns where it went, or false when it was dropped.
bool write(State& s, const void* record, std::size_t n, int kind, std::uint8_t** data,
           std::size_t* offset) {
  if (s.has_active && s.active.used + n > s.active.size) {
    s.full.push_back(s.active);
    s.has_active = false;
  }
  if (!s.has_active) {
    std::uint8_t* b = nullptr;
    std::size_t size = 0;
    std::size_t max_records = 0;
    if (s.request != nullptr) s.request(&b, &size, &max_records);
    if (b != nullptr && s.request != other_request && other_slot(b) >= 0) ++g_stolen;
    if (b == nullptr || size < n) {  // declined: the record is dropped and counted
      ++s.dropped;
      return false;
    }
    ++s.buffers_requested;
    s.last_size = size;
    s.active = Buffer{};
    s.active.data = b;
    s.active.size = size;
    s.has_active = true;
  }
  std::memcpy(s.active.data + s.active.used, record, n);
  if (data != nullptr) *data = s.active.data;
  if (offset != nullptr) *offset = s.active.used;
  s.active.used += n;
  ++s.records[kind];
  return true;
}

bool api_enabled(const State& s, bool driver, int cbid) {
  if (driver) {
    return s.enabled.count(CUPTI_ACTIVITY_KIND_DRIVER) != 0 || s.driver_calls.count(cbid) != 0;
  }
  return s.enabled.count(CUPTI_ACTIVITY_KIND_RUNTIME) != 0 || s.runtime_calls.count(cbid) != 0;
}

std::uint32_t thread_id() {
  return static_cast<std::uint32_t>(std::hash<std::thread::id>{}(std::this_thread::get_id()));
}

// The API record of a call that started at t0, preceded by an external correlation
// record for each id pushed on the calling thread (cupti_activity.h: "the activity API
// record will be preceded by a CUpti_ActivityExternalCorrelation record").
void write_api_record(State& s, bool driver, int cbid, std::uint32_t correlation,
                      std::uint64_t t0) {
  if (!api_enabled(s, driver, cbid)) return;
  if (s.enabled.count(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) != 0) {
    for (const auto& [kind, stack] : t_stacks) {
      if (stack.empty()) continue;
      CUpti_ActivityExternalCorrelation c{};
      c.kind = CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION;
      c.externalKind = static_cast<CUpti_ExternalCorrelationKind>(kind);
      c.externalId = stack.back();
      c.correlationId = correlation;
      write(s, &c, sizeof(c), c.kind, nullptr, nullptr);
    }
  }
  CUpti_ActivityAPI a{};
  a.kind = driver ? CUPTI_ACTIVITY_KIND_DRIVER : CUPTI_ACTIVITY_KIND_RUNTIME;
  a.cbid = static_cast<CUpti_CallbackId>(cbid);
  a.start = t0;
  a.end = timestamp();
  a.processId = 1;
  a.threadId = thread_id();
  a.correlationId = correlation;
  write(s, &a, sizeof(a), a.kind, nullptr, nullptr);
}

void fill_kernel(State& s, const InFlight& k) {
  auto* r = reinterpret_cast<KernelRecord*>(k.data + k.offset);
  r->start = k.start;
  r->end = k.end;
  if (Buffer* b = find_buffer(s, k.data)) --b->incomplete;
}

}  // namespace

extern "C" {

CUptiResult CUPTIAPI cuptiGetVersion(uint32_t* version) {
  *version = CUPTI_API_VERSION;  // the release of the headers it is built with, as a real one
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiGetResultString(CUptiResult result, const char** str) {
  *str = result == CUPTI_ERROR_INSUFFICIENT_PRIVILEGES ? "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"
                                                       : "CUPTI_ERROR_FAKE";
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiGetTimestamp(uint64_t* t) {
  *t = timestamp();
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc request,
                                                    CUpti_BuffersCallbackCompleteFunc complete) {
  if (request == nullptr || complete == nullptr) return CUPTI_ERROR_INVALID_PARAMETER;
  if (auto* before = std::exchange(g_before_registration, nullptr)) before();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.request = request;
  s.complete = complete;
  if (s.first_request == nullptr) s.first_request = request;
  ++s.registrations;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityEnable(CUpti_ActivityKind kind) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (auto it = s.fail_enable.find(kind); it != s.fail_enable.end()) return it->second;
  s.enabled.insert(kind);
  // the whole kind overrides the calls enabled one by one (cupti_activity.h)
  if (kind == CUPTI_ACTIVITY_KIND_RUNTIME) s.runtime_calls.clear();
  if (kind == CUPTI_ACTIVITY_KIND_DRIVER) s.driver_calls.clear();
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityDisable(CUpti_ActivityKind kind) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.enabled.erase(kind);
  if (kind == CUPTI_ACTIVITY_KIND_RUNTIME) s.runtime_calls.clear();
  if (kind == CUPTI_ACTIVITY_KIND_DRIVER) s.driver_calls.clear();
  ++s.disables;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityEnableRuntimeApi(CUpti_CallbackId cbid, uint8_t enable) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.fail_filter != CUPTI_SUCCESS) return s.fail_filter;
  if (s.late_filters_ignored) return CUPTI_SUCCESS;  // accepted, and no record is ever written
  if (enable != 0) {
    s.runtime_calls.insert(static_cast<int>(cbid));
  } else {
    s.runtime_calls.erase(static_cast<int>(cbid));
  }
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityEnableDriverApi(CUpti_CallbackId cbid, uint8_t enable) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.fail_filter != CUPTI_SUCCESS) return s.fail_filter;
  if (s.late_filters_ignored) return CUPTI_SUCCESS;  // accepted, and no record is ever written
  if (enable != 0) {
    s.driver_calls.insert(static_cast<int>(cbid));
  } else {
    s.driver_calls.erase(static_cast<int>(cbid));
  }
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityPushExternalCorrelationId(CUpti_ExternalCorrelationKind kind,
                                                            uint64_t id) {
  t_stacks[kind].push_back(id);
  std::lock_guard<std::mutex> lock(state().mu);
  ++state().pushes;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityPopExternalCorrelationId(CUpti_ExternalCorrelationKind kind,
                                                           uint64_t* id) {
  auto& stack = t_stacks[kind];
  if (stack.empty()) return CUPTI_ERROR_QUEUE_EMPTY;
  if (id != nullptr) *id = stack.back();
  stack.pop_back();
  std::lock_guard<std::mutex> lock(state().mu);
  ++state().pops;
  return CUPTI_SUCCESS;
}

// Hands back the buffers that may go back (forced: all of them, the one being filled
// too), through the completion callback registered now, whoever's buffers they are, and
// outside the lock (the callback calls back into CUPTI), as CUPTI does.
CUptiResult CUPTIAPI cuptiActivityFlushAll(uint32_t flag) {
  State& s = state();
  const bool forced = (flag & CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) != 0;
  std::vector<Buffer> out;
  CUpti_BuffersCallbackCompleteFunc complete = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    // "CUPTI_ERROR_INVALID_OPERATION if not preceded by a successful call to
    // cuptiActivityRegisterCallbacks" (cupti_activity.h): also after cuptiFinalize
    if (s.complete == nullptr) return CUPTI_ERROR_INVALID_OPERATION;
    ++(forced ? s.forced_flushes : s.flushes);
    if (forced && s.has_active) {
      s.full.push_back(s.active);
      s.has_active = false;
    }
    if (forced) {
      s.full.insert(s.full.end(), s.spares.begin(), s.spares.end());
      s.spares.clear();
    }
    for (auto it = s.full.begin(); it != s.full.end();) {
      if (forced || it->incomplete == 0) {
        // kernels that have not run go out as they are: without timestamps
        const std::uint8_t* data = it->data;
        s.in_flight.erase(std::remove_if(s.in_flight.begin(), s.in_flight.end(),
                                         [&](const InFlight& k) { return k.data == data; }),
                          s.in_flight.end());
        out.push_back(*it);
        it = s.full.erase(it);
      } else {
        ++it;
      }
    }
    complete = s.complete;
  }
  for (const Buffer& b : out) {
    if (complete != nullptr) complete(nullptr, 0, b.data, b.size, b.used);
    std::lock_guard<std::mutex> lock(s.mu);
    ++s.buffers_returned;
  }
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityGetNextRecord(uint8_t* buffer, size_t valid_size,
                                                CUpti_Activity** record) {
  uint8_t* next = buffer;
  if (*record != nullptr) {
    next = reinterpret_cast<uint8_t*>(*record) + record_size(*record);
  }
  if (next >= buffer + valid_size) return CUPTI_ERROR_MAX_LIMIT_REACHED;
  *record = reinterpret_cast<CUpti_Activity*>(next);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityGetNumDroppedRecords(CUcontext, uint32_t, size_t* dropped) {
  std::lock_guard<std::mutex> lock(state().mu);
  *dropped = state().dropped;
  state().dropped = 0;
  return CUPTI_SUCCESS;
}

void fake_cupti_reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.enabled.clear();
  s.runtime_calls.clear();
  s.driver_calls.clear();
  s.fail_enable.clear();
  s.fail_filter = CUPTI_SUCCESS;
  s.late_filters_ignored = false;
  s.has_active = false;
  s.full.clear();
  s.spares.clear();
  s.in_flight.clear();
  s.busy = false;
  s.dropped = 0;
  s.records.clear();
  s.registrations = s.flushes = s.forced_flushes = s.pushes = s.pops = s.disables = 0;
  s.buffers_requested = s.buffers_returned = 0;
  s.last_size = 0;
  s.finalizes = 0;
  std::fill(std::begin(g_other_used), std::end(g_other_used), false);
  g_before_registration = nullptr;
  g_other_unknown = g_other_received = g_stolen = 0;
}

std::uint32_t fake_cupti_launch_via(bool driver, int cbid, const char* name, std::uint64_t start_ns,
                                    std::uint64_t end_ns, bool kernel_first, int count) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::uint32_t correlation = g_next_correlation.fetch_add(1);  // at the call's entry
  const std::uint64_t t0 = timestamp();
  auto write_kernels = [&] {
    if (s.enabled.count(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) == 0) return;
    for (int i = 0; i < count; ++i) {
      KernelRecord k{};
      k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
      k.correlationId = correlation;
      k.name = name;
      const InFlight run{nullptr, 0, start_ns + i, end_ns + i};
      if (!s.busy) {
        k.start = run.start;
        k.end = run.end;
      }
      InFlight pending = run;
      if (write(s, &k, sizeof(k), k.kind, &pending.data, &pending.offset) && s.busy) {
        ++find_buffer(s, pending.data)->incomplete;
        s.in_flight.push_back(pending);
      }
    }
  };
  if (kernel_first) write_kernels();  // reserved at the launch, before the call returns
  write_api_record(s, driver, cbid, correlation, t0);
  if (!kernel_first) write_kernels();
  return correlation;
}

std::uint32_t fake_cupti_launch(const char* name, std::uint64_t start_ns, std::uint64_t end_ns,
                                bool kernel_first) {
  return fake_cupti_launch_via(false, 211 /* cudaLaunchKernel_v7000 */, name, start_ns, end_ns,
                               kernel_first, 1);
}

std::uint32_t fake_cupti_api_call(bool driver, int cbid) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::uint32_t correlation = g_next_correlation.fetch_add(1);
  write_api_record(s, driver, cbid, correlation, timestamp());
  return correlation;
}

void fake_cupti_hold_spare() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  Buffer b;
  std::size_t max_records = 0;
  if (s.request != nullptr) s.request(&b.data, &b.size, &max_records);
  if (b.data == nullptr) return;
  ++s.buffers_requested;
  s.spares.push_back(b);
}

void fake_cupti_set_busy(bool busy) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().busy = busy;
}

void fake_cupti_complete_kernels() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (const InFlight& k : s.in_flight) fill_kernel(s, k);
  s.in_flight.clear();
}

void fake_cupti_set_dropped(std::uint64_t n) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().dropped = n;
}

void fake_cupti_ignore_api_filters_after_init() {
  std::lock_guard<std::mutex> lock(state().mu);
  state().late_filters_ignored = true;
}

void fake_cupti_fail_enable(int kind, int result) {
  std::lock_guard<std::mutex> lock(state().mu);
  if (result == 0) {
    state().fail_enable.erase(kind);
  } else {
    state().fail_enable[kind] = static_cast<CUptiResult>(result);
  }
}

void fake_cupti_fail_api_filter(int result) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().fail_filter = static_cast<CUptiResult>(result);
}

}  // extern "C"

namespace {
// The other tool (Kineto): buffers from its arena; a completed buffer it did not hand
// out is logged and left alone (CuptiActivityApi::bufferCompleted: "bufferCompleted
// called with unknown buffer"). Both run with state().mu not held (CUPTI calls them
// from write(), under it, for requests: so requests take no lock here).
void CUPTIAPI other_request(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = nullptr;
  *size = 0;
  *max_records = 0;
  for (std::size_t i = 0; i < kOtherBuffers; ++i) {
    if (!g_other_used[i]) {
      g_other_used[i] = true;
      *buffer = g_other_arena[i];
      *size = kOtherSize;
      return;
    }
  }
}
void CUPTIAPI other_complete(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t) {
  std::lock_guard<std::mutex> lock(state().mu);
  const int slot = other_slot(buffer);
  if (slot < 0) {
    ++g_other_unknown;
    return;
  }
  g_other_used[slot] = false;
  ++g_other_received;
}
}  // namespace

extern "C" {

void fake_cupti_register_other() { cuptiActivityRegisterCallbacks(other_request, other_complete); }

void fake_cupti_other_stop(bool flush) {
  if (flush) cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
}

int fake_cupti_other_unknown_buffers() {
  std::lock_guard<std::mutex> lock(state().mu);
  return g_other_unknown;
}

int fake_cupti_other_buffers_out() {
  std::lock_guard<std::mutex> lock(state().mu);
  int n = 0;
  for (bool used : g_other_used) n += used ? 1 : 0;
  return n;
}

int fake_cupti_other_buffers_received() {
  std::lock_guard<std::mutex> lock(state().mu);
  return g_other_received;
}

int fake_cupti_stolen_buffers() {
  std::lock_guard<std::mutex> lock(state().mu);
  return g_stolen;
}

// The profiler half (fake_profiler.cpp), when linked in: its objects die too.
__attribute__((weak)) void fake_profiler_finalized();

// cuptiFinalize (cupti_activity.h: "destroys and cleans up all the resources associated
// with CUPTI in the current process"): the registered callbacks, the enabled kinds and
// calls, and the buffers CUPTI held (not handed back) are gone.
CUptiResult CUPTIAPI cuptiFinalize() {
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    s.enabled.clear();
    s.runtime_calls.clear();
    s.driver_calls.clear();
    s.request = nullptr;
    s.complete = nullptr;
    s.has_active = false;
    s.full.clear();
    s.spares.clear();
    s.in_flight.clear();
    ++s.finalizes;
  }
  if (fake_profiler_finalized != nullptr) fake_profiler_finalized();
  return CUPTI_SUCCESS;
}

void fake_cupti_before_next_registration(void (*fn)()) { g_before_registration = fn; }

void fake_cupti_finalize(bool flush_first) {
  if (flush_first) cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  cuptiFinalize();
}

int fake_cupti_finalizes() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().finalizes;
}

bool fake_cupti_kind_enabled(int kind) {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().enabled.count(kind) != 0;
}

bool fake_cupti_api_enabled(bool driver, int cbid) {
  std::lock_guard<std::mutex> lock(state().mu);
  return api_enabled(state(), driver, cbid);
}

int fake_cupti_api_filters() {
  std::lock_guard<std::mutex> lock(state().mu);
  return static_cast<int>(state().runtime_calls.size() + state().driver_calls.size());
}

bool fake_cupti_first_callbacks_registered() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().request != nullptr && state().request == state().first_request;
}

int fake_cupti_registrations() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().registrations;
}

int fake_cupti_flushes(bool forced) {
  std::lock_guard<std::mutex> lock(state().mu);
  return forced ? state().forced_flushes : state().flushes;
}

int fake_cupti_pushes() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().pushes;
}

int fake_cupti_pops() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().pops;
}

int fake_cupti_disables() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().disables;
}

int fake_cupti_stack_depth(int kind) { return static_cast<int>(t_stacks[kind].size()); }

int fake_cupti_records(int kind) {
  std::lock_guard<std::mutex> lock(state().mu);
  auto it = state().records.find(kind);
  return it != state().records.end() ? it->second : 0;
}

int fake_cupti_buffers_requested() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().buffers_requested;
}

int fake_cupti_buffers_returned() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().buffers_returned;
}

int fake_cupti_full_buffers() {
  std::lock_guard<std::mutex> lock(state().mu);
  return static_cast<int>(state().full.size());
}

std::uint64_t fake_cupti_last_buffer_size() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().last_size;
}

}  // extern "C"
