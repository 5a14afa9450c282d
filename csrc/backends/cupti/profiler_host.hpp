// CUPTI's profiler host API (metric existence, config images, pass counts, evaluation),
// shared by the metric-set check (cupti_host.cpp) and the PM sampler. Only for files built
// with the CUPTI headers (STEPTRACE_HAVE_CUPTI_HEADERS); the entry points come from the
// dlopen'ed libcupti.
#pragma once

#if STEPTRACE_HAVE_CUPTI_HEADERS

#include <cupti_profiler_host.h>
#include <cupti_profiler_target.h>
#include <cupti_result.h>
#include <cupti_target.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "metric_sets.hpp"
#include "pm_sampling_logic.hpp"

// structSize up to and including `last`, the last field CUPTI 12.6 (the oldest CUPTI
// steptrace supports) defines: a newer header that appends fields then still talks to an
// older libcupti. The 12.8 and 13.0 headers have the same layouts. The value of CUPTI's
// CUPTI_PROFILER_STRUCT_SIZE(type, last) (offsetof + sizeof of that field), spelled with the
// field's type: CUPTI's `sizeof(((type*)0)->last)` of a pointer field reads as a likely
// mistake to clang-tidy (bugprone-sizeof-expression).
// (`type` is a type name, which cannot be parenthesized in a template argument.)
#define STEPTRACE_CUPTI_STRUCT_SIZE(type, last) \
  (offsetof(type, last) +                       \
   sizeof(decltype(std::declval<type&>().last)))  // NOLINT(bugprone-macro-parentheses)

namespace steptrace::detail::cupti {

/// The host-API entry points, resolved from the loaded library.
struct HostApi {
  decltype(&::cuptiProfilerHostInitialize) initialize = nullptr;
  decltype(&::cuptiProfilerHostDeinitialize) deinitialize = nullptr;
  decltype(&::cuptiProfilerHostGetMetricProperties) metric_properties = nullptr;
  decltype(&::cuptiProfilerHostConfigAddMetrics) add_metrics = nullptr;
  decltype(&::cuptiProfilerHostGetConfigImageSize) config_image_size = nullptr;
  decltype(&::cuptiProfilerHostGetConfigImage) config_image = nullptr;
  decltype(&::cuptiProfilerHostGetNumOfPasses) num_passes = nullptr;
  decltype(&::cuptiProfilerHostEvaluateToGpuValues) evaluate = nullptr;
  decltype(&::cuptiGetResultString) result_string = nullptr;

  /// Resolves every entry point; false with the first missing name in `missing`.
  bool load(void* lib, std::string* missing);
  /// "CUPTI_ERROR_UNKNOWN (999)" and the like.
  std::string error(CUptiResult r) const;
  /// CUPTI's name for `r`, "" when unknown (for unavailable_reason).
  std::string result_text(CUptiResult r) const;
};

/// One host object (chip + profiler type, optionally a device's counter availability
/// image, which must outlive it); deinitialized on destruction.
class HostObject {
 public:
  HostObject(const HostApi& api, const std::string& chip, ProfilerMode mode,
             const std::uint8_t* counter_availability = nullptr);
  ~HostObject();
  HostObject(const HostObject&) = delete;
  HostObject& operator=(const HostObject&) = delete;

  CUptiResult status() const { return status_; }
  CUpti_Profiler_Host_Object* get() const { return object_; }
  /// Forgets the object without deinitializing it: cuptiFinalize already destroyed it.
  void abandon() noexcept { object_ = nullptr; }

 private:
  const HostApi& api_;
  CUptiResult status_ = CUPTI_ERROR_UNKNOWN;
  CUpti_Profiler_Host_Object* object_ = nullptr;
};

bool metric_exists(const HostApi& api, CUpti_Profiler_Host_Object* obj, const std::string& name);

/// Adds `metrics` to `obj` (once per host object: CUPTI accumulates them) and writes its
/// config image; false with `why` (the failing call and CUPTI's error).
bool make_config_image(const HostApi& api, CUpti_Profiler_Host_Object* obj,
                       const std::vector<std::string>& metrics, std::vector<std::uint8_t>* image,
                       std::string* why);

/// Passes a config image needs; -1 with `why` on failure.
int config_image_passes(const HostApi& api, const std::vector<std::uint8_t>& image,
                        std::string* why);

/// Passes `metrics` need together, on a fresh host object; -1 with `why` when CUPTI refuses.
int count_passes(const HostApi& api, const std::string& chip, ProfilerMode mode,
                 const std::vector<std::string>& metrics, std::string* why,
                 const std::uint8_t* counter_availability = nullptr);

/// select_metric_set's oracle backed by CUPTI: existence from `host`, passes from fresh host
/// objects for the same chip, mode and availability image. Captures its arguments by
/// reference: they must outlive the oracle.
MetricOracle host_oracle(const HostApi& api, const HostObject& host, const std::string& chip,
                         ProfilerMode mode, const std::uint8_t* counter_availability);

/// The profiler entry points every counter backend needs besides the host API.
struct ProfilerApi {
  decltype(&::cuptiProfilerInitialize) initialize = nullptr;
  decltype(&::cuptiProfilerDeInitialize) deinitialize = nullptr;
  decltype(&::cuptiDeviceGetChipName) chip_name = nullptr;
  CUptiResult (*get_timestamp)(std::uint64_t*) = nullptr;  // cupti_activity.h's signature

  /// Resolves every entry point; false with the first missing name in `missing`.
  bool load(void* lib, std::string* missing);
};

/// unavailable_reason for `call` failing with `r`, with CUPTI's name for `r`.
std::string call_reason(const HostApi& api, const char* call, CUptiResult r);

/// cuptiProfilerInitialize, then the chip of `device_index` and its row of the table.
/// false with `why` (one line) and, when a CUPTI call failed, its result in `*result`
/// (else CUPTI_SUCCESS); after a failure past the initialize, *initialized is true and
/// the caller deinitializes (deinitialize_profiler).
bool initialize_profiler(const ProfilerApi& api, const HostApi& host_api, int device_index,
                         bool* initialized, std::string* chip, const ChipFamily** family,
                         CUptiResult* result, std::string* why);
/// cuptiProfilerDeInitialize (never cuptiFinalize: torch.profiler may be using CUPTI).
void deinitialize_profiler(const ProfilerApi& api) noexcept;

/// After a call on a sampler's object failed with `result`: whether CUPTI was torn down
/// under it (torn_down_result), or the profiler no longer knows the device, as once
/// cuptiFinalize has undone cuptiProfilerInitialize (cuptiDeviceGetChipName fails). A
/// host-side call, safe on any thread.
bool profiler_torn_down(const ProfilerApi& api, int device_index, CUptiResult result) noexcept;

/// The one-pass metric set of `mode` on `chip` (select_metric_set against `host`), the
/// counters it feeds (*map) and its config image; false with `why`.
bool one_pass_config(const HostApi& api, const HostObject& host, const std::string& chip,
                     const ChipFamily& family, ProfilerMode mode,
                     const std::uint8_t* counter_availability, CounterMap* map,
                     std::vector<std::uint8_t>* config, std::string* why);

/// EvaluateToGpuValues of range (or sample) `index` of `image` into `values` (one per
/// name, in order); false when CUPTI refuses.
bool evaluate_range(const HostApi& api, CUpti_Profiler_Host_Object* host,
                    const std::vector<std::uint8_t>& image, std::size_t index,
                    const std::vector<const char*>& metric_names, double* values) noexcept;

}  // namespace steptrace::detail::cupti

#endif  // STEPTRACE_HAVE_CUPTI_HEADERS
