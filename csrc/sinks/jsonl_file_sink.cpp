#include "jsonl_file_sink.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace steptrace::detail {

void JsonlFileSink::write(std::string_view lines) {
  const char* p = lines.data();
  std::size_t left = lines.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0) {
      const int e = errno;
      if (e == EINTR) continue;
      // Keep training going: the batch is lost, counted, and reported in run_end.
      int none = 0;
      first_errno_.compare_exchange_strong(none, e, std::memory_order_relaxed);
      last_errno_.store(e, std::memory_order_relaxed);
      write_errors_.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

void JsonlFileSink::on_close() {
  ::fsync(fd_);
  ::close(fd_);
}

void JsonlFileSink::abandon() noexcept { ::close(fd_); }

std::string JsonlFileSink::first_error() const {
  const int e = first_errno();
  return e == 0 ? std::string() : fmt::format("write: {}", std::strerror(e));
}

}  // namespace steptrace::detail
