// One-line reasons for a CUPTI backend being unavailable, from the failing call and its
// CUptiResult: the text run_start carries ("counters": unavailable because ...). Pure: no
// CUPTI headers, so every reason is tested on a machine without a GPU.
#pragma once

#include <string>
#include <string_view>

namespace steptrace::detail::cupti {

/// Why `call` failing with `result` (a CUptiResult as an int) makes the backend
/// unavailable, with what a person can do about it. `result_text` is CUPTI's own name
/// for the result (cuptiGetResultString), "" when unknown.
std::string unavailable_reason(std::string_view call, int result, std::string_view result_text);

/// The reason for a CUPTI too old for a feature: `version` is cuptiGetVersion's value.
std::string too_old_reason(std::string_view feature, int version, std::string_view needed);

/// CUPTI versions as people know them: 13xxyy -> "13.x.y"; 12.x's API numbers -> "12.x".
std::string version_string(int version);

/// Whether `result`, from a call on an object (PM sampling, range profiler, activity
/// callbacks) that was set up successfully earlier in the run, can only mean that CUPTI's
/// state was torn down under it: another tool called cuptiFinalize (Kineto does with
/// TEARDOWN_CUPTI=1), which destroys every CUPTI object of the process.
bool torn_down_result(int result) noexcept;

/// The one line a backend reports when CUPTI was torn down under it: `what` stopped
/// ("counters", "kernel activity"), `call` failed with `result`.
std::string torn_down_reason(std::string_view what, std::string_view call, int result,
                             std::string_view result_text);

}  // namespace steptrace::detail::cupti
