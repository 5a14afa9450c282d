#include "run_queue.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstddef>

namespace steptrace::detail {

std::int64_t parse_schedstat_wait(const char* text, std::size_t size) noexcept {
  // "<on-cpu ns> <run-queue wait ns> <timeslices>\n"
  std::size_t i = 0;
  while (i < size && text[i] >= '0' && text[i] <= '9') ++i;  // on-cpu time
  if (i == 0 || i >= size || text[i] != ' ') return -1;
  ++i;
  const std::size_t start = i;
  std::int64_t wait = 0;
  for (; i < size && text[i] >= '0' && text[i] <= '9'; ++i) wait = wait * 10 + (text[i] - '0');
  return i > start ? wait : -1;
}

RunQueueReader::~RunQueueReader() {
  if (fd_ >= 0) ::close(fd_);
}

std::int64_t RunQueueReader::read() noexcept {
  if (failed_) return -1;
  if (fd_ < 0) {
    fd_ = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      failed_ = true;
      return -1;
    }
  }
  char buf[96];
  const ssize_t n = ::pread(fd_, buf, sizeof buf, 0);
  const std::int64_t wait = n > 0 ? parse_schedstat_wait(buf, static_cast<std::size_t>(n)) : -1;
  if (wait < 0) failed_ = true;
  return wait;
}

}  // namespace steptrace::detail
