// See fake_profiler.hpp (the libcupti half; fake_cuda.cpp is the libcuda half). The counter data
// image the backend allocates holds, in this fake, the number of decoded ranges (or PM samples)
// and per entry a name and, for PM samples, its start and end time; a range's "metric value" is
// its step (a sample's: its number) plus a quarter per metric index, so the test can tell which
// range fed a sample.
//
// cuptiFinalize (fake_cupti.cpp) ends a generation: every profiler object made before (host
// objects, range profiler and PM sampling objects) is destroyed, and a call that names one fails
// with the result fake_rp_set_stale_result chose (the real library's is not documented); the
// profiler is deinitialized, so cuptiDeviceGetChipName fails until cuptiProfilerInitialize.
#include "fake_profiler.hpp"

#include <cupti_profiler_host.h>
#include <cupti_range_profiler.h>
#include <cupti_target.h>
#include <dlfcn.h>
#if FAKE_CUPTI_PM_SAMPLING
#include <cupti_activity.h>  // cuptiGetTimestamp: the sample times
#include <cupti_pmsampling.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr std::size_t kNameBytes = 32;     // an entry: a name, or a 16-byte name and two times
constexpr std::size_t kImageRanges = 256;  // the PM sampler asks for 256 samples per image
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
  // objects and their generation; cuptiFinalize starts a new one
  int generation = 0;
  int initialized = 0;      // cuptiProfilerInitialize calls not yet undone
  std::deque<char> tokens;  // one per object: its address is the handle
  std::map<const void*, int> objects;
  CUptiResult stale_result = CUPTI_ERROR_NOT_INITIALIZED;
  int stale_calls = 0, stale_teardowns = 0;
  int chip_device = -1;
  // PM sampling
  int pm_device = -1, availability_device = -1;
  int pm_enables = 0, pm_disables = 0, pm_starts = 0, pm_stops = 0, pm_decodes = 0;
  bool pm_running = false;
  std::uint32_t pm_samples = 0;  // samples produced so far (their names)
  CUptiResult pm_fail_start = CUPTI_SUCCESS;
};

State& state() {
  static State s;
  return s;
}

// With s.mu held: a handle for a new object of this generation.
void* new_object(State& s) {
  s.tokens.emplace_back();
  void* handle = &s.tokens.back();
  s.objects[handle] = s.generation;
  return handle;
}

// With s.mu held: whether `handle` names an object destroyed by cuptiFinalize (or none);
// such calls are counted, those that would free it (`teardown`) apart.
bool stale(State& s, const void* handle, bool teardown = false) {
  const auto it = s.objects.find(handle);
  if (it != s.objects.end() && it->second == s.generation) return false;
  ++(teardown ? s.stale_teardowns : s.stale_calls);
  return true;
}

// The name of decoded range `index` of a counter data image; null past its ranges.
const char* image_range_name(const std::uint8_t* image, std::size_t index) {
  std::uint32_t count = 0;
  std::memcpy(&count, image, sizeof(count));
  if (index >= count) return nullptr;
  return reinterpret_cast<const char*>(image) + sizeof(count) + index * kNameBytes;
}

}  // namespace

extern "C" {

void fake_rp_reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.initialized = 0;
  s.stale_result = CUPTI_ERROR_NOT_INITIALIZED;
  s.stale_calls = s.stale_teardowns = 0;
  s.chip_device = -1;
  s.pm_device = s.availability_device = -1;
  s.pm_enables = s.pm_disables = s.pm_starts = s.pm_stops = s.pm_decodes = 0;
  s.pm_running = false;
  s.pm_samples = 0;
  s.pm_fail_start = CUPTI_SUCCESS;
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
  fake_cuda_set_device_count(8);
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
FAKE_RP_COUNTER(fake_rp_stale_calls, stale_calls)
FAKE_RP_COUNTER(fake_rp_stale_teardowns, stale_teardowns)
FAKE_RP_COUNTER(fake_rp_chip_device, chip_device)
FAKE_RP_COUNTER(fake_pm_enabled_device, pm_device)
FAKE_RP_COUNTER(fake_pm_availability_device, availability_device)
FAKE_RP_COUNTER(fake_pm_enables, pm_enables)
FAKE_RP_COUNTER(fake_pm_disables, pm_disables)
FAKE_RP_COUNTER(fake_pm_starts, pm_starts)
FAKE_RP_COUNTER(fake_pm_decodes, pm_decodes)
#undef FAKE_RP_COUNTER

void fake_pm_fail_start(int result) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().pm_fail_start = static_cast<CUptiResult>(result);
}

