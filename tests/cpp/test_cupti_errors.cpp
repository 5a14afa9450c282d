// The one-line reasons run_start gives when a CUPTI backend is unavailable: each cause a
// user can hit names itself and what to do.
#include "backends/cupti/cupti_errors.hpp"
#include "backends/cupti/cupti_host.hpp"

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

// The library/headers rule of cupti_host.cpp: activity records are read only from a
// libcupti of the release the headers describe (the record structs change between releases:
// CUpti_ActivityKernel10 in 13.0, 11 in 13.2).

namespace steptrace::detail::cupti {
namespace {

TEST(CuptiLibrary, ReleaseOfAnApiVersion) {
  EXPECT_EQ(cupti_release(130001), 1300);
  EXPECT_EQ(cupti_release(130202), 1302);
  EXPECT_EQ(cupti_release(130002), cupti_release(130001));  // a patch release reads alike
  EXPECT_EQ(cupti_release(28), 28);                         // 12.x numbers its releases
  EXPECT_EQ(cupti_release(0), 0);
}

TEST(CuptiLibrary, RecordsOfAnotherReleaseAreRefusedWithBothVersions) {
  Library torch_215;  // torch 2.15's libcupti.so.13 beside the toolkit's 13.0 headers
  torch_215.path = "/site-packages/nvidia/cu13/lib/libcupti.so.13";
  torch_215.version = 130202;
  torch_215.built_for = 130001;
  const std::string why = activity_records_unreadable(torch_215);
  EXPECT_TRUE(has(why, "13.2.2")) << why;
  EXPECT_TRUE(has(why, "13.0.1")) << why;
  EXPECT_TRUE(has(why, torch_215.path)) << why;
  EXPECT_TRUE(has(why, "Rebuild steptrace")) << why;

  Library older = torch_215;  // and the other way round
  older.version = 130001;
  older.built_for = 130202;
  EXPECT_FALSE(activity_records_unreadable(older).empty());

  Library patch = torch_215;
  patch.version = 130002;
  patch.built_for = 130001;
  EXPECT_EQ(activity_records_unreadable(patch), "");

  Library no_headers = torch_215;  // a stub build reads no records anyway
  no_headers.built_for = 0;
  EXPECT_EQ(activity_records_unreadable(no_headers), "");
}

}  // namespace
}  // namespace steptrace::detail::cupti
