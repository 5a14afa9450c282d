// See fake_profiler.hpp (the libcupti half; fake_cuda.cpp is the libcuda half). The counter data
// image the backend allocates holds, in this fake, the number of decoded ranges and their names; a
// range's "metric value" is its step plus a quarter per metric index, so the test can tell which
// range fed a sample.
#include "fake_profiler.hpp"

#include <cupti_profiler_host.h>
#include <cupti_range_profiler.h>
#include <cupti_target.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kNameBytes = 32;
constexpr std::size_t kImageRanges = 64;
constexpr std::size_t kImageBytes = sizeof(std::uint32_t) + kImageRanges * kNameBytes;

struct State {
  std::mutex mu;
  CUptiResult fail_initialize = CUPTI_SUCCESS;
  int initializes = 0, deinitializes = 0, enables = 0, null_enables = 0, disables = 0;
  int set_configs = 0, starts = 0, stops = 0, pops = 0, decodes = 0, misuses = 0;
  void* enabled_ctx = nullptr;
  bool running = false;
  int depth = 0;
  std::uint8_t* image = nullptr;
  std::vector<std::string> pushed;     // every range ever pushed
  std::vector<std::string> pass;       // the ranges of the current pass
  std::vector<std::string> undecoded;  // ranges of stopped passes, for DecodeData
};

State& state() {
  static State s;
  return s;
}

// The name of decoded range `index` of a counter data image; null past its ranges.
const char* image_range_name(const std::uint8_t* image, std::size_t index) {
  std::uint32_t count = 0;
  std::memcpy(&count, image, sizeof(count));
  if (index >= count) return nullptr;
  return reinterpret_cast<const char*>(image) + sizeof(count) + index * kNameBytes;
}

int g_host_object = 0;  // its address is the host object
int g_range_object = 0;

}  // namespace

extern "C" {

void fake_rp_reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.fail_initialize = CUPTI_SUCCESS;
  s.initializes = s.deinitializes = s.enables = s.null_enables = s.disables = 0;
  s.set_configs = s.starts = s.stops = s.pops = s.decodes = s.misuses = 0;
  s.enabled_ctx = nullptr;
  s.running = false;
  s.depth = 0;
  s.image = nullptr;
  s.pushed.clear();
  s.pass.clear();
  s.undecoded.clear();
  fake_cuda_set_current(nullptr, 0);
}

void fake_rp_fail_initialize(int result) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().fail_initialize = static_cast<CUptiResult>(result);
}

#define FAKE_RP_COUNTER(name, field)              \
  int name() {                                    \
    std::lock_guard<std::mutex> lock(state().mu); \
    return state().field;                         \
  }
FAKE_RP_COUNTER(fake_rp_initializes, initializes)
FAKE_RP_COUNTER(fake_rp_deinitializes, deinitializes)
FAKE_RP_COUNTER(fake_rp_enables, enables)
FAKE_RP_COUNTER(fake_rp_null_context_enables, null_enables)
FAKE_RP_COUNTER(fake_rp_disables, disables)
FAKE_RP_COUNTER(fake_rp_set_configs, set_configs)
FAKE_RP_COUNTER(fake_rp_starts, starts)
FAKE_RP_COUNTER(fake_rp_stops, stops)
FAKE_RP_COUNTER(fake_rp_pops, pops)
FAKE_RP_COUNTER(fake_rp_decodes, decodes)
FAKE_RP_COUNTER(fake_rp_misuses, misuses)
#undef FAKE_RP_COUNTER

void* fake_rp_enabled_context() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().enabled_ctx;
}

int fake_rp_pushes() {
  std::lock_guard<std::mutex> lock(state().mu);
  return static_cast<int>(state().pushed.size());
}

const char* fake_rp_pushed_name(int i) {
  std::lock_guard<std::mutex> lock(state().mu);
  const auto& p = state().pushed;
  return i >= 0 && static_cast<std::size_t>(i) < p.size() ? p[i].c_str() : "";
}

// ---- profiler ----

