// The Pushgateway transport of the metrics: one PUT of the exposition, under one deadline.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

namespace steptrace::detail {

/// PUTs `text` to <url>/metrics/job@base64/<job>/run_id@base64/<run_id>/rank/<rank>, all of
/// it (name lookup, connect, send, answer) within `deadline`. Returns "" on success, else
/// what failed.
std::string push_to_gateway(const std::string& url, std::string_view job, std::string_view run_id,
                            int rank, const std::string& text, std::chrono::milliseconds deadline);

/// RFC 4648 base64url with padding (Pushgateway's `label@base64/value` path segments).
std::string base64url(std::string_view v);

}  // namespace steptrace::detail
