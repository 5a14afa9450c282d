#include "fake_cupti.hpp"

#include <cupti_activity.h>
#include <cupti_result.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <vector>

namespace {

struct Pending {
  bool kernel = false;
  CUpti_ActivityKernel10 k{};
  CUpti_ActivityExternalCorrelation c{};
};

struct State {
  std::mutex mu;
  std::set<int> enabled;
  std::map<int, CUptiResult> fail_enable;
  CUpti_BuffersCallbackRequestFunc request = nullptr;
  CUpti_BuffersCallbackCompleteFunc complete = nullptr;
  CUpti_BuffersCallbackRequestFunc first_request = nullptr;
  std::vector<Pending> pending;
  std::uint32_t next_correlation = 1;
  std::uint64_t dropped = 0;
  int registrations = 0, flushes = 0, forced_flushes = 0, pushes = 0, pops = 0, disables = 0;
};

State& state() {
  static State s;
  return s;
}

thread_local std::map<int, std::vector<std::uint64_t>> t_stacks;

std::size_t record_size(const CUpti_Activity* r) {
  return r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
             ? sizeof(CUpti_ActivityKernel10)
             : sizeof(CUpti_ActivityExternalCorrelation);
}

}  // namespace

extern "C" {

CUptiResult CUPTIAPI cuptiGetVersion(uint32_t* version) {
  *version = 130001;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiGetResultString(CUptiResult result, const char** str) {
  *str = result == CUPTI_ERROR_INSUFFICIENT_PRIVILEGES ? "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES"
                                                       : "CUPTI_ERROR_FAKE";
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiGetTimestamp(uint64_t* timestamp) {
  *timestamp = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch() /
                                     std::chrono::nanoseconds(1));
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc request,
                                                    CUpti_BuffersCallbackCompleteFunc complete) {
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
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiActivityDisable(CUpti_ActivityKind kind) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.enabled.erase(kind);
  ++s.disables;
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
  *id = stack.back();
  stack.pop_back();
  std::lock_guard<std::mutex> lock(state().mu);
  ++state().pops;
  return CUPTI_SUCCESS;
}

// Writes the pending records into one buffer from the registered callbacks, outside the
// lock (the callbacks may call back into CUPTI), as CUPTI does.
CUptiResult CUPTIAPI cuptiActivityFlushAll(uint32_t flag) {
  State& s = state();
  std::vector<Pending> pending;
  CUpti_BuffersCallbackRequestFunc request = nullptr;
  CUpti_BuffersCallbackCompleteFunc complete = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ++((flag & CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) != 0 ? s.forced_flushes : s.flushes);
    pending.swap(s.pending);
    request = s.request;
    complete = s.complete;
  }
  if (pending.empty() || request == nullptr) return CUPTI_SUCCESS;
  uint8_t* buffer = nullptr;
  size_t size = 0;
  size_t max_records = 0;
  request(&buffer, &size, &max_records);
  if (buffer == nullptr) return CUPTI_SUCCESS;
  size_t used = 0;
  for (const Pending& p : pending) {
    const void* src = p.kernel ? static_cast<const void*>(&p.k) : static_cast<const void*>(&p.c);
    const size_t n = p.kernel ? sizeof(p.k) : sizeof(p.c);
    if (used + n > size) break;
    std::memcpy(buffer + used, src, n);
    used += n;
  }
  complete(nullptr, 0, buffer, size, used);
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
  s.fail_enable.clear();
  s.pending.clear();
  s.dropped = 0;
  s.registrations = s.flushes = s.forced_flushes = s.pushes = s.pops = s.disables = 0;
}

std::uint32_t fake_cupti_launch(const char* name, std::uint64_t start_ns, std::uint64_t end_ns,
                                bool kernel_first) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::uint32_t correlation = s.next_correlation++;
  std::vector<Pending> correlations;
  if (s.enabled.count(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) != 0) {
    for (const auto& [kind, stack] : t_stacks) {
      if (stack.empty()) continue;
      Pending p;
      p.c.kind = CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION;
      p.c.externalKind = static_cast<CUpti_ExternalCorrelationKind>(kind);
      p.c.externalId = stack.back();
      p.c.correlationId = correlation;
      correlations.push_back(p);
    }
  }
  Pending k;
  k.kernel = true;
  k.k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  k.k.start = start_ns;
  k.k.end = end_ns;
  k.k.correlationId = correlation;
  k.k.name = name;
  const bool kernel_on = s.enabled.count(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != 0;
  if (kernel_on && kernel_first) s.pending.push_back(k);
  s.pending.insert(s.pending.end(), correlations.begin(), correlations.end());
  if (kernel_on && !kernel_first) s.pending.push_back(k);
  return correlation;
}

void fake_cupti_set_dropped(std::uint64_t n) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().dropped = n;
}

void fake_cupti_fail_enable(int kind, int result) {
  std::lock_guard<std::mutex> lock(state().mu);
  if (result == 0) {
    state().fail_enable.erase(kind);
  } else {
    state().fail_enable[kind] = static_cast<CUptiResult>(result);
  }
}

namespace {
void CUPTIAPI other_request(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = nullptr;
  *size = 0;
  *max_records = 0;
}
void CUPTIAPI other_complete(CUcontext, uint32_t, uint8_t*, size_t, size_t) {}
}  // namespace

void fake_cupti_register_other() { cuptiActivityRegisterCallbacks(other_request, other_complete); }

void fake_cupti_discard_pending() {
  std::lock_guard<std::mutex> lock(state().mu);
  state().pending.clear();
}

bool fake_cupti_kind_enabled(int kind) {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().enabled.count(kind) != 0;
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

}  // extern "C"
