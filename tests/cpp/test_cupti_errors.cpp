// The one-line reasons run_start gives when a CUPTI backend is unavailable: each cause a
// user can hit names itself and what to do.
#include "backends/cupti/cupti_errors.hpp"

#include <gtest/gtest.h>

#include <string>

namespace steptrace::detail::cupti {
namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CuptiErrors, EachCauseNamesItselfTheCallAndTheCode) {
  struct Case {
    int result;
    const char* expect;
  };
  const Case cases[] = {
      {999, "no usable CUDA driver or GPU"},        // CPU-only machine
      {15, "no usable CUDA driver or GPU"},         // CUPTI 12.x without a driver
      {35, "NVreg_RestrictProfilingToAdminUsers"},  // ERR_NVGPUCTRPERM
      {40, "restricted to admin users"},
      {39, "another tool holds CUPTI"},  // Kineto / Nsight subscribed
      {7, "DCGM profiling"},             // counters busy
      {26, "dcgmi profile --pause"},
      {38, "older than the ones CUPTI's profiler supports"},
      {43, "MIG slice"},
      {27, "not supported on this device and driver"},
  };
  for (const Case& c : cases) {
    const std::string why = unavailable_reason("cuptiPmSamplingEnable", c.result, "CUPTI_ERROR_X");
    EXPECT_TRUE(has(why, c.expect)) << c.result << ": " << why;
    EXPECT_TRUE(has(
        why, "cuptiPmSamplingEnable failed with CUPTI_ERROR_X (" + std::to_string(c.result) + ")"))
        << why;
    EXPECT_EQ(why.find('\n'), std::string::npos);  // one line
  }
}

TEST(CuptiErrors, AnUnknownResultStillNamesTheCall) {
  EXPECT_EQ(unavailable_reason("cuptiActivityEnable", 1234, ""),
            "cuptiActivityEnable failed with error 1234");
}

TEST(CuptiErrors, VersionsReadAsPeopleKnowThem) {
  EXPECT_EQ(version_string(130001), "13.0.1");
  EXPECT_EQ(version_string(24), "12.x (API version 24)");
  EXPECT_EQ(version_string(0), "unknown");
  EXPECT_EQ(too_old_reason("PM sampling", 18, "12.6"),
            "CUPTI 12.x (API version 18) is too old for PM sampling: 12.6 or newer is needed");
}

}  // namespace
}  // namespace steptrace::detail::cupti
