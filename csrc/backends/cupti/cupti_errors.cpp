#include "cupti_errors.hpp"

#include <fmt/format.h>

namespace steptrace::detail::cupti {
namespace {

// CUptiResult values (cupti_result.h; stable across CUPTI 12 and 13).
constexpr int kInvalidDevice = 2;
constexpr int kInvalidContext = 3;
constexpr int kInvalidOperation = 7;
constexpr int kNotCompatible = 14;
constexpr int kNotInitialized = 15;
constexpr int kHardwareBusy = 26;
constexpr int kNotSupported = 27;
constexpr int kVirtualizedDevice = 33;
constexpr int kInsufficientPrivileges = 35;
constexpr int kOldProfilerApi = 36;
constexpr int kLegacyProfiler = 38;
constexpr int kMultipleSubscribers = 39;
constexpr int kVirtualizedPrivileges = 40;
constexpr int kConfidentialComputing = 41;
constexpr int kCmpDevice = 42;
constexpr int kMigDevice = 43;
constexpr int kSliDevice = 44;
constexpr int kWslDevice = 45;
constexpr int kUnknown = 999;

const char* advice(int result) {
  switch (result) {
    case kInsufficientPrivileges:
    case kVirtualizedPrivileges:
      return "GPU profiling is restricted to admin users: run as root, or load the driver with "
             "NVreg_RestrictProfilingToAdminUsers=0";
    case kMultipleSubscribers:
      return "another tool holds CUPTI (torch.profiler/Kineto, Nsight Systems or Nsight "
             "Compute): steptrace yields to it";
    case kInvalidOperation:
    case kHardwareBusy:
      return "the counters are in use by another tool (DCGM profiling metrics, Nsight, "
             "another profiler session): pause it (dcgmi profile --pause) to get counters";
    case kOldProfilerApi:
      return "the legacy CUPTI profiler API is already in use in this process";
    case kLegacyProfiler:
    case kNotCompatible:
      return "this GPU is older than the ones CUPTI's profiler supports";
    case kMigDevice:
      return "counters are not available on a MIG slice";
    case kCmpDevice:
    case kSliDevice:
    case kWslDevice:
    case kVirtualizedDevice:
    case kConfidentialComputing:
      return "this kind of device does not support CUPTI profiling";
    case kNotSupported:
      return "not supported on this device and driver";
    case kInvalidDevice:
    case kInvalidContext:
    case kNotInitialized:
    case kUnknown:
      return "no usable CUDA driver or GPU (a CPU-only machine, or CUDA not initialized)";
    default:
      return nullptr;
  }
}

}  // namespace

std::string unavailable_reason(std::string_view call, int result, std::string_view result_text) {
  const std::string code = result_text.empty() ? fmt::format("error {}", result)
                                               : fmt::format("{} ({})", result_text, result);
  if (const char* a = advice(result)) return fmt::format("{}: {} failed with {}", a, call, code);
  return fmt::format("{} failed with {}", call, code);
}

bool torn_down_result(int result) noexcept {
  // Neither can come from a call on a live object whose setup succeeded: CUPTI lost its
  // connection to the driver (NOT_INITIALIZED) or the object's context (INVALID_CONTEXT).
  return result == kNotInitialized || result == kInvalidContext;
}

std::string torn_down_reason(std::string_view what, std::string_view call, int result,
                             std::string_view result_text) {
  const std::string code = result_text.empty() ? fmt::format("error {}", result)
                                               : fmt::format("{} ({})", result_text, result);
  return fmt::format(
      "CUPTI was torn down under steptrace (another tool called cuptiFinalize, e.g. "
      "torch.profiler with TEARDOWN_CUPTI=1): {} failed with {}; {} stopped, the run goes on",
      call, code, what);
}

std::string version_string(int version) {
  if (version >= 130000) {
    return fmt::format("{}.{}.{}", version / 10000, version / 100 % 100, version % 100);
  }
  if (version > 0) return fmt::format("12.x (API version {})", version);
  return "unknown";
}

std::string too_old_reason(std::string_view feature, int version, std::string_view needed) {
  return fmt::format("CUPTI {} is too old for {}: {} or newer is needed", version_string(version),
                     feature, needed);
}

}  // namespace steptrace::detail::cupti
