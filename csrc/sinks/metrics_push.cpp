#include "metrics_push.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <utility>

#include "metrics_http.hpp"

namespace steptrace::detail {

std::string base64url(std::string_view v) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  std::size_t i = 0;
  for (; i + 3 <= v.size(); i += 3) {
    const auto n = (static_cast<std::uint32_t>(static_cast<unsigned char>(v[i])) << 16) |
                   (static_cast<std::uint32_t>(static_cast<unsigned char>(v[i + 1])) << 8) |
                   static_cast<unsigned char>(v[i + 2]);
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += kAlphabet[(n >> 6) & 63];
    out += kAlphabet[n & 63];
  }
  if (const std::size_t left = v.size() - i; left > 0) {
    std::uint32_t n = static_cast<std::uint32_t>(static_cast<unsigned char>(v[i])) << 16;
    if (left == 2) n |= static_cast<std::uint32_t>(static_cast<unsigned char>(v[i + 1])) << 8;
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += left == 2 ? kAlphabet[(n >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string push_to_gateway(const std::string& url, std::string_view job, std::string_view run_id,
                            int rank, const std::string& text, std::chrono::milliseconds deadline) {
  // "http://host:port/prefix" -> origin "http://host:port", path "/prefix/metrics/..."
  const std::size_t scheme = url.find("://");
  const std::size_t slash = url.find('/', scheme == std::string::npos ? 0 : scheme + 3);
  const std::string origin = url.substr(0, slash);
  std::string prefix = slash == std::string::npos ? "" : url.substr(slash);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  const std::string path = fmt::format("{}/metrics/job@base64/{}/run_id@base64/{}/rank/{}", prefix,
                                       base64url(job), base64url(run_id), rank);
  return http_put(origin, path, text, "text/plain; version=0.0.4; charset=utf-8", deadline);
}

}  // namespace steptrace::detail