void fake_rp_set_stale_result(int result) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().stale_result = static_cast<CUptiResult>(result);
}

// From cuptiFinalize (fake_cupti.cpp): a new generation, the profiler deinitialized.
void fake_profiler_finalized() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.generation;
  s.initialized = 0;
  s.running = false;
  s.depth = 0;
  s.pass.clear();
  s.undecoded.clear();
  s.pm_running = false;
}

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
  ++state().initialized;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiProfilerDeInitialize(CUpti_Profiler_DeInitialize_Params*) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.deinitializes;
  if (s.initialized == 0) {  // undone by cuptiFinalize (or never done)
    ++s.stale_teardowns;
    return CUPTI_ERROR_NOT_INITIALIZED;
  }
  --s.initialized;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiDeviceGetChipName(CUpti_Device_GetChipName_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.initialized == 0) return CUPTI_ERROR_NOT_INITIALIZED;
  s.chip_device = static_cast<int>(p->deviceIndex);
  p->pChipName = "GH100";
  return CUPTI_SUCCESS;
}

// ---- host API: every metric exists, any set is one pass ----

CUptiResult CUPTIAPI cuptiProfilerHostInitialize(CUpti_Profiler_Host_Initialize_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  p->pHostObject = static_cast<CUpti_Profiler_Host_Object*>(new_object(s));
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI cuptiProfilerHostDeinitialize(CUpti_Profiler_Host_Deinitialize_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (stale(s, p->pHostObject, /*teardown=*/true)) return s.stale_result;
  s.objects.erase(p->pHostObject);
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI
cuptiProfilerHostGetMetricProperties(CUpti_Profiler_Host_GetMetricProperties_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return stale(s, p->pHostObject) ? s.stale_result : CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI
cuptiProfilerHostConfigAddMetrics(CUpti_Profiler_Host_ConfigAddMetrics_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return stale(s, p->pHostObject) ? s.stale_result : CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI
cuptiProfilerHostGetConfigImageSize(CUpti_Profiler_Host_GetConfigImageSize_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (stale(s, p->pHostObject)) return s.stale_result;
  p->configImageSize = 16;
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI cuptiProfilerHostGetConfigImage(CUpti_Profiler_Host_GetConfigImage_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return stale(s, p->pHostObject) ? s.stale_result : CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI cuptiProfilerHostGetNumOfPasses(CUpti_Profiler_Host_GetNumOfPasses_Params* p) {
  p->numOfPasses = 1;
  return CUPTI_SUCCESS;
}
CUptiResult CUPTIAPI
cuptiProfilerHostEvaluateToGpuValues(CUpti_Profiler_Host_EvaluateToGpuValues_Params* p) {
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (stale(s, p->pHostObject)) return s.stale_result;
  }
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
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.enables;
  if (p->ctx == nullptr) {  // the real one crashes
    ++s.null_enables;
    return CUPTI_ERROR_INVALID_PARAMETER;
  }
  if (s.initialized == 0) return CUPTI_ERROR_NOT_INITIALIZED;
  s.enabled_ctx = p->ctx;
  p->pRangeProfilerObject = static_cast<CUpti_RangeProfiler_Object*>(new_object(s));
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerDisable(CUpti_RangeProfiler_Disable_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.disables;
  if (stale(s, p->pRangeProfilerObject, /*teardown=*/true)) return s.stale_result;
  s.objects.erase(p->pRangeProfilerObject);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI
cuptiRangeProfilerGetCounterDataSize(CUpti_RangeProfiler_GetCounterDataSize_Params* p) {
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (stale(s, p->pRangeProfilerObject)) return s.stale_result;
  }
  if (p->maxNumOfRanges > kImageRanges) return CUPTI_ERROR_INVALID_PARAMETER;
  p->counterDataSize = kImageBytes;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerCounterDataImageInitialize(
    CUpti_RangeProfiler_CounterDataImage_Initialize_Params* p) {
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (stale(s, p->pRangeProfilerObject)) return s.stale_result;
  }
  if (p->counterDataSize < kImageBytes) return CUPTI_ERROR_INVALID_PARAMETER;
  std::memset(p->pCounterData, 0, p->counterDataSize);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerSetConfig(CUpti_RangeProfiler_SetConfig_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  if (stale(s, p->pRangeProfilerObject)) return s.stale_result;
  ++s.set_configs;
  if (p->range != CUPTI_UserRange || p->replayMode != CUPTI_UserReplay || s.running) ++s.misuses;
  s.image = p->pCounterDataImage;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerStart(CUpti_RangeProfiler_Start_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  if (stale(s, p->pRangeProfilerObject)) return s.stale_result;
  ++s.starts;
  if (s.running || s.image == nullptr) ++s.misuses;
  s.running = true;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerStop(CUpti_RangeProfiler_Stop_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  if (stale(s, p->pRangeProfilerObject)) return s.stale_result;
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
  if (stale(s, p->pRangeProfilerObject)) return s.stale_result;
  if (!s.running || fake_cuda_current() == nullptr || fake_cuda_current() != s.enabled_ctx) {
    ++s.misuses;
  }
  ++s.depth;
  s.pushed.emplace_back(p->pRangeName);
  s.pass.emplace_back(p->pRangeName);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerPopRange(CUpti_RangeProfiler_PopRange_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  if (stale(s, p->pRangeProfilerObject)) return s.stale_result;
  ++s.pops;
  if (!s.running || s.depth != 1) ++s.misuses;
  --s.depth;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiRangeProfilerDecodeData(CUpti_RangeProfiler_DecodeData_Params* p) {
  std::lock_guard<std::mutex> lock(state().mu);
  State& s = state();
  if (stale(s, p->pRangeProfilerObject)) return s.stale_result;
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

#if FAKE_CUPTI_PM_SAMPLING
// ---- PM sampling (CUPTI 12.6+): a sample per DecodeData while sampling runs ----

CUptiResult CUPTIAPI
cuptiPmSamplingGetCounterAvailability(CUpti_PmSampling_GetCounterAvailability_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.initialized == 0) return CUPTI_ERROR_NOT_INITIALIZED;
  s.availability_device = static_cast<int>(p->deviceIndex);
  if (p->pCounterAvailabilityImage == nullptr) {
    p->counterAvailabilityImageSize = 64;
  } else {
    std::memset(p->pCounterAvailabilityImage, 0, p->counterAvailabilityImageSize);
  }
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiPmSamplingEnable(CUpti_PmSampling_Enable_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.initialized == 0) return CUPTI_ERROR_NOT_INITIALIZED;
  ++s.pm_enables;
  s.pm_device = static_cast<int>(p->deviceIndex);
  p->pPmSamplingObject = static_cast<CUpti_PmSampling_Object*>(new_object(s));
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiPmSamplingDisable(CUpti_PmSampling_Disable_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.pm_disables;
  if (stale(s, p->pPmSamplingObject, /*teardown=*/true)) return s.stale_result;
  s.objects.erase(p->pPmSamplingObject);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiPmSamplingSetConfig(CUpti_PmSampling_SetConfig_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return stale(s, p->pPmSamplingObject) ? s.stale_result : CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI
cuptiPmSamplingGetCounterDataSize(CUpti_PmSampling_GetCounterDataSize_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (stale(s, p->pPmSamplingObject)) return s.stale_result;
  if (p->maxSamples > kImageRanges) return CUPTI_ERROR_INVALID_PARAMETER;
  p->counterDataSize = kImageBytes;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI
cuptiPmSamplingCounterDataImageInitialize(CUpti_PmSampling_CounterDataImage_Initialize_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (stale(s, p->pPmSamplingObject)) return s.stale_result;
  if (p->counterDataSize < kImageBytes) return CUPTI_ERROR_INVALID_PARAMETER;
  std::memset(p->pCounterData, 0, p->counterDataSize);
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiPmSamplingStart(CUpti_PmSampling_Start_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (stale(s, p->pPmSamplingObject)) return s.stale_result;
  if (s.pm_fail_start != CUPTI_SUCCESS) return s.pm_fail_start;
  if (s.pm_running) ++s.misuses;
  ++s.pm_starts;
  s.pm_running = true;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiPmSamplingStop(CUpti_PmSampling_Stop_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (stale(s, p->pPmSamplingObject)) return s.stale_result;
  if (!s.pm_running) ++s.misuses;
  ++s.pm_stops;
  s.pm_running = false;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI cuptiPmSamplingDecodeData(CUpti_PmSampling_DecodeData_Params* p) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (stale(s, p->pPmSamplingObject)) return s.stale_result;
  ++s.pm_decodes;
  p->overflow = 0;
  p->decodeStopReason = CUPTI_PM_SAMPLING_DECODE_STOP_REASON_END_OF_RECORDS;
  if (!s.pm_running) return CUPTI_SUCCESS;
  std::uint32_t count = 0;
  std::memcpy(&count, p->pCounterDataImage, sizeof(count));
  if (count == kImageRanges) {
    p->decodeStopReason = CUPTI_PM_SAMPLING_DECODE_STOP_REASON_COUNTER_DATA_FULL;
    return CUPTI_SUCCESS;
  }
  std::uint8_t* entry = p->pCounterDataImage + sizeof(count) + count * kNameBytes;
  std::snprintf(reinterpret_cast<char*>(entry), 16, "%u", s.pm_samples++);
  std::uint64_t end = 0;
  cuptiGetTimestamp(&end);  // fake_cupti.cpp's clock
  const std::uint64_t start = end - 1000;
  std::memcpy(entry + 16, &start, sizeof(start));
  std::memcpy(entry + 24, &end, sizeof(end));
  ++count;
  std::memcpy(p->pCounterDataImage, &count, sizeof(count));
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI
cuptiPmSamplingGetCounterDataInfo(CUpti_PmSampling_GetCounterDataInfo_Params* p) {
  std::uint32_t count = 0;
  std::memcpy(&count, p->pCounterDataImage, sizeof(count));
  p->numTotalSamples = p->numPopulatedSamples = p->numCompletedSamples = count;
  return CUPTI_SUCCESS;
}

CUptiResult CUPTIAPI
cuptiPmSamplingCounterDataGetSampleInfo(CUpti_PmSampling_CounterData_GetSampleInfo_Params* p) {
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    if (stale(s, p->pPmSamplingObject)) return s.stale_result;
  }
  if (image_range_name(p->pCounterDataImage, p->sampleIndex) == nullptr) {
    return CUPTI_ERROR_INVALID_PARAMETER;
  }
  const std::uint8_t* entry =
      p->pCounterDataImage + sizeof(std::uint32_t) + p->sampleIndex * kNameBytes;
  std::memcpy(&p->startTimestamp, entry + 16, sizeof(p->startTimestamp));
  std::memcpy(&p->endTimestamp, entry + 24, sizeof(p->endTimestamp));
  return CUPTI_SUCCESS;
}
#endif  // FAKE_CUPTI_PM_SAMPLING

}  // extern "C"
