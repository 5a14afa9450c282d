#include "host_steal.hpp"

#include <unistd.h>

#include <algorithm>

namespace steptrace::detail {
namespace {
constexpr std::size_t kBufBytes = std::size_t{64} * 1024;  // cpuN lines come first: ~1000 CPUs
constexpr int kMaxCpus = 4096;
constexpr int kStealField = 8;  // user nice system idle iowait irq softirq steal

bool starts_with(const char* p, const char* end, const char* s) noexcept {
  for (; *s != '\0'; ++p, ++s) {
    if (p == end || *p != *s) return false;
  }
  return true;
}
}  // namespace

int parse_proc_stat_steal(const char* text, std::size_t size, std::int64_t* steal,
                          int max) noexcept {
  const char* p = text;
  const char* const end = text + size;
  int n = 0;
  while (p < end && n < max) {
    const char* eol = std::find(p, end, '\n');
    if (eol == end) break;  // a line cut by the buffer: not read
    // "cpu " is the sum over the CPUs; "cpuN " are the CPUs; they come first.
    if (!starts_with(p, eol, "cpu")) {
      if (n > 0) break;
      p = eol + 1;
      continue;
    }
    const char* q = p + 3;
    if (q < eol && *q == ' ') {
      p = eol + 1;
      continue;
    }
    while (q < eol && *q >= '0' && *q <= '9') ++q;  // the CPU number
    std::int64_t value = -1;
    for (int f = 1; f <= kStealField; ++f) {
      while (q < eol && *q == ' ') ++q;
      const char* start = q;
      std::int64_t v = 0;
      for (; q < eol && *q >= '0' && *q <= '9'; ++q) v = v * 10 + (*q - '0');
      if (q == start) return -1;
      value = v;
    }
    steal[n++] = value;
    p = eol + 1;
  }
  return n;
}

StealReader::StealReader(const std::string& path)
    : file_(path.c_str()),
      buf_(kBufBytes),
      ns_per_tick_(1'000'000'000 / std::max<long>(1, ::sysconf(_SC_CLK_TCK))) {
  ticks_.resize(kMaxCpus);
  const int n = read_ticks();
  if (n <= 0) return;
  last_.assign(ticks_.begin(), ticks_.begin() + n);
  available_ = std::any_of(last_.begin(), last_.end(), [](std::int64_t t) { return t > 0; });
}

int StealReader::read_ticks() noexcept {
  const long got = file_.read(buf_.data(), buf_.size());
  if (got <= 0) return -1;
  return parse_proc_stat_steal(buf_.data(), static_cast<std::size_t>(got), ticks_.data(), kMaxCpus);
}

std::int64_t StealReader::sample() noexcept {
  const int n = read_ticks();
  if (n <= 0) return total_ns_;
  if (static_cast<std::size_t>(n) != last_.size()) {  // CPUs came or went: a new baseline
    last_.assign(ticks_.begin(), ticks_.begin() + n);
    return total_ns_;
  }
  std::int64_t most = 0;
  for (int i = 0; i < n; ++i) {
    most = std::max(most, ticks_[static_cast<std::size_t>(i)] - last_[static_cast<std::size_t>(i)]);
    last_[static_cast<std::size_t>(i)] = ticks_[static_cast<std::size_t>(i)];
  }
  total_ns_ += most * ns_per_tick_;
  return total_ns_;
}

}  // namespace steptrace::detail