CUptiResult CUPTIAPI cuptiProfilerInitialize(CUpti_Profiler_Initialize_Params*) {
  std::lock_guard<std::mutex> lock(state().mu);
  if (state().fail_initialize != CUPTI_SUCCESS) return state().fail_initialize;
  ++state().initializes;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiProfilerDeInitialize(CUpti_Profiler_DeInitialize_Params*) {
  std::lock_guard<std::mutex> lock(state().mu);
  ++state().deinitializes;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiDeviceGetChipName(CUpti_Device_GetChipName_Params* p) {
  p->pChipName = "GH100";
  return CUPTI_SUCCESS;
}

// ---- host API: every metric exists, any set is one pass ----

CUptiResult CUPTIAPI cuptiProfilerHostInitialize(CUpti_Profiler_Host_Initialize_Params* p) {
  p->pHostObject = reinterpret_cast<CUpti_Profiler_Host_Object*>(&g_host_object);
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI cuptiProfilerHostDeinitialize(CUpti_Profiler_Host_Deinitialize_Params*) {
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI
cuptiProfilerHostGetMetricProperties(CUpti_Profiler_Host_GetMetricProperties_Params*) {
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI
cuptiProfilerHostConfigAddMetrics(CUpti_Profiler_Host_ConfigAddMetrics_Params*) {
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI
cuptiProfilerHostGetConfigImageSize(CUpti_Profiler_Host_GetConfigImageSize_Params* p) {
  p->configImageSize = 16;
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI cuptiProfilerHostGetConfigImage(CUpti_Profiler_Host_GetConfigImage_Params*) {
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI cuptiProfilerHostGetNumOfPasses(CUpti_Profiler_Host_GetNumOfPasses_Params* p) {
  p->numOfPasses = 1;
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI
cuptiProfilerHostEvaluateToGpuValues(CUpti_Profiler_Host_EvaluateToGpuValues_Params* p) {
  const char* name = image_range_name(p->pCounterDataImage, p->rangeIndex);
  if (name == nullptr) return CUPTI_ERROR_INVALID_PARAMETER;
  const double step = std::strtod(name, nullptr);
  for (std::size_t i = 0; i < p->numMetrics; ++i) {
    p->pMetricValues[i] = step + 0.25 * static_cast<double>(i);
  }
  return CUPTI_SUCCESS;
}

// ---- range profiler ----

CUptiResult CUPTIAPI cuptiRangeProfilerEnable(CUpti_RangeProfiler_Enable_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  ++state().enables;
  if (p->ctx == nullptr) {  // the real one crashes
    ++state().null_enables;
    return CUPTI_ERROR_INVALID_PARAMETER;
  }
  state().enabled_ctx = p->ctx;
  p->pRangeProfilerObject = reinterpret_cast<CUpti_RangeProfiler_Object*>(&g_range_object);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerDisable(CUpti_RangeProfiler_Disable_Params*) {
  std::lock_guard<std::mutex> lock(state().mu);
  ++state().disables;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI
cuptiRangeProfilerGetCounterDataSize(CUpti_RangeProfiler_GetCounterDataSize_Params* p) {
  if (p->maxNumOfRanges > kImageRanges) return CUPTI_ERROR_INVALID_PARAMETER;
  p->counterDataSize = kImageBytes;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerCounterDataImageInitialize(
    CUpti_RangeProfiler_CounterDataImage_Initialize_Params* p) {
  if (p->counterDataSize < kImageBytes) return CUPTI_ERROR_INVALID_PARAMETER;
  std::memset(p->pCounterData, 0, p->counterDataSize);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerSetConfig(CUpti_RangeProfiler_SetConfig_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  ++s.set_configs;
  if (p->range != CUPTI_UserRange || p->replayMode != CUPTI_UserReplay || s.running) ++s.misuses;
  s.image = p->pCounterDataImage;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerStart(CUpti_RangeProfiler_Start_Params*) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  ++s.starts;
  if (s.running || s.image == nullptr) ++s.misuses;
  s.running = true;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerStop(CUpti_RangeProfiler_Stop_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  ++s.stops;
  if (!s.running || s.depth != 0) ++s.misuses;
  s.running = false;
  s.undecoded.insert(s.undecoded.end(), s.pass.begin(), s.pass.end());
  s.pass.clear();
  p->isAllPassSubmitted = 1;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerPushRange(CUpti_RangeProfiler_PushRange_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  if (!s.running || fake_cuda_current() == nullptr || fake_cuda_current() != s.enabled_ctx) {
    ++s.misuses;
  }
  ++s.depth;
  s.pushed.emplace_back(p->pRangeName);
  s.pass.emplace_back(p->pRangeName);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerPopRange(CUpti_RangeProfiler_PopRange_Params*) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  ++s.pops;
  if (!s.running || s.depth != 1) ++s.misuses;
  --s.depth;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerDecodeData(CUpti_RangeProfiler_DecodeData_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  ++s.decodes;
  if (s.running || s.image == nullptr) {
    ++s.misuses;
    return CUPTI_ERROR_INVALID_OPERATION;
  }
  std::uint32_t count = 0;
  std::memcpy(&count, s.image, sizeof(count));
  p->numOfRangeDropped = 0;
  for (const std::string& name : s.undecoded) {
    if (count == kImageRanges) {
      ++p->numOfRangeDropped;
      continue;
    }
    char* slot = reinterpret_cast<char*>(s.image) + sizeof(count) + count * kNameBytes;
    std::strncpy(slot, name.c_str(), kNameBytes - 1);
    ++count;
  }
  s.undecoded.clear();
  std::memcpy(s.image, &count, sizeof(count));
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI
cuptiRangeProfilerGetCounterDataInfo(CUpti_RangeProfiler_GetCounterDataInfo_Params* p) {
  std::uint32_t count = 0;
  std::memcpy(&count, p->pCounterDataImage, sizeof(count));
  p->numTotalRanges = count;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI
cuptiRangeProfilerCounterDataGetRangeInfo(CUpti_RangeProfiler_CounterData_GetRangeInfo_Params* p) {
  p->rangeName = image_range_name(p->pCounterDataImage, p->rangeIndex);
  if (p->rangeName == nullptr) return CUPTI_ERROR_INVALID_PARAMETER;
  return CUPTI_SUCCESS;
}

}  // extern "C"
